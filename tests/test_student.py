"""Learner copies (`make student`): every answer between the solution markers is replaced by a stub
that raises NotImplementedError, and nothing else of the notebook changes."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from minitp.exercises import ExerciseError, ch00, student
from minitp.exercises.student import (
    STUB,
    SolutionMarkerError,
    strip_solutions,
    write_student_copies,
)

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

EXERCISE = '''\
import torch

def ring_all_reduce(tensor, rank, world_size):
    """Sum ``tensor`` over all ranks in place."""
    chunks = list(tensor.chunk(world_size))
    ### BEGIN SOLUTION
    for step in range(world_size - 1):
        send_to = (rank + 1) % world_size
        chunks[step].add_(chunks[step])
    ### END SOLUTION
    return tensor
'''


def synthetic_notebook() -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# 00 · Exercise\n\nWrite the ring."),
        nbformat.v4.new_code_cell(EXERCISE, execution_count=3, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="the answer ran\n")]),
        nbformat.v4.new_code_cell("def scale(x, world_size):\n    ### BEGIN SOLUTION\n    return x / world_size\n"
                                  "    ### END SOLUTION\n\nclass Twice:\n    def __call__(self, x):\n"
                                  "        ### BEGIN SOLUTION\n        return 2 * x\n        ### END SOLUTION"),
        nbformat.v4.new_code_cell("print('figure')", execution_count=4, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="figure\n")]),
        nbformat.v4.new_markdown_cell("<details><summary>Answer</summary>\n\n```python\n### BEGIN SOLUTION\n"
                                      "return x / world_size\n### END SOLUTION\n```\n</details>"),
    ]
    return notebook


@pytest.fixture
def copies(tmp_path) -> tuple[Path, Path]:
    source = tmp_path / "notebooks"
    source.mkdir()
    nbformat.write(synthetic_notebook(), source / "00_exercise.ipynb")
    (source / "scratch.ipynb").write_text("{}")  # not a chapter: not copied
    target = tmp_path / "student"
    done = subprocess.run([sys.executable, "-m", "minitp.exercises.student", str(source), str(target)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "3 solution region(s) in 2 cell(s)" in done.stdout
    return source / "00_exercise.ipynb", target / "00_exercise.ipynb"


def test_student_copy_has_no_solution_and_is_valid_nbformat(copies):
    original, copy = copies
    assert sorted(p.name for p in copy.parent.iterdir()) == ["00_exercise.ipynb"]
    notebook = nbformat.read(copy, as_version=4)
    nbformat.validate(notebook)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    assert "chunks[step].add_" not in code[0] and "return x / world_size" not in code[1]
    assert "return 2 * x" not in code[1]
    assert all("SOLUTION" not in source for source in code)
    assert f"    {STUB}\n    return tensor" in code[0]  # same indentation, code after the region kept
    assert f"        {STUB}" in code[1]


def test_stubbed_cells_lose_outputs_and_the_rest_is_untouched(copies):
    original, copy = copies
    before, after = nbformat.read(original, as_version=4), nbformat.read(copy, as_version=4)
    assert after.cells[1].outputs == [] and after.cells[1].execution_count is None
    assert after.cells[3] == before.cells[3]  # a cell without a solution keeps its outputs
    assert after.cells[4] == before.cells[4]  # the worked answer behind <details> stays
    assert after.cells[0] == before.cells[0]


def test_stub_raises_not_implemented_when_run(copies):
    _, copy = copies
    notebook = nbformat.read(copy, as_version=4)
    namespace: dict = {}
    exec(notebook.cells[1].source, namespace)
    exec(notebook.cells[2].source, namespace)
    import torch

    with pytest.raises(NotImplementedError, match="Exercise: write this part"):
        namespace["ring_all_reduce"](torch.ones(4), 0, 2)
    with pytest.raises(NotImplementedError):
        namespace["scale"](1.0, 2)
    with pytest.raises(NotImplementedError):
        namespace["Twice"]()(3)


@pytest.mark.parametrize(
    "source, message",
    [
        ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "line 2: '### BEGIN SOLUTION' is never closed"),
        ("def f():\n    return 1\n    ### END SOLUTION\n", "line 3: '### END SOLUTION' without"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "line 2: '### BEGIN SOLUTION' again"),
    ],
)
def test_unbalanced_markers_are_rejected_with_the_line(source, message):
    with pytest.raises(SolutionMarkerError, match=message):
        strip_solutions(source, where="00_x.ipynb, cell 4")


def test_unbalanced_markers_fail_the_command_and_write_nothing(tmp_path):
    source = tmp_path / "notebooks"
    source.mkdir()
    notebook = synthetic_notebook()
    notebook.cells[2].source = "def f():\n    ### BEGIN SOLUTION\n    return 1\n"
    nbformat.write(notebook, source / "01_broken.ipynb")
    assert student.main([str(source), str(tmp_path / "student")]) == 1
    assert not (tmp_path / "student").exists()
    with pytest.raises(SolutionMarkerError, match=r"01_broken.ipynb, cell 2, line 2"):
        write_student_copies(source, tmp_path / "student")


@pytest.mark.skipif(not CHAPTERS, reason="no chapters in notebooks/ yet")
def test_real_chapters_keep_no_solution_line(tmp_path):
    copies = write_student_copies(ROOT / "notebooks", tmp_path)
    assert [copy.target.name for copy in copies] == [chapter.name for chapter in CHAPTERS]
    for copy in copies:
        notebook = nbformat.read(copy.target, as_version=4)
        nbformat.validate(notebook)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert "### BEGIN SOLUTION" not in cell.source, copy.target.name
                assert "### END SOLUTION" not in cell.source, copy.target.name
        original = json.loads(copy.source.read_text(encoding="utf-8"))
        assert len(notebook.cells) == len(original["cells"])
        assert copy.regions >= 3, f"{copy.target.name}: {copy.regions} exercises, the course has 3 per chapter"
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type == "code" and STUB in cell.source:
                assert cell.outputs == []
                python = "\n".join(
                    line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))
                )
                ast.parse(python, filename=f"{copy.target.name} cell {index}")  # the copy still parses


def test_a_stub_run_by_a_checker_on_several_processes_is_reported_as_not_done_yet():
    def ring_all_reduce(tensor, group=None):
        raise NotImplementedError("Exercise: write this part, then run the checker below")

    with pytest.raises(ExerciseError, match="not done yet"):
        ch00.check_ring_all_reduce(ring_all_reduce)


# -- answer-derived cells, Run All, clean failures, the website's form ------------------------------------
def answers_notebook() -> nbformat.NotebookNode:
    """An exercise whose answer shows up in four later cells, and two cells that must stay as they are."""
    out = lambda text: [nbformat.v4.new_output("stream", name="stdout", text=text)]  # noqa: E731
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [
        nbformat.v4.new_markdown_cell("### Exercise — the bubble"),
        nbformat.v4.new_code_cell("def bubble(p, m):\n    ### BEGIN SOLUTION\n    return (p - 1) / (m + p - 1)\n"
                                  "    ### END SOLUTION", execution_count=1),
        nbformat.v4.new_code_cell("ch05.check_bubble(bubble)", execution_count=2,
                                  outputs=out("[ok] bubble fraction: correct\n")),
        nbformat.v4.new_code_cell("predicted = {m: bubble(2, m) for m in (1, 2)}", execution_count=3),
        nbformat.v4.new_code_cell("print(predicted)", execution_count=4, outputs=out("{1: 0.5, 2: 0.333}\n")),
        nbformat.v4.new_code_cell("%matplotlib inline\nfor m in (1, 2):\n    print(m)", execution_count=5,
                                  outputs=out("1\n2\n")),
        nbformat.v4.new_code_cell("predicted = 3\nprint(predicted)", execution_count=6, outputs=out("3\n")),
    ]
    return notebook


def test_cells_that_check_or_use_an_answer_lose_their_outputs_and_let_run_all_go_on():
    original = json.loads(nbformat.writes(answers_notebook()))
    assert student.answer_cells(original) == {1: "answer", 2: "checker", 3: "uses bubble", 4: "uses predicted"}
    copy, regions, cells = student.student_notebook(original)
    assert (regions, cells) == (1, 1)
    for index in (1, 2, 3, 4):  # the verdict, and a number computed from the answer, are gone
        assert copy["cells"][index]["outputs"] == [] and copy["cells"][index]["execution_count"] is None
        assert student.CONTINUE_TAG in copy["cells"][index]["metadata"]["tags"]
    assert copy["cells"][5] == original["cells"][5]  # its own loop variable m is not the answer's
    assert copy["cells"][6] == original["cells"][6]  # `predicted` bound again, without the answer


def test_only_an_exercise_checker_makes_a_checker_cell_not_a_library_check():
    out = [nbformat.v4.new_output("stream", name="stdout", text="8 ranks\n")]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("cost.check_3d_layout(TINY, 2, 2, 2)\nprint('8 ranks')", outputs=out),
                      nbformat.v4.new_code_cell("ch06.check_mesh_position(position)"),
                      nbformat.v4.new_code_cell("check_mesh_position(position)")]
    assert student.answer_cells(json.loads(nbformat.writes(notebook))) == {1: "checker", 2: "checker"}


def test_website_form_shows_the_stub_and_tags_the_answer_and_its_checker_for_the_fold():
    web, folds = student.website_notebook(json.loads(nbformat.writes(answers_notebook())))
    assert folds == 1  # cells 1-4 follow one another: one fold
    tags = [cell.get("metadata", {}).get("tags", []) for cell in web["cells"]]
    assert tags[1] == [student.STUB_TAG] and STUB in "".join(web["cells"][1]["source"])
    assert web["cells"][1]["outputs"] == []
    assert [student.ANSWER_TAG in t for t in tags[2:]] == [True, True, True, True, False, False]
    assert "[ok] bubble fraction" in "".join(web["cells"][3]["outputs"][0]["text"])  # kept, inside the fold


WIDGET_STATE = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2, "version_minor": 0}}


def widget_output(kind: str, plain: str, **more) -> dict:
    view = {"model_id": "f00d", "version_major": 2, "version_minor": 0}
    output = nbformat.v4.new_output(kind, data={student.WIDGET_VIEW: view, "text/plain": plain, **more})
    if kind == "execute_result":
        output["execution_count"] = 7
    return output


def test_website_form_drops_live_widgets_and_keeps_their_static_twin():
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["widgets"] = WIDGET_STATE
    twin = '<div class="minitp-explore-static"><div class="minitp-explore" id="mx0">…</div></div>'
    notebook.cells = [
        nbformat.v4.new_code_cell("explore(run, draw, {'n': [2, 4]})", execution_count=1, outputs=[
            widget_output("display_data", "ring: n = 2", **{"text/html": twin})]),
        nbformat.v4.new_code_cell("@interact\ndef show(n=2): ...", execution_count=2, outputs=[
            widget_output("display_data", "interactive(children=(IntSlider(value=2),))"),
            nbformat.v4.new_output("execute_result", data={"text/plain": "<function show>"}, execution_count=2)]),
        nbformat.v4.new_code_cell("panel", execution_count=3, outputs=[
            widget_output("execute_result", "VBox(children=(Dropdown(),))"),
            nbformat.v4.new_output("stream", name="stdout", text="world_size = 4\n"),
            nbformat.v4.new_output("display_data", data={"image/png": "iVBOR", "text/plain": "<Figure>"})]),
    ]
    original = json.loads(nbformat.writes(notebook))
    web, folds = student.website_notebook(original)
    assert folds == 0 and "widgets" not in web["metadata"]
    assert student.WIDGET_VIEW not in json.dumps(web)
    first, second, third = (cell["outputs"] for cell in web["cells"])
    assert [sorted(o["data"]) for o in first] == [["text/html", "text/plain"]]  # the twin stays
    assert "".join(first[0]["data"]["text/html"]) == twin
    # the widget's own repr goes; what the cell returned is another output, left to the notebook
    assert ["".join(o["data"]["text/plain"]) for o in second] == ["<function show>"]
    assert [o["output_type"] for o in third] == ["stream", "display_data"]
    assert "widgets" in original["metadata"] and student.WIDGET_VIEW in json.dumps(original)  # not mutated


@pytest.mark.skipif(not CHAPTERS, reason="no chapters in notebooks/ yet")
def test_no_chapter_page_carries_a_live_widget():
    for path in CHAPTERS:
        web, _ = student.website_notebook(json.loads(path.read_text(encoding="utf-8")), name=path.name)
        text = json.dumps(web)
        assert student.WIDGET_VIEW not in text and "widget-state" not in text, path.name
        for number, cell in enumerate(web["cells"]):
            for output in cell.get("outputs", []):
                plain = "".join(output.get("data", {}).get("text/plain", ""))
                assert not re.match(r"(interactive|VBox|HBox)\(", plain), f"{path.name} cell {number}: {plain[:60]}"


def test_website_form_puts_the_hints_before_the_folded_worked_answer():
    """The hints move up between the stub and the fold; the next exercise, stored in the same Markdown
    cell after them, stays after the fold (a "# comment" in a code block there is no heading)."""
    notebook = answers_notebook()
    notebook.cells.insert(5, nbformat.v4.new_markdown_cell(
        "**Hints.** (1) Count the slots.\n\n<details><summary>Solution and why</summary>\n\n```python\n"
        "# idle slots over all slots\nreturn (p - 1) / (m + p - 1)\n```\n</details>\n\n"
        "### Exercise 2 — the zero-bubble table\n\nWrite the table."))
    web, folds = student.website_notebook(json.loads(nbformat.writes(notebook)))
    order = [student.STUB_TAG if student.STUB_TAG in c["metadata"].get("tags", []) else
             "fold" if student.ANSWER_TAG in c["metadata"].get("tags", []) else
             "hints" if "".join(c["source"]).startswith("**Hints") else
             "next" if "".join(c["source"]).startswith("### Exercise 2") else "other" for c in web["cells"]]
    assert order == ["other", student.STUB_TAG, "hints", "fold", "fold", "fold", "fold", "next", "other", "other"]
    assert folds == 1
    hints, after = "".join(web["cells"][2]["source"]), "".join(web["cells"][7]["source"])
    assert "# idle slots" in hints and "Exercise 2" not in hints and after.endswith("Write the table.")
    assert len({c["id"] for c in web["cells"]}) == len(web["cells"])  # ids stay unique


@pytest.mark.skipif(not CHAPTERS, reason="no chapters in notebooks/ yet")
def test_every_chapter_page_shows_an_exercises_hints_between_its_stub_and_its_worked_answer():
    for path in CHAPTERS:
        web, _ = student.website_notebook(json.loads(path.read_text(encoding="utf-8")), name=path.name)
        cells = web["cells"]
        hints = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and student.HINTS.match(
            "".join(c["source"]))]
        assert hints, f"{path.name}: no hints found"
        for i in hints:
            where = f"{path.name} cell {i}"
            assert student.STUB_TAG in cells[i - 1]["metadata"].get("tags", []), f"{where}: not after a stub"
            assert student.ANSWER_TAG in cells[i + 1]["metadata"].get("tags", []), f"{where}: no fold after it"
            assert student._split_at_heading(cells[i])[1] is None, f"{where}: the next exercise sits before the fold"


def test_hints_that_open_straight_with_their_first_fold_also_come_before_the_worked_answer():
    """A hints cell need not open with **Hints: one that opens with ``<details><summary>Hint 1`` (as
    chapters 06 and 10 write some) moves up between the stub and the fold all the same."""
    notebook = answers_notebook()
    notebook.cells.insert(5, nbformat.v4.new_markdown_cell(
        "<details><summary>Hint 1</summary>\n\nCount the idle slots.\n</details>"))
    web, folds = student.website_notebook(json.loads(nbformat.writes(notebook)))
    sources = ["".join(c["source"]) for c in web["cells"]]
    assert sources[2].startswith("<details><summary>Hint 1") and folds == 1
    assert student.STUB_TAG in web["cells"][1]["metadata"]["tags"]
    assert all(student.ANSWER_TAG in c["metadata"]["tags"] for c in web["cells"][3:7])


class _Page(HTMLParser):
    """Each notebook cell of a chapter's page (``<div id="cell-id=…">``), with whether it sits inside an
    answer fold (``<details class="minitp-answer">``), and the page's folds."""

    def __init__(self) -> None:
        super().__init__()
        self.open_details: list[bool] = []  # for each <details> still open: is it an answer fold?
        self.folded: dict[str, bool] = {}  # cell id -> inside a fold
        self.folds = 0

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "details":
            answer = "minitp-answer" in (attributes.get("class") or "").split()
            self.folds += answer
            self.open_details.append(answer)
        elif tag == "div" and (attributes.get("id") or "").startswith("cell-id="):
            self.folded[attributes["id"].removeprefix("cell-id=")] = any(self.open_details)

    def handle_endtag(self, tag):
        if tag == "details" and self.open_details:
            self.open_details.pop()


