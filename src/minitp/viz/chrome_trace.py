"""A run's traces as a Chrome trace-event file, to look at a real step in the viewer everyone uses.

The format is one JSON object, ``{"traceEvents": [...], "displayTimeUnit": "ms"}``, whose events are
slices (``"ph": "X"``, start ``ts`` and ``dur`` in microseconds) on a process (``pid``) and a thread
(``tid``), named by metadata events (``"ph": "M"``). Here a process is a rank and a thread is a
track: "compute" for its forward/backward/optimizer spans (with ``--profile``, PyTorch's operators
nested under them: ``minitp.measure.operators``) and one per mesh dimension ("dp", "tp",
"pp", ...) for its messages, with an arrow (a flow event) from each send to the receive that took
it.

Open the file in Perfetto (drag it onto https://ui.perfetto.dev) or in Chrome (chrome://tracing,
Load). Times start at the earliest event of any rank (ranks on one machine share ``perf_counter``'s
clock). A track's slices must nest, so messages that overlap without nesting (asynchronous buckets
still in flight together) go on a second lane of their dimension, "dp #2".
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

from minitp.layout import AXES
from minitp.trace import TAGS, Event

# top to bottom; others after, by name
TRACK_ORDER = ("compute", "dp", "fsdp", "pp", "tp", "cp", "ep")


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _track(event: Event) -> str:
    """Compute (minitp's spans and, profiled, PyTorch's operators inside them) on "compute", a
    message on its group's dimension ("comm" for a group nobody named)."""
    return "compute" if event.kind in ("compute", "op") else event.dim or "comm"


def _track_order(name: str) -> tuple:
    base, _, lane = name.partition(" #")
    return (TRACK_ORDER.index(base) if base in TRACK_ORDER else len(TRACK_ORDER), base,
            int(lane or 1))


def _lanes(events: list[Event]) -> list[int]:
    """A lane for each event (sorted by start, the longer first) such that every lane's slices nest:
    each lane keeps the ends of its open slices, and an event fits where it ends inside the
    innermost."""
    open_ends: list[list[float]] = []
    lanes = []
    for e in events:
        for ends in open_ends:  # close the slices that ended before this one starts
            while ends and ends[-1] <= e.start:
                ends.pop()
        lane = next((i for i, ends in enumerate(open_ends) if not ends or e.end <= ends[-1]),
                    len(open_ends))
        if lane == len(open_ends):
            open_ends.append([])
        open_ends[lane].append(e.end)
        lanes.append(lane)
    return lanes


def _args(e: Event) -> dict:
    """What the viewer shows for a slice: its label, a message's bytes and peers, where in the
    run."""
    args = {"label": e.label} if e.label else {}
    if e.kind == "comm":
        args.update(op=e.op, bytes=e.bytes, sent_bytes=e.sent_bytes, shape=list(e.shape),
                    dtype=e.dtype)
        args.update({"peer": e.peer} if e.peer is not None else {"peers": list(e.group)})
    args.update({tag: getattr(e, tag) for tag in TAGS if getattr(e, tag) not in ("", None)})
    return args


def _process_name(rank: int, coords: list[dict] | None) -> str:
    where = coords[rank] if coords is not None and rank < len(coords) else {}
    inside = ", ".join(f"{dim} {index}" for dim, index in where.items())
    return f"rank {rank} ({inside})" if inside else f"rank {rank}"


def _inset(e: Event) -> float:
    """How far inside its slice an arrow's end sits: a viewer ties the end to the slice open at that
    time, and at the slice's very edge that may be its neighbour (1 µs, less in a short slice)."""
    return min(1e-6, max(e.end - e.start, 0.0) / 4)


