"""Learner copies of the chapters, and the website's form of them: answers out, or folded.

The rule every chapter follows (00-08 and any later one; no chapter is special, no cell needs a
tag):

1. **Answers** sit in code cells between a line ``### BEGIN SOLUTION`` and a line ``### END
   SOLUTION`` (indented like the code around them, usually inside a function body).
2. **Checkers** are called as a function whose name starts with ``check_``
   (``ch03.check_f_operator(f)``), in the answer's own cell or in a cell after it.
3. **Answer-derived cells**: a code cell that calls a checker, or reads a name an answer defines
   (the function or class whose body holds the answer), or reads a name such a cell set
   (``x = bubble(2, 8)`` then ``print(x)``), shows the answer at work. A cell that binds a name
   again without reading the answer's clears it. Keep a cell out of this set (it stays visible
   everywhere) by calling minitp's own function there instead of the learner's.

What the two forms do with them:

* **Learner copy** (``make student``; ``python -m minitp.exercises.student notebooks student``):
  each
  answer region, markers included, becomes one line at the same indentation::

      raise NotImplementedError("Exercise: write this part, then run the checker below")

  The answer cells and every answer-derived cell lose their outputs (no verdict, no "[ok]", no
  number computed from an answer survives) and get the cell tag ``raises-exception``: JupyterLab's
  Run All (and nbclient) then goes on past them, so an unfinished exercise shows "not done yet" and
  the rest of the chapter still runs. Each exercise's hints stay; its worked answer ("Solution and
  why", folded inside ``<details>``) does not: the fold says where the answer is (the solved chapter
  in ``notebooks/``, and the website), so the copy itself reveals no answer. A live control's stored
  output (its static twin, or any widget view: a fresh copy is not trusted, so JupyterLab would
  strip the twin's style and show every stored panel at once) becomes one line,
  ``LIVE_CONTROL_LINE``, and the notebook's ``widgets`` metadata goes: the control appears when its
  cell runs. The copy carries the kernelspec JupyterLab writes (``KERNELSPEC``), so it opens
  unchanged, not marked unsaved. A copy that already exists and differs from a fresh one (the
  learner's work) is kept unless ``--force``.
* **The final project** (``write_project_copy``): ``notebooks/project.py``, solved, becomes
  ``student/project.py`` with each answer region one line, ``PROJECT_STUB``, which names the
  grader (``minitp grade``); a copy the learner changed is kept, as a chapter's is.
* **Website form** (``website_notebook``, used by ``tools/mkdocs_hooks.py``): before each answer
  cell a copy of its stub (tag ``minitp-stub``, no output); the answer cell and the answer-derived
  cells right after it are tagged ``minitp-answer``, and the site folds each run of them, outputs
  included, behind ``<details>`` "Show a worked answer", after the exercise's hints (a Markdown cell
  opening with ``**Hints``, or with its first hint's ``<details><summary>Hint`` fold, stored after
  the checker, moves up to sit between the stub and the fold; its text from its first heading on,
  the next exercise, stays where it was). A page has no kernel, so the live widgets go: each output
  loses its ``application/vnd.jupyter.widget-view+json`` entry (the rest stays: a control's static
  twin is its ``text/html``), an output left with only the widget's ``text/plain`` repr
  (``interactive(children=…``) is dropped, and so is the notebook's ``widgets`` metadata (with it,
  the page would load a widget renderer from a CDN).

Only the standard library is used (the notebook is JSON), so this runs wherever minitp is installed.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = 'raise NotImplementedError("Exercise: write this part, then run the checker below")'
# the final project: notebooks/project.py solved, student/project.py the learner's
PROJECT = "project.py"
PROJECT_STUB = ('raise NotImplementedError("Project: write this part, then run: minitp grade '
                'student/project.py")')
CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"
CHECKER_PREFIX = "check_"
# JupyterLab and nbclient keep running the cells after an error here
CONTINUE_TAG = "raises-exception"
STUB_TAG = "minitp-stub"  # website form: the learner's stub of an answer cell
ANSWER_TAG = "minitp-answer"  # website form: folded behind "Show a worked answer"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"  # a live ipywidgets view: needs a kernel
# the outer class of a static twin (minitp.viz.explore.Explorer.static_html)
TWIN_CLASS = "minitp-explore-static"
# a learner copy's stand-in for a twin
LIVE_CONTROL_LINE = "Run this cell: the live control appears here."
# What ipykernel installs and JupyterLab writes into a notebook it opens: stored the same, a chapter
# opens unchanged (tests/test_student.py checks every chapter carries it).
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# An exercise's hints: a Markdown cell that opens with **Hints, or straight with its first hint's
# fold (<details><summary>Hint 1</summary>, as chapters 06 and 10 write some)
HINTS = re.compile(r"\s*(\*\*Hints\b|<details>\s*<summary>\s*Hint\b)")
# a Markdown heading: in a hints cell, where the next exercise begins
HEADING = re.compile(r"#{1,6} ")


class SolutionMarkerError(ValueError):
    """The ``### BEGIN SOLUTION`` / ``### END SOLUTION`` markers of a cell do not pair up."""


