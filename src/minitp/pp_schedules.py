"""Pipeline schedules as data: for each rank, the list of actions it runs, in order.

An action is ``Action(kind, microbatch, chunk)``: ``F`` (forward), ``B`` (backward) and, in the
zero-bubble schedule, ``W`` (the weight gradient, split off from ``B``). ``chunk`` is which of the
rank's model pieces it runs: with ``v`` virtual stages per rank (interleaved 1F1B) the model is cut
into p·v pieces and rank r holds pieces r, r + p, r + 2p, ... (chunk c is piece c·p + r); the V
schedules cut it into 2p pieces, rank r holding piece r (chunk 0) and piece 2p-1-r (chunk 1); every
other schedule has one chunk per rank (chunk 0). ``ScheduleEntry.placement`` says which.

Six schedules, six pure functions of (p, m[, v]):

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
* ``zbv_zero_bubble`` and ``dualpipe_v`` (PyTorch's ``ScheduleZBVZeroBubble`` and
  ``ScheduleDualPipeV``, action for action): two chunks per rank in a V, so a micro-batch goes
  down the ranks and back up, turning on the last rank without a message and ending on rank 0,
  where it began. The same (p-1) slots of bubble, each slot now half a stage: (p-1)/(6m+p-1)
  with equal F, B, W (ZB-V once m >= (3p-1)/2; DualPipeV needs m >= 2p).

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
    chunk: int = 0  # which of the rank's pieces (interleaved, V); 0 otherwise

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


Schedule = list[list[Action]]  # one list of actions per rank


class Placement(NamedTuple):
    """Which piece of the model each (rank, chunk) holds, and back. ``piece(p, rank, chunk)``;
    ``holder(p, piece)`` -> (rank, chunk)."""

    name: str
    piece: Callable[[int, int, int], int]
    holder: Callable[[int, int], tuple[int, int]]


# chunk c of rank r is piece c·p + r: every hop goes to the next rank, the last back to rank 0
INTERLEAVED = Placement("interleaved", lambda p, r, c: c * p + r, lambda p, k: (k % p, k // p))
# two chunks: down the ranks on chunk 0 (piece r), back up on chunk 1 (piece 2p-1-r)
V_SHAPE = Placement("v", lambda p, r, c: 2 * p - 1 - r if c else r,
                    lambda p, k: (k, 0) if k < p else (2 * p - 1 - k, 1))


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


# -- two chunks in a V: rank r holds piece r (chunk 0) and piece 2p-1-r (chunk 1) -----------------
class _RankActions:
    """One rank's actions as a V schedule writes them: each call runs the next micro-batch of
    its kind on a chunk. ``backward(c, split=False)`` is a whole backward, B then its W at once;
    with ``split=True`` the W waits in a queue for ``held_weight()``, which runs the oldest."""

    def __init__(self):
        self.actions: list[Action] = []
        self.done = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}  # how many have run
        self.waiting: list[Action] = []  # W's of split backwards, oldest first

    def run(self, kind: str, chunk: int) -> None:
        self.actions.append(Action(kind, self.done[kind, chunk], chunk))
        self.done[kind, chunk] += 1

    def backward(self, chunk: int, split: bool = False) -> None:
        self.actions.append(Action("B", self.done["B", chunk], chunk))
        weight = Action("W", self.done["B", chunk], chunk)
        self.done["B", chunk] += 1
        if split:
            self.waiting.append(weight)
        else:
            self.actions.append(weight)

    def held_weight(self) -> None:
        if self.waiting:
            self.actions.append(self.waiting.pop(0))


def zbv_zero_bubble(num_stages: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2023, §6; PyTorch's ``ScheduleZBVZeroBubble``): 2p pieces in a V, rank r
    holds piece r (chunk 0) and piece 2p-1-r (chunk 1), so the first and last pieces sit on rank 0
    and the turn at the bottom (pieces p-1, p on rank p-1) costs no message. Every backward is
    split into B and W. Rank r warms up with 2(p-r)-1 forwards of chunk 0, then r pairs of F on
    chunk 1 and chunk 0, then p-r of (F, B, W) on chunk 1; the steady state runs F, B, W on chunk 0
    then on chunk 1; the drain runs r pairs of B (W held back), p-r of (B, W) on chunk 0, then the
    held W's. The order is laid out for at least 2p-1 micro-batches; with fewer, the actions of
    the micro-batches that do not exist are left out (as PyTorch does)."""
    _check(num_stages, microbatches)
    p, m = num_stages, microbatches
    n = max(2 * p - 1, m)  # micro-batches the order is laid out for
    out = []
    for r in range(p):
        rank = _RankActions()
        for _ in range(2 * (p - r) - 1):  # down the first chunk: what the ranks below need
            rank.run("F", 0)
        for _ in range(r):  # micro-batches come back up: chunk 1 and chunk 0 in turn
            rank.run("F", 1)
            rank.run("F", 0)
        for _ in range(p - r):  # the first backwards, on chunk 1, each with its W
            rank.run("F", 1)
            rank.run("B", 1)
            rank.run("W", 1)
        while rank.done["F", 1] < rank.done["F", 0] or rank.done["F", 0] < n:  # steady state
            if rank.done["F", 0] < n:
                rank.run("F", 0)
            rank.run("B", 0)
            rank.run("W", 0)
            rank.run("F", 1)
            rank.run("B", 1)
            rank.run("W", 1)
        for _ in range(r):  # drain: the gradients the ranks above wait for first
            rank.run("B", 0)
            rank.run("B", 1)
        for _ in range(p - r):
            rank.run("B", 0)
            rank.run("W", 0)
        for c in (1, 0):  # the W's held back
            while rank.done["W", c] < n:
                rank.run("W", c)
        out.append([a for a in rank.actions if a.microbatch < m])
    return out