WORKED = re.compile(r"^\s*def problem_\d+\(|\bch\d\d\.check_\w*\(|^\s*### BEGIN SOLUTION", re.M)


@pytest.mark.skipif(not CHAPTERS, reason="no chapters in notebooks/ yet")
def test_every_worked_answer_of_every_chapter_is_folded_on_its_page(tmp_path):
    """Render each chapter's website form as the site does (mkdocs-jupyter's converter, then the site's
    ``fold_answers``): every cell that holds an answer or calls a checker (each exercise's and each worked
    problem's, found here by its text, not by the code under test) sits inside a closed "Show a worked
    answer" fold; each stub and each hint stays in view; one fold per run of answer cells."""
    nb2html = pytest.importorskip("mkdocs_jupyter.nbconvert2").nb2html
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT / "tools"))
    problems = 0
    for path in CHAPTERS:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        cells = notebook["cells"]
        worked = {c["id"] for c in cells if c["cell_type"] == "code" and WORKED.search("".join(c["source"]))}
        text = {kind: "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == kind)
                for kind in ("markdown", "code")}
        headings = re.findall(r"^#+ Problem (\d+)", text["markdown"], re.M)
        defined = re.findall(r"^def problem_(\d+)\(", text["code"], re.M)
        assert headings == defined, f"{path.name}: worked problems {headings}, answer functions {defined}"
        problems += len(headings)
        web, folds = student.website_notebook(notebook, name=path.name)
        form = tmp_path / path.name
        form.write_text(json.dumps(web), encoding="utf-8")
        page = _Page()
        page.feed(mkdocs_hooks.fold_answers(nb2html(str(form))))
        assert worked <= set(page.folded), f"{path.name}: cells missing from the page: {worked - set(page.folded)}"
        shown = sorted(cell_id for cell_id in worked if not page.folded[cell_id])
        assert not shown, f"{path.name}: worked answers in plain view on the page (cell ids {shown})"
        stubs = [c["id"] for c in web["cells"] if student.STUB_TAG in c["metadata"].get("tags", [])]
        assert stubs and not any(page.folded[cell_id] for cell_id in stubs), f"{path.name}: a stub is folded"
        hints = [c["id"] for c in web["cells"] if c["cell_type"] == "markdown"
                 and "<summary>Hint" in "".join(c["source"])]
        assert not any(page.folded[cell_id] for cell_id in hints), f"{path.name}: a hint is inside a fold"
        assert page.folds == folds, f"{path.name}: {page.folds} folds on the page, {folds} runs of answer cells"
        after_fold = [c["id"] for before, c in zip(web["cells"], web["cells"][1:]) if student._folded(before)
                      and c["cell_type"] == "markdown" and "<summary>Hint" in "".join(c["source"])]
        assert not after_fold, f"{path.name}: hints after their worked answer (cell ids {after_fold})"
    assert problems >= 3 * len(CHAPTERS)  # every chapter's worked problems were looked at


