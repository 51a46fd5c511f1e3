"""MkDocs hooks that put the chapters of ``notebooks/`` on the website (listed in mkdocs.yml ``hooks``).

The notebooks stay where they are: they never get copied into ``course/`` (the docs_dir). Instead:

* ``on_config`` builds the navigation from the chapters that exist (``notebooks/NN_*.ipynb``, in
  order, titled by each notebook's first ``# `` heading), so a new chapter needs no edit here, and
  points the notebooks' MathJax at a local copy when one is installed (else at a CDN).
* ``on_files`` adds each notebook as the page ``notebooks/NN_name.ipynb`` (URL ``notebooks/NN_name/``)
  before mkdocs-jupyter looks at the files (it turns them into pages), so links like
  ``notebooks/01_ddp.ipynb`` from ``course/index.md`` resolve. The page is made from the notebook's
  website form (``minitp.exercises.student.website_notebook``, written to a temporary folder): each
  exercise shows its stub, and its answer cells come tagged ``minitp-answer``.
* ``on_page_content`` folds each run of ``minitp-answer`` cells, outputs included (the checker's
  verdict), behind ``<details class="minitp-answer">`` "Show a worked answer", closed by default.
* ``on_page_markdown`` resolves ``[text](chapter:NN)`` links in the Markdown pages: a link to
  chapter NN when it exists, plain text marked "in preparation" when it does not (so the course
  plan can name every chapter and ``mkdocs build --strict`` stays clean).
* ``on_post_build`` copies the few MathJax files the pages use into ``site/assets/mathjax``, and
  publishes each chapter's learner copy (answers out, as ``make student`` writes it) as the notebook to
  download next to its page.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.minitp")

CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"
CHAPTER_DIR = "notebooks"  # chapter pages live at notebooks/NN_name/, as the files do in the repo
CHAPTER_LINK = re.compile(r"\[([^\]]+)\]\(chapter:(\d\d)\)")

# MathJax 2 (the notebook template configures MathJax 2). Debian's libjs-mathjax has it; any other
# MathJax 2.7 folder can be named with MINITP_MATHJAX_DIR.
MATHJAX_DIRS = ["/usr/share/javascript/mathjax", "/usr/share/mathjax"]
MATHJAX_CONFIG = "TeX-AMS_CHTML-full,Safe"
MATHJAX_CDN = f"https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/latest.js?config={MATHJAX_CONFIG}"
MATHJAX_FILES = [  # what TeX input + CommonHTML output load: about 1.5 MB instead of 40
    "MathJax.js",
    "config/TeX-AMS_CHTML-full.js",
    "config/Safe.js",
    "extensions",
    "jax/input/TeX",
    "jax/element",
    "jax/output/CommonHTML",
    "fonts/HTML-CSS/TeX/woff",
]
MATHJAX_SITE_DIR = "assets/mathjax"

ANSWER_CLASS = "celltag_minitp-answer"  # nbconvert's lab template: one class per cell tag
FOLD_OPEN = '<details class="minitp-answer"><summary>Show a worked answer</summary>\n'
FOLD_CLOSE = "</details>\n"
CELL_START = re.compile(r'<div\b[^>]*\bclass="jp-Cell\b[^"]*"[^>]*>')
DIV_TAG = re.compile(r"<(/?)div\b[^>]*>")

_state: dict = {}


def _student_module():
    """``minitp.exercises.student``: from the installed package, else from src/ next to this file (it
    only needs the standard library)."""
    try:
        from minitp.exercises import student
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from minitp.exercises import student
    return student


def notebook_dir(config) -> Path:
    return Path(config.config_file_path).resolve().parent / "notebooks"


def chapters(config) -> list[Path]:
    """The chapter notebooks, in order."""
    folder = notebook_dir(config)
    return sorted(folder.glob(CHAPTER_GLOB)) if folder.is_dir() else []


def chapter_title(path: Path) -> str:
    """The notebook's first level-1 heading, else a title made from its file name."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    except (OSError, ValueError):
        cells = []
    for cell in cells:
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        for line in text.splitlines():
            if line.startswith("# "):
                return re.sub(r"[*_`]", "", line[2:]).strip()
    number, _, name = path.stem.partition("_")
    return f"{number} · {name.replace('_', ' ').capitalize()}"


def find_mathjax() -> Path | None:
    candidates = [os.environ.get("MINITP_MATHJAX_DIR", "")] + MATHJAX_DIRS
    for candidate in candidates:
        if candidate and (Path(candidate) / "MathJax.js").is_file():
            return Path(candidate)
    return None