def _flows(placed: list[tuple[Event, str]], tid: dict[str, int], t0: float) -> list[dict]:
    """An arrow from each send to its receive: between two ranks in one group, the k-th send meets
    the k-th receive (messages of a pair arrive in the order they were posted). The arrow leaves as
    the send starts (an ``isend`` hands its buffer over when posted) and lands where the receive
    completes: an ``irecv`` is posted early (a pipeline posts its receives as the step starts) and
    its slice ends when its ``wait`` returned, the first moment the data is known to be there. A
    receive cannot complete before its send began (ranks on one machine share the clock), so every
    arrow goes forward."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for e, track in placed:
        if e.op == "send":
            sends[e.rank, e.peer, e.group].append((e, track))
        elif e.op == "recv":
            recvs[e.peer, e.rank, e.group].append((e, track))
    out = []
    for pair, sent in sends.items():
        for (s, s_track), (r, r_track) in zip(sent, recvs.get(pair, [])):
            leaves = s.start + _inset(s)
            lands = max(r.end - _inset(r), leaves)
            flow = {"name": "message", "cat": "p2p", "id": len(out) // 2}
            out.append({**flow, "ph": "s", "pid": s.rank, "tid": tid[s_track],
                        "ts": _us(leaves - t0)})
            out.append({**flow, "ph": "f", "bp": "e", "pid": r.rank, "tid": tid[r_track],
                        "ts": _us(lands - t0)})
    return out


def _clock_shifts(per_rank_events) -> dict[int, float]:
    """{rank: seconds to add to its perf_counter times}: nothing when every rank ran on one machine
    (they share perf_counter's clock), else each machine's offset to the wall clock
    (``Trace.clock_offset``), so machines line up as their clocks agree."""
    traces = [t for t in per_rank_events if hasattr(t, "clock_offset")]
    if len({t.host for t in traces}) < 2:
        return {}
    by_host: dict[str, float] = {}
    for t in traces:  # one offset per machine: its ranks keep their order to the microsecond
        by_host.setdefault(t.host, t.clock_offset)
    first = min(by_host.values())
    return {t.rank: by_host[t.host] - first for t in traces}


def chrome_trace(per_rank_events, per_rank_spans=None, coords: list[dict] | None = None) -> dict:
    """The trace-event JSON object of a run (pure: nothing is written).

    per_rank_events: each rank's events, a list per rank or its ``Trace`` (messages and compute
    spans). per_rank_spans: more compute spans per rank, kept apart from the traces (optional).
    coords: each rank's place, ``{"dp": 1, "tp": 1}``, shown in its process name
    (``report_coords``).
    """
    events = [e for rank in (*per_rank_events, *(per_rank_spans or ()))
              for e in getattr(rank, "events", rank)]
    shift = _clock_shifts(per_rank_events)
    if shift:  # ranks on several machines: each machine's clock onto the wall clock
        events = [replace(e, start=e.start + shift.get(e.rank, 0.0),
                          end=e.end + shift.get(e.rank, 0.0))
                  for e in events]
    events.sort(key=lambda e: (e.rank, e.start, -e.end))  # an enclosing slice before what it holds
    t0 = min((e.start for e in events), default=0.0)
    by_track = defaultdict(list)
    for e in events:
        by_track[e.rank, _track(e)].append(e)
    placed = [(e, track if lane == 0 else f"{track} #{lane + 1}")
              for (_, track), evs in by_track.items() for e, lane in zip(evs, _lanes(evs))]
    tid = {name: i for i, name in enumerate(sorted({name for _, name in placed}, key=_track_order))}

    # a name or sort index for a process or thread
    def meta(kind: str, pid: int, tid: int, **args) -> dict:
        return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": args}

    out = []
    for rank in sorted({e.rank for e in events}):
        out += [meta("process_name", rank, 0, name=_process_name(rank, coords)),
                meta("process_sort_index", rank, 0, sort_index=rank)]
    for rank, name in sorted({(e.rank, name) for e, name in placed}):
        out += [meta("thread_name", rank, tid[name], name=name), meta("thread_sort_index", rank,
                                                                      tid[name],
                                                                        sort_index=tid[name])]
    for e, name in sorted(placed, key=lambda p: (p[0].start, p[0].rank, -p[0].end)):
        out.append({"name": f"{e.op} {e.label}" if e.label else e.op, "cat": e.kind, "ph": "X",
                    "pid": e.rank, "tid": tid[name], "ts": _us(e.start - t0),
                    "dur": _us(max(e.end - e.start, 0.0)), "args": _args(e)})
    out += _flows(placed, tid, t0)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, per_rank_events, per_rank_spans=None,
                       coords: list[dict] | None = None) -> dict:
    """Write ``chrome_trace(...)`` to ``path`` as JSON; returns the object written."""
    data = chrome_trace(per_rank_events, per_rank_spans, coords)
    with open(path, "w") as f:
        json.dump(data, f)
    return data


def report_coords(report) -> list[dict[str, int]]:
    """Each rank's place on the mesh for its process name, dimensions of size 1 left out: from the
    report's ``coords`` ((dp, pp, tp) per rank: 3D and expert runs), else, for a run over one
    dimension, the rank itself along it."""
    sizes = {dim: n for dim, n in report.layout.items() if n > 1}
    if "coords" in report:
        return [{dim: c for dim, c in zip(AXES, xyz) if dim in sizes} for xyz in report["coords"]]
    return [{dim: rank for dim, n in sizes.items() if n == report.world_size}
            for rank in range(report.world_size)]
