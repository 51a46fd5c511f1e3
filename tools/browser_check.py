"""Open the built website in a real browser (headless Chromium) and check what a reader would see.

For the home page and every chapter page of a built site (``make site``) this

* serves the site over HTTP on 127.0.0.1 (a free port), as a reader's browser would get it;
* lets Chromium load the page, run its scripts (MathJax) and take a screenshot (1280 x 4000);
* checks that every figure stored in the chapter's notebook is in the page as a PNG image, that the
  formulas were typeset by MathJax without errors, and that the screenshot is a real page (many
  colours, not one flat colour), not an empty or broken one;
* checks that every exercise's worked answer is folded: one ``<details class="minitp-answer">`` per
  fold of the chapter's website form (``minitp.exercises.student.website_notebook``), each closed when
  the page loads (its cells not drawn, no checker verdict "[ok]" in the page's visible text) and open
  once its summary is clicked; with ``--fold-screenshots`` the first fold, opened, is photographed at
  1280 and 390 px wide.

    python tools/browser_check.py site --screenshots build/screenshots --fold-screenshots

exits 1 and says what is wrong when a page fails; ``tests/test_site.py`` runs the same checks.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_NAMES = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    # run the page's scripts (MathJax) to the end, on a virtual clock, before the screenshot/DOM
    "--virtual-time-budget=20000",
]
PNG_IMG = re.compile(r"<img\b[^>]*\bsrc=\"data:image/png;base64,", re.IGNORECASE)
MATH_TYPESET = re.compile(r"id=\"MathJax-Element-\d+-Frame\"")
MATH_ERRORS = ("Math Processing Error", 'class="mjx-merror"', 'class="merror"')
TEX_MATH = re.compile(r"\$[^$\n]+\$")  # a $...$ or $$...$$ span in notebook Markdown
MIN_COLOURS = 64  # a rendered page has anti-aliased text and figures: thousands of colours
WINDOW = (1280, 4000)  # the browser window of every page screenshot
FOLD_WIDTHS = (1280, 390)  # a desktop and a phone


def find_chromium() -> str | None:
    """The Chromium executable: $MINITP_CHROMIUM, else the first of the usual names on PATH."""
    named = os.environ.get("MINITP_CHROMIUM")
    if named:
        return named if shutil.which(named) else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


PROBE_PATH = "/__minitp_probe__.html"
# A same-origin page that loads a chapter in a frame of the screenshot's size, lets its scripts run,
# then (1) looks at the answer folds as a reader finds them (closed, nothing of them drawn, no verdict
# in the visible text) and clicks each one open, (2) counts the figures the browser actually decoded,
# and scrolls the first figure (or, with show=fold, the first opened fold) into view: the screenshot
# of this page shows it however far down the chapter it sits.
PROBE_HTML = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>probe</title></head>
<body style="margin:0">
<iframe id="page" style="border:0"></iframe>
<pre id="result">pending</pre>
<script>
const query = new URLSearchParams(location.search);
const frame = document.getElementById("page");
frame.style.width = (query.get("width") || "1280") + "px";
frame.style.height = (query.get("height") || "4000") + "px";
frame.src = query.get("page");
frame.addEventListener("load", () => setTimeout(() => {
  const doc = frame.contentDocument;
  const view = frame.contentWindow;
  // what a fold takes on the page beyond its summary line (its cells, when they are drawn)
  const extra = (fold) => fold.getBoundingClientRect().height - fold.querySelector("summary").offsetHeight;
  const seen = (el) => (el.checkVisibility ? el.checkVisibility() : el.getClientRects().length > 0);
  const body = (fold) => [...fold.children].filter((el) => el.tagName !== "SUMMARY");
  const folds = [...doc.querySelectorAll("details.minitp-answer")];
  const closed = folds.filter((fold) => !fold.open && extra(fold) < 20 && !body(fold).some(seen)).length;
  const verdictVisible = /\[ok\]/.test(doc.body.innerText);
  folds.forEach((fold) => fold.querySelector("summary").click());
  const opened = folds.filter((fold) => fold.open && extra(fold) > 40 && body(fold).some(seen)).length;
  const images = [...doc.querySelectorAll('img[src^="data:image/png"]')];
  const decoded = images.filter((img) => img.complete && img.naturalWidth > 0);
  const target = query.get("show") === "fold" ? folds[0] : images[0];
  if (target) {  // just below the page's sticky header
    view.scrollTo(0, target.getBoundingClientRect().top + view.scrollY - 160);
  }
  document.getElementById("result").textContent = JSON.stringify({
    images: images.length,
    decoded: decoded.length,
    smallest: decoded.length ? Math.min(...decoded.map((img) => img.width * img.height)) : 0,
    typeset: doc.querySelectorAll('[id^="MathJax-Element-"][id$="-Frame"]').length,
    folds: folds.length,
    closed: closed,
    opened: opened,
    verdict_visible: verdictVisible,
  });
}, 8000));
</script>
</body></html>
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.path.split("?")[0] == PROBE_PATH:
            body = PROBE_HTML.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@contextmanager
def serve(site_dir: Path) -> Iterator[str]:
    """Serve ``site_dir`` on 127.0.0.1 (a free port) while the block runs; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def run_chromium(chromium: str, url: str, extra: list[str], timeout: float = 120,
                 window: tuple[int, int] = WINDOW) -> str:
    """Run headless Chromium once on ``url`` with a fresh profile; return its standard output."""
    with tempfile.TemporaryDirectory(prefix="minitp-chromium-") as profile:
        size = f"--window-size={window[0]},{window[1]}"
        command = [chromium, *CHROMIUM_FLAGS, size, f"--user-data-dir={profile}", *extra, url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited with {done.returncode} on {url}:\n{done.stderr[-2000:]}")
    return done.stdout


def screenshot_colours(path: Path) -> tuple[int, float]:
    """Distinct colours in the screenshot, and the share of pixels taken by the most common one."""
    from PIL import Image

    with Image.open(path) as image:
        rgb = image.convert("RGB")
        counts = rgb.getcolors(maxcolors=rgb.width * rgb.height)
    total = sum(count for count, _ in counts)
    return len(counts), max(count for count, _ in counts) / total


def notebook_expectations(notebook: Path) -> tuple[int, int]:
    """(PNG figures among the stored outputs, formulas in the Markdown cells) of a notebook."""
    cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
    figures = formulas = 0
    for cell in cells:
        if cell.get("cell_type") == "code":
            figures += sum("image/png" in output.get("data", {}) for output in cell.get("outputs", []))
        elif cell.get("cell_type") == "markdown":
            source = cell.get("source", "")
            text = "".join(source) if isinstance(source, list) else source
            text = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.DOTALL)  # not math inside code
            formulas += len(TEX_MATH.findall(text))
    return figures, formulas


