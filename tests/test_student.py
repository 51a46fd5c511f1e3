"""Learner copies (`make student`): every answer between the solution markers is replaced by a stub
that raises NotImplementedError, and nothing else of the notebook changes."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minitp.exercises import ExerciseError, ch00, student
from minitp.exercises.student import STUB, SolutionMarkerError, strip_solutions, write_student_copies

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