def on_config(config):
    found = chapters(config)
    _state["chapters"] = found
    nav = [{"Home": "index.md"}]
    if found:
        nav.append({"Chapters": [{chapter_title(p): f"{CHAPTER_DIR}/{p.name}"} for p in found]})
    extra = [p for p in sorted(Path(config.docs_dir).glob("*.md")) if p.name != "index.md"]
    nav += [p.name for p in extra]
    config.nav = nav

    mathjax = find_mathjax()
    _state["mathjax"] = mathjax
    if mathjax is not None:
        # chapter pages sit at notebooks/NN_name/ (or notebooks/NN_name.html): the path back to the root
        up = "../../" if config.use_directory_urls else "../"
        url = f"{up}{MATHJAX_SITE_DIR}/MathJax.js?config={MATHJAX_CONFIG}"
    else:
        url = MATHJAX_CDN
        log.info("no local MathJax 2 (apt-get install libjs-mathjax): formulas load MathJax from a CDN")
    jupyter = config.plugins.get("mkdocs-jupyter")
    if jupyter is not None:
        jupyter.config["custom_mathjax_url"] = url
    return config


def write_website_forms(paths: list[Path], folder: Path) -> dict[str, int]:
    """The website form of each chapter into ``folder/notebooks/``; returns the folds of each page."""
    student = _student_module()
    (folder / CHAPTER_DIR).mkdir(parents=True, exist_ok=True)
    folds = {}
    for path in paths:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        web, folds[path.stem] = student.website_notebook(notebook, name=path.name)
        (folder / CHAPTER_DIR / path.name).write_text(json.dumps(web, indent=1, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
    return folds


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files, config):
    web = Path(tempfile.mkdtemp(prefix="minitp-site-"))
    _state["web_dir"] = web
    _state["folds"] = write_website_forms(_state.get("chapters", []), web)
    for path in _state.get("chapters", []):
        # the page's source is the chapter's website form, at notebooks/NN_name.ipynb under a temporary
        # root, so its URL mirrors the repository: notebooks/NN_name/
        files.append(File(f"{CHAPTER_DIR}/{path.name}", str(web), config.site_dir, config.use_directory_urls))
    return files


def _cell_end(html: str, start: int) -> int:
    """The index just past the ``</div>`` that closes the ``<div`` opening at ``start``."""
    depth = 0
    for match in DIV_TAG.finditer(html, start):
        depth += -1 if match.group(1) else 1
        if depth == 0:
            return match.end()
    raise ValueError(f"a notebook cell opened at character {start} is never closed")


def fold_answers(html: str) -> str:
    """Put each run of consecutive ``minitp-answer`` cells inside one closed ``<details>``."""
    out, position, open_fold = [], 0, False
    for match in CELL_START.finditer(html):
        if match.start() < position:
            continue  # a cell inside a cell already copied
        answer = ANSWER_CLASS in match.group(0).split('class="', 1)[1].split('"', 1)[0].split()
        between = html[position:match.start()]
        if open_fold and (not answer or between.strip()):
            out.append(FOLD_CLOSE)
            open_fold = False
        out.append(between)
        if answer and not open_fold:
            out.append(FOLD_OPEN)
            open_fold = True
        end = _cell_end(html, match.start())
        out.append(html[match.start():end])
        position = end
    if open_fold:
        out.append(FOLD_CLOSE)
    out.append(html[position:])
    return "".join(out)


def on_page_content(html, page, config, files):
    if page.file.src_uri.startswith(f"{CHAPTER_DIR}/") and page.file.src_uri.endswith(".ipynb"):
        return fold_answers(html)
    return html


def on_page_markdown(markdown, page, config, files):
    by_number = {p.name[:2]: p.name for p in _state.get("chapters", [])}
    depth = page.file.src_uri.count("/")

    def resolve(match: re.Match) -> str:
        text, number = match.group(1), match.group(2)
        if number in by_number:
            return f"[{text}]({'../' * depth}{CHAPTER_DIR}/{by_number[number]})"
        return f"{text} *(in preparation)*"

    return CHAPTER_LINK.sub(resolve, markdown)


def publish_learner_copies(config) -> None:
    """The notebook offered next to each chapter page is the learner's copy (answers out)."""
    student = _student_module()
    for path in _state.get("chapters", []):
        folder = Path(config.site_dir) / CHAPTER_DIR / path.stem
        if folder.is_dir():
            student.write_student_copy(path, folder / path.name)


def on_post_build(config):
    publish_learner_copies(config)
    web = _state.pop("web_dir", None)
    if web is not None:
        shutil.rmtree(web, ignore_errors=True)
    mathjax = _state.get("mathjax")
    if mathjax is None:
        return
    target = Path(config.site_dir) / MATHJAX_SITE_DIR
    for part in MATHJAX_FILES:
        source = mathjax / part
        if source.is_dir():
            shutil.copytree(source, target / part, dirs_exist_ok=True)
        elif source.is_file():
            (target / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target / part)
