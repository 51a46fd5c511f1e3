"""Open learner copies in a real JupyterLab, in headless Chromium, and check what a learner sees first.

``make lab`` starts JupyterLab on the learner's copies (``student/``). This check does the same on a
fresh copy of some chapters in a temporary folder, with the same settings (``tools/lab-overrides.json``
installed as ``make lab`` installs it), opens each chapter in one headless Chromium at 1280 px and checks:

* each live control's stored output is the copy's one line (``LIVE_CONTROL_LINE``), once per control:
  no static twin (its radio buttons and every panel at once, as an untrusted notebook shows it) and no
  radio button anywhere in the notebook;
* the chapter opens **saved**: its tab is not marked changed once its kernel has started (a stored
  kernel name JupyterLab does not know marks a notebook changed as it opens);
* JupyterLab asks nothing: no dialog, no notification (its first start otherwise asks whether to fetch
  Jupyter's news);
* a screenshot of each chapter at its first live control's place (``lab-NAME.png``).

    python tools/lab_check.py --chapters 03_tensor_parallel,05_pipeline --screenshots build/screenshots

exits 1 and says what is wrong; ``tests/test_site.py`` runs the same check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Page

sys.path.insert(0, str(Path(__file__).resolve().parent))

import browser_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = Path(__file__).resolve().parent / "lab-overrides.json"
DEFAULT_CHAPTERS = ("03_tensor_parallel", "05_pipeline")  # the chapters with the most controls
START_TIMEOUT_S = 90.0
SETTLE_TIMEOUT_S = 60.0


def install_overrides(prefix: str = sys.prefix) -> Path:
    """Install JupyterLab's settings for minitp (``tools/lab-overrides.json``) where JupyterLab reads
    defaults for every user of this environment; ``make lab`` does the same."""
    target = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.d" / "minitp.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(OVERRIDES, target)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server on 127.0.0.1 over ``root``, with no token and a private configuration."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._home = tempfile.TemporaryDirectory(prefix="minitp-lab-")
        home = Path(self._home.name)
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
                   JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "ws"),
                   MINITP_LIVE="1")
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
                   f"--ServerApp.root_dir={root}", "--IdentityProvider.token=", "--ServerApp.password=",
                   "--LabApp.news_url=None"]
        if hasattr(os, "getuid") and os.getuid() == 0:
            command.append("--allow-root")
        self.log = home / "lab.log"
        self._log_file = open(self.log, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{self.base}/api/status", timeout=2).read()
                return
            except OSError as error:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.close()
                    raise RuntimeError(f"JupyterLab did not start; its log ends: {tail}") from error
                time.sleep(0.3)

    def log_tail(self) -> str:
        try:
            return self.log.read_text()[-1500:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()
        self._home.cleanup()


# What the learner sees in an open notebook, once JupyterLab has drawn every cell and the kernel is up.
READ_JS = r"""
async ([cells, line, limitMs]) => {
  const sleep = (ms) => new Promise((done) => setTimeout(done, ms));
  const deadline = Date.now() + limitMs;
  const notebook = () => document.querySelector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook");
  const status = () => (document.querySelector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator")
                        || {}).getAttribute?.("data-status") || "";
  while (Date.now() < deadline) {
    const nb = notebook();
    if (nb && nb.querySelectorAll(".jp-Cell").length >= cells && status() === "idle") break;
    await sleep(250);
  }
  await sleep(2000);  // time for a late change mark or notification
  const nb = notebook();
  if (!nb) return {drawn: false};
  const outputs = [...nb.querySelectorAll(".jp-OutputArea-output")];
  const tab = document.querySelector(".lm-DockPanel .lm-TabBar-tab.lm-mod-current");
  const toasts = [...document.querySelectorAll(".Toastify__toast, .jp-Notification-Toast-default, .jp-toast-message")];
  const standIns = outputs.filter((o) => o.textContent.trim() === line);
  if (standIns.length) {  // the screenshot shows where the control will appear
    for (let i = 0; i < 3; i++) {  // again once the cells above have been laid out
      standIns[0].scrollIntoView({block: "end"});
      await sleep(400);
    }
  }
  return {
    drawn: true,
    cells: nb.querySelectorAll(".jp-Cell").length,
    kernel: status(),
    stand_ins: standIns.length,
    twins: nb.querySelectorAll(".minitp-explore-static, .minitp-explore").length,
    radios: nb.querySelectorAll("input[type=radio]").length,
    changed: !!(tab && tab.classList.contains("jp-mod-dirty")),
    title: tab ? tab.textContent.trim() : "",
    dialogs: [...document.querySelectorAll(".jp-Dialog")].map((d) => d.textContent.trim().slice(0, 120)),
    notices: [...new Set(toasts.map((t) => t.textContent.trim().slice(0, 120)))],
  };
}
"""


@dataclass
class LabReport:
    chapter: str
    screenshot: Path
    seen: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        verdict = "ok" if not self.problems else "; ".join(self.problems)
        return f"{self.chapter} in JupyterLab: {verdict}"


def expected_controls(solved: dict) -> int:
    """How many live controls the solved chapter stores (cells whose output is a twin or a widget):
    its learner copy must show one stand-in line for each."""
    from minitp.exercises.student import is_live_control

    return sum(any(is_live_control(out) for out in cell.get("outputs", [])) for cell in solved["cells"])


def check_chapter(page: Page, lab: Lab, solved: Path, copy: Path, screenshots: Path) -> LabReport:
    """Open the learner copy ``copy`` of the chapter ``solved`` in JupyterLab and read what it shows."""
    from minitp.exercises.student import LIVE_CONTROL_LINE

    notebook = json.loads(copy.read_text())
    report = LabReport(chapter=copy.stem, screenshot=screenshots / f"lab-{copy.stem}.png")
    controls = expected_controls(json.loads(solved.read_text()))
    page.goto(f"{lab.base}/lab/tree/{copy.name}")  # returns once the page's load event fired
    cells = len(notebook["cells"])
    seen = page.evaluate(READ_JS, [cells, LIVE_CONTROL_LINE, SETTLE_TIMEOUT_S * 1000])
    report.seen = seen
    page.screenshot(path=report.screenshot)
    if not seen.get("drawn"):
        report.problems.append("JupyterLab drew no notebook")
        return report
    if seen["cells"] < len(notebook["cells"]):
        report.problems.append(f"{seen['cells']} of {len(notebook['cells'])} cells drawn")
    if controls == 0:
        report.problems.append("the chapter stores no live control (each chapter has one)")
    if seen["stand_ins"] != controls:
        report.problems.append(f"{seen['stand_ins']} outputs read {LIVE_CONTROL_LINE!r}, expected {controls}")
    if seen["twins"] or seen["radios"]:
        report.problems.append(f"a stored control shows: {seen['twins']} twins, {seen['radios']} radio buttons")
    if seen["kernel"] != "idle":
        report.problems.append(f"the kernel is {seen['kernel'] or 'not started'}, expected idle")
    if seen["changed"]:
        report.problems.append(f"the notebook opens marked changed ({seen['title']!r})")
    for text in seen["dialogs"] + seen["notices"]:
        report.problems.append(f"JupyterLab asks: {text!r}")
    return report


def check_lab(chapters: list[str], screenshots: Path, notebook_dir: Path = ROOT / "notebooks",
              chromium: str | None = None, copy=None) -> list[LabReport]:
    """Learner copies of ``chapters`` in a temporary folder, opened one after another in JupyterLab.
    ``copy(source, target)`` makes a copy (default: ``minitp.exercises.student.write_student_copy``)."""
    from minitp.exercises.student import write_student_copy

    copy = copy or write_student_copy
    chromium = chromium or browser_check.find_chromium()
    if chromium is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium, or set MINITP_CHROMIUM)")
    install_overrides()
    screenshots = Path(screenshots).resolve()
    with tempfile.TemporaryDirectory(prefix="minitp-lab-copies-") as folder:
        copies = []
        for name in chapters:
            source = Path(notebook_dir) / f"{name}.ipynb"
            if not source.is_file():
                raise FileNotFoundError(f"no chapter {source}")
            copy(source, Path(folder) / source.name)
            copies.append((source, Path(folder) / source.name))
        lab = Lab(Path(folder))
        try:
            with browser_check.browser(chromium) as launched:
                page = launched.new_page(viewport={"width": 1280, "height": 900})
                page.set_default_timeout(START_TIMEOUT_S * 1000)
                return [check_chapter(page, lab, solved, copy, screenshots)
                        for solved, copy in copies]
        finally:
            lab.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chapters", default=",".join(DEFAULT_CHAPTERS), help="notebook names, comma-separated")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    parser.add_argument("--screenshots", type=Path, default=Path("build/screenshots"))
    args = parser.parse_args(argv)
    reports = check_lab([c for c in args.chapters.split(",") if c], args.screenshots, args.notebooks)
    for report in reports:
        print(report.line())
    return 1 if any(report.problems for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
