"""Pipeline schedules as data: for each rank, the list of actions it runs, in order.

An action is ``Action(kind, microbatch, chunk)``: ``F`` (forward), ``B`` (backward) and, in the
zero-bubble schedule, ``W`` (the weight gradient, split off from ``B``). ``chunk`` is which of the
rank's model pieces it runs: with ``v`` virtual stages per rank (interleaved 1F1B) the model is cut
into p·v pieces and rank r holds pieces r, r + p, r + 2p, ... (chunk c is piece c·p + r); every
other schedule has one chunk per rank (chunk 0).

Four schedules, four pure functions of (p, m[, v]):

* ``gpipe``: all forwards, then all backwards. A stage holds all m micro-batches' activations.
* ``one_f_one_b``: p-s-1 warm-up forwards, then one forward, one backward in turn, then drain.
  The same bubble as GPipe, (p-1)/(m+p-1), but at most p-s micro-batches held.
* ``interleaved_1f1b``: 1F1B over the p·v pieces (Megatron's interleaved schedule). A piece takes
  1/v of a stage's time, so filling and draining the pipe costs 1/v as much: bubble (p-1)/(v·m+p-1),
  for v times more messages (every piece boundary is a hop).
* ``zero_bubble_h1``: 1F1B whose backward is cut in two (Qi et al. 2023, ZB-H1). B computes only
  the gradient of the stage's input, which is what the previous stage waits for; W, the gradient
  of the weights, waits for nobody, so it is held back and run where 1F1B would idle. With equal
  F, B and W times the bubble falls from (p-1)·3 slots to (p-1)·1.

``simulate`` plays any of them with fixed times per action (no processes): it proves a table
cannot deadlock and gives its ideal timeline; fed measured times, it draws what a deeper run would
look like. ``replay`` plays a measured run's own action times again with free messages, which
splits its bubble into what the compute alone leaves and what the hand-over of messages adds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple


class Action(NamedTuple):
    # "F" forward, "B" backward (input gradient only when the schedule has W), "W" weight gradient
    kind: str
    microbatch: int
    chunk: int = 0  # which of the rank's pieces (interleaved); 0 otherwise

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


Schedule = list[list[Action]]  # one list of actions per rank


def _check(num_stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    for name, value in (("num_stages", num_stages), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def gpipe(num_stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards, on every stage. Backwards run in reverse order (the last
    micro-batch's activations are the freshest); the gradient sum is the same either way."""
    _check(num_stages, microbatches)
    m = microbatches
    stage = [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]
    return [list(stage) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, microbatches: int) -> Schedule:
    """1F1B: stage s runs min(p-s-1, m) warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards. Micro-batches in increasing order everywhere."""
    _check(num_stages, microbatches)
    p, m = num_stages, microbatches
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: the forward of i+warmup, the backward of i
            actions += [Action("F", i + warmup), Action("B", i)]
        actions += [Action("B", i) for i in range(m - warmup, m)]
        out.append(actions)
    return out