def _student_module():
    """``minitp.exercises.student`` (standard library only): installed, else from src/ next to tools/."""
    try:
        from minitp.exercises import student
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from minitp.exercises import student
    return student


def expected_folds(notebook: Path) -> int:
    """How many answer folds the chapter's page must show (one per run of answer cells)."""
    notebook_json = json.loads(notebook.read_text(encoding="utf-8"))
    return _student_module().website_notebook(notebook_json, name=notebook.name)[1]


@dataclass
class PageReport:
    """What the browser showed for one page, and what was wrong with it."""

    page: str
    screenshot: Path
    figure_screenshot: Path | None = None
    figures_expected: int = 0
    figures_in_page: int = 0
    figures_decoded: int = 0
    formulas_expected: int = 0
    formulas_typeset: int = 0
    folds_expected: int = 0
    folds_in_page: int = 0
    folds_closed: int = 0
    folds_opened: int = 0
    fold_screenshots: list[Path] = field(default_factory=list)
    colours: int = 0
    top_colour_share: float = 1.0
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        state = "ok  " if not self.problems else "FAIL"
        return (
            f"{state} {self.page}: {self.figures_decoded} figures drawn by the browser "
            f"({self.figures_in_page} in the HTML, {self.figures_expected} in the notebook), "
            f"{self.formulas_typeset} formulas typeset ({self.formulas_expected} in the notebook), "
            f"{self.folds_closed} answer folds closed on load and {self.folds_opened} opened on click "
            f"({self.folds_in_page} in the page, {self.folds_expected} exercises' runs in the notebook), "
            f"screenshot {self.colours} colours ({self.screenshot})"
            + "".join(f"\n     - {problem}" for problem in self.problems)
        )