def dualpipe_v(num_stages: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3 §3.2.1, cut to a V; PyTorch's ``ScheduleDualPipeV``): the V
    placement of ZB-V, and a steady state of pairs: the forward of one chunk with the whole
    backward of the other, which DualPipe overlaps so that one's messages hide behind the other's
    compute. minitp runs a pair as its forward, then its backward's B and W (PyTorch's runtime runs
    the two sub-actions one after the other too, unless told otherwise); a whole backward is B then
    W at once, a split one (PyTorch's BACKWARD_INPUT) leaves its W for later. Rank r: 2(p-r-1)
    forwards of chunk 0; r+1 of (F chunk 0, F chunk 1); p-r-1 of (B chunk 1, a held W, F chunk 1);
    m-2p+r+1 of the pairs (F0 + B1, F1 + B0); p-r-1 of (B1, the pair F1 + B0); r+1 of (B1, B0),
    split from the middle on; p-r-1 of (a held W, B0); the held W's. Needs m >= 2p."""
    _check(num_stages, microbatches)
    p, m = num_stages, microbatches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as pieces (2·pp = "
                         f"{2 * p}), got microbatches={m}")
    out = []
    for r in range(p):
        rank = _RankActions()
        for _ in range(2 * (p - r - 1)):
            rank.run("F", 0)
        for _ in range(r + 1):
            rank.run("F", 0)
            rank.run("F", 1)
        for _ in range(p - r - 1):  # the first backwards, their W's run at once
            rank.backward(1, split=True)
            rank.held_weight()
            rank.run("F", 1)
        for _ in range(m - 2 * p + r + 1):  # steady state: two overlapped pairs
            rank.run("F", 0)
            rank.backward(1)
            rank.run("F", 1)
            rank.backward(0)
        for _ in range(p - r - 1):
            rank.backward(1)
            rank.run("F", 1)
            rank.backward(0)
        half = (r + 1) // 2
        for i in range(r + 1):  # from the middle on, the W's wait to fill the drain
            rank.backward(1, split=i > half or (i == half and r % 2 == 1))
            rank.backward(0, split=i >= half)
        for _ in range(p - r - 1):
            rank.held_weight()
            rank.backward(0, split=True)
        for _ in range(r + 1):
            rank.held_weight()
        out.append(rank.actions)
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
    placement: Placement = INTERLEAVED  # which piece each (rank, chunk) holds


def _zb_bubble(p: int, m: int, v: int) -> float:
    idle = p - 1 + max(p - m, 0)  # with m < p every stage also waits p - m more slots
    return idle / (3 * m + idle)


# the V schedules, F = B = W = one slot of one chunk: a rank computes 2 chunks × 3 slots × m
def _zbv_bubble(p: int, m: int, v: int) -> float:
    idle = p - 1 + max(3 * p - 1 - 2 * m, 0)  # below m = (3p-1)/2 the fill is not covered
    return idle / (6 * m + idle)


def _dualpipe_v_bubble(p: int, m: int, v: int) -> float:
    return (p - 1) / (6 * m + p - 1)  # m >= 2p always


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
    ScheduleEntry("zbv", zbv_zero_bubble, _zbv_bubble,
                  "(p-1)/(6m+p-1) with F=B=W, once m >= (3p-1)/2",
                  lambda p, m, s, v: min(2 * p, m + 1 + s, 2 * m), False, V_SHAPE),
    ScheduleEntry("dualpipev", dualpipe_v, _dualpipe_v_bubble, "(p-1)/(6m+p-1) with F=B=W",
                  lambda p, m, s, v: 2 * p + 1, False, V_SHAPE),
)}


