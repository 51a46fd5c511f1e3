"""The website: `mkdocs build --strict` is clean, every chapter of notebooks/ becomes a page, the nav
lists only chapters that exist, and the pages show their figures and formulas in a real browser,
load nothing from another host, link no missing anchor, show no raw TeX, answer clicks on their
static controls, and read on a phone.

The machinery is tested twice: on a small throwaway course made here (two chapters with a stored
figure, formulas, an exercise and a live control), so it is checked whatever chapters exist yet, and
on the real one. The browser check itself is tested on hand-made pages with each fault it must catch.
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
import lab_check  # noqa: E402

pytestmark = pytest.mark.site

REQUIRE_BROWSER = os.environ.get("MINITP_REQUIRE_BROWSER") == "1"
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
OUTSIDE_HOSTS = re.compile(r"fonts\.googleapis|fonts\.gstatic|unpkg\.com|cdnjs\.|cdn\.jsdelivr")


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


def figure_png(values: tuple = (3, 5, 2)) -> str:
    """A small real matplotlib figure, as a notebook stores it (base64 PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 2.5), dpi=80)
    ax.bar([f"rank {r}" for r in range(len(values))], values, color=["tab:blue", "tab:orange", "tab:green",
                                                                     "tab:red"][:len(values)])
    ax.set_title(f"bytes sent, {len(values)} ranks")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def cell(kind: str, text: str, outputs: list | None = None) -> dict:
    made = {"cell_type": kind, "metadata": {}, "source": text.splitlines(keepends=True)}
    if kind == "code":
        made.update(execution_count=1, outputs=outputs or [])
    return made


def twin_html(panels: list[str], sid: str = "mx0-toy", switches: bool = True) -> str:
    """A static twin shaped like ``minitp.viz.explore``'s: one radio per value of a control ``n``,
    one panel per value, and CSS that shows the panel of the checked radio (with ``switches=False``
    the CSS always shows the first panel: a control whose clicks change nothing)."""
    inputs = "".join(f'<input type="radio" name="{sid}-n" id="{sid}-n-{k}"{" checked" if k == 0 else ""}>'
                     f'<label for="{sid}-n-{k}">{k + 2}</label>' for k in range(len(panels)))
    blocks = "".join(f'<div class="mx-panel mx-p{k}" data-setting="n = {k + 2}">{body}</div>'
                     for k, body in enumerate(panels))
    rules = "".join(f"#{sid} #{sid}-n-{k}:checked ~ .mx-panels .mx-p{k}{{display:block}}" if switches
                    else f"#{sid} .mx-p0{{display:block}}" for k in range(len(panels)))
    style = (f"#{sid} input{{position:absolute;opacity:0;width:1px;height:1px}}"
             f"#{sid} label{{border:1px solid #888;padding:.1em .6em;cursor:pointer}}"
             f"#{sid} input:checked+label{{background:#3f51b5;color:#fff}}"
             f"#{sid} .mx-panel{{display:none}}#{sid} img{{max-width:100%;height:auto}}" + rules)
    return (f'<div class="minitp-explore-static"><style>{style}</style><div class="minitp-explore" id="{sid}">'
            f'{inputs}<div class="mx-panels">{blocks}</div></div></div>')


def panel(png: str, text: str) -> str:
    return f'<img alt="figure" src="data:image/png;base64,{png}"><pre class="minitp-explore-text">{text}</pre>'