def twin_of_two_settings() -> str:
    """A static twin as ``minitp.viz.explore`` writes it: two stored panels behind a radio row."""
    from minitp.viz.explore import Control, Explorer

    explorer = Explorer(run=lambda n: n, draw=lambda result, setting: str(result), controls={"n": Control([2, 4])})
    return explorer.static_html([({"n": 2}, "<pre>n = 2</pre>"), ({"n": 4}, "<pre>n = 4</pre>")])


def test_a_learner_copy_shows_one_line_where_a_live_control_was_stored():
    """JupyterLab does not trust a fresh copy: it would strip the twin's <style> and show every stored
    panel at once under dead radio buttons. The copy shows one line instead; the cell's other outputs stay."""
    twin = twin_of_two_settings()
    assert student.TWIN_CLASS in twin  # the class the copier looks for is the one explore writes
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["widgets"] = WIDGET_STATE
    notebook.cells = [
        nbformat.v4.new_code_cell("explore(run, draw, {'n': [2, 4]}).with_twin()", execution_count=1, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="world_size = 4\n"),
            widget_output("execute_result", "ring: n = 2", **{"text/html": twin})]),
        nbformat.v4.new_code_cell("panel", execution_count=2, outputs=[
            nbformat.v4.new_output("display_data", data={"text/html": twin, "text/plain": "ring"})]),  # no view
        nbformat.v4.new_code_cell("print(1)", execution_count=3, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="1\n")]),
    ]
    original = json.loads(nbformat.writes(notebook))
    copy, _, _ = student.student_notebook(original)
    text = json.dumps(copy)
    assert student.TWIN_CLASS not in text and "<style>" not in text and 'type="radio"' not in text
    assert student.WIDGET_VIEW not in text and "widgets" not in copy["metadata"]
    first, second, third = (cell["outputs"] for cell in copy["cells"])
    line = {"output_type": "display_data", "data": {"text/plain": [student.LIVE_CONTROL_LINE]}, "metadata": {}}
    assert first == [original["cells"][0]["outputs"][0], line]
    assert second == [line] and third == original["cells"][2]["outputs"]
    nbformat.validate(nbformat.reads(json.dumps(copy), as_version=4))


