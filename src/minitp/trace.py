"""The record of what each rank sent and computed, and how to add it up across ranks.

Every message in minitp goes through ``minitp.comm``, and every ``comm`` call appends one
``Event`` to the trace that is recording on its process (``launch`` starts one per rank).
A trace is plain data: it pickles, it goes back to the parent with the rank's result, and the
figures in ``minitp.viz`` are drawn from it.

Each message also knows the mesh dimension it went through (``Event.dim``: "dp", "fsdp", "tp",
"pp"; "" for a group nobody named), taken from its process group (``minitp.comm.name_group``),
so traffic is split by dimension with ``totals(events, by=("dim",))`` or ``sent_bytes_by_dim``.

Where in the run an event happened is kept in fields, set by the code that sent it, never read back
from the label (a label is text for people): ``phase`` ("forward", "backward", ...), ``microbatch``
and ``chunk`` (a pipeline's), ``unit`` (an FSDP unit), ``step`` (a training step), ``ring_step``
(a step round a ring) and ``scopes`` (the names of the ``scope`` blocks open, outermost first).
The library sets them with ``tagged``: ``with trace.tagged(unit="layers.1", phase="forward"): ...``
stamps every event recorded inside (messages and compute spans; nested blocks add up, the inner
one wins).

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
  payload, computed from the recorded call (``collective_sent_bytes``, below), the same model
  ``minitp.cost`` uses for a strategy.
"""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace


