"""A live progress line for launched runs of more than a second, when ``MINITP_PROGRESS=1`` asks for
it.

``make lab`` sets the variable, so a learner sees which step each rank is at while a cell runs (in
place of a bare ``[*]``). It is off otherwise: ``make notebooks`` and nbval run without it, so no
stored output ever holds a progress line. In a notebook the line is one display, updated in place
and emptied when the run ends; in a terminal it is rewritten on stderr and erased.

Ranks report with ``step(index, total)`` (the shared training loop does); the parent reads what each
rank wrote into the run's folder (``MINITP_PROGRESS_DIR``, set by ``launch`` for its ranks).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from minitp.launcher.guard import PROGRESS_ENV, env_flag

ENV = PROGRESS_ENV
DIR_ENV = "MINITP_PROGRESS_DIR"
SHOW_AFTER_S = 1.0  # shorter runs show nothing
EVERY_S = 0.5  # at most two updates a second


_sink = None  # while `to(callback)` is active: where the parent's progress lines go


@contextlib.contextmanager
def to(callback):
    """Send the parent's progress lines to ``callback(text)`` instead of a display or the terminal,
    and have the ranks report even when ``MINITP_PROGRESS`` is off (a live control's status
    line)."""
    global _sink
    old_sink, old_env = _sink, os.environ.get(ENV)
    _sink = callback
    os.environ[ENV] = "1"
    try:
        yield
    finally:
        _sink = old_sink
        if old_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old_env


def enabled() -> bool:
    """``MINITP_PROGRESS`` read as ``guard.env_flag`` reads every flag: 1/0, true/false, yes/no,
    on/off."""
    return env_flag(ENV)


def step(index: int, total: int | None = None, what: str = "step") -> None:
    """In a launched rank: this rank is at step ``index`` (0-based) of ``total``. Free when progress
    is off."""
    folder = os.environ.get(DIR_ENV)
    if not folder or not enabled():
        return
    path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.progress")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(f"{what} {index + 1}" + (f"/{total}" if total else ""))
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the run's folder is gone: the run is over


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class Line:
    """The parent's progress line for one run of ``nprocs`` ranks whose folder is ``workdir``."""

    def __init__(self, workdir: str, nprocs: int):
        self.workdir, self.nprocs = workdir, nprocs
        self.start = time.perf_counter()
        self.shown_at = 0.0
        self.handle = None  # the notebook display, once shown
        self.width = 0  # the terminal line's length, once shown

    def __enter__(self) -> Line:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def text(self, finished: int) -> str:
        parts = []
        for rank in range(self.nprocs):
            try:
                with open(os.path.join(self.workdir, f"rank{rank}.progress")) as f:
                    parts.append(f"rank {rank} {f.read()}")
            except OSError:
                pass
        elapsed = time.perf_counter() - self.start
        where = (": " + ", ".join(parts)) if parts else ""
        return f"running on {self.nprocs} ranks, {elapsed:.0f} s, {finished} finished{where}"

    def update(self, finished: int) -> None:
        """Show or refresh the line (called as the parent polls); nothing in the first second."""
        now = time.perf_counter()
        if not enabled() or now - self.start < SHOW_AFTER_S or now - self.shown_at < EVERY_S:
            return
        self.shown_at = now
        text = self.text(finished)
        if _sink is not None:
            _sink(text)
        elif _in_notebook():
            from IPython.display import display

            if self.handle is None:
                self.handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self.handle.update({"text/plain": text}, raw=True)
        elif sys.stderr.isatty():
            sys.stderr.write("\r" + text.ljust(self.width))
            sys.stderr.flush()
            self.width = max(self.width, len(text))

    def close(self) -> None:
        """Take the line away: an empty display in a notebook, an erased line in a terminal."""
        if self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)
            self.handle = None
        if self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0