def chapter_pages(site_dir: Path) -> list[Path]:
    """The built chapter pages, ``notebooks/NN_name/index.html``, in order."""
    return sorted((site_dir / "notebooks").glob("[0-9][0-9]_*/index.html"))


def check_page(
    chromium: str, base_url: str, site_dir: Path, page: Path, screenshots: Path, notebook: Path | None,
    fold_screenshots: bool = False,
) -> PageReport:
    relative = page.relative_to(site_dir).as_posix()
    name = page.parent.name if page.parent != site_dir else "index"
    report = PageReport(page=relative, screenshot=screenshots / f"{name}.png")
    url = base_url + relative.removesuffix("index.html")
    html = page.read_text(encoding="utf-8")
    report.figures_in_page = len(PNG_IMG.findall(html))
    if notebook is not None:
        report.figures_expected, report.formulas_expected = notebook_expectations(notebook)
        report.folds_expected = expected_folds(notebook)
        if report.figures_in_page < report.figures_expected:
            report.problems.append(
                f"the notebook stores {report.figures_expected} PNG figures, the page has "
                f"{report.figures_in_page}"
            )

    dom = run_chromium(chromium, url, ["--dump-dom"])
    report.formulas_typeset = len(MATH_TYPESET.findall(dom))
    errors = [error for error in MATH_ERRORS if error in dom]
    if errors:
        report.problems.append(f"MathJax reported errors: {errors}")
    if report.formulas_expected and report.formulas_typeset < 0.9 * report.formulas_expected:
        report.problems.append(
            f"{report.formulas_expected} formulas in the notebook, {report.formulas_typeset} typeset: "
            "MathJax did not load or failed (a site built without a local MathJax loads it from a CDN; "
            "apt-get install libjs-mathjax and rebuild)"
        )
    if "md-content" not in dom:
        report.problems.append("the page has no Material content area after loading")

    report.screenshot.parent.mkdir(parents=True, exist_ok=True)
    report.screenshot.unlink(missing_ok=True)
    run_chromium(chromium, url, [f"--screenshot={report.screenshot}"])
    _check_screenshot(report, report.screenshot)

    if report.figures_in_page or report.folds_expected:
        # the same page in the probe frame: the folds as a reader finds them, then the figures
        probe = f"{base_url}{PROBE_PATH.lstrip('/')}?page=/{relative.removesuffix('index.html')}"
        found = re.search(r'<pre id="result">(.*?)</pre>', run_chromium(chromium, probe, ["--dump-dom"]), re.S)
        result = json.loads(found.group(1)) if found and found.group(1).startswith("{") else None
        if result is None:
            report.problems.append("the probe page could not read the chapter page's figures and folds")
        else:
            _read_probe(report, result)
        if report.figures_in_page:
            report.figure_screenshot = screenshots / f"{name}-first-figure.png"
            report.figure_screenshot.unlink(missing_ok=True)
            run_chromium(chromium, probe, [f"--screenshot={report.figure_screenshot}"])
            _check_screenshot(report, report.figure_screenshot)
        if fold_screenshots and report.folds_in_page:
            for width in FOLD_WIDTHS:
                shot = screenshots / f"{name}-first-answer-{width}px.png"
                shot.unlink(missing_ok=True)
                run_chromium(chromium, f"{probe}&show=fold&width={width}&height=1400", [f"--screenshot={shot}"],
                             window=(width, 1400))
                report.fold_screenshots.append(shot)
                _check_screenshot(report, shot)
    return report