@pytest.mark.skipif(not CHAPTERS, reason="no chapters in notebooks/ yet")
def test_no_learner_copy_of_a_chapter_keeps_a_stored_control(tmp_path):
    for copy in write_student_copies(ROOT / "notebooks", tmp_path):
        original = json.loads(copy.source.read_text(encoding="utf-8"))
        notebook = json.loads(copy.target.read_text(encoding="utf-8"))
        text = json.dumps(notebook)
        assert student.TWIN_CLASS not in text and student.WIDGET_VIEW not in text, copy.target.name
        assert "widgets" not in notebook["metadata"], copy.target.name
        for index, cell in enumerate(original["cells"]):
            if any(student.is_live_control(output) for output in cell.get("outputs", [])):
                shown = ["".join(o.get("data", {}).get("text/plain", "")) for o in notebook["cells"][index]["outputs"]]
                assert shown.count(student.LIVE_CONTROL_LINE) == 1, f"{copy.target.name} cell {index}: {shown}"


@pytest.mark.skipif(not CHAPTERS, reason="no chapters in notebooks/ yet")
def test_every_chapter_and_its_learner_copy_carry_the_kernelspec_jupyterlab_writes(tmp_path):
    """JupyterLab writes its kernel's name into a notebook it opens: a different stored one marks every
    chapter unsaved the moment it opens."""
    from ipykernel.kernelspec import KERNEL_NAME, get_kernel_dict

    installed = get_kernel_dict()
    assert student.KERNELSPEC == {"name": KERNEL_NAME, "display_name": installed["display_name"],
                                  "language": installed["language"]}
    for path in CHAPTERS:
        assert json.loads(path.read_text(encoding="utf-8"))["metadata"].get("kernelspec") == student.KERNELSPEC, \
            f"{path.name}: kernelspec is not {student.KERNELSPEC}"
    notebook = answers_notebook()  # stored with another kernelspec: the copy still carries JupyterLab's
    assert student.student_notebook(json.loads(nbformat.writes(notebook)))[0]["metadata"]["kernelspec"] == \
        student.KERNELSPEC