@dataclass
class Event:
    """One communication call or one timed piece of compute on one rank."""

    rank: int
    kind: str  # "comm" or "compute"
    # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, or a compute name
    op: str
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
    # where in the run it happened (set with ``tagged`` by the code that sent it; see the top)
    # "forward", "backward", "weight", "step", "init", "state_dict", ...; "" if not said
    phase: str = ""
    microbatch: int | None = None  # a pipeline's micro-batch
    # a pipeline's model chunk on its rank (``Action.chunk``); a message: the sender's
    chunk: int | None = None
    unit: str = ""  # an FSDP unit ("root", "layers.1")
    step: int | None = None  # a training step
    ring_step: int | None = None  # a step round a ring (ring attention: whose block is held)
    scopes: tuple[str, ...] = ()  # the ``scope`` blocks open when it was recorded, outermost first

    @property
    def duration(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict:
        return asdict(self)

    def within(self, *names: str) -> bool:
        """Recorded inside the nested scopes ``names``, the outermost first and at the top:
        ``e.within("answer")``, ``e.within("answer", "step0")``."""
        return tuple(self.scopes[:len(names)]) == names

    def labelled(self, prefix: str) -> bool:
        """Its label starts with ``prefix``: how a person picks events by the text they read (a
        figure's ``label_prefix``). Code that needs the structure reads the fields instead."""
        return self.label.startswith(prefix)


# The fields ``tagged`` sets, and what an event holds when nothing set them.
TAGS = ("phase", "microbatch", "chunk", "unit", "step", "ring_step")
_UNSET = {f.name: f.default for f in fields(Event) if f.name in (*TAGS, "scopes")}


@dataclass
class Trace:
    """Events recorded on one rank, in the order they were started."""

    rank: int = 0
    events: list[Event] = field(default_factory=list)
    # perf_counter's clock is this machine's own: time.time() - time.perf_counter() when recording
    # began, and where, so traces from several machines line up (``viz.chrome_trace``)
    host: str = field(default_factory=socket.gethostname)
    clock_offset: float = field(default_factory=lambda: time.time() - time.perf_counter())
    _scopes: list[str] = field(default_factory=list, repr=False)
    _tags: list[dict] = field(default_factory=list, repr=False)
    # what each span also opens around its compute (a profiler's mark: ``measure.operators``)
    mark: Callable[[Event], AbstractContextManager] | None = field(default=None, repr=False)

    # -- recording ----------------------------------------------------------------------------
    def label(self, label: str) -> str:
        """The full label: open scopes joined with ``label`` by '/'."""
        parts = [*self._scopes, label] if label else list(self._scopes)
        return "/".join(p for p in parts if p)

    def tags(self) -> dict:
        """The fields an event recorded now gets: the open scopes and the open ``tagged`` blocks'
        fields (the inner block's value where two set one)."""
        out = {"scopes": tuple(self._scopes)}
        for tags in self._tags:
            out.update(tags)
        return out

    def stamp(self, event: Event) -> Event:
        """``event`` with the open scopes and tags in the fields it left unset (a copy when any)."""
        missing = {name: value for name, value in self.tags().items()
                   if value != _UNSET[name] and getattr(event, name) == _UNSET[name]}
        return replace(event, **missing) if missing else event

    def add(self, event: Event) -> Event:
        """Record ``event`` (stamped); returns the recorded event, whose end a caller may still
        set."""
        event = self.stamp(event)
        self.events.append(event)
        return event

    @contextmanager
    def span(self, name: str, label: str = "") -> Iterator[Event]:
        """Time a piece of compute: ``with trace.span("backward", "layers.1"): ...``."""
        event = Event(self.rank, "compute", name, self.label(label), time.perf_counter(), 0.0,
                      **self.tags())
        try:
            with self.mark(event) if self.mark is not None else nullcontext():
                yield event
        finally:
            event.end = time.perf_counter()
            self.add(event)

    # -- reading ------------------------------------------------------------------------------
    def comm(self) -> list[Event]:
        return [e for e in self.events if e.kind == "comm"]

    def sent_bytes(self, label_prefix: str = "", dim: str | None = None, *,
                   scope: str | None = None) -> float:
        """Bytes this rank sent (ring model), over events whose label starts with the prefix and,
        when ``dim`` is given, that went through a group of that mesh dimension; when ``scope`` is
        given, only those recorded inside a ``scope`` of that name (``Event.scopes``)."""
        return sum(e.sent_bytes for e in self.comm()
                   if e.labelled(label_prefix) and (dim is None or e.dim == dim)
                   and (scope is None or scope in e.scopes))

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
def scope(name: str, *inner: str) -> Iterator[None]:
    """Prefix the labels of calls made inside the block: ``with scope("ddp"): ...``; events
    recorded inside list it in ``Event.scopes``. Several names open nested scopes:
    ``scope("answer", "step0")`` labels "answer/step0/...", scopes ("answer", "step0")."""
    trace = current()
    if trace is None:
        yield
        return
    names = (name, *inner)
    trace._scopes.extend(names)
    try:
        yield
    finally:
        del trace._scopes[len(trace._scopes) - len(names):]


@contextmanager
def tagged(**tags) -> Iterator[None]:
    """Set fields of every event recorded inside the block (on the trace recording now):
    ``with tagged(unit="layers.1", phase="forward"): comm.all_gather(...)``. Blocks nest; where
    two set the same field the inner one wins. The fields: ``TAGS``."""
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise TypeError(
            f"tagged() got {', '.join(unknown)}; the fields it sets are {', '.join(TAGS)}")
    trace = current()
    if trace is None:
        yield
        return
    trace._tags.append(tags)
    try:
        yield
    finally:
        trace._tags.pop()


@contextmanager
def span(name: str, label: str = "") -> Iterator[Event | None]:
    """Time a piece of compute on the current trace (does nothing when none records)."""
    trace = current()
    if trace is None:
        yield None
        return
    with trace.span(name, label) as event:
        yield event


# -- the payload model: bytes one rank puts on the wire for one call -------------------------------
def collective_sent_bytes(op: str, nbytes: int, n: int, position: int = 0,
                          kept_bytes: float | None = None) -> float:
    """Bytes one rank sends for one call of ``op`` on a buffer of ``nbytes`` over ``n`` ranks (ring
    algorithm). ``position``: broadcast only, the rank's place along the chain from the source (n-1,
    the last, forwards nothing). ``kept_bytes``: all-to-all only, the bytes of this rank's input
    addressed to itself (an even split keeps nbytes/n, the default)."""
    if op == "all_to_all":  # every chunk but its own goes straight to its rank
        return 0.0 if n <= 1 else float(nbytes - (nbytes / n if kept_bytes is None else kept_bytes))
    if op == "send":
        return float(nbytes)
    if op == "recv" or n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if op == "broadcast":
        return float(nbytes) if position < n - 1 else 0.0
    raise ValueError(f"unknown collective {op!r}; expected all_reduce, all_gather, reduce_scatter, "
                     "broadcast, all_to_all, send or recv")


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


def sent_bytes_per_rank(traces: Iterable[Trace], label_prefix: str = "", dim: str | None = None, *,
                        scope: str | None = None) -> list[float]:
    """Bytes each rank sent, in rank order (only through groups of mesh dimension ``dim`` if given;
    only under a label prefix if given; only inside a ``scope`` of that name if given, as the
    exercises do to single out the learner's answer)."""
    return [t.sent_bytes(label_prefix, dim, scope=scope)
            for t in sorted(traces, key=lambda t: t.rank)]


def sent_bytes_by_dim(traces: Iterable[Trace]) -> list[dict[str, float]]:
    """Bytes each rank sent through each mesh dimension, one dict per rank in rank order:
    [{"tp": ..., "pp": ..., "dp": ...}, ...]. Every dict has every dimension any rank sent through
    ("" for unnamed groups), zero where this rank sent nothing in it."""
    traces = sorted(traces, key=lambda t: t.rank)
    dims = sorted({e.dim for t in traces for e in t.comm()})
    return [{d: t.sent_bytes(dim=d) for d in dims} for t in traces]