def interleaved_1f1b(num_stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B: rank r holds v chunks (pieces r, r+p, ...). Forwards go through the
    micro-batches p at a time, chunk 0 for those p, then chunk 1 for the same p, ...; backwards the
    same way from the last chunk down. Rank r warms up with 2(p-r-1) + (v-1)p forwards (what the
    pieces after it need before the first gradient comes back), then alternates, then drains.
    Needs m to be a multiple of p (the groups of p micro-batches)."""
    _check(num_stages, microbatches, virtual_stages)
    p, m, v = num_stages, microbatches, virtual_stages
    if m % p:
        raise ValueError(f"interleaved 1F1B needs microbatches to be a multiple of the stages: "
                         f"microbatches={m} is not divisible by pp={p}")

    # the k-th forward (or backward): (mb, chunk)
    def nth(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, (v - 1 - chunk if backward else chunk)

    total = m * v
    out = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        actions = [Action("F", *nth(k, False)) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [Action("F", *nth(k + warmup, False)), Action("B", *nth(k, True))]
        actions += [Action("B", *nth(k, True)) for k in range(total - warmup, total)]
        out.append(actions)
    return out


def zero_bubble_h1(num_stages: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's order of F and B, with each backward cut into B (input gradient: sent at once
    to the previous stage) and W (weight gradient: needed by nobody until the optimizer). Stage s
    runs W(i-s) right after B(i): the last stages, whose gradients the others wait for, hold back
    the most W's, so their B's go out sooner; the held-back W's run in the drain, where 1F1B idles.
    Every stage then holds at most p micro-batches (F done, W not yet), 1F1B's first-stage peak."""
    _check(num_stages, microbatches)
    p, m = num_stages, microbatches
    out = []
    for s in range(p):
        first = min(p - s, m)  # forwards before the first backward: 1F1B's warm-up plus one
        actions = [Action("F", i) for i in range(first)]
        for i in range(m):
            actions.append(Action("B", i))
            if i >= s:
                actions.append(Action("W", i - s))
            if i + first < m:
                actions.append(Action("F", i + first))
        actions += [Action("W", i) for i in range(max(m - s, 0), m)]
        out.append(actions)
    return out


# -- one schedule, one entry: what the runtime, the cost model, the reports, the CLI and figures
# read ----
class ScheduleEntry(NamedTuple):
    name: str
    table: Callable[..., Schedule]  # (p, m) -> every rank's actions; (p, m, v) with chunks
    bubble: Callable[[int, int, int], float]  # (p, m, v) -> idle share of a step with equal stages
    bubble_words: str  # the same, as the reports print it
    # (p, m, stage, v) -> activation sets held at once
    peak_in_flight: Callable[[int, int, int, int], int]
    chunks: bool  # takes virtual_stages v >= 2


def _zb_bubble(p: int, m: int, v: int) -> float:
    idle = p - 1 + max(p - m, 0)  # with m < p every stage also waits p - m more slots
    return idle / (3 * m + idle)


SCHEDULES: dict[str, ScheduleEntry] = {e.name: e for e in (
    ScheduleEntry("gpipe", gpipe, lambda p, m, v: (p - 1) / (m + p - 1), "(p-1)/(m+p-1)",
                  lambda p, m, s, v: m, False),
    ScheduleEntry("1f1b", one_f_one_b, lambda p, m, v: (p - 1) / (m + p - 1), "(p-1)/(m+p-1)",
                  lambda p, m, s, v: min(p - s, m), False),
    ScheduleEntry("interleaved", interleaved_1f1b, lambda p, m, v: (p - 1) / (v * m + p - 1),
                  "(p-1)/(v·m+p-1)", lambda p, m, s, v: min(2 * (p - s - 1) + (v - 1) * p + 1,
                                                            v * m), True),
    ScheduleEntry("zb", zero_bubble_h1, _zb_bubble, "(p-1)/(3m+p-1) with F=B=W",
                  lambda p, m, s, v: min(p, m), False),
)}


def schedule_entry(name: str) -> ScheduleEntry:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def make_schedule(name: str, num_stages: int, microbatches: int,
                  virtual_stages: int = 1) -> Schedule:
    """The table of schedule ``name``; ``virtual_stages`` (chunks per rank) only for
    "interleaved"."""
    entry = schedule_entry(name)
    if entry.chunks:
        if not isinstance(virtual_stages, int) or virtual_stages < 2:
            raise ValueError("interleaved 1F1B needs virtual_stages >= 2 (chunks per rank), got "
                             f"{virtual_stages!r}")
        return entry.table(num_stages, microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} is for the interleaved schedule; {name!r} runs one "
            "chunk per rank (virtual_stages=1)")
    return entry.table(num_stages, microbatches)


def chunks_of(actions: Sequence[Action]) -> int:
    """How many chunks a rank's actions touch (v)."""
    return 1 + max((a.chunk for a in actions), default=0)


def splits_weight_gradient(actions: Sequence[Action]) -> bool:
    """Whether the actions run W apart from B (then B computes the input gradient only)."""
    return any(a.kind == "W" for a in actions)


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most (micro-batch, chunk) pairs whose forward has run and whose backward has not
    finished (the W, when the backward is split), along one rank's actions: how many sets of
    activations it holds at once. Under interleaving each set is one chunk's, 1/v of a stage."""
    last = "W" if splits_weight_gradient(actions) else "B"
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1 if a.kind == last else 0
        peak = max(peak, held)
    return peak


Timeline = list[tuple[Action, float, float]]  # one rank's (action, start, end), in order
Times = float | Sequence[float]  # one time for every rank, or one per rank


def _per_rank(t: Times | None, p: int) -> list[float | None]:
    return list(t) if isinstance(t, Sequence) else [t] * p