def control_options(source: str) -> dict[str, list]:
    """Each ``Control([...])`` option list of the ``explore(...)`` call in a cell's code, by control name."""
    for node in ast.walk(ast.parse("\n".join(line for line in source.splitlines() if not line.startswith("%")))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "explore":
            controls = node.args[2]
            return {ast.literal_eval(key): ast.literal_eval(value.args[0])
                    for key, value in zip(controls.keys, controls.values)}
    return {}


@pytest.mark.skipif(not (ROOT / "notebooks" / "05_pipeline.ipynb").is_file(), reason="no chapter 05")
def test_every_setting_of_chapter_05s_control_makes_a_schedule():
    """Interleaved 1F1B needs m divisible by p: the control offers no stage count it fails for."""
    import itertools

    from minitp import pp

    cells = json.loads((ROOT / "notebooks" / "05_pipeline.ipynb").read_text(encoding="utf-8"))["cells"]
    found = [control_options("".join(c["source"])) for c in cells if c["cell_type"] == "code"]
    [options] = [o for o in found if {"schedule", "stages", "microbatches"} <= set(o)]
    for schedule, stages, microbatches in itertools.product(options["schedule"], options["stages"],
                                                            options["microbatches"]):
        virtual = 2 if schedule == "interleaved" else 1  # the chapter's V
        assert pp.make_schedule(schedule, stages, microbatches, virtual), (schedule, stages, microbatches)


def test_a_changed_learner_copy_is_kept_unless_forced(tmp_path):
    source = tmp_path / "notebooks"
    source.mkdir()
    nbformat.write(answers_notebook(), source / "05_bubble.ipynb")
    [first] = write_student_copies(source, tmp_path / "student")
    first.target.write_text(first.target.read_text().replace("raise NotImplementedError", "return 0.5  #"))
    [again] = write_student_copies(source, tmp_path / "student", force=False)  # the learner's work stays
    assert again.kept and "return 0.5" in again.target.read_text()
    [fresh] = write_student_copies(source, tmp_path / "student", force=True)
    assert not fresh.kept and "return 0.5" not in fresh.target.read_text()


VERDICTS = re.compile(r"\[ok\]|: correct\b|ExerciseError|Traceback")


def names_used(source: str) -> set[str]:
    """The plain names a cell's code mentions (not attributes, strings or comments)."""
    import io
    import tokenize

    python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    names, previous = set(), None
    for token in tokenize.generate_tokens(io.StringIO(python + "\n").readline):
        if token.type == tokenize.NAME and previous != ".":
            names.add(token.string)
        previous = token.string
    return names


@pytest.mark.skipif(not CHAPTERS, reason="no chapters in notebooks/ yet")
def test_no_learner_copy_keeps_a_verdict_or_an_output_of_a_cell_that_names_an_answer(tmp_path):
    """Walks every chapter's copy: no stored checker verdict anywhere, and no output in any cell that
    calls a checker or names a function or class whose body was an answer (a textual rule, independent
    of the copier's own analysis)."""
    for copy in write_student_copies(ROOT / "notebooks", tmp_path):
        notebook = nbformat.read(copy.target, as_version=4)
        stubbed = set()
        for cell in notebook.cells:
            if cell.cell_type == "code" and STUB in cell.source:
                stubbed |= set(re.findall(r"^(?:def|class)\s+(\w+)", cell.source, flags=re.MULTILINE))
        assert stubbed, f"{copy.target.name}: no exercise found"
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code":
                continue
            text = json.dumps(cell.outputs)
            where = f"{copy.target.name} cell {index}"
            assert not VERDICTS.search(text), f"{where} keeps a verdict: {text[:200]}"
            used = names_used(cell.source)
            names_answer = used & stubbed or {name for name in used if name.startswith("check_")}
            names_answer |= {"check_"} if re.search(r"\bch\d\d\.check_\w+\(", cell.source) else set()
            if names_answer:
                assert cell.outputs == [], f"{where} uses {sorted(names_answer)} and keeps its output"
                assert "raises-exception" in cell.metadata.get("tags", []), f"{where} would stop Run All"


def test_run_all_of_a_learner_copy_goes_past_an_unfinished_exercise(tmp_path):
    import nbclient

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [
        nbformat.v4.new_code_cell("from minitp.exercises import ch03\n\ndef pair_bytes(batch, seq, dim, n, b):\n"
                                  "    ### BEGIN SOLUTION\n    return 4 * (n - 1) / n * batch * seq * dim * b\n"
                                  "    ### END SOLUTION"),
        nbformat.v4.new_code_cell("ch03.check_pair_bytes(pair_bytes)"),
        nbformat.v4.new_code_cell("print('the rest of the chapter ran')"),
    ]
    copy, _, _ = student.student_notebook(json.loads(nbformat.writes(notebook)))
    ran = nbclient.NotebookClient(nbformat.reads(json.dumps(copy), as_version=4), timeout=120).execute()
    error = ran.cells[1].outputs[0]
    assert error["output_type"] == "error" and "not done yet" in error["evalue"]
    assert "\n".join(error["traceback"]).count("\n") <= 1, "the checker's frames are shown"
    assert ran.cells[2].outputs[0]["text"] == "the rest of the chapter ran\n"


def test_a_failing_rank_shows_its_error_and_the_learners_frames_not_the_checkers():
    from minitp.exercises import ch03

    def row_parallel_forward(x_shard, weight_shard, bias, group):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("a mistake on rank 1")
        return x_shard @ weight_shard.T + bias

    with pytest.raises(ExerciseError) as caught:
        ch03.check_row_parallel_forward(row_parallel_forward)
    message = str(caught.value)
    assert "rank 1 raised ValueError: a mistake on rank 1" in message
    assert "in row_parallel_forward" in message and 'raise ValueError("a mistake on rank 1")' in message
    assert "exercises/ch03.py" not in message and "launch.py" not in message
    shown = caught.value._render_traceback_()  # what IPython shows: the message, no checker frame
    assert "ExerciseError" in shown[0] and "a mistake on rank 1" in shown[0]
    assert "\n".join(shown[1:]) == "\n".join(message.splitlines()[1:])


def test_call_answer_reports_a_stub_and_a_crash_by_the_learners_frames():
    from minitp.exercises import call_answer

    def stub(x):
        raise NotImplementedError

    def crash(x):
        return x / 0

    with pytest.raises(ExerciseError, match="bubble: not done yet"):
        call_answer("bubble", stub, 1)
    with pytest.raises(ExerciseError, match="bubble: your code raised ZeroDivisionError") as caught:
        call_answer("bubble", crash, 1)
    assert "in crash" in str(caught.value) and "exercises/__init__.py" not in str(caught.value)


def test_progress_is_off_by_default_and_names_each_ranks_step_when_asked(monkeypatch):
    import time

    import minitp
    from minitp.launcher import progress

    def work(steps):
        for index in range(steps):
            progress.step(index, steps)
        time.sleep(0.5)  # the parent looks while the ranks are still there
        return os.environ.get(progress.DIR_ENV) is not None

    monkeypatch.delenv(progress.ENV, raising=False)
    lines = []
    monkeypatch.setattr(progress.Line, "update", lambda self, finished: lines.append(self.text(finished)))
    assert minitp.launch(work, 2, 3) == [True, True]
    assert not any("rank 0 step" in line for line in lines)  # ranks wrote nothing: progress is off
    monkeypatch.setenv(progress.ENV, "1")
    lines.clear()
    minitp.launch(work, 2, 3)
    assert any("rank 0 step 3/3, rank 1 step 3/3" in line for line in lines), lines[-1:]


def test_learner_copies_hold_no_worked_answer():
    """Each chapter's "Solution and why" folds go from the copy (the answer stays in notebooks/ and on
    the site); the hints stay."""
    import json
    import re

    from minitp.exercises.student import student_notebook

    chapters = sorted(Path(__file__).parents[1].glob("notebooks/[0-9][0-9]_*.ipynb"))
    folds = 0
    for path in chapters:
        notebook = json.loads(path.read_text())
        folds += sum("Solution and why" in "".join(c["source"]) for c in notebook["cells"])
        copy, _, _ = student_notebook(notebook, path.name)
        for cell in (c for c in copy["cells"] if c["cell_type"] == "markdown"):
            text = "".join(cell["source"])
            for fold in re.findall(r"<summary>Solution and why</summary>(.*?)</details>", text, re.S):
                assert "```" not in fold and f"notebooks/{path.name}" in fold, (path.name, fold[:200])
        hints = [c for c in copy["cells"] if "".join(c["source"]).startswith("**Hints")]
        assert len(hints) == sum("".join(c["source"]).startswith("**Hints") for c in notebook["cells"])
    assert folds >= 30  # the chapters' worked answers, all of them checked above