@dataclass
class StudentCopy:
    """What happened to one notebook: where it was written and how many answers were taken out."""

    source: Path
    target: Path
    regions: int
    cells: int
    cleared: int = 0  # answer-derived cells whose outputs were cleared (answer cells not counted)
    kept: bool = False  # an existing copy differed from a fresh one and was left as it was


def _marker(line: str) -> str | None:
    stripped = line.strip()
    if stripped.startswith(BEGIN):
        return BEGIN
    if stripped.startswith(END):
        return END
    return None


def solution_regions(source: str, where: str = "cell") -> list[tuple[int, int]]:
    """The (BEGIN line, END line) pairs of ``source``, 1-based; bad pairing raises
    ``SolutionMarkerError``."""
    regions: list[tuple[int, int]] = []
    open_at: int | None = None  # line number of the BEGIN that is still open
    for number, line in enumerate(source.splitlines(), start=1):
        marker = _marker(line)
        if marker == BEGIN:
            if open_at is not None:
                raise SolutionMarkerError(
                    f"{where}, line {number}: '{BEGIN}' again before the '{END}' "
                    f"of the region opened on line {open_at}"
                )
            open_at = number
        elif marker == END:
            if open_at is None:
                raise SolutionMarkerError(
                    f"{where}, line {number}: '{END}' without a '{BEGIN}' before it")
            regions.append((open_at, number))
            open_at = None
    if open_at is not None:
        raise SolutionMarkerError(f"{where}, line {open_at}: '{BEGIN}' is never closed by '{END}'")
    return regions


def strip_solutions(source: str, where: str = "cell", stub: str = STUB) -> tuple[str, int]:
    """Replace each solution region of ``source`` by ``stub``; return the new source and the count.

    ``where`` names the cell in error messages (``"00_collectives.ipynb, cell 12"``).
    """
    regions = solution_regions(source, where)
    starts = {begin: end for begin, end in regions}
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    skip_to = 0
    for number, line in enumerate(lines, start=1):
        if number <= skip_to:
            continue
        if number in starts:
            indent = line[: len(line) - len(line.lstrip())]
            end_line = lines[starts[number] - 1]
            # the region closed the cell: do not add a trailing newline the original did not have
            newline = "\n" if end_line.endswith("\n") else ""
            out.append(f"{indent}{stub}{newline}")
            skip_to = starts[number]
        else:
            out.append(line)
    return "".join(out), len(regions)


def _source_text(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


# -- which cells show an answer at work ------------------------------------------------------------
def _parse(source: str) -> ast.Module | None:
    """The cell's code as Python; IPython's ``%magic`` and ``!shell`` lines become blank lines."""
    python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                       for line in source.splitlines())
    try:
        return ast.parse(python)
    except SyntaxError:
        return None


