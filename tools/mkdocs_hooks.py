"""MkDocs hooks that put the chapters of ``notebooks/`` on the website (listed in mkdocs.yml ``hooks``).

The notebooks stay where they are: they never get copied into ``course/`` (the docs_dir). Instead:

* ``on_config`` builds the navigation from the chapters that exist (``notebooks/NN_*.ipynb``, in
  order, titled by each notebook's first ``# `` heading), so a new chapter needs no edit here, and
  points the notebooks' MathJax at a local copy when one is installed (else at a CDN).
* ``on_files`` adds each notebook as the page ``notebooks/NN_name.ipynb`` (URL ``notebooks/NN_name/``)
  before mkdocs-jupyter looks at the files (it turns them into pages), so links like
  ``notebooks/01_ddp.ipynb`` from ``course/index.md`` resolve. The page is made from the notebook's
  website form (``minitp.exercises.student.website_notebook``, written to a temporary folder): each
  exercise shows its stub, then its hints, and its answer cells come tagged ``minitp-answer``.
* ``on_page_content`` folds each run of ``minitp-answer`` cells, outputs included (the checker's
  verdict), behind ``<details class="minitp-answer">`` "Show a worked answer", closed by default. It
  also takes the notebook stylesheet (about 600 KB, the same on every chapter) out of the page, to be
  served once as ``site/assets/notebook-<hash>.css`` (``on_post_page`` links it, ``on_post_build``
  writes it); drops the Mermaid loader (it would import Mermaid from a CDN) from a page with no
  diagram; keeps the prompts (``In [3]:``), the copy buttons ("Copied!") and the second copy of each
  cell's source that the copy button reads out of the search index; and rebuilds the page's table of
  contents from the headings as rendered (mkdocs-jupyter makes it from a Markdown conversion whose
  ids drop inline code: ``## Accumulate with `no_sync` `` was linked as ``#accumulate-with``, while
  the heading's id is ``accumulate-with-no_sync``).
* ``on_page_markdown`` resolves ``[text](chapter:NN)`` links in the Markdown pages: a link to
  chapter NN when it exists, plain text marked "in preparation" when it does not (so the course
  plan can name every chapter and ``mkdocs build --strict`` stays clean).
* ``on_post_build`` copies the few MathJax files the pages use into ``site/assets/mathjax``, writes
  the shared notebook stylesheet, and publishes each chapter's learner copy (answers out, as
  ``make student`` writes it) as the notebook to download next to its page.

Nothing a page loads comes from another host (``theme.font: false`` in mkdocs.yml: no web fonts;
no widget renderer: the website form has no widget state; MathJax local): ``tools/browser_check.py``
checks it in Chromium.
"""

from __future__ import annotations

import hashlib
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

# The notebook template's head: stylesheets before the cells (moved to one shared file), the Mermaid
# loader, and a repr of the Pygments stylesheet list that mkdocs-jupyter appends after the cells
# (``<style>['pre { …', …]</style>``: not CSS, it matches nothing).
WRAPPER_START = '<div class="jupyter-wrapper">'
STYLE_BLOCK = re.compile(r"<style\b[^>]*>(.*?)</style>\s*", re.DOTALL)
LIST_REPR_STYLE = re.compile(r"<style>\s*\[\s*'.*?'\s*\]\s*</style>\s*", re.DOTALL)
MERMAID_SCRIPT = re.compile(r'<script type="module">(?:(?!</script>).)*?mermaid(?:(?!</script>).)*</script>\s*',
                            re.DOTALL)
NOTEBOOK_CSS = "assets/notebook-{digest}.css"
# Not for the search index (Material skips an element with data-search-exclude, then strips the mark).
SEARCH_EXCLUDED = re.compile(
    r'<(div|span|a)\b(?=[^>]*\bclass="(?:jp-InputPrompt|jp-OutputPrompt|zeroclipboard-container|anchor-link'
    r'|clipboard-copy-txt)\b)'
)
HEADING = re.compile(r'<h([1-6]) id="([^"]+)"[^>]*>(.*?)</h\1>', re.DOTALL)
ANCHOR_LINK = re.compile(r'<a class="anchor-link"[^>]*>.*?</a>', re.DOTALL)
TAG = re.compile(r"<[^>]+>")

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