def make_chapter(path: Path, title: str, png: str, twin: str | None = None) -> None:
    """A throwaway chapter shaped like the real ones: heading, formulas, figure, exercise, and (given
    ``twin``) a live control: its widget view, the static twin and the widget state."""
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
        cell("markdown", "## 4. Gradient accumulation with `no_sync`\n\nThe hooks stay quiet."),
        cell("code", "print('rank 0: ' + 'x' * 150)",
             [{"name": "stdout", "output_type": "stream", "text": ["rank 0: " + "0123456789 " * 15 + "\n"]}]),
    ]
    metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                "language_info": {"name": "python"}}
    if twin is not None:
        view = {"model_id": "f00d", "version_major": 2, "version_minor": 0}
        cells.append(cell("code", "explore(run, draw, {'n': [2, 3]})", [
            {"output_type": "display_data", "metadata": {},
             "data": {WIDGET_VIEW: view, "text/html": twin, "text/plain": ["ring: n = 2"]}}]))
        cells.append(cell("code", "interact(show, n=(2, 8))", [
            {"output_type": "display_data", "metadata": {},
             "data": {WIDGET_VIEW: view, "text/plain": ["interactive(children=(IntSlider(value=2),))"]}}]))
        metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2,
                                                                            "version_minor": 0}}
    notebook = {"cells": cells, "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}
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
    twin = twin_html([panel(png, "n = 2: 2 messages"), panel(figure_png((4, 1, 6)), "n = 3: 4 messages")])
    make_chapter(root / "notebooks" / "00_toy_collectives.ipynb", "00 · Toy collectives", png, twin)
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
    assert len(browser_check.PNG_IMG.findall(html)) == 3  # the stored figure, and the two of the static twin
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


def test_chapter_page_has_no_live_widget_and_keeps_the_static_twin(toy_site):
    html = (toy_site / "notebooks" / "00_toy_collectives" / "index.html").read_text(encoding="utf-8")
    assert html.count('class="minitp-explore"') == 1 and html.count('class="mx-panel ') == 2
    assert WIDGET_VIEW not in html and "widget-state" not in html and "interactive(children" not in html
    assert not OUTSIDE_HOSTS.search(html)  # no widget renderer, Mermaid loader or web fonts from a CDN


def test_notebook_stylesheet_is_served_once_for_every_chapter(toy_site):
    linked = set()
    for page in browser_check.chapter_pages(toy_site):
        html = page.read_text(encoding="utf-8")
        inline = [len(css) for css in re.findall(r"<style[^>]*>(.*?)</style>", html, flags=re.DOTALL)]
        assert max(inline, default=0) < 20_000, f"{page}: an inline stylesheet of {max(inline)} characters"
        [href] = re.findall(r'<link rel="stylesheet" href="((?:\.\./)*assets/notebook-[0-9a-f]+\.css)">', html)
        assert html.index(href) < html.index("stylesheets/extra.css")  # the site's own rules come after
        linked.add((page.parent / href).resolve())
    [css] = linked  # one file for all the chapters
    assert css.stat().st_size > 100_000 and ".jp-OutputArea" in css.read_text(encoding="utf-8")


def test_table_of_contents_links_the_headings_as_rendered(toy_site):
    html = (toy_site / "notebooks" / "00_toy_collectives" / "index.html").read_text(encoding="utf-8")
    ids = set(re.findall(r'\bid="([^"]+)"', html))
    toc = re.findall(r'<a href="#([^"]+)" class="md-nav__link">', html)
    assert "4-gradient-accumulation-with-no_sync" in toc  # the heading with inline code
    assert toc and set(toc) <= ids


def test_search_index_has_the_text_without_prompts_or_copy_buttons(toy_site):
    index = json.loads((toy_site / "search" / "search_index.json").read_text(encoding="utf-8"))
    text = " ".join(doc["text"] for doc in index["docs"])
    assert "world_size = 3" in text  # the outputs and the code are still found
    assert "Copied!" not in text and "¶" not in text
    assert not re.search(r"(In|Out)\s*\[\d*\]:", text)
    chapter = [doc for doc in index["docs"] if doc["location"] == "notebooks/00_toy_collectives/"]
    assert chapter and chapter[0]["text"].count("import minitp") == 1  # the code once, not twice


def test_index_links_existing_chapters_and_marks_the_rest_in_preparation(toy_site):
    html = (toy_site / "index.html").read_text(encoding="utf-8")
    assert 'href="notebooks/00_toy_collectives/"' in html
    assert 'href="notebooks/03_toy_tensor_parallel/"' in html
    assert "chapter:" not in html
    linked = sorted(set(re.findall(r"\(chapter:(\d\d)\)", (ROOT / "course" / "index.md").read_text())))
    assert html.count("in preparation") == len(linked) - 2  # every chapter the index links, but 00 and 03


def test_real_site_builds_strict_with_a_page_per_chapter(real_site):
    site, seconds = real_site
    pages = [page.parent.name for page in browser_check.chapter_pages(site)]
    assert pages == [notebook.stem for notebook in CHAPTERS]
    html = (site / "index.html").read_text(encoding="utf-8")
    assert "chapter:" not in html
    for notebook in CHAPTERS:
        assert f'href="notebooks/{notebook.stem}/"' in html, f"the home page does not link {notebook.name}"
    print(f"mkdocs build --strict: {seconds:.1f} s for {len(CHAPTERS)} chapters")


def test_real_site_loads_nothing_from_outside_and_shares_one_stylesheet(real_site):
    site, _ = real_site
    for page in [site / "index.html", *browser_check.chapter_pages(site)]:
        html = page.read_text(encoding="utf-8")
        assert not browser_check.outside_loads(html), f"{page}: {browser_check.outside_loads(html)[:3]}"
        inline = [len(css) for css in re.findall(r"<style[^>]*>(.*?)</style>", html, flags=re.DOTALL)]
        assert max(inline, default=0) < 20_000, f"{page}: an inline stylesheet of {max(inline)} characters"
    shared = list((site / "assets").glob("notebook-*.css"))
    assert len(shared) == 1 and not browser_check.outside_loads(shared[0].read_text(encoding="utf-8"))
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    text = " ".join(doc["text"] for doc in index["docs"])
    assert "Copied!" not in text and not re.search(r"(In|Out)\s*\[\d*\]:", text)


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


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>fake</title>HEAD
<style>body { margin: 0; font: 16px/1.5 sans-serif } .md-content { padding: 0 12px }
pre { font-size: 13px; overflow-x: auto } img { max-width: 100% } .jp-OutputPrompt { display: none }</style></head>
<body><div class="md-content"><h1 id="top">A page</h1>
<p>Each rank sends two messages per step; <a href="#top">back to the top</a>. Colour and type make a
screenshot of many colours: <b style="color:#0072B2">blue</b>, <i style="color:#E69F00">orange</i>.</p>
<div style="height:300px;max-width:100%;background:linear-gradient(90deg,#0072B2,#E69F00,#009E73)"></div>
BODY</div></body></html>
"""


def fake_page(path: Path, body: str, head: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PAGE.replace("HEAD", head).replace("BODY", body), encoding="utf-8")


def output(inner: str, prompt: str = "") -> str:
    return (f'<div class="jp-OutputArea-child"><div class="jp-OutputPrompt">{prompt}</div>'
            f'<div class="jp-OutputArea-output">{inner}</div></div>')


@pytest.mark.timeout(300)
def test_browser_check_catches_what_a_reader_would_suffer(tmp_path):
    """A clean page passes; a page with each fault (outside requests, a loader that did not run this
    time, a broken anchor, raw TeX, stray outputs, dead static controls, a layout unreadable on a
    phone, a figure wider than a phone, a worked answer before its hints) fails with each named. The
    browser sees requests that no scan of the HTML could."""
    chromium = chromium_or_skip()
    site = tmp_path / "site"
    png, other = figure_png(), figure_png((4, 1, 6))
    fake_page(site / "index.html", "<p>Home.</p>")
    fake_page(site / "notebooks" / "00_clean" / "index.html",
              output(f'<img alt="bars" src="data:image/png;base64,{png}">', "Out[2]:")
              + twin_html([panel(png, "n = 2"), panel(other, "n = 3")], sid="mx0-clean"))
    (site / "notebooks" / "01_broken").mkdir(parents=True)
    (site / "notebooks" / "01_broken" / "fonts.css").write_text(
        "@font-face { font-family: Far; src: url(https://fonts.gstatic.com/far.woff2) }\n"
        "p { font-family: Far, sans-serif }\n")
    fake_page(
        site / "notebooks" / "01_broken" / "index.html",
        head='<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">'
             '<link rel="stylesheet" href="fonts.css">',
        body='<img alt="" src="http://example.invalid/pixel.png">'
             '<script>fetch("https:" + "//cdn.example.org/renderer.js").catch(() => null)</script>'
             '<script>function never() { return import("https://cdn.example.net/mermaid.mjs") }</script>'
             '<p><a href="#nowhere">a section</a> where rank = (dp\\_rank · pp) and $x^2$ stay raw.</p>'
             + output("<pre>&lt;function show_step&gt;</pre>", "Out[9]:") + output("", "Out[23]:")
             + twin_html([panel(png, "n = 2"), panel(other, "n = 3")], sid="mx1-dead", switches=False)
             + twin_html([panel(png, "n = 2"), panel(png, "n = 2")], sid="mx2-same")
             + '<div class="jp-InputPrompt" style="display:inline-block;width:80px">In [1]:</div>'
             + '<pre style="overflow:visible;font-size:9px">' + "rank 0 sent 1,024 bytes; " * 12 + "</pre>"
             + output(f'<img alt="bars" style="width:120px" src="data:image/png;base64,{png}">')
             + output(f'<div style="overflow-x:auto"><img alt="wide" style="width:600px;max-width:none" '
                      f'src="data:image/png;base64,{png}"></div>')  # scrolls, but a phone shows no scrollbar
             + '<div class="jp-Cell celltag_minitp-stub"><pre>raise NotImplementedError</pre></div>'
             + '<div class="jp-Cell"><h3 id="ex2">Exercise 2</h3></div>'
             + '<details class="minitp-answer"><summary>Show a worked answer</summary><p>[ok] done</p></details>'
             + '<div class="jp-Cell"><p><b>Hints.</b> (1) Count the slots.</p></div>',
    )
    reports = browser_check.check_site(site, tmp_path / "shots", None, chromium)
    home, clean, broken = reports
    assert_pages_pass([home, clean])
    assert clean.twins == 1 and clean.twin_clicks == 2 and clean.requests > 0 and not clean.outside_requests
    assert [shot.name for shot in clean.screenshots] == [
        "00_clean.png", "00_clean-first-figure.png", "00_clean-first-control.png", "00_clean-390px.png",
        "00_clean-first-figure-390px.png", "00_clean-first-control-390px.png"]

    hosts = {re.sub(r"^https?://([^/]+).*", r"\1", url) for url in broken.outside_requests}
    assert {"fonts.googleapis.com", "fonts.gstatic.com", "example.invalid", "cdn.example.org"} <= hosts
    assert "cdn.example.net" not in hosts  # never requested: only the scan of the HTML finds it
    problems = "\n".join(broken.problems)
    expected = [
        r"would load from outside the site: .*cdn\.example\.net",
        r"would load from outside the site: .*fonts\.googleapis\.com",
        r"fonts\.css: .*fonts\.gstatic\.com",
        r"requests outside the site: .*",
        r"anchors that do not exist: #nowhere",
        r"raw TeX in the text: .*dp\\_rank",
        r"raw TeX in the text: .*\$x\^2\$",
        r"bare repr: Out\[9\]: <function show_step>",
        r"Out\[23\]: \(empty\)",
        r"control 1 \(#mx1-dead\): clicking \"3\" leaves the same panel shown",
        r"control 2 \(#mx2-same\): clicking \"3\" shows the same figures and text",
        r"at 390 px the page scrolls sideways .*pre reaches",
        r"at 730 px the page scrolls sideways",
        r"at 390 px code is under 12 px: pre 9 px",
        r"at 390 px figures are drawn too small or too wide: 120 px \(it is 320 px\)",
        r"at 390 px figures .*600 px, scrolls sideways past the screen's edge",
        r"1 answer folds come before their exercise's hints",
        r"1 exercises show a heading \(the next exercise\?\) between their stub and their answer fold",
        r"at 390 px the In/Out gutter takes 80 px",
    ]
    missing = [pattern for pattern in expected if not re.search(pattern, problems)]
    assert not missing, f"not reported: {missing}\nreported:\n{problems}"


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
    assert chapter.figures_in_page == 3 and chapter.figures_decoded == 3 and chapter.formulas_expected == 2
    assert chapter.figure_screenshot is not None and chapter.figure_screenshot.is_file()
    # the answer is folded when the page loads and opens on a click, on a desktop and a phone
    assert chapter.folds_expected == chapter.folds_in_page == chapter.folds_closed == chapter.folds_opened == 1
    # its static twin answers clicks; nothing left the site; the phone layout passed (in assert_pages_pass)
    assert chapter.twins == 1 and chapter.twin_clicks == 2 and reports[2].twins == 0
    assert chapter.requests > 0 and not chapter.outside_requests and not chapter.broken_anchors
    assert chapter.phone["gutter_px"] == 0 and chapter.phone["code_px"] >= 12
    assert [shot.name for shot in chapter.fold_screenshots] == [
        "00_toy_collectives-first-answer-1280px.png", "00_toy_collectives-first-answer-390px.png"]
    if browser_check_has_local_mathjax(toy_site) or REQUIRE_BROWSER:
        assert chapter.formulas_typeset >= 2


def browser_check_has_local_mathjax(site: Path) -> bool:
    return (site / "assets" / "mathjax" / "MathJax.js").is_file()


@pytest.mark.timeout(900)  # one Chromium for the whole site; a page takes seconds
def test_chapter_pages_render_in_chromium(real_site, tmp_path):
    chromium = chromium_or_skip()
    site, _ = real_site
    shots = Path(os.environ.get("MINITP_SCREENSHOTS", tmp_path / "screenshots"))
    reports = browser_check.check_site(site, shots, ROOT / "notebooks", chromium)
    for report in reports:
        print(report.line())
    assert len(reports) == 1 + len(CHAPTERS)
    assert_pages_pass(reports)


@pytest.mark.timeout(300)
def test_learner_copies_open_in_jupyterlab_with_one_line_per_control_saved_and_asking_nothing(tmp_path):
    """Learner copies of 03 and 05 in a real JupyterLab (``tools/lab_check.py``, ``make lab``'s settings):
    one stand-in line per live control, no twin, no radio button, the tab not marked changed, no
    question. The solved chapter 00 given a stale kernel name, opened beside them, fails on each."""
    from minitp.exercises.student import write_student_copy

    chromium = chromium_or_skip()

    def copy(source: Path, target: Path) -> None:
        if source.stem != "00_collectives":
            write_student_copy(source, target)
            return
        planted = json.loads(source.read_text(encoding="utf-8"))  # the solved chapter: its twin stays
        planted["metadata"]["kernelspec"] = {"name": "python3-old", "display_name": "Old", "language": "python"}
        target.write_text(json.dumps(planted), encoding="utf-8")

    reports = lab_check.check_lab(["03_tensor_parallel", "05_pipeline", "00_collectives"], tmp_path / "shots",
                                  ROOT / "notebooks", chromium, copy=copy)
    for report in reports:
        print(report.line())
    learner, planted = reports[:2], reports[2]
    assert_pages_pass(learner)
    assert all(report.seen["stand_ins"] == 1 and report.screenshot.is_file() for report in learner)
    wrong = " ".join(planted.problems)
    assert "0 outputs read" in wrong and "radio buttons" in wrong and "opens marked changed" in wrong, wrong