def _scoped_names(statement: ast.AST) -> set[str]:
    """Names a statement binds for its own use before reading them: loop and comprehension
    variables, function and lambda arguments, ``with ... as`` and ``except ... as`` names."""
    names: set[str] = set()
    for node in ast.walk(statement):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            targets = [node.target]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets = [node.optional_vars]
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        for target in targets:
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _bound_names(statement: ast.stmt) -> set[str]:
    """Names a top-level statement binds in the notebook's namespace (not imports: a module is never
    an answer; not comprehension variables or arguments, which stay inside)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return set()
    inner = {n.id for node in ast.walk(statement) if isinstance(node, ast.comprehension)
             for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    inner |= {node.arg for node in ast.walk(statement) if isinstance(node, ast.arg)}
    stored = {node.id for node in ast.walk(statement)
              if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del))}
    return stored - inner


def _reads(statement: ast.AST) -> set[str]:
    """Names a statement reads from the notebook's namespace (its own loop variables and arguments
    aside)."""
    loads = {node.id for node in ast.walk(statement) if isinstance(node, ast.Name)
             and isinstance(node.ctx, ast.Load)}
    return loads - _scoped_names(statement)


def _calls_checker(statement: ast.AST) -> bool:
    """Whether the statement calls an exercise's checker: ``chNN.check_x(...)`` or a bare
    ``check_x(...)`` imported from the chapter's module; a library's own
    ``cost.check_3d_layout(...)`` is not one."""
    for node in ast.walk(statement):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                name = func.id
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                    and re.fullmatch(r"ch\d\d", func.value.id):
                name = func.attr
            else:
                name = ""
            if name.startswith(CHECKER_PREFIX):
                return True
    return False


def answer_cells(notebook: dict, name: str = "notebook") -> dict[int, str]:
    """Index -> why, for every code cell that holds an answer or shows one at work (see the module
    doc).

    Reasons: ``"answer"``, ``"checker"`` (calls a ``check_*`` function), ``"uses NAME"``.
    """
    tainted: set[str] = set()  # names whose value comes from an answer
    found: dict[int, str] = {}
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        text = _source_text(cell)
        regions = solution_regions(
            text, where=f"{name}, cell {index}") if BEGIN in text or END in text else []
        tree = _parse(text)
        if tree is None:  # not Python we can read: judge by the words in it
            words = set(re.findall(r"[A-Za-z_]\w*", text))
            if regions:
                found[index] = "answer"
            elif words & tainted or re.search(rf"\b{CHECKER_PREFIX}\w*\(", text):
                found[index] = "uses " + ", ".join(sorted(
                    words & tainted)) if words & tainted else "checker"
            continue
        if regions:
            found[index] = "answer"
        for statement in tree.body:
            start, end = statement.lineno, statement.end_lineno or statement.lineno
            holds_answer = any(begin <= end and start <= stop for begin, stop in regions)
            read = _reads(statement) & tainted
            checker = _calls_checker(statement)
            if holds_answer or read or checker:
                if index not in found:
                    found[index] = "checker" if checker else "uses " + ", ".join(sorted(read))
                tainted |= _bound_names(statement)
            else:
                # bound again without the answer: no longer derived
                tainted -= _bound_names(statement)
    return found


# -- the learner's copy ----------------------------------------------------------------------------
def _clear(cell: dict) -> None:
    cell["outputs"] = []
    cell["execution_count"] = None
    tags = cell.setdefault("metadata", {}).setdefault("tags", [])
    if CONTINUE_TAG not in tags:
        tags.append(CONTINUE_TAG)


def is_live_control(output: dict) -> bool:
    """Whether a stored output is a live control: a static twin (``TWIN_CLASS``) or a widget
    view."""
    data = output.get("data")
    if not isinstance(data, dict):
        return False
    html = data.get("text/html", "")
    return WIDGET_VIEW in data or TWIN_CLASS in ("".join(html) if isinstance(html, list) else html)


def without_stored_controls(outputs: list[dict]) -> list[dict]:
    """A learner copy's outputs: each live control's stored output (see :func:`is_live_control`)
    becomes one line, ``LIVE_CONTROL_LINE`` (once per cell); the other outputs stay as they are."""
    kept, replaced = [], False
    for output in outputs:
        if not is_live_control(output):
            kept.append(output)
        elif not replaced:
            kept.append({"output_type": "display_data", "data": {"text/plain": [LIVE_CONTROL_LINE]},
                         "metadata": {}})
            replaced = True
    return kept


def student_notebook(notebook: dict, name: str = "notebook") -> tuple[dict, int, int]:
    """The learner's copy of a notebook (as loaded JSON): ``(copy, regions removed, cells
    changed)``.

    "Cells changed" counts the cells that lost an answer; answer-derived cells are cleared too. Each
    live control's stored output becomes one line; the kernelspec is JupyterLab's (``KERNELSPEC``).
    """
    copy = json.loads(json.dumps(notebook))
    metadata = copy.setdefault("metadata", {})
    # the state of widgets whose kernel is gone: no view is left to use it
    metadata.pop("widgets", None)
    metadata["kernelspec"] = dict(KERNELSPEC)
    for cell in copy.get("cells", []):
        if cell.get("outputs"):
            cell["outputs"] = without_stored_controls(cell["outputs"])
    for cell in copy.get("cells", []):
        if cell.get("cell_type") == "markdown":
            text = _source_text(cell)
            if SOLUTION_FOLD.search(text):
                cell["source"] = SOLUTION_FOLD.sub(_answer_elsewhere(name),
                                                   text).splitlines(keepends=True)
    regions = cells = 0
    for index, why in answer_cells(copy, name).items():
        cell = copy["cells"][index]
        if why == "answer":
            new_text, found = strip_solutions(_source_text(cell), where=f"{name}, cell {index}")
            cell["source"] = new_text.splitlines(keepends=True)
            regions += found
            cells += 1
        _clear(cell)
    return copy, regions, cells


SOLUTION_FOLD = re.compile(r"<details>\s*<summary>Solution and why</summary>.*?</details>", re.S)


def _answer_elsewhere(name: str) -> str:
    """What a learner copy holds in place of a worked answer's fold."""
    return ("<details><summary>Solution and why</summary>\n\nNot in your copy: the answer and its "
            f"reasoning are in the solved chapter, `notebooks/{name}`, and on the website under "
            "\"Show a worked answer\". Try the hints first.\n</details>")