# what ``minitp run pp``, ``minitp run 3d`` and ``minitp train`` take: their stages' blocks and byte
# model are the interleaved placement's (the V schedules run through ``minitp.pp.Pipeline``)
RUNNER_SCHEDULES = tuple(name for name, e in SCHEDULES.items() if e.placement is INTERLEAVED)


def schedule_entry(name: str) -> ScheduleEntry:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def make_schedule(name: str, num_stages: int, microbatches: int,
                  virtual_stages: int = 1) -> Schedule:
    """The table of schedule ``name``; ``virtual_stages`` (chunks per rank) only for
    "interleaved" ("zbv" and "dualpipev" always hold two, placed by ``SCHEDULES[name].placement``).
    """
    entry = schedule_entry(name)
    if entry.chunks:
        if not isinstance(virtual_stages, int) or virtual_stages < 2:
            raise ValueError("interleaved 1F1B needs virtual_stages >= 2 (chunks per rank), got "
                             f"{virtual_stages!r}")
        return entry.table(num_stages, microbatches, virtual_stages)
    if virtual_stages != 1:
        holds = ("two chunks per rank, in a V" if entry.placement is V_SHAPE
                 else "one chunk per rank (virtual_stages=1)")
        raise ValueError(
            f"virtual_stages={virtual_stages} is for the interleaved schedule; {name!r} runs "
            f"{holds}")
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
             weight_time: Times | None = None,
             placement: Placement = INTERLEAVED) -> list[Timeline]:
    """Play a schedule with fixed compute times and free messages: each rank runs its actions in
    order, each as soon as its input is there. Piece k = ``placement.piece(p, rank, chunk)``
    (c·p + r unless the schedule says otherwise): F of piece k waits for F of piece k-1; B of
    piece k for B of piece k+1 (the last piece: for its own F); W for its own B.

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
    return _play(schedule, lambda s, j, a: cost[s][a.kind], placement=placement)


def replay(timelines: list[Timeline], message_s: float = 0.0, gap_s: float = 0.0,
           placement: Placement = INTERLEAVED) -> list[Timeline]:
    """Play measured timelines again, each action as long as it took; by default with free messages
    and no time between actions: the step as it would have gone had only compute taken time.

    What it tells apart: the bubble of the replay holds the formula's bubble plus what unequal
    stages and uneven actions (one micro-batch's backward slower than the next) add; the measured
    bubble minus the replay's is the hand-over. ``message_s`` (each message from another rank
    arrives that long after its action ends) and ``gap_s`` (a rank's own time between two actions)
    put the hand-over's measured costs back in."""
    schedule = [[a for a, _, _ in t] for t in timelines]
    return _play(schedule, lambda s, j, a: timelines[s][j][2] - timelines[s][j][1], message_s,
                 gap_s, placement)


def needs(a: Action, piece: int, last_piece: int) -> tuple[str, int, int] | None:
    """The (kind, piece, micro-batch) whose end action ``a`` of piece ``piece`` waits for: F of
    piece k waits for F of k-1, B of k for B of k+1 (the last piece: for its own F), W for its B."""
    if a.kind == "F":
        return ("F", piece - 1, a.microbatch) if piece > 0 else None
    if a.kind == "B":
        return ("B", piece + 1, a.microbatch) if piece < last_piece else ("F", piece, a.microbatch)
    return ("B", piece, a.microbatch)


def feeds(a: Action, rank: int, p: int, v: int,
          placement: Placement = INTERLEAVED) -> tuple[int, int] | None:
    """The (rank, chunk) whose action waits for what action ``a`` of ``rank`` makes (the reverse
    of ``needs``): F of piece k feeds the F of k+1, B of k the B of k-1; W, the last piece's F and
    the first piece's B feed no other piece."""
    k = placement.piece(p, rank, a.chunk)
    to = k + 1 if a.kind == "F" else k - 1
    if a.kind == "W" or not 0 <= to < p * v:
        return None
    return placement.holder(p, to)


def _play(schedule: Schedule, duration: Callable[[int, int, Action], float], message_s: float = 0.0,
          gap_s: float = 0.0, placement: Placement = INTERLEAVED) -> list[Timeline]:
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
                k = placement.piece(p, s, a.chunk)
                need = needs(a, k, last_piece)
                if need is not None and need not in done:
                    break
                there = need is not None and placement.holder(p, need[1])[0] != s
                arrives = done[need] + (message_s if there else 0.0) if need else 0.0
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
