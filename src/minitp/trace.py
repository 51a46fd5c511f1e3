"""The record of what each rank sent and computed, and how to add it up across ranks.

Every message in minitp goes through ``minitp.comm``, and every ``comm`` call appends one
``Event`` to the trace that is recording on its process (``launch`` starts one per rank).
A trace is plain data: it pickles, it goes back to the parent with the rank's result, and the
figures in ``minitp.viz`` are drawn from it.

Each message also knows the mesh dimension it went through (``Event.dim``: "dp", "fsdp", "tp",
"pp"; "" for a group nobody named), taken from its process group (``minitp.comm.name_group``),
so traffic is split by dimension with ``totals(events, by=("dim",))`` or ``sent_bytes_by_dim``.

Two byte counts are kept per message (see ``minitp.cost`` for the formulas):

* ``bytes``: the size of the logical buffer of the operation, ``numel * itemsize`` of the tensor
  the collective is about: the reduced buffer of an all-reduce, the full (gathered) output of an
  all-gather, the full input of a reduce-scatter, this rank's whole input of an all-to-all (its
  rows for every rank), the tensor of a broadcast, send or recv.
* ``sent_bytes``: the payload bytes this rank puts on the wire for that call under the ring
  algorithm (all-reduce 2(n-1)/n * bytes, all-gather and reduce-scatter (n-1)/n * bytes, a
  chain broadcast bytes for every rank but the last of the chain, all-to-all bytes less the chunk
  addressed to itself, send bytes, recv 0). Headers,
  retransmits and the backend's own choice of algorithm are not counted: it is a model of the
  payload, computed from the recorded call, the same model ``minitp.cost`` uses for a strategy.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class Event:
    """One communication call or one timed piece of compute on one rank."""

    rank: int
    kind: str  # "comm" or "compute"
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, or a compute name
    label: str  # where it came from, e.g. "ddp/bucket3" or "backward/layers.1"
    start: float  # time.perf_counter() seconds on the recording process
    end: float
    group: tuple[int, ...] = ()  # global ranks of the process group
    dim: str = ""  # the mesh dimension that group was named with ("dp", "tp", ...; "" if unnamed)
    peer: int | None = None  # global rank on the other side of a send/recv
    shape: tuple[int, ...] = ()
    dtype: str = ""
    bytes: int = 0
    sent_bytes: float = 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Trace:
    """Events recorded on one rank, in the order they were started."""

    rank: int = 0
    events: list[Event] = field(default_factory=list)
    _scopes: list[str] = field(default_factory=list, repr=False)

    # -- recording ----------------------------------------------------------------------------
    def label(self, label: str) -> str:
        """The full label: open scopes joined with ``label`` by '/'."""
        parts = [*self._scopes, label] if label else list(self._scopes)
        return "/".join(p for p in parts if p)

    def add(self, event: Event) -> Event:
        self.events.append(event)
        return event

    @contextmanager
    def span(self, name: str, label: str = "") -> Iterator[Event]:
        """Time a piece of compute: ``with trace.span("backward", "layers.1"): ...``."""
        event = Event(self.rank, "compute", name, self.label(label), time.perf_counter(), 0.0)
        try:
            yield event
        finally:
            event.end = time.perf_counter()
            self.add(event)

    # -- reading ------------------------------------------------------------------------------
    def comm(self) -> list[Event]:
        return [e for e in self.events if e.kind == "comm"]

    def sent_bytes(self, label_prefix: str = "", dim: str | None = None) -> float:
        """Bytes this rank sent (ring model), over events whose label starts with the prefix and,
        when ``dim`` is given, that went through a group of that mesh dimension."""
        return sum(e.sent_bytes for e in self.comm()
                   if e.label.startswith(label_prefix) and (dim is None or e.dim == dim))

    def clear(self) -> None:
        self.events.clear()


# The traces recording on this process, innermost last. A stack rather than one global so that
# nested recordings (a test inside a launched rank, say) each see their own calls.
_recording: list[Trace] = []


@contextmanager
def recording(rank: int = 0) -> Iterator[Trace]:
    """Record every ``minitp.comm`` call made inside the block into a new ``Trace``."""
    trace = Trace(rank=rank)
    _recording.append(trace)
    try:
        yield trace
    finally:
        _recording.remove(trace)


def current() -> Trace | None:
    """The innermost trace recording on this process, or None when nothing records."""
    return _recording[-1] if _recording else None


@contextmanager
def scope(name: str) -> Iterator[None]:
    """Prefix the labels of calls made inside the block: ``with scope("ddp"): ...``."""
    trace = current()
    if trace is None:
        yield
        return
    trace._scopes.append(name)
    try:
        yield
    finally:
        trace._scopes.pop()


@contextmanager
def span(name: str, label: str = "") -> Iterator[Event | None]:
    """Time a piece of compute on the current trace (does nothing when none records)."""
    trace = current()
    if trace is None:
        yield None
        return
    with trace.span(name, label) as event:
        yield event


# -- across ranks ---------------------------------------------------------------------------------
def merge(traces: Iterable[Trace], align: bool = True) -> list[Event]:
    """All ranks' events in one list sorted by start time.

    With ``align`` the times are shifted so that the earliest event starts at 0 (ranks on one
    machine share ``perf_counter``'s clock, so their events line up).
    """
    events = [e for t in traces for e in t.events]
    if align and events:
        t0 = min(e.start for e in events)
        events = [
            Event(**{**e.as_dict(), "start": e.start - t0, "end": e.end - t0}) for e in events
        ]
    return sorted(events, key=lambda e: (e.start, e.rank))


def totals(events: Iterable[Event], by: tuple[str, ...] = ("op",)) -> dict[tuple, dict]:
    """Sum communication events by the given fields: {key: {"calls", "bytes", "sent_bytes"}}."""
    out: dict[tuple, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0, "sent_bytes": 0.0})
    for e in events:
        if e.kind != "comm":
            continue
        row = out[tuple(getattr(e, f) for f in by)]
        row["calls"] += 1
        row["bytes"] += e.bytes
        row["sent_bytes"] += e.sent_bytes
    return dict(out)


def sent_bytes_per_rank(traces: Iterable[Trace], label_prefix: str = "", dim: str | None = None) -> list[float]:
    """Bytes each rank sent, in rank order (only through groups of mesh dimension ``dim`` if given;
    only under a label prefix if given, as the exercises do to single out the learner's answer)."""
    return [t.sent_bytes(label_prefix, dim) for t in sorted(traces, key=lambda t: t.rank)]


def sent_bytes_by_dim(traces: Iterable[Trace]) -> list[dict[str, float]]:
    """Bytes each rank sent through each mesh dimension, one dict per rank in rank order:
    [{"tp": ..., "pp": ..., "dp": ...}, ...]. Every dict has every dimension any rank sent through
    ("" for unnamed groups), zero where this rank sent nothing in it."""
    traces = sorted(traces, key=lambda t: t.rank)
    dims = sorted({e.dim for t in traces for e in t.comm()})
    return [{d: t.sent_bytes(dim=d) for d in dims} for t in traces]
