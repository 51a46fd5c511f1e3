"""PyTorch's own operators inside minitp's spans: what a step's forward, backward and optimizer are
made of, on the same timeline as its messages.

``with operators(trace): ...`` runs the block under ``torch.profiler`` (CPU activity) and adds one
``Event(kind="op")`` per operator it saw (``aten::mm``, ``aten::_softmax``, a collective's call
``c10d::allreduce_``...) to ``trace``, so ``minitp.viz.chrome_trace`` draws them on the rank's
"compute" track, nested under the span that ran them (``minitp train --profile --trace-out FILE``).
``timeline`` and ``shares`` then say what each moment of the step was: the innermost operator's
kind of work, or a wait for a message, or Python (``minitp train --profile`` prints the shares,
``minitp.viz.profile`` draws the timeline).

The profiler keeps its own clock (microseconds from its start, the start on the wall clock), and
minitp's spans keep ``time.perf_counter``'s. Converting one into the other through the wall clock
is off by a few hundred microseconds, more than many operators last. So while the profiler runs,
every ``Trace.span`` also opens a ``torch.profiler.record_function`` named ``minitp/<name>``: the
k-th span and the k-th mark are the same piece of work seen by both clocks, and an operator is
moved by the offset of the innermost mark it ran in. It then lies inside its span, as it did inside
the mark (the mark's length kept no longer than the span's: the clocks tick at rates a hair apart).
An operator outside every mark (the clipping's, between backward and the optimizer) moves by the
median offset, and by the few microseconds more that keep it clear of the spans' edges.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from minitp.trace import Event, Trace

MARK = "minitp/"  # the profiler mark a span opens while profiling: "minitp/forward"

# the backend's record of a collective while it is in flight: it outlives the call that started it
# (an asynchronous bucket runs on after backward's span ends) and is minitp's message already, on
# its dimension's track; the call itself (``c10d::allreduce_``) stays
IN_FLIGHT = ("gloo:", "nccl:")


@contextmanager
def operators(trace: Trace) -> Iterator[None]:
    """Profile the block's CPU operators into ``trace`` (one ``Event(kind="op")`` each)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    marked: list[Event] = []  # the spans that opened a mark, in the order they began

    def mark(span: Event):
        marked.append(span)
        return record_function(MARK + span.op)

    trace.mark = mark
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
    finally:
        trace.mark = None
    trace.events.extend(operator_events(prof.events(), marked, trace.rank))


def operator_events(profiled, spans: list[Event], rank: int) -> list[Event]:
    """The profiler's operators (``FunctionEvent``s, times in µs from its start) as events on the
    spans' clock. ``spans``: the spans that opened a mark while it ran, in the order they began;
    the marks pair with them in the same order. None when they do not pair."""
    marks = sorted((f for f in profiled if f.name.startswith(MARK)),
                   key=lambda f: f.time_range.start)
    names = [f.name for f in marks], [MARK + s.op for s in spans]
    if not marks or names[0] != names[1]:  # the pairing broke: no offset can be trusted
        warnings.warn(f"rank {rank}: the profiler saw {len(marks)} of minitp's spans where the "
                      f"trace holds {len(spans)} (or in another order): its operators are left "
                      "out of the trace", RuntimeWarning, stacklevel=2)
        return []
    paired = {mark.id: (mark, span) for mark, span in zip(marks, spans)}
    median = statistics.median(span.start - mark.time_range.start / 1e6
                               for mark, span in paired.values())
    kept = [f for f in profiled if not f.name.startswith(MARK) and
            not f.name.startswith(IN_FLIGHT)]
    loose: dict[int, float] = {}  # each tree that ran outside every mark: seconds to add to it
    placed_end = -math.inf
    for root in sorted((f for f in kept if _holder(f, paired) is None and f.cpu_parent is None),
                       key=lambda f: f.time_range.start):
        start, end = root.time_range.start / 1e6 + median, root.time_range.end / 1e6 + median
        for _ in range(len(spans) + 1):  # clear of every span's edge, after the tree before
            move = _clear_of(spans, start, end)
            move = max(move, placed_end + GAP_S - start)
            if move <= 0:
                break
            start, end = start + move, end + move
        loose[root.id] = start - root.time_range.start / 1e6
        placed_end = end
    out = []
    for f in kept:
        holder = _holder(f, paired)
        if holder is None:  # outside every mark: its tree's shift
            root = f
            while root.cpu_parent is not None:
                root = root.cpu_parent
            shift = loose.get(root.id, median)
            start, end = f.time_range.start / 1e6 + shift, f.time_range.end / 1e6 + shift
        else:
            start, end = (_on_span(t, *paired[holder.id]) for t in (f.time_range.start,
                                                                     f.time_range.end))
        out.append(Event(rank, "op", f.name, "", start, end))
    return out


def _holder(f, paired):
    """The innermost mark ``f`` ran in (a ``FunctionEvent`` in ``paired``), or None."""
    node = f.cpu_parent
    while node is not None and node.id not in paired:
        node = node.cpu_parent
    return node


def _on_span(t_us: float, mark, span: Event) -> float:
    """A profiler time inside ``mark`` on the span's clock: the mark's start on the span's, its
    length no longer than the span's (the two clocks tick at rates a hair apart, and a long span's
    last operator must still end inside it)."""
    length = (mark.time_range.end - mark.time_range.start) / 1e6
    scale = min(1.0, (span.end - span.start) / length) if length > 0 else 1.0
    return span.start + (t_us - mark.time_range.start) / 1e6 * scale


# what separates a moved operator from the edge it was moved off (and from the tree before it):
# placed exactly on the edge, the trace's start and length, each rounded to the nanosecond, could
# add up to a hair past it, and a viewer would see two slices that overlap without nesting
GAP_S = 1e-6


