"""Open the built website in a real browser (headless Chromium) and check what a reader would see.

For the home page and every chapter page of a built site (``make site``) this

* serves the site over HTTP on 127.0.0.1 (a free port), as a reader's browser would get it, and opens
  each page in headless Chromium (the one installed, driven by Playwright: no browser download),
  in a tab 1280 px wide, then in a tab that is a phone 390 px wide;
* checks that **no request leaves the site**: every request the page makes is seen (the browser
  reports each one, and anything not on 127.0.0.1 goes to a dead proxy, so nothing really leaves),
  and the page's HTML and stylesheets are scanned for loads from other hosts that did not happen this
  time (a loader that only runs on some pages); a file of the site that is missing fails too;
* checks that every figure stored in the chapter's notebook is in the page and decoded, that the
  formulas were typeset by MathJax without errors and that **no raw TeX** (``\\_``, ``\\frac``,
  ``$x$``) is left in the text a reader sees, that **no link** ``href="#x"`` lacks its target, that
  no output is a stray repr (``<function show_step>``) or empty, and that the screenshot is a real
  page (many colours, not one flat colour);
* checks each exercise's worked answer is folded: one ``<details class="minitp-answer">`` per fold of
  the chapter's website form (``minitp.exercises.student.website_notebook``), closed on load (nothing
  of it drawn, no checker verdict "[ok]" in the visible text), open once its summary is clicked, and
  after the exercise's hints (no fold is followed by a cell that opens with "Hints", no heading sits
  between an exercise's stub and its fold);
* checks each **static twin** of a live control (``.minitp-explore``): clicking each value of each
  control shows another stored panel, with decoded figures or text that differ from the panel before;
* checks that at 1280 px a chapter's code cell holds at least 110 characters of code (its lines go up
  to 120: a narrower column makes most cells scroll sideways);
* checks the page at 730 px and on a **phone** (390 px): the page does not scroll sideways as a whole
  (wide outputs scroll inside themselves), code is at least 12 px, each figure is drawn at least 300 px
  wide (or as wide as it is) and no wider than the screen (a phone shows no scrollbar: a figure that
  scrolls sideways looks cut off), and on the phone the ``In [n]:`` gutter takes at most a tenth of
  the width;
* photographs every page at 1280 and 390 px (``NAME.png``, ``NAME-390px.png``), its first figure and
  first control at both widths; with ``--fold-screenshots`` also its first answer fold, opened.

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
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin, urlsplit

from playwright.sync_api import Browser, Request, Response, sync_playwright

CHROMIUM_NAMES = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
# Nothing but the site itself is reachable: every other host goes to a closed port (the page's
# request is still seen and reported), and no host name resolves. Playwright adds the usual
# switches of a quiet headless browser (no first-run pages, no updates, no crash reports).
CHROMIUM_FLAGS = [
    "--proxy-server=http://127.0.0.1:9",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]
PNG_IMG = re.compile(r"<img\b[^>]*\bsrc=\"data:image/png;base64,", re.IGNORECASE)
TEX_MATH = re.compile(r"\$[^$\n]+\$")  # a $...$ or $$...$$ span in notebook Markdown
MIN_COLOURS = 64  # a rendered page has anti-aliased text and figures: thousands of colours
DESKTOP = (1280, 2000)  # the browser window of the desktop checks and screenshots
PHONE = (390, 1600)  # a phone (CSS px; drawn at twice that, as a phone's screen does)
TABLET = (730, 1000)  # a small tablet, or a narrow window: checked, not photographed
PAGE_TIMEOUT_S = 60  # loading a page and typesetting its formulas, on a busy machine
MIN_CODE_CHARS = 110  # at DESKTOP width a code cell holds this many characters (chapter code runs to 120)
# Loads from another host written in a page's HTML or CSS (not links a reader may follow).
OUTSIDE_LOADS = [
    re.compile(r"<(?:script|img|iframe|source|audio|video|embed|track|input)\b[^>]*\bsrc\s*=\s*[\"']?(https?:)?//",
               re.IGNORECASE),
    re.compile(r"<link\b(?=[^>]*\brel\s*=\s*[\"']?(?:stylesheet|preconnect|preload|prefetch|modulepreload|"
               r"dns-prefetch|icon|manifest))[^>]*\bhref\s*=\s*[\"']?(https?:)?//", re.IGNORECASE),
    re.compile(r"@import\s+(?:url\()?\s*[\"']?(https?:)?//", re.IGNORECASE),
    re.compile(r"url\(\s*[\"']?(https?:)?//", re.IGNORECASE),
    re.compile(r"\bimport\(\s*[\"'](https?:)?//", re.IGNORECASE),
    re.compile(r"(?:\.src|Src|\bfetch\()\s*=?\s*[\"'](https?:)?//"),  # script.src = …, widgetRendererSrc = …
]
LOCAL_STYLESHEET = re.compile(r"<link\b[^>]*\brel=\"stylesheet\"[^>]*\bhref=\"([^\"]+)\"", re.IGNORECASE)


def find_chromium() -> str | None:
    """The Chromium executable: $MINITP_CHROMIUM, else the first of the usual names on PATH."""
    named = os.environ.get("MINITP_CHROMIUM")
    if named:
        return shutil.which(named)
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
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


@contextmanager
def browser(chromium: str) -> Iterator[Browser]:
    """One headless Chromium, the executable ``chromium``, for the block."""
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            yield launched
        finally:
            launched.close()


class Tab:
    """A browser tab at one screen size: open a page, run JavaScript on it, photograph it; it keeps
    the requests the page made since it was opened."""

    def __init__(self, browser: Browser, size: tuple[int, int], phone: bool = False):
        width, height = size
        # a phone draws each CSS px with two pixels and lays the page out as its viewport tag says
        context = browser.new_context(viewport={"width": width, "height": height},
                                      device_scale_factor=2 if phone else 1, is_mobile=phone)
        context.set_default_timeout(PAGE_TIMEOUT_S * 1000)
        self.page = context.new_page()
        self.asked: list[str] = []  # every URL the page asked for
        self.failed: list[str] = []  # the files that failed, or came back as errors
        self.page.on("request", self._asked)
        self.page.on("response", self._answered)
        self.page.on("requestfailed", self._request_failed)

    def _asked(self, request: Request) -> None:
        self.asked.append(request.url)

    def _answered(self, response: Response) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.url} ({response.status})")

    def _request_failed(self, request: Request) -> None:
        if request.failure != "net::ERR_ABORTED":  # cancelled (the page no longer needed it)
            self.failed.append(f"{request.url} ({request.failure})")

    def viewport(self, width: int, height: int) -> None:
        self.page.set_viewport_size({"width": width, "height": height})

    def open(self, url: str) -> None:
        """Load ``url`` and wait until it is drawn: MathJax done, fonts loaded, images decoded."""
        self.asked.clear()
        self.failed.clear()
        self.page.goto(url)  # returns once the page's load event fired
        self.evaluate(PROBE_JS)
        self.evaluate(f"__minitp.settle({(PAGE_TIMEOUT_S - 10) * 1000})")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression on the page (a promise is awaited)."""
        return self.page.evaluate(expression)

    def screenshot(self, path: Path) -> Path:
        self.page.screenshot(path=path)  # what the screen shows, in device pixels
        return path


