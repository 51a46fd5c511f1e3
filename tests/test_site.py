"""The website: `mkdocs build --strict` is clean, every chapter of notebooks/ becomes a page, the nav
lists only chapters that exist, and the pages show their figures and formulas in a real browser.

The machinery is tested twice: on a small throwaway course made here (two chapters with a stored
figure, formulas and an exercise), so it is checked whatever chapters exist yet, and on the real one.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import browser_check  # noqa: E402

pytestmark = pytest.mark.site

REQUIRE_BROWSER = os.environ.get("MINITP_REQUIRE_BROWSER") == "1"
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def build(config: Path, site_dir: Path) -> tuple[str, float]:
    """`mkdocs build --strict` of ``config`` into ``site_dir``: its log and the seconds it took."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site_dir)],
        cwd=config.parent, capture_output=True, text=True, env=env, timeout=600,
    )
    seconds = time.perf_counter() - start
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    assert "WARNING" not in log, log
    return log, seconds


def figure_png() -> str:
    """A small real matplotlib figure, as a notebook stores it (base64 PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 2.5), dpi=80)
    ax.bar(["rank 0", "rank 1", "rank 2"], [3, 5, 2], color=["tab:blue", "tab:orange", "tab:green"])
    ax.set_title("bytes sent")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def cell(kind: str, text: str, outputs: list | None = None) -> dict:
    made = {"cell_type": kind, "metadata": {}, "source": text.splitlines(keepends=True)}
    if kind == "code":
        made.update(execution_count=1, outputs=outputs or [])
    return made


def make_chapter(path: Path, title: str, png: str) -> None:
    """A throwaway chapter shaped like the real ones: heading, formulas, figure, exercise."""
    cells = [
        cell("markdown", f"# {title}\n\nA ring all-reduce sends $2\\frac{{n-1}}{{n}}\\Psi$ bytes per rank.\n\n"
             "$$T = \\alpha \\log_2 n + \\frac{\\Psi}{\\beta}$$"),
        cell("markdown", '<div class="admonition question"><p class="admonition-title">Predict</p>'
             "<p>How many bytes does rank 0 send?</p></div>"),
        cell("code", "import minitp\nprint('world_size = 3')",
             [{"name": "stdout", "output_type": "stream", "text": ["world_size = 3\n"]}]),
        cell("code", "figure = draw()",
             [{"output_type": "display_data", "metadata": {},
               "data": {"image/png": png, "text/plain": ["<Figure size 320x200 with 1 Axes>"]}}]),
        cell("code", "def ring_step(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n",
             []),
        cell("code", "ch00.check_ring_step(ring_step)",
             [{"name": "stdout", "output_type": "stream", "text": ["[ok] ring step: correct\n"]}]),
        cell("markdown", "<details><summary>Answer</summary>\n\nAdd one: `x + 1`.\n\n</details>"),
    ]
    notebook = {
        "cells": cells,
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                     "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    for number, made in enumerate(cells):
        made["id"] = f"cell-{number}"
    path.write_text(json.dumps(notebook, indent=1), encoding="utf-8")


@pytest.fixture(scope="module")
def toy_course(tmp_path_factory) -> Path:
    """A copy of the site's sources with two throwaway chapters (00 and 03) instead of the real ones."""
    root = tmp_path_factory.mktemp("toy-course")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(ROOT / "course", root / "course")
    shutil.copytree(ROOT / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "notebooks").mkdir()
    png = figure_png()
    make_chapter(root / "notebooks" / "00_toy_collectives.ipynb", "00 · Toy collectives", png)
    make_chapter(root / "notebooks" / "03_toy_tensor_parallel.ipynb", "03 · Toy tensor parallel", png)
    (root / "notebooks" / "scratch.ipynb").write_text("not a chapter, not on the site")
    return root


@pytest.fixture(scope="module")
def toy_site(toy_course) -> Path:
    build(toy_course / "mkdocs.yml", toy_course / "site")
    return toy_course / "site"


@pytest.fixture(scope="module")
def real_site(tmp_path_factory) -> tuple[Path, float]:
    site = tmp_path_factory.mktemp("site") / "site"
    _, seconds = build(ROOT / "mkdocs.yml", site)
    return site, seconds


def nav_titles(page: Path) -> list[str]:
    html = page.read_text(encoding="utf-8")
    return re.findall(r'<span class="md-ellipsis">\s*([^<]+?)\s*</span>', html)


def test_every_numbered_notebook_becomes_a_page_and_nothing_else(toy_site):
    pages = [page.parent.name for page in browser_check.chapter_pages(toy_site)]
    assert pages == ["00_toy_collectives", "03_toy_tensor_parallel"]
    assert not (toy_site / "notebooks" / "scratch").exists()
    titles = nav_titles(toy_site / "index.html")
    assert "00 · Toy collectives" in titles and "03 · Toy tensor parallel" in titles


