"""Learner copies: every answer is taken out, what is left still runs, and a stub is recognised."""

import ast
import json
from pathlib import Path

import pytest

from minitp.exercises import ExerciseError, ch00, student

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob(student.CHAPTER_GLOB))

SOLVED = '''import torch

def double(x):
    """Twice x."""
    ### BEGIN SOLUTION
    y = x + x
    return y
    ### END SOLUTION

print(double(2))
'''


def test_a_solution_region_becomes_a_stub_at_the_same_indentation():
    text, regions = student.strip_solutions(SOLVED)
    assert regions == 1
    assert "x + x" not in text and "BEGIN SOLUTION" not in text
    assert f"    {student.STUB}\n" in text
    assert '"""Twice x."""' in text and "print(double(2))" in text  # everything else is kept
    namespace = {}
    exec(compile(text.replace("print(double(2))", ""), "<copy>", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="Exercise: write this part"):
        namespace["double"](2)


@pytest.mark.parametrize("broken", [
    "def f():\n    ### BEGIN SOLUTION\n    return 1\n",
    "def f():\n    return 1\n    ### END SOLUTION\n",
    "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n",
])
def test_unbalanced_markers_are_refused_naming_the_cell(broken):
    with pytest.raises(student.SolutionMarkerError, match="07_demo.ipynb, cell 3"):
        student.strip_solutions(broken, where="07_demo.ipynb, cell 3")


def test_a_notebook_copy_clears_the_answers_outputs_and_keeps_the_rest():
    notebook = {"cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "<details><summary>Answer</summary>x + x</details>"},
        {"cell_type": "code", "metadata": {}, "execution_count": 3, "source": SOLVED,
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "4\n"}]},
        {"cell_type": "code", "metadata": {}, "execution_count": 4, "source": "print('kept')",
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "kept\n"}]},
    ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    copy, regions, cells = student.student_notebook(notebook)
    assert (regions, cells) == (1, 1)
    assert copy["cells"][0] == notebook["cells"][0]
    assert copy["cells"][1]["outputs"] == [] and copy["cells"][1]["execution_count"] is None
    assert copy["cells"][2] == notebook["cells"][2]
    assert notebook["cells"][1]["outputs"]  # the solved notebook itself is untouched


@pytest.mark.skipif(not CHAPTERS, reason="no chapters yet")
def test_the_real_chapters_lose_every_answer_and_still_parse(tmp_path):
    copies = student.write_student_copies(ROOT / "notebooks", tmp_path)
    assert [c.target.name for c in copies] == [c.name for c in CHAPTERS]
    for copy in copies:
        assert copy.regions >= 3, f"{copy.target.name}: {copy.regions} exercises, the course has 3 per chapter"
        nb = json.loads(copy.target.read_text())
        for index, cell in enumerate(nb["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] != "code":
                continue
            assert "### BEGIN SOLUTION" not in source and "### END SOLUTION" not in source
            if student.STUB in source:
                python = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
                ast.parse(python, filename=f"{copy.target.name} cell {index}")
                assert cell["outputs"] == []


def test_a_stub_on_several_processes_is_reported_as_not_done_yet():
    def ring_all_reduce(tensor, group=None):
        raise NotImplementedError("Exercise: write this part, then run the checker below")

    with pytest.raises(ExerciseError, match="not done yet"):
        ch00.check_ring_all_reduce(ring_all_reduce)


def test_the_command_writes_the_copies(tmp_path, capsys):
    source = tmp_path / "notebooks"
    source.mkdir()
    (source / "00_demo.ipynb").write_text(json.dumps({"cells": [
        {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": SOLVED, "outputs": []}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert student.main([str(source), str(tmp_path / "student")]) == 0
    assert "1 solution region(s) in 1 cell(s)" in capsys.readouterr().out
    copy = json.loads((tmp_path / "student" / "00_demo.ipynb").read_text())
    assert student.STUB in "".join(copy["cells"][0]["source"])