def _notebook_text(notebook: dict) -> str:
    return json.dumps(notebook, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def write_student_copy(source: Path, target: Path, force: bool = True) -> StudentCopy:
    """Write the learner's copy of the notebook ``source`` to ``target``.

    With ``force=False`` an existing ``target`` that differs from a fresh copy (the learner's work,
    or a copy of an older chapter) is left as it is; the result says so (``kept``).
    """
    notebook = json.loads(Path(source).read_text(encoding="utf-8"))
    copy, regions, cells = student_notebook(notebook, name=Path(source).name)
    cleared = sum(why != "answer" for why in answer_cells(notebook, Path(source).name).values())
    target = Path(target)
    text = _notebook_text(copy)
    kept = not force and target.is_file() and target.read_text(encoding="utf-8") != text
    if not kept:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return StudentCopy(Path(source), target, regions, cells, cleared, kept)


def write_student_copies(notebook_dir: Path, student_dir: Path,
                         force: bool = True) -> list[StudentCopy]:
    """A learner's copy of every chapter ``NN_*.ipynb`` of ``notebook_dir``, written into
    ``student_dir``.

    Every notebook is checked before any is written, so bad markers leave ``student_dir`` untouched.
    """
    notebook_dir, student_dir = Path(notebook_dir), Path(student_dir)
    if not notebook_dir.is_dir():
        raise FileNotFoundError(f"no notebook folder at {notebook_dir}")
    sources = sorted(notebook_dir.glob(CHAPTER_GLOB))
    for source in sources:  # fail early, before writing anything
        student_notebook(json.loads(source.read_text(encoding="utf-8")), name=source.name)
    return [write_student_copy(source, student_dir / source.name, force) for source in sources]


def write_project_copy(notebook_dir: Path, student_dir: Path,
                       force: bool = True) -> StudentCopy | None:
    """The learner's copy of the final project (``notebook_dir/project.py``, solved) in
    ``student_dir``: each answer region one ``PROJECT_STUB`` line. None when there is no project;
    with ``force=False`` a copy that differs from a fresh one (the learner's work) is kept."""
    source = Path(notebook_dir) / PROJECT
    if not source.is_file():
        return None
    text, regions = strip_solutions(source.read_text(encoding="utf-8"), PROJECT, PROJECT_STUB)
    target = Path(student_dir) / PROJECT
    kept = not force and target.is_file() and target.read_text(encoding="utf-8") != text
    if not kept:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return StudentCopy(source, target, regions, 0, kept=kept)


# -- the website's form ----------------------------------------------------------------------------
def without_widgets(outputs: list[dict]) -> list[dict]:
    """The outputs a page without a kernel can show: every live widget view dropped, and with it an
    output that had nothing else but the widget's plain-text repr (``VBox(children=…``)."""
    kept = []
    for output in outputs:
        data = output.get("data")
        if isinstance(data, dict) and WIDGET_VIEW in data:
            data = {mime: value for mime, value in data.items() if mime != WIDGET_VIEW}
            if set(data) <= {"text/plain"}:
                continue
            output = {**output, "data": data}
            if isinstance(output.get("metadata"), dict):
                output["metadata"] = {k: v for k, v in output["metadata"].items()
                                      if k != WIDGET_VIEW}
        kept.append(output)
    return kept


def website_notebook(notebook: dict, name: str = "notebook") -> tuple[dict, int]:
    """The notebook as the website shows it: ``(copy, number of folds)``.

    Before each answer cell, its stub (tag ``minitp-stub``, no output); the answer cell and the
    answer-derived cells that follow it without a Markdown cell between are tagged
    ``minitp-answer``. An answer-derived cell further on is tagged too and becomes a fold of its
    own. The exercise's hints (a Markdown cell opening with ``**Hints`` or with a hint's fold, right
    after a fold) move up before the fold: hints first, the worked answer last. No live widget is
    left (see :func:`without_widgets`), nor the ``widgets`` metadata.
    """
    original = json.loads(json.dumps(notebook))
    original.get("metadata", {}).pop("widgets", None)
    for cell in original.get("cells", []):
        if "outputs" in cell:
            cell["outputs"] = without_widgets(cell["outputs"])
    derived = answer_cells(original, name)
    cells: list[dict] = []
    for index, cell in enumerate(original.get("cells", [])):
        why = derived.get(index)
        if why == "answer":
            stub = json.loads(json.dumps(cell))
            stub["source"] = strip_solutions(_source_text(cell), where=f"{name}, cell {index}")[0] \
                .splitlines(keepends=True)
            stub["outputs"], stub["execution_count"] = [], None
            stub.setdefault("metadata", {})["tags"] = [STUB_TAG]
            if "id" in stub:
                stub["id"] = f"{stub['id']}-stub"[:64]
            cells.append(stub)
        if why is not None:
            tags = cell.setdefault("metadata", {}).setdefault("tags", [])
            tags.append(ANSWER_TAG)
        cells.append(cell)
    original["cells"] = _hints_before_folds(cells)
    folded = [_folded(cell) for cell in original["cells"]]
    # runs of folded cells
    folds = sum(now and not before for before, now in zip([False] + folded, folded))
    return original, folds


def _folded(cell: dict) -> bool:
    return ANSWER_TAG in cell.get("metadata", {}).get("tags", [])


def _split_at_heading(cell: dict) -> tuple[dict, dict | None]:
    """A hints cell as (the hints, what follows from its first heading on: often the next exercise's
    statement, which must stay after the fold), or (the cell, None) when it has no heading."""
    lines = _source_text(cell).splitlines(keepends=True)
    at, fenced = None, False
    for number, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced  # a "# comment" inside a code block is no heading
        elif number and not fenced and HEADING.match(line):
            at = number
            break
    if at is None:
        return cell, None
    hints, rest = json.loads(json.dumps(cell)), json.loads(json.dumps(cell))
    hints["source"], rest["source"] = lines[:at], lines[at:]
    if "id" in rest:
        rest["id"] = f"{rest['id']}-next"[:64]
    return hints, rest


def _hints_before_folds(cells: list[dict]) -> list[dict]:
    """The cells with each run of hints cells that follows a fold moved up to just before that fold
    (a hints cell's text from its first heading on stays after the fold)."""
    out: list[dict] = []
    index = 0
    while index < len(cells):
        if not _folded(cells[index]):
            out.append(cells[index])
            index += 1
            continue
        end = index
        while end < len(cells) and _folded(cells[end]):
            end += 1
        hints, rest = [], None
        next_cell = end
        while rest is None and next_cell < len(
            cells) and cells[next_cell].get("cell_type") == "markdown" \
                and HINTS.match(_source_text(cells[next_cell])):
            part, rest = _split_at_heading(cells[next_cell])
            hints.append(part)
            next_cell += 1
        out += hints + cells[index:end] + ([rest] if rest is not None else [])
        index = next_cell
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minitp.exercises.student",
        description="Write the learner's copies of the chapters, with the solutions replaced by "
                    "stubs.",
    )
    parser.add_argument("notebooks", type=Path, help="folder of solved chapters (NN_*.ipynb)")
    parser.add_argument("student", type=Path, help="folder to write the learner's copies into")
    parser.add_argument("--keep-changed", action="store_true",
                        help="leave a copy that differs from a fresh one (your work) as it is")
    args = parser.parse_args(argv)
    try:
        copies = write_student_copies(args.notebooks, args.student, force=not args.keep_changed)
        project = write_project_copy(args.notebooks, args.student, force=not args.keep_changed)
    except (SolutionMarkerError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for copy in copies:
        if copy.kept:
            print(f"{copy.target}: kept as it is (it differs from a fresh copy: your work?); "
                  "delete it, or run `make student`, for a fresh one")
        else:
            print(f"{copy.target}: {copy.regions} solution region(s) in {copy.cells} cell(s) "
                  f"replaced by stubs, outputs of {copy.cleared} answer-derived cell(s) cleared")
    if project is not None and project.kept:
        print(f"{project.target}: kept as it is (your work?); delete it for a fresh template")
    elif project is not None:
        print(f"{project.target}: the final project's template, {project.regions} part(s) to write "
              f"(minitp grade {project.target} grades it)")
    if not copies:
        print(f"no chapters ({CHAPTER_GLOB}) in {args.notebooks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