def test_chapter_page_shows_stored_outputs_and_offers_the_notebook(toy_site):
    page = toy_site / "notebooks" / "00_toy_collectives" / "index.html"
    html = page.read_text(encoding="utf-8")
    assert len(browser_check.PNG_IMG.findall(html)) == 1
    assert "world_size = 3" in html
    assert "<details>" in html and 'class="admonition question"' in html
    assert (page.parent / "00_toy_collectives.ipynb").is_file()


def test_exercise_shows_its_stub_and_folds_the_answer_with_the_checker_output(toy_site):
    page = toy_site / "notebooks" / "00_toy_collectives" / "index.html"
    html = page.read_text(encoding="utf-8")
    folds = re.findall(r'<details class="minitp-answer"><summary>Show a worked answer</summary>(.*?)</details>',
                       html, flags=re.DOTALL)
    assert len(folds) == 1
    assert "[ok] ring step: correct" in folds[0] and "BEGIN SOLUTION" in folds[0]  # answer and verdict
    outside = html.replace(folds[0], "")
    assert "[ok]" not in outside and "BEGIN SOLUTION" not in outside
    assert "NotImplementedError" in outside  # the stub, in plain view before the fold
    published = (page.parent / "00_toy_collectives.ipynb").read_text(encoding="utf-8")
    assert "[ok]" not in published and "return x + 1" not in published  # the download is the learner's copy


def test_index_links_existing_chapters_and_marks_the_rest_in_preparation(toy_site):
    html = (toy_site / "index.html").read_text(encoding="utf-8")
    assert 'href="notebooks/00_toy_collectives/"' in html
    assert 'href="notebooks/03_toy_tensor_parallel/"' in html
    assert "chapter:" not in html
    assert html.count("in preparation") == 5  # 01, 02, 04, 05, 06


def test_real_site_builds_strict_with_a_page_per_chapter(real_site):
    site, seconds = real_site
    pages = [page.parent.name for page in browser_check.chapter_pages(site)]
    assert pages == [notebook.stem for notebook in CHAPTERS]
    html = (site / "index.html").read_text(encoding="utf-8")
    assert "chapter:" not in html
    for notebook in CHAPTERS:
        assert f'href="notebooks/{notebook.stem}/"' in html, f"the home page does not link {notebook.name}"
    print(f"mkdocs build --strict: {seconds:.1f} s for {len(CHAPTERS)} chapters")


def test_chapters_keep_no_error_outputs():
    """allow_errors is off on the site: a stored traceback would fail the build, so catch it here first."""
    for notebook in CHAPTERS:
        for number, made in enumerate(json.loads(notebook.read_text(encoding="utf-8"))["cells"]):
            for output in made.get("outputs", []):
                assert output.get("output_type") != "error", f"{notebook.name} cell {number} stores an error"


def chromium_or_skip() -> str:
    chromium = browser_check.find_chromium()
    if chromium is None:
        if REQUIRE_BROWSER:
            pytest.fail("MINITP_REQUIRE_BROWSER=1 but no Chromium is installed (apt-get install chromium)")
        pytest.skip("no Chromium installed (apt-get install chromium); set MINITP_REQUIRE_BROWSER=1 to fail")
    return chromium


def assert_pages_pass(reports) -> None:
    failed = [report.line() for report in reports if report.problems]
    assert not failed, "\n".join(failed)


@pytest.mark.timeout(900)
def test_toy_chapter_pages_render_in_chromium(toy_course, toy_site):
    chromium = chromium_or_skip()
    reports = browser_check.check_site(toy_site, toy_course / "shots", toy_course / "notebooks", chromium,
                                       fold_screenshots=True)
    assert [report.page for report in reports] == [
        "index.html",
        "notebooks/00_toy_collectives/index.html",
        "notebooks/03_toy_tensor_parallel/index.html",
    ]
    assert_pages_pass(reports)
    chapter = reports[1]
    assert chapter.figures_in_page == 1 and chapter.figures_decoded == 1 and chapter.formulas_expected == 2
    assert chapter.figure_screenshot is not None and chapter.figure_screenshot.is_file()
    # the answer is folded when the page loads and opens on a click, on a desktop and a phone
    assert chapter.folds_expected == chapter.folds_in_page == chapter.folds_closed == chapter.folds_opened == 1
    assert [shot.name for shot in chapter.fold_screenshots] == [
        "00_toy_collectives-first-answer-1280px.png", "00_toy_collectives-first-answer-390px.png"]
    if browser_check_has_local_mathjax(toy_site) or REQUIRE_BROWSER:
        assert chapter.formulas_typeset >= 2


def browser_check_has_local_mathjax(site: Path) -> bool:
    return (site / "assets" / "mathjax" / "MathJax.js").is_file()


@pytest.mark.timeout(1800)  # three Chromium runs per page, on a busy machine
def test_chapter_pages_render_in_chromium(real_site, tmp_path):
    chromium = chromium_or_skip()
    site, _ = real_site
    shots = Path(os.environ.get("MINITP_SCREENSHOTS", tmp_path / "screenshots"))
    reports = browser_check.check_site(site, shots, ROOT / "notebooks", chromium)
    for report in reports:
        print(report.line())
    assert len(reports) == 1 + len(CHAPTERS)
    assert_pages_pass(reports)
