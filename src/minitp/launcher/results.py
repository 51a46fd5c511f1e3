"""What a launch hands back: its ``Results`` (each rank's return value, trace and printed output),
or one of its errors (a rank that raised or died, a run past its timeout).

The four types answer to their public path, ``minitp.launcher``: that is where a learner imports
them from, and the name a traceback prints."""

from __future__ import annotations

from minitp import trace as _trace


class LaunchError(RuntimeError):
    """A launched run did not finish."""

    __module__ = "minitp.launcher"


class RankError(LaunchError):
    """A rank raised (or died); ``rank`` and the remote ``traceback`` text say which and where."""

    __module__ = "minitp.launcher"

    def __init__(self, message: str, rank: int, remote_traceback: str):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback

    @property
    def raised(self) -> tuple[str, str]:
        """(the exception's qualified name, its message) from the traceback's last line, e.g.
        ("minitp.checkpoint.CheckpointError", "x.pt is torn"); ("", "") for a rank that died."""
        lines = self.remote_traceback.strip().splitlines()
        kind, _, message = lines[-1].partition(": ") if lines else ("", "", "")
        return kind, message


class LaunchTimeout(LaunchError):
    """The run went past its timeout. ``stacks`` maps each unfinished rank to its Python stack,
    ``calls`` each rank still inside the function to the call it waited in (``stuck.in_flight``);
    ``summary`` says it in a few lines (one a rank, then the likely mistake when the pattern is a
    known one)."""

    __module__ = "minitp.launcher"

    def __init__(self, message: str, stacks: dict[int, str], calls: dict[int, dict] | None = None,
                 summary: str = ""):
        super().__init__(message)
        self.stacks = stacks
        self.calls = calls or {}
        self.summary = summary


class Results(list):
    """Per-rank return values in rank order, with each rank's trace and printed output."""

    __module__ = "minitp.launcher"

    def __init__(self, values, traces, outputs, errors, wall_s: float):
        super().__init__(values)
        self.traces: list[_trace.Trace] = traces
        self.outputs: list[str] = outputs  # what each rank printed to stdout
        self.errors: list[str] = errors  # what each rank printed to stderr
        self.wall_s = wall_s

    @property
    def events(self) -> list[_trace.Event]:
        """Every rank's events, merged and sorted, times starting at 0."""
        return _trace.merge(self.traces)

    def sent_bytes(self, label_prefix: str = "") -> list[float]:
        """Bytes each rank sent over the run (ring model; see ``minitp.cost``)."""
        return _trace.sent_bytes_per_rank(self.traces, label_prefix)