# Installed in each page as window.__minitp; each function returns plain JSON for the checks.
PROBE_JS = r"""
window.__minitp = (() => {
  const sleep = (ms) => new Promise((done) => setTimeout(done, ms));
  const seen = (el) => (el.checkVisibility ? el.checkVisibility() : el.getClientRects().length > 0);
  const content = () => document.querySelector(".md-content") || document.body;
  const short = (text, n = 70) => text.replace(/\s+/g, " ").trim().slice(0, n);

  async function settle(limitMs) {
    const deadline = Date.now() + limitMs;
    const left = () => Math.max(0, deadline - Date.now());
    const hub = window.MathJax && window.MathJax.Hub;
    if (hub && hub.Register) {  // MathJax 2: its first typeset, then anything still queued
      await Promise.race([new Promise((done) => hub.Register.StartupHook("End", done)), sleep(left())]);
      await Promise.race([new Promise((done) => hub.Queue(done)), sleep(left())]);
    }
    if (document.fonts) await Promise.race([document.fonts.ready, sleep(Math.min(5000, left()))]);
    await Promise.all([...document.images].map((img) => img.decode().catch(() => null)));
    await sleep(50);
    return true;
  }

  // raw TeX a reader would see: the page's text without code, scripts and MathJax's own copies
  const TEX = /\\[A-Za-z]{2,}|\\[_{}%&#$^]|\$[^$\s][^$\n]*\$/g;
  function rawTex() {
    const clone = content().cloneNode(true);
    clone.querySelectorAll("pre, code, script, style, textarea, .MJX_Assistive_MathML, .MathJax_Preview, "
                           + ".clipboard-copy-txt").forEach((el) => el.remove());
    const text = clone.textContent;
    const found = [];
    for (const match of text.matchAll(TEX)) {
      found.push(short(text.slice(Math.max(0, match.index - 25), match.index + match[0].length + 25)));
      if (found.length >= 5) break;
    }
    return found;
  }

  function brokenAnchors() {
    const ids = new Set([...document.querySelectorAll("[id]")].map((el) => el.id));
    document.querySelectorAll("a[name]").forEach((el) => ids.add(el.getAttribute("name")));
    const broken = new Set();
    for (const link of document.querySelectorAll('a[href^="#"]')) {
      const raw = link.getAttribute("href").slice(1);
      let id = raw;
      try { id = decodeURIComponent(raw); } catch (error) { /* keep it as written */ }
      if (raw && !ids.has(id)) broken.add(raw);
    }
    return [...broken];
  }

  // an output that shows nothing, or only the repr of what a cell returned
  const REPR = new RegExp("^(<(function|bound method|module|class|built-in function|generator object)\\b[^>]*>"
    + "|<[\\w.]+ object at 0x[0-9a-fA-F]+>|<Figure size [^>]*>"
    + "|(interactive|VBox|HBox|Box|GridBox|Output|Tab|Accordion)\\()");
  function strayOutputs() {
    const stray = [];
    for (const output of document.querySelectorAll(".jp-OutputArea-output")) {
      const text = output.textContent.trim();
      const media = output.querySelector("img, svg, table, canvas, video, iframe, input, .MathJax_CHTML, .MathJax");
      const prompt = output.parentElement.querySelector(".jp-OutputPrompt");
      const where = prompt && prompt.textContent.trim() ? prompt.textContent.trim() + " " : "";
      if (!text && !media) stray.push(`${where}(empty)`);
      else if (!media && REPR.test(text)) stray.push(`${where}${short(text, 50)}`);
    }
    return stray;
  }

  function facts() {
    const images = [...document.querySelectorAll('img[src^="data:image/png"]')];
    const decoded = images.filter((img) => img.complete && img.naturalWidth > 0);
    const folds = [...document.querySelectorAll("details.minitp-answer")];
    return {
      images: images.length,
      decoded: decoded.length,
      smallest: decoded.length ? Math.min(...decoded.map((img) => img.width * img.height)) : 0,
      typeset: document.querySelectorAll('[id^="MathJax-Element-"][id$="-Frame"]').length,
      math_errors: [
        ...(document.body.innerText.includes("Math Processing Error") ? ["Math Processing Error"] : []),
        ...[...document.querySelectorAll(".mjx-merror, .merror")].map((el) => short(el.textContent, 40)),
      ].slice(0, 5),
      content: !!document.querySelector(".md-content"),
      broken_anchors: brokenAnchors(),
      raw_tex: rawTex(),
      stray_outputs: strayOutputs(),
      twins: document.querySelectorAll(".minitp-explore").length,
      folds: folds.length,
      code_chars: codeChars(),
    };
  }

  // how many characters of code a code cell's editor holds on one line (null: no code cell)
  function codeChars() {
    const editor = [...document.querySelectorAll(".jp-InputArea-editor")].find(seen);
    const pre = editor && editor.querySelector("pre");
    if (!pre) return null;
    const probe = document.createElement("span");
    probe.style.cssText = "position:absolute;visibility:hidden;white-space:pre";
    probe.style.font = getComputedStyle(pre).font;
    probe.textContent = "0".repeat(100);
    document.body.appendChild(probe);
    const width = probe.getBoundingClientRect().width / 100;
    probe.remove();
    const style = getComputedStyle(pre);
    const inner = editor.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    return width > 0 ? Math.floor(inner / width) : null;
  }

  // the answer folds as a reader finds them (closed, nothing of them drawn), then clicked open
  function folds() {
    const all = [...document.querySelectorAll("details.minitp-answer")];
    const extra = (fold) => fold.getBoundingClientRect().height - fold.querySelector("summary").offsetHeight;
    const body = (fold) => [...fold.children].filter((el) => el.tagName !== "SUMMARY");
    const closed = all.filter((fold) => !fold.open && extra(fold) < 20 && !body(fold).some(seen)).length;
    const verdict = /\[ok\]/.test(document.body.innerText);
    // the exercise's hints come before its worked answer, not right after the fold
    const hintsAfter = all.filter((fold) => /^\s*Hints\b/.test((fold.nextElementSibling || {}).innerText || "")).length;
    // and nothing of the next exercise (a heading) sits between an exercise's stub and its fold
    const headingBefore = [...document.querySelectorAll(".celltag_minitp-stub")].filter((stub) => {
      for (let el = stub.nextElementSibling; el && !el.matches("details.minitp-answer"); el = el.nextElementSibling) {
        if (el.matches("h1, h2, h3, h4, h5, h6") || el.querySelector("h1, h2, h3, h4, h5, h6")) return true;
      }
      return false;
    }).length;
    all.forEach((fold) => fold.querySelector("summary").click());
    const opened = all.filter((fold) => fold.open && extra(fold) > 40 && body(fold).some(seen)).length;
    return {folds: all.length, closed: closed, opened: opened, verdict_visible: verdict, hints_after: hintsAfter,
            heading_before: headingBefore};
  }

  // each static twin: every value of every control, clicked, shows another panel that differs
  async function twins() {
    const problems = [];
    let clicks = 0;
    const all = [...document.querySelectorAll(".minitp-explore")];
    for (const [number, twin] of all.entries()) {
      const name = `control ${number + 1}` + (twin.id ? ` (#${twin.id})` : "");
      const shown = () => [...twin.querySelectorAll(".mx-panel")].filter(seen);
      const looks = (panel) => [...panel.querySelectorAll("img")].map((img) => img.src).join("|") + "\n"
        + [...panel.querySelectorAll("pre")].map((pre) => pre.textContent).join("\n");
      const radios = [...twin.querySelectorAll('input[type="radio"]')];
      const folded = [];  // a control inside a closed answer fold: opened for the check, closed after
      for (let fold = twin.closest("details"); fold; fold = fold.parentElement.closest("details")) {
        if (!fold.open) { fold.open = true; folded.push(fold); }
      }
      if (shown().length !== 1) problems.push(`${name}: ${shown().length} panels shown on load, not one`);
      if (!radios.length) problems.push(`${name}: no control to click`);
      const click = async (input) => {
        const label = twin.querySelector(`label[for="${CSS.escape(input.id)}"]`);
        if (!label) { problems.push(`${name}: the value ${input.id} has no label`); return; }
        const before = shown()[0];
        label.click();
        clicks += 1;
        await sleep(10);
        const after = shown();
        const what = `${name}: clicking "${short(label.textContent, 20)}"`;
        if (!input.checked) problems.push(`${what} does not select it`);
        if (after.length !== 1) { problems.push(`${what} shows ${after.length} panels, not one`); return; }
        if (after[0] === before) { problems.push(`${what} leaves the same panel shown`); return; }
        if (before && looks(after[0]) === looks(before)) problems.push(`${what} shows the same figures and text`);
        const images = [...after[0].querySelectorAll("img")];
        const undecoded = images.filter((img) => !(img.complete && img.naturalWidth > 0));
        if (undecoded.length) problems.push(`${what} shows a figure not decoded`);
        if (!images.length && !after[0].textContent.trim()) problems.push(`${what} shows an empty panel`);
      };
      for (const group of [...new Set(radios.map((radio) => radio.name))]) {
        const values = radios.filter((radio) => radio.name === group);
        const start = values.find((radio) => radio.checked);
        if (!start) { problems.push(`${name}: no value of ${group} is selected on load`); continue; }
        for (const input of values) if (input !== start) await click(input);
        if (values.length > 1) await click(start);  // back where it was: its own label clicked too
      }
      folded.forEach((fold) => { fold.open = false; });
    }
    if (document.activeElement) document.activeElement.blur();  // no focus ring in the screenshots
    return {twins: all.length, clicks: clicks, problems: problems};
  }

  // the page on a phone: nothing wider than the screen unless it sits in a box that scrolls
  function scrolls(el) {
    for (let node = el.parentElement; node && node !== document.body; node = node.parentElement) {
      if (/auto|scroll/.test(getComputedStyle(node).overflowX) && node.scrollWidth > node.clientWidth) return true;
    }
    return false;
  }
  function describe(el) {
    const names = typeof el.className === "string" ? el.className.trim().split(/\s+/).filter(Boolean) : [];
    const cls = names.length ? "." + names.slice(0, 2).join(".") : "";
    return el.tagName.toLowerCase() + cls;
  }
  function phone() {
    // the layout width (a phone zooms out to show a page wider than its screen: innerWidth grows)
    const width = document.documentElement.clientWidth;
    const wide = [];
    for (const el of content().querySelectorAll("*")) {
      if (el.closest(".MJX_Assistive_MathML")) continue;  // MathJax's copy for screen readers, clipped to 1 px
      const box = el.getBoundingClientRect();
      let right = box.right;  // and what sticks out of a box that lets its content overflow
      if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX === "visible") {
        right = Math.max(right, box.left + el.scrollWidth);
      }
      if (box.width === 0 || right <= width + 1 || !seen(el) || scrolls(el)) continue;
      wide.push(`${describe(el)} reaches ${Math.round(right)} px`);
      if (wide.length >= 3) break;
    }
    const code = [...content().querySelectorAll("pre, code")].filter(seen).slice(0, 400);
    const sizes = code.map((el) => parseFloat(getComputedStyle(el).fontSize));
    const smallCode = code.map((el, i) => [el, sizes[i]]).filter(([, size]) => size < 12).slice(0, 3)
      .map(([el, size]) => `${describe(el)} ${size} px`);
    const small = [];
    for (const img of content().querySelectorAll("img")) {
      if (!seen(img) || !img.naturalWidth) continue;
      const drawn = img.getBoundingClientRect();
      const natural = img.getAttribute("width") ? parseFloat(img.getAttribute("width")) : img.naturalWidth;
      if (drawn.width + 1 < Math.min(natural, 300)) small.push(`${Math.round(drawn.width)} px (it is ${natural} px)`);
      else if (drawn.right > width + 1) {
        const how = scrolls(img) ? "scrolls sideways past" : "cut at";
        small.push(`${Math.round(drawn.width)} px, ${how} the screen's edge`);
      }
    }
    const prompts = [...content().querySelectorAll(".jp-InputPrompt, .jp-OutputPrompt")].filter(seen);
    return {
      width: width,
      page_width: document.documentElement.scrollWidth,
      wide: wide,
      code_px: sizes.length ? Math.min(...sizes) : null,
      small_code: smallCode,
      small_figures: small.slice(0, 5),
      figures_checked: [...content().querySelectorAll("img")].filter(seen).length,
      gutter_px: prompts.length ? Math.max(...prompts.map((el) => el.getBoundingClientRect().width)) : 0,
    };
  }

  // scroll so that the first element matching a selector (and shown) sits below the sticky header,
  // or to the top; then let the header's title change (a short transition) finish
  async function show(selector) {
    const target = selector ? [...document.querySelectorAll(selector)].find(seen) : document.body;
    if (!target) return false;
    window.scrollTo(0, selector ? target.getBoundingClientRect().top + window.scrollY - 80 : 0);
    await sleep(400);
    return true;
  }

  return {settle, facts, folds, twins, phone, show};
})();
true
"""


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