def simulate(schedule: Schedule, forward_time: Times = 1.0, backward_time: Times = 2.0,
             weight_time: Times | None = None) -> list[Timeline]:
    """Play a schedule with fixed compute times and free messages: each rank runs its actions in
    order, each as soon as its input is there. Piece k = chunk·p + rank: F of piece k waits for
    F of piece k-1; B of piece k for B of piece k+1 (the last piece: for its own F); W for its own
    B.

    Times are per action of one chunk (a float, or one per rank, e.g. measured). ``backward_time``
    is a whole backward; where a schedule splits it, B and W take ``backward_time - weight_time``
    and ``weight_time`` (half each when ``weight_time`` is None). Raises if the schedule deadlocks.
    """
    p = len(schedule)
    fwd = _per_rank(forward_time, p)
    bwd = _per_rank(backward_time, p)
    wgt = _per_rank(weight_time, p)
    cost = []
    for s in range(p):
        split = splits_weight_gradient(schedule[s])
        w = (bwd[s] / 2 if wgt[s] is None else wgt[s]) if split else 0.0
        cost.append({"F": fwd[s], "B": bwd[s] - w, "W": w})
    return _play(schedule, lambda s, j, a: cost[s][a.kind])


def replay(timelines: list[Timeline], message_s: float = 0.0, gap_s: float = 0.0) -> list[Timeline]:
    """Play measured timelines again, each action as long as it took; by default with free messages
    and no time between actions: the step as it would have gone had only compute taken time.

    What it tells apart: the bubble of the replay holds the formula's bubble plus what unequal
    stages and uneven actions (one micro-batch's backward slower than the next) add; the measured
    bubble minus the replay's is the hand-over. ``message_s`` (each message from another rank
    arrives that long after its action ends) and ``gap_s`` (a rank's own time between two actions)
    put the hand-over's measured costs back in."""
    schedule = [[a for a, _, _ in t] for t in timelines]
    return _play(schedule, lambda s, j, a: timelines[s][j][2] - timelines[s][j][1], message_s,
                 gap_s)


def needs(a: Action, piece: int, last_piece: int) -> tuple[str, int, int] | None:
    """The (kind, piece, micro-batch) whose end action ``a`` of piece ``piece`` waits for: F of
    piece k waits for F of k-1, B of k for B of k+1 (the last piece: for its own F), W for its B."""
    if a.kind == "F":
        return ("F", piece - 1, a.microbatch) if piece > 0 else None
    if a.kind == "B":
        return ("B", piece + 1, a.microbatch) if piece < last_piece else ("F", piece, a.microbatch)
    return ("B", piece, a.microbatch)


def _play(schedule: Schedule, duration: Callable[[int, int, Action], float], message_s: float = 0.0,
          gap_s: float = 0.0) -> list[Timeline]:
    """Each rank runs its actions in order, action j of rank s lasting ``duration(s, j, action)``,
    each as soon as the action it needs has ended (plus ``message_s`` from another rank) and
    ``gap_s`` after the rank's previous action."""
    p = len(schedule)
    v = max(chunks_of(a) for a in schedule)
    last_piece = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, piece, microbatch) -> end time
    timelines: list[Timeline] = [[] for _ in range(p)]
    position, free = [0] * p, [0.0] * p
    while any(position[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                a = schedule[s][position[s]]
                k = a.chunk * p + s
                need = needs(a, k, last_piece)
                if need is not None and need not in done:
                    break
                arrives = done[need] + (message_s if need[1] % p != s else 0.0) if need else 0.0
                start = max(free[s] + (gap_s if position[s] else 0.0), arrives)
                free[s] = start + duration(s, position[s], a)
                done[(a.kind, k, a.microbatch)] = free[s]
                timelines[s].append((a, start, free[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: schedule[s][position[s]] for s in range(p)
                       if position[s] < len(schedule[s])}
            raise ValueError(
                f"the schedule deadlocks: each stage waits for another, next actions {waiting}")
    return timelines


def bubble_fraction(timelines: list[Timeline]) -> list[float]:
    """Idle share of the step, per rank: 1 - busy / T, where busy is the rank's time in compute
    (F, B and W) and T the step's span over all ranks, from the first action's start on any rank to
    the last action's end on any rank (ranks on one machine share one clock).

    Why it compares with (p-1)/(m+p-1): with equal stages the step lasts (m+p-1)(F+B) and every
    stage computes m(F+B), under GPipe and 1F1B alike (``simulate`` shows it). Measured, the idle
    share also holds what the formula leaves out: message latency, the loop's own overhead, and
    unequal stages (the last one adds the output layer and the loss). The mean over ranks is the
    share of all ranks' time lost.
    """
    start = min(t[0][1] for t in timelines if t)
    end = max(t[-1][2] for t in timelines if t)
    return [1.0 - sum(e - s for _, s, e in t) / (end - start) for t in timelines]