def split_notebook_css(html: str) -> tuple[str, str]:
    """``(html without its notebook stylesheets, their CSS)``: the ``<style>`` blocks of the notebook
    template's head (before the cells; the cells' own styles, such as a control's, stay), and the
    Pygments list repr after the cells. Without a Mermaid diagram, the Mermaid loader goes too."""
    start = html.find(WRAPPER_START)
    if start < 0:
        return html, ""
    head, cells = html[:start], html[start:]
    css = [match.group(1).strip() for match in STYLE_BLOCK.finditer(head)]
    head = STYLE_BLOCK.sub("", head)
    if "jp-Mermaid" not in cells:
        head = MERMAID_SCRIPT.sub("", head)
    cells = LIST_REPR_STYLE.sub("", cells)
    return head + cells, "\n".join(css) + "\n" if css else ""


def exclude_from_search(html: str) -> str:
    """Mark the prompts, copy buttons, copy-button texts and heading permalinks ``data-search-exclude``."""
    return SEARCH_EXCLUDED.sub(r'<\1 data-search-exclude="true"', html)


def toc_from_headings(html: str) -> list[dict]:
    """Table-of-contents tokens (as Python-Markdown's toc makes them) from the rendered headings of the
    notebook's Markdown cells (those with a permalink), nested by level: ids are the headings' own."""
    tokens: list[dict] = []
    stack: list[dict] = []
    for match in HEADING.finditer(html):
        level, anchor, inner = int(match.group(1)), match.group(2), match.group(3)
        if 'class="anchor-link"' not in inner:
            continue  # a heading inside an output, not a section of the chapter
        name = " ".join(TAG.sub("", ANCHOR_LINK.sub("", inner)).split())
        token = {"level": level, "id": anchor, "name": name, "children": []}
        while stack and stack[-1]["level"] >= level:
            stack.pop()
        (stack[-1]["children"] if stack else tokens).append(token)
        stack.append(token)
    return tokens


def on_page_content(html, page, config, files):
    if not (page.file.src_uri.startswith(f"{CHAPTER_DIR}/") and page.file.src_uri.endswith(".ipynb")):
        return html
    from mkdocs.structure.toc import get_toc

    html, css = split_notebook_css(fold_answers(html))
    if css:
        digest = hashlib.sha256(css.encode()).hexdigest()[:12]
        path = NOTEBOOK_CSS.format(digest=digest)
        _state.setdefault("css", {})[path] = css
        _state.setdefault("page_css", {})[page.file.src_uri] = path
    tokens = toc_from_headings(html)
    if tokens:
        page.toc = get_toc(tokens)
    return exclude_from_search(html)


def link_stylesheet(output: str, href: str, before: str | None) -> str:
    """``output`` with a stylesheet link to ``href`` in its head: before the link to ``before`` (the
    site's own extra.css, so that it can override the notebook's rules), else at the end of the head."""
    tag = f'<link rel="stylesheet" href="{href}">\n'
    if before:
        match = re.search(rf'<link rel="stylesheet" href="[^"]*{re.escape(before)}[^"]*">', output)
        if match:
            return output[:match.start()] + tag + output[match.start():]
    return output.replace("</head>", tag + "</head>", 1)


def on_post_page(output, page, config):
    path = _state.get("page_css", {}).get(page.file.src_uri)
    if path is None:
        return output
    from mkdocs.utils import get_relative_url

    extra = [str(item) for item in config.extra_css]
    return link_stylesheet(output, get_relative_url(path, page.url), extra[0] if extra else None)


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


def write_notebook_css(config) -> None:
    for path, css in _state.pop("css", {}).items():
        target = Path(config.site_dir) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(css, encoding="utf-8")
    _state.pop("page_css", None)


def on_post_build(config):
    publish_learner_copies(config)
    write_notebook_css(config)
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