def outside_loads(text: str) -> list[str]:
    """What in an HTML page or a stylesheet would load something from another host (a snippet each)."""
    found = []
    for pattern in OUTSIDE_LOADS:
        for match in pattern.finditer(text):
            found.append(" ".join(text[match.start():match.end() + 60].split())[:110])
    return found


def is_outside(url: str, base_url: str) -> bool:
    scheme = urlsplit(url).scheme
    return scheme not in ("data", "blob", "about", "javascript", "chrome", "devtools") and not url.startswith(base_url)


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
    twins: int = 0
    twin_clicks: int = 0
    requests: int = 0
    outside_requests: list[str] = field(default_factory=list)
    broken_anchors: list[str] = field(default_factory=list)
    raw_tex: list[str] = field(default_factory=list)
    phone: dict = field(default_factory=dict)
    screenshots: list[Path] = field(default_factory=list)
    fold_screenshots: list[Path] = field(default_factory=list)
    colours: int = 0
    top_colour_share: float = 1.0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        state = "ok  " if not self.problems else "FAIL"
        phone = (f"phone: page {self.phone.get('page_width')} px wide, code {self.phone.get('code_px')} px, "
                 f"gutter {self.phone.get('gutter_px', 0):.0f} px" if self.phone else "phone: not checked")
        return (
            f"{state} {self.page} ({self.seconds:.1f} s): {self.figures_decoded} figures drawn by the browser "
            f"({self.figures_in_page} in the HTML, {self.figures_expected} in the notebook), "
            f"{self.formulas_typeset} formulas typeset ({self.formulas_expected} in the notebook), "
            f"{self.folds_closed} answer folds closed on load and {self.folds_opened} opened on click "
            f"({self.folds_in_page} in the page, {self.folds_expected} exercises' runs in the notebook), "
            f"{self.twins} static controls ({self.twin_clicks} clicks, each changed the figure), "
            f"{self.requests} requests, {len(self.outside_requests)} outside the site, "
            f"{len(self.broken_anchors)} broken anchors, {len(self.raw_tex)} raw TeX; {phone}; "
            f"screenshot {self.colours} colours ({self.screenshot})"
            + "".join(f"\n     - {problem}" for problem in self.problems)
        )


