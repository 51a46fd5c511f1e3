"""Learner copies of the chapters: the solved notebooks with every answer taken out.

In ``notebooks/`` an answer sits between a line ``### BEGIN SOLUTION`` and a line ``### END SOLUTION``
(indented like the code around it, usually inside a function body). The learner's copy keeps every
cell but replaces each such region, markers included, by one line at the same indentation::

    raise NotImplementedError("Exercise: write this part, then run the checker below")

so the function still parses, and calling it says plainly that the part is missing. The outputs of a
cell that lost an answer are cleared (they showed the answer at work). Markdown cells are left alone:
worked answers there sit inside ``<details>``, hidden until the learner clicks.

Only the standard library is used (the notebook is JSON), so this runs wherever minitp is installed::

    python -m minitp.exercises.student notebooks student
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = 'raise NotImplementedError("Exercise: write this part, then run the checker below")'
CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"


class SolutionMarkerError(ValueError):
    """The ``### BEGIN SOLUTION`` / ``### END SOLUTION`` markers of a cell do not pair up."""


@dataclass
class StudentCopy:
    """What happened to one notebook: where it was written and how many answers were taken out."""

    source: Path
    target: Path
    regions: int
    cells: int


def _marker(line: str) -> str | None:
    stripped = line.strip()
    if stripped.startswith(BEGIN):
        return BEGIN
    if stripped.startswith(END):
        return END
    return None


def strip_solutions(source: str, where: str = "cell") -> tuple[str, int]:
    """Replace each solution region of ``source`` by the stub; return the new source and the count.

    ``where`` names the cell in error messages (``"00_collectives.ipynb, cell 12"``).
    """
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    regions = 0
    open_at: int | None = None  # line number (1-based) of the BEGIN that is still open
    for number, line in enumerate(lines, start=1):
        marker = _marker(line)
        if marker == BEGIN:
            if open_at is not None:
                raise SolutionMarkerError(
                    f"{where}, line {number}: '{BEGIN}' again before the '{END}' "
                    f"of the region opened on line {open_at}"
                )
            open_at = number
            indent = line[: len(line) - len(line.lstrip())]
            newline = "\n" if line.endswith("\n") else ""
            out.append(f"{indent}{STUB}{newline}")
        elif marker == END:
            if open_at is None:
                raise SolutionMarkerError(f"{where}, line {number}: '{END}' without a '{BEGIN}' before it")
            open_at = None
            regions += 1
            if not line.endswith("\n") and out and out[-1].endswith("\n"):
                # the region closed the cell: do not leave a trailing newline the original did not have
                out[-1] = out[-1][:-1]
        elif open_at is None:
            out.append(line)
    if open_at is not None:
        raise SolutionMarkerError(f"{where}, line {open_at}: '{BEGIN}' is never closed by '{END}'")
    return "".join(out), regions


def _source_text(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def student_notebook(notebook: dict, name: str = "notebook") -> tuple[dict, int, int]:
    """The learner's copy of a notebook (as loaded JSON): ``(copy, regions removed, cells changed)``."""
    copy = json.loads(json.dumps(notebook))
    regions = cells = 0
    for index, cell in enumerate(copy.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        text = _source_text(cell)
        if BEGIN not in text and END not in text:
            continue
        new_text, found = strip_solutions(text, where=f"{name}, cell {index}")
        if found == 0:
            continue
        cell["source"] = new_text.splitlines(keepends=True)
        cell["outputs"] = []
        cell["execution_count"] = None
        regions += found
        cells += 1
    return copy, regions, cells


def write_student_copy(source: Path, target: Path) -> StudentCopy:
    """Write the learner's copy of the notebook ``source`` to ``target``."""
    notebook = json.loads(Path(source).read_text(encoding="utf-8"))
    copy, regions, cells = student_notebook(notebook, name=Path(source).name)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(copy, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    target.write_text(text, encoding="utf-8")
    return StudentCopy(Path(source), target, regions, cells)


def write_student_copies(notebook_dir: Path, student_dir: Path) -> list[StudentCopy]:
    """A learner's copy of every chapter ``NN_*.ipynb`` of ``notebook_dir``, written into ``student_dir``.

    Every notebook is checked before any is written, so bad markers leave ``student_dir`` untouched.
    """
    notebook_dir, student_dir = Path(notebook_dir), Path(student_dir)
    if not notebook_dir.is_dir():
        raise FileNotFoundError(f"no notebook folder at {notebook_dir}")
    sources = sorted(notebook_dir.glob(CHAPTER_GLOB))
    for source in sources:  # fail early, before writing anything
        student_notebook(json.loads(source.read_text(encoding="utf-8")), name=source.name)
    return [write_student_copy(source, student_dir / source.name) for source in sources]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minitp.exercises.student",
        description="Write the learner's copies of the chapters, with the solutions replaced by stubs.",
    )
    parser.add_argument("notebooks", type=Path, help="folder of solved chapters (NN_*.ipynb)")
    parser.add_argument("student", type=Path, help="folder to write the learner's copies into")
    args = parser.parse_args(argv)
    try:
        copies = write_student_copies(args.notebooks, args.student)
    except (SolutionMarkerError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for copy in copies:
        print(f"{copy.target}: {copy.regions} solution region(s) in {copy.cells} cell(s) replaced by stubs")
    if not copies:
        print(f"no chapters ({CHAPTER_GLOB}) in {args.notebooks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
