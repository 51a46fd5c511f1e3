"""MkDocs hooks that put the chapters of ``notebooks/`` on the website (listed in mkdocs.yml ``hooks``).

The notebooks stay where they are: they never get copied into ``course/`` (the docs_dir). Instead:

* ``on_config`` builds the navigation from the chapters that exist (``notebooks/NN_*.ipynb``, in
  order, titled by each notebook's first ``# `` heading), so a new chapter needs no edit here, and
  points the notebooks' MathJax at a local copy when one is installed (else at a CDN).
* ``on_files`` adds each notebook as the page ``notebooks/NN_name.ipynb`` (URL ``notebooks/NN_name/``)
  before mkdocs-jupyter looks at the files (it turns them into pages), so links like
  ``notebooks/01_ddp.ipynb`` from ``course/index.md`` resolve.
* ``on_page_markdown`` resolves ``[text](chapter:NN)`` links in the Markdown pages: a link to
  chapter NN when it exists, plain text marked "in preparation" when it does not (so the course
  plan can name every chapter and ``mkdocs build --strict`` stays clean).
* ``on_post_build`` copies the few MathJax files the pages use into ``site/assets/mathjax``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
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

_state: dict = {}


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


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files, config):
    for path in _state.get("chapters", []):
        # src_dir is the repository root, so the page's source path is the notebook itself (mkdocs-jupyter
        # reads it from there) and its URL mirrors the repository: notebooks/NN_name/
        files.append(File(f"{CHAPTER_DIR}/{path.name}", str(path.parent.parent), config.site_dir,
                          config.use_directory_urls))
    return files


def on_page_markdown(markdown, page, config, files):
    by_number = {p.name[:2]: p.name for p in _state.get("chapters", [])}
    depth = page.file.src_uri.count("/")

    def resolve(match: re.Match) -> str:
        text, number = match.group(1), match.group(2)
        if number in by_number:
            return f"[{text}]({'../' * depth}{CHAPTER_DIR}/{by_number[number]})"
        return f"{text} *(in preparation)*"

    return CHAPTER_LINK.sub(resolve, markdown)


def on_post_build(config):
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