def chapter_pages(site_dir: Path) -> list[Path]:
    """The built chapter pages, ``notebooks/NN_name/index.html``, in order."""
    return sorted((site_dir / "notebooks").glob("[0-9][0-9]_*/index.html"))


def _static_outside(site_dir: Path, page: Path, html: str, seen_css: dict[Path, list[str]]) -> list[str]:
    """Loads from other hosts written in the page and in the site's stylesheets it links."""
    found = outside_loads(html)
    for href in LOCAL_STYLESHEET.findall(html):
        if urlsplit(href).scheme or href.startswith("//"):
            continue  # another host: outside_loads has it already
        css = (page.parent / href.split("?")[0]).resolve() if not href.startswith("/") else \
            (site_dir / href.lstrip("/").split("?")[0]).resolve()
        if css not in seen_css:
            seen_css[css] = outside_loads(css.read_text(encoding="utf-8", errors="replace")) if css.is_file() else []
        found += [f"{css.name}: {snippet}" for snippet in seen_css[css]]
    return found


def check_page(
    tab: Tab, phone_tab: Tab, base_url: str, site_dir: Path, page: Path, screenshots: Path,
    notebook: Path | None, fold_screenshots: bool = False, seen_css: dict | None = None,
) -> PageReport:
    """Check one page: in ``tab`` on a desktop, then narrowed to a small tablet, and in
    ``phone_tab`` on a phone."""
    start = time.perf_counter()
    relative = page.relative_to(site_dir).as_posix()
    name = page.parent.name if page.parent != site_dir else "index"
    report = PageReport(page=relative, screenshot=screenshots / f"{name}.png")
    url = urljoin(base_url, relative.removesuffix("index.html"))
    html = page.read_text(encoding="utf-8")
    report.figures_in_page = len(PNG_IMG.findall(html))
    problems = report.problems
    if notebook is not None:
        report.figures_expected, report.formulas_expected = notebook_expectations(notebook)
        report.folds_expected = expected_folds(notebook)
        if report.figures_in_page < report.figures_expected:
            problems.append(f"the notebook stores {report.figures_expected} PNG figures, the page has "
                            f"{report.figures_in_page}")
    for snippet in _static_outside(site_dir, page, html, {} if seen_css is None else seen_css):
        problems.append(f"would load from outside the site: {snippet}")

    # --- on a desktop -----------------------------------------------------------------------------
    tab.viewport(*DESKTOP)
    tab.open(url)
    facts = tab.evaluate("__minitp.facts()")
    report.formulas_typeset, report.twins = facts["typeset"], facts["twins"]
    if facts["math_errors"]:
        problems.append(f"MathJax reported errors: {facts['math_errors']}")
    if report.formulas_expected and report.formulas_typeset < 0.9 * report.formulas_expected:
        problems.append(
            f"{report.formulas_expected} formulas in the notebook, {report.formulas_typeset} typeset: "
            "MathJax did not load or failed (a site built without a local MathJax loads it from a CDN; "
            "apt-get install libjs-mathjax and rebuild)"
        )
    if not facts["content"]:
        problems.append("the page has no Material content area after loading")
    if notebook is not None and facts["code_chars"] is not None and facts["code_chars"] < MIN_CODE_CHARS:
        problems.append(f"at {DESKTOP[0]} px a code cell holds {facts['code_chars']} characters of code (at least "
                        f"{MIN_CODE_CHARS}): most code scrolls sideways")
    report.figures_decoded = facts["decoded"]
    if report.figures_in_page and (facts["decoded"] < report.figures_in_page or facts["smallest"] < 100):
        problems.append(f"the browser decoded {facts['decoded']} of {facts['images']} figures "
                        f"(smallest drawn {facts['smallest']} px)")
    report.broken_anchors, report.raw_tex = facts["broken_anchors"], facts["raw_tex"]
    if report.broken_anchors:
        problems.append(f"links to anchors that do not exist: {', '.join('#' + a for a in report.broken_anchors)}")
    if report.raw_tex:
        problems.append(f"raw TeX in the text: {' | '.join(report.raw_tex)}")
    if facts["stray_outputs"]:
        problems.append(f"outputs that show nothing or a bare repr: {' | '.join(facts['stray_outputs'][:5])}")

    shots = report.screenshots
    shots.append(tab.screenshot(report.screenshot))
    _check_screenshot(report, report.screenshot)
    if report.figures_in_page and tab.evaluate("__minitp.show('.jp-OutputArea-output img, .md-content img')"):
        report.figure_screenshot = tab.screenshot(screenshots / f"{name}-first-figure.png")
        shots.append(report.figure_screenshot)
        _check_screenshot(report, report.figure_screenshot)
    if report.twins:
        twins = tab.evaluate("__minitp.twins()")
        report.twin_clicks = twins["clicks"]
        problems.extend(f"static control: {problem}" for problem in twins["problems"])
        if tab.evaluate("__minitp.show('.minitp-explore')"):
            shots.append(tab.screenshot(screenshots / f"{name}-first-control.png"))

    folds = tab.evaluate("__minitp.folds()")  # opens them all: the phone checks see the answers too
    _read_folds(report, folds)
    if fold_screenshots and report.folds_in_page and tab.evaluate("__minitp.show('details.minitp-answer')"):
        shot = tab.screenshot(screenshots / f"{name}-first-answer-{DESKTOP[0]}px.png")
        report.fold_screenshots.append(shot)
        _check_screenshot(report, shot)

    # --- on a small tablet (the same tab, narrowed), then on a phone (a tab that is one) ----------
    tab.viewport(*TABLET)
    tab.evaluate("__minitp.settle(5000)")
    _layout_problems(report, tab.evaluate("__minitp.phone()"), gutter=False)
    phone_tab.open(url)
    phone_tab.evaluate("__minitp.folds()")  # answers open, as on the desktop: their layout counts
    phone_tab.evaluate("__minitp.settle(5000)")
    report.phone = phone_tab.evaluate("__minitp.phone()")
    _layout_problems(report, report.phone, gutter=True)
    phone_tab.evaluate("__minitp.show(null)")
    shot = phone_tab.screenshot(screenshots / f"{name}-{PHONE[0]}px.png")
    shots.append(shot)
    _check_screenshot(report, shot)
    first_figure = "__minitp.show('.jp-OutputArea-output img, .md-content img')"
    if report.figures_in_page and phone_tab.evaluate(first_figure):
        shots.append(phone_tab.screenshot(screenshots / f"{name}-first-figure-{PHONE[0]}px.png"))
    if report.twins and phone_tab.evaluate("__minitp.show('.minitp-explore')"):
        shots.append(phone_tab.screenshot(screenshots / f"{name}-first-control-{PHONE[0]}px.png"))
    first_answer = "__minitp.show('details.minitp-answer')"
    if fold_screenshots and report.folds_in_page and phone_tab.evaluate(first_answer):
        shot = phone_tab.screenshot(screenshots / f"{name}-first-answer-{PHONE[0]}px.png")
        report.fold_screenshots.append(shot)
        _check_screenshot(report, shot)

    asked = tab.asked + phone_tab.asked
    report.requests = len(asked)
    report.outside_requests = sorted({url for url in asked if is_outside(url, base_url)})
    if report.outside_requests:
        problems.append(f"requests outside the site: {', '.join(report.outside_requests[:5])}")
    # outside: reported above; /favicon.ico: asked by the browser itself of a page that names no icon
    failed = [failure for failure in tab.failed + phone_tab.failed
              if failure.startswith(base_url) and "/favicon.ico " not in failure]
    if failed:
        problems.append(f"files of the site that did not load: {', '.join(failed[:5])}")
    report.seconds = time.perf_counter() - start
    return report