def _clear_of(spans: list[Event], start: float, end: float) -> float:
    """How far to move an operator that ran between spans, placed by the median offset, so that it
    does not straddle a span's edge (the offsets differ by a few microseconds from span to span;
    a viewer cannot nest a slice that straddles another's edge), ``GAP_S`` clear of it."""
    for span in spans:
        if span.start < start < span.end + GAP_S and span.end < end:  # began inside, ends after:
            return span.end + GAP_S - start  # it ran after it
        if start < span.start and span.start - GAP_S < end < span.end:  # ran before it
            return span.start - GAP_S - end
    return 0.0


# -- where the step's time went -------------------------------------------------------------------
# what each moment of a profiled step counts as
CATEGORIES = ("matmul", "attention", "elementwise", "optimizer", "communication", "python")
MATMUL = ("aten::mm", "aten::addmm")  # the linear layers, forward and backward
ATTENTION = ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_softmax_backward_data",
             "aten::masked_fill_", "aten::masked_fill", "aten::_scaled_dot_product")
COMMUNICATION = ("c10d::", "gloo:", "nccl:")


def category(op: str | None, in_optimizer: bool, in_flight: bool) -> str:
    """What a moment counts as, from the innermost operator running then (None: none):

    - the optimizer's span: "optimizer", whatever runs;
    - a collective's call (``c10d::allreduce_``): "communication";
    - a kernel (``aten::``): "matmul" (the linear layers' ``mm``), "attention" (its fused kernel,
      or written out its batched matmuls, softmax and mask), else "elementwise" (copies,
      reshapes, norms, activations, RoPE, the loss);
    - no kernel (no operator, or only a wrapper around none: an autograd Function's own time, a
      hook): "communication" while one of the rank's messages is in flight (it waits), else
      "python" (minitp's code and the interpreter)."""
    if in_optimizer:
        return "optimizer"
    if op is not None and op.startswith(COMMUNICATION):
        return "communication"
    if op is not None and op.startswith("aten::"):
        if op in MATMUL:
            return "matmul"
        return "attention" if op.startswith(ATTENTION) else "elementwise"
    return "communication" if in_flight else "python"


def _innermost(ops: list[Event], t0: float, t1: float) -> list[tuple[float, float, str | None]]:
    """[t0, t1] cut into pieces, each with the innermost operator running in it (None: none).
    Operators nest (one rank, one thread): a stack of the open ones, swept in time."""
    pieces: list[tuple[float, float, str | None]] = []
    cursor, stack = t0, []

    def emit(end: float, op: str | None):
        nonlocal cursor
        if end > cursor:
            pieces.append((cursor, end, op))
            cursor = end

    for e in sorted(ops, key=lambda e: (e.start, -e.end)):
        while stack and stack[-1].end <= e.start:  # close what ended, innermost first
            top = stack.pop()
            emit(top.end, top.op)
        emit(e.start, stack[-1].op if stack else None)
        stack.append(e)
    while stack:
        top = stack.pop()
        emit(top.end, top.op)
    emit(t1, None)
    return pieces


def _cut(pieces, intervals: list[tuple[float, float]]):
    """Each piece split where ``intervals`` (sorted, disjoint) begin and end: (start, end, op,
    whether inside one)."""
    out = []
    for a, b, op in pieces:
        t = a
        for lo, hi in intervals:
            if lo >= b:
                break
            if hi <= t:
                continue
            if lo > t:
                out.append((t, lo, op, False))
                t = lo
            end = min(hi, b)
            out.append((t, end, op, True))
            t = end
        if t < b:
            out.append((t, b, op, False))
    return out


def _union(events: list[Event]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for e in sorted(events, key=lambda e: e.start):
        if out and e.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e.end)
        else:
            out.append([e.start, e.end])
    return [(a, b) for a, b in out]


def timeline(events: list[Event]) -> list[tuple[float, float, str]]:
    """One rank's profiled step as (start, end, category) pieces, from its first span or operator
    to its last: what ``shares`` adds up and ``minitp.viz.profile`` draws."""
    ops = [e for e in events if e.kind == "op"]
    spans = [e for e in events if e.kind == "compute"]
    if not ops:
        return []
    timed = ops + spans
    t0, t1 = min(e.start for e in timed), max(e.end for e in timed)
    pieces = _innermost(ops, t0, t1)
    optimizer = _union([s for s in spans if s.op == "optimizer"])
    flight = _union([e for e in events if e.kind == "comm"])
    out = []
    for a, b, op, in_opt in _cut(pieces, optimizer):
        for c, d, _, flying in _cut([(a, b, op)], flight):
            out.append((c, d, category(op, in_opt, flying)))
    return out


def shares(events: list[Event]) -> dict[str, float]:
    """Seconds of one rank's profiled step per category (``CATEGORIES``, ``category``); they add up
    to the step's wall time, first span or operator to last."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for a, b, kind in timeline(events):
        out[kind] += b - a
    return out if any(out.values()) else {}


def format_shares(per_rank: list[dict[str, float]]) -> str:
    """One line per rank: the step's milliseconds and each category's share of them."""
    head = f"{'rank':>4} {'step ms':>8}  " + "  ".join(f"{c:>13}" for c in CATEGORIES)
    lines = [head]
    for rank, s in enumerate(per_rank):
        total = sum(s.values())
        if not total:
            continue
        lines.append(f"{rank:>4} {total * 1e3:>8.1f}  "
                     + "  ".join(f"{s[c] / total:>13.0%}" for c in CATEGORIES))
    return "\n".join(lines)