def _read_probe(report: PageReport, result: dict) -> None:
    report.figures_decoded = result["decoded"]
    if report.figures_in_page and (result["decoded"] < report.figures_in_page or result["smallest"] < 100):
        report.problems.append(
            f"the browser decoded {result['decoded']} of {result['images']} figures "
            f"(smallest drawn {result['smallest']} px)"
        )
    report.folds_in_page, report.folds_closed = result["folds"], result["closed"]
    report.folds_opened = result["opened"]
    if report.folds_in_page != report.folds_expected:
        report.problems.append(f"the notebook's exercises make {report.folds_expected} answer folds, "
                               f"the page has {report.folds_in_page}")
    if report.folds_closed < report.folds_in_page:
        report.problems.append(f"{report.folds_in_page - report.folds_closed} answer folds are open (or drawn) "
                               "when the page loads")
    if report.folds_opened < report.folds_in_page:
        report.problems.append(f"{report.folds_in_page - report.folds_opened} answer folds show nothing when "
                               "their summary is clicked")
    if result["verdict_visible"]:
        report.problems.append("a checker's verdict ([ok]) is visible outside the answer folds")


def _check_screenshot(report: PageReport, path: Path) -> None:
    if not path.is_file() or path.stat().st_size == 0:
        report.problems.append(f"chromium wrote no screenshot {path.name}")
        return
    colours, top_share = screenshot_colours(path)
    if path == report.screenshot:
        report.colours, report.top_colour_share = colours, top_share
    if colours < MIN_COLOURS or top_share > 0.995:
        report.problems.append(
            f"the screenshot {path.name} looks blank: {colours} colours, the commonest covers {top_share:.1%}"
        )


def check_site(
    site_dir: Path, screenshots: Path, notebook_dir: Path | None = None, chromium: str | None = None,
    fold_screenshots: bool = False,
) -> list[PageReport]:
    """Check the home page and every chapter page of a built site; one report per page.

    The figures, formulas and answer folds a chapter must show are counted in its solved notebook,
    ``notebook_dir/NN_name.ipynb``, else in the copy published next to the page (the learner's copy:
    its answers are out, so it gives no fold count).
    """
    site_dir, screenshots = Path(site_dir).resolve(), Path(screenshots).resolve()
    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium, or set MINITP_CHROMIUM)")
    if not (site_dir / "index.html").is_file():
        raise FileNotFoundError(f"no built site at {site_dir} (run make site)")
    reports = []
    with serve(site_dir) as base_url:
        reports.append(check_page(chromium, base_url, site_dir, site_dir / "index.html", screenshots, None))
        for page in chapter_pages(site_dir):
            stem = page.parent.name
            candidates = [Path(notebook_dir) / f"{stem}.ipynb"] if notebook_dir is not None else []
            found = next((path for path in [*candidates, page.parent / f"{stem}.ipynb"] if path.is_file()), None)
            reports.append(check_page(chromium, base_url, site_dir, page, screenshots, found, fold_screenshots))
    if notebook_dir is not None:
        built = {page.parent.name for page in chapter_pages(site_dir)}
        for notebook in sorted(Path(notebook_dir).glob("[0-9][0-9]_*.ipynb")):
            if notebook.stem not in built:
                missing = PageReport(page=f"notebooks/{notebook.stem}/", screenshot=screenshots / "-")
                missing.problems.append(f"{notebook.name} has no page in the site (rebuild it: make site)")
                reports.append(missing)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, nargs="?", default=Path("site"), help="the built site")
    parser.add_argument("--screenshots", type=Path, default=Path("build/screenshots"))
    parser.add_argument("--notebooks", type=Path, default=Path("notebooks"))
    parser.add_argument("--fold-screenshots", action="store_true",
                        help="also photograph each chapter's first answer fold, opened, 1280 and 390 px wide")
    args = parser.parse_args(argv)
    notebooks = args.notebooks if args.notebooks.is_dir() else None
    reports = check_site(args.site, args.screenshots, notebooks, fold_screenshots=args.fold_screenshots)
    for report in reports:
        print(report.line())
    failed = [report for report in reports if report.problems]
    print(f"{len(reports) - len(failed)} pages passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