def _layout_problems(report: PageReport, result: dict, gutter: bool) -> None:
    at = f"at {result['width']} px"
    if result["page_width"] > result["width"] + 1 or result["wide"]:
        report.problems.append(f"{at} the page scrolls sideways ({result['page_width']} px wide): "
                               + "; ".join(result["wide"]))
    if result["small_code"]:
        report.problems.append(f"{at} code is under 12 px: {'; '.join(result['small_code'])}")
    if result["small_figures"]:
        report.problems.append(f"{at} figures are drawn too small or too wide: {'; '.join(result['small_figures'])}")
    if gutter and result["gutter_px"] > 0.1 * result["width"]:
        report.problems.append(f"{at} the In/Out gutter takes {result['gutter_px']:.0f} px")


def _read_folds(report: PageReport, result: dict) -> None:
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
    if result.get("hints_after"):
        report.problems.append(f"{result['hints_after']} answer folds come before their exercise's hints "
                               "(hints first, the worked answer last)")
    if result.get("heading_before"):
        report.problems.append(f"{result['heading_before']} exercises show a heading (the next exercise?) "
                               "between their stub and their answer fold")


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
    seen_css: dict = {}
    with serve(site_dir) as base_url, browser(chromium) as launched:
        tab = Tab(launched, DESKTOP)
        phone_tab = Tab(launched, PHONE, phone=True)
        reports.append(check_page(tab, phone_tab, base_url, site_dir, site_dir / "index.html",
                                  screenshots, None, seen_css=seen_css))
        for page in chapter_pages(site_dir):
            stem = page.parent.name
            candidates = [Path(notebook_dir) / f"{stem}.ipynb"] if notebook_dir is not None else []
            candidates.append(page.parent / f"{stem}.ipynb")
            found = next((path for path in candidates if path.is_file()), None)
            reports.append(check_page(tab, phone_tab, base_url, site_dir, page, screenshots, found,
                                      fold_screenshots, seen_css))
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
