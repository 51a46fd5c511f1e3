"""Checkers for chapter 00, processes and collectives.

* ``check_ring_all_reduce(fn)``: ``fn(tensor)`` sums ``tensor`` over all ranks in place, using
  only ``minitp.comm`` sends and receives. Run on 4 and 3 ranks; compared with ``comm.all_reduce``
  and with the ring's bytes, 2(n-1)/n * B per rank.
* ``check_ring_all_gather(fn)``: ``fn(output, input)`` puts rank i's ``input`` in chunk i of
  ``output`` on every rank, from sends and receives. Compared with ``comm.all_gather`` and with
  (n-1)/n * B per rank.
* ``check_ring_bytes(fn)``: ``fn(op, nbytes, n)`` gives the bytes one rank sends for a ring
  all-reduce, all-gather or reduce-scatter; compared with ``minitp.cost``.
* ``check_tree_broadcast(fn)``: ``fn(tensor, src)`` copies rank ``src``'s tensor to every rank along
  a binomial tree of sends and receives (the ranks that have it double each round). Run on 4 ranks
  from rank 0 and on 6 from rank 2; compared with ``comm.broadcast``, and the trace with the tree:
  each rank receives once, and no path from ``src`` is longer than ⌈log2 n⌉ messages.
* ``check_problem(n, answer)``: worked problems 1-3, estimates from the hardware sheet
  (``minitp.cost.H100``) checked against ``minitp.cost`` within 5 % (``minitp.exercises.problems``).

The inputs are small random integers stored as floats, so every sum is exact whatever order the
additions run in, and a wrong value can be traced back to which ranks' data it holds.
"""

from __future__ import annotations

import itertools
import math

import torch

from minitp import comm, cost, trace
from minitp.exercises import ExerciseError, passed, problems, run_answer, wrong
from minitp.exercises.problems import Problem

_P2P = ("send", "recv")
_ANSWER = "answer"  # the scope the learner's calls are traced under


# -- running the answer --------------------------------------------------------------------------
def _inputs(rank: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(0, 1000, (numel,), generator=g).to(torch.float32)


def _answer_events(tr: trace.Trace) -> list[trace.Event]:
    return [e for e in tr.comm() if _ANSWER in e.scopes]


def _check_ops(results, name: str, building: str) -> None:
    for tr in results.traces:
        ops = sorted({e.op for e in _answer_events(tr)} - set(_P2P))
        if ops:
            raise wrong(name, f"rank {tr.rank} called {', '.join(ops)}; build {building} from "
                        "comm.send / comm.recv (or comm.isend / comm.irecv) only.")


def _check_bytes(results, name: str, expected: float, formula: str, per_step: str) -> None:
    sent = trace.sent_bytes_per_rank(results.traces, scope=_ANSWER)
    if all(s == 0 for s in sent):
        raise wrong(name, "the values are right but no message was traced. Send with "
                    "minitp.comm.send/recv (or isend/irecv), not torch.distributed directly, "
                    "so that every byte is recorded.")
    for rank, s in enumerate(sent):
        if s != expected:
            more = "more" if s > expected else "less"
            raise wrong(name, f"the values are right, but rank {rank} sent {s:g} bytes, {more} "
                              f"than the ring's {formula} (per rank: {[f'{x:g}' for x in sent]}). "
                              f"Each step should send {per_step}, not the whole "
                              "tensor.", f"{expected:g} bytes per rank")


# -- exercise 1: ring all-reduce -----------------------------------------------------------------
def _all_reduce_worker(fn, numel: int = 12, seed: int = 0):
    import torch.distributed as dist

    rank = dist.get_rank()
    x = _inputs(rank, numel, seed)
    expected = x.clone()
    with trace.scope("reference"):
        comm.all_reduce(expected)
    tensor = x.clone()
    with trace.scope(_ANSWER):
        returned = fn(tensor)
    if isinstance(returned, torch.Tensor):
        returned = returned.detach().clone()
    return {"input": x, "tensor": tensor, "returned": returned, "expected": expected}


def _explain_chunk(value: torch.Tensor, inputs: list[torch.Tensor], sl: slice) -> str:
    """Say which ranks' data a wrong chunk holds, if it is the sum over some of them."""
    n = len(inputs)
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            if torch.equal(value, sum(inputs[k][sl] for k in subset)):
                if size == n:
                    return "the full sum"
                return (f"the sum of ranks {list(subset)} only" if size > 1
                        else f"rank {subset[0]}'s data only")
    return "no sum of the ranks' matching chunks (values from another chunk were added?)"


def check_ring_all_reduce(fn, nprocs: tuple[int, ...] = (4, 3), timeout: float = 20.0) -> None:
    """Run ``fn(tensor)`` on each world size in ``nprocs``; it must sum in place like all_reduce."""
    name = "ring all-reduce"
    for n in nprocs:
        numel = 4 * n  # 4 elements per chunk
        results = run_answer(_all_reduce_worker, n, (fn, numel, n), name, timeout, hang_hint=(
                       "Each step, every rank must send to its right neighbour (rank + 1) % n and "
                       "receive from its left one (rank - 1) % n; a rank that waits for a message "
                       "its neighbour never sends waits forever. Post the send with comm.isend "
                       "before comm.recv."))
        inputs = [r["input"] for r in results]
        for rank, r in enumerate(results):
            got, want = r["tensor"], r["expected"]
            if torch.equal(got, want):
                continue
            if isinstance(r["returned"], torch.Tensor) and torch.equal(r["returned"], want):
                raise wrong(name, "your function returned the right sum, but `tensor` itself was "
                            "not changed. Like all_reduce, sum in place: write into the chunks of "
                            "`tensor` (views of it), e.g. chunk += incoming or "
                            "chunk.copy_(incoming).")
            if torch.equal(got, inputs[rank]):
                raise wrong(name, f"{name} on {n} ranks: rank {rank}'s tensor did not change at "
                            "all. Write the received chunks into `tensor` in place (its chunks are "
                            "views of it).")
            size = numel // n
            lines, wanted = [], []
            for c in range(n):
                sl = slice(c * size, (c + 1) * size)
                if not torch.equal(got[sl], want[sl]):
                    lines.append(f"  chunk {c}: got {got[sl].tolist()} = "
                                 f"{_explain_chunk(got[sl], inputs, sl)}")
                    wanted.append(f"chunk {c} = {want[sl].tolist()}")
            raise wrong(
                name, f"{name} on {n} ranks: rank {rank} ends with a wrong tensor.\n"
                + "\n".join(lines) + "\nHints: in the reduce-scatter steps a rank must ADD the "
                "incoming chunk to its own (copy only in the all-gather steps); at step s rank r "
                "sends chunk (r - s) % n and receives chunk (r - s - 1) % n; after n - 1 steps "
                "rank r holds chunk (r + 1) % n complete, which is the first chunk it sends in the "
                "all-gather.", f"on rank {rank}, " + ", ".join(wanted))
        _check_ops(results, name, "the all-reduce")
        expected = cost.collective_sent_bytes("all_reduce", numel * 4, n)
        _check_bytes(results, name, expected, f"2(n-1)/n * B with n={n}, B={numel * 4}",
                     "one chunk of B/n bytes")
    passed(name, f"matches all_reduce on {' and '.join(map(str, nprocs))} ranks, "
                 "each rank sent 2(n-1)/n * B bytes")


# -- exercise 2: ring all-gather -----------------------------------------------------------------
_UNWRITTEN = -1.0  # inputs are >= 0, so this marks output the answer never wrote


def _all_gather_worker(fn, per_rank: int = 3, seed: int = 0):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    x = _inputs(rank, per_rank, seed)
    expected = torch.empty(n * per_rank)
    with trace.scope("reference"):
        comm.all_gather(expected, x)
    output = torch.full((n * per_rank,), _UNWRITTEN)
    given = x.clone()
    with trace.scope(_ANSWER):
        fn(output, given)
    return {"input": x, "output": output, "expected": expected, "input_after": given}


def check_ring_all_gather(fn, nprocs: tuple[int, ...] = (4, 3), timeout: float = 20.0) -> None:
    """Run ``fn(output, input)`` on each world size in ``nprocs``; it must behave like
    all_gather."""
    name = "ring all-gather"
    per_rank = 3
    for n in nprocs:
        results = run_answer(_all_gather_worker, n, (fn, per_rank, n), name, timeout, hang_hint=(
                       "Every rank must send to (rank + 1) % n and receive from (rank - 1) % n; "
                       "post the send with comm.isend before comm.recv so that no rank waits on a "
                       "neighbour that is itself waiting."))
        inputs = [r["input"] for r in results]
        for rank, r in enumerate(results):
            got, want = r["output"], r["expected"]
            if not torch.equal(r["input_after"], r["input"]):
                raise wrong(name, f"rank {rank} changed its `input`; only write into `output`.")
            if torch.equal(got, want):
                continue
            lines = []
            for c in range(n):
                chunk = got[c * per_rank:(c + 1) * per_rank]
                if torch.equal(chunk, inputs[c]):
                    continue
                if torch.all(chunk == _UNWRITTEN):
                    what = "nothing (never written)"
                else:
                    owners = [k for k in range(n) if torch.equal(chunk, inputs[k])]
                    what = (f"rank {owners[0]}'s input" if owners
                            else f"{chunk.tolist()}, no rank's input")
                lines.append(f"  chunk {c}: expected rank {c}'s input, got {what}")
            raise wrong(
                name, f"{name} on {n} ranks: rank {rank}'s output is wrong.\n" + "\n".join(lines)
                + "\nHints: first copy your own input into chunk `rank` of output; then at step s "
                "send chunk (rank - s) % n to the right and receive chunk (rank - s - 1) % n from "
                "the left, straight into that chunk of "
                "output.", f"on rank {rank}, output = {want.tolist()}")
        _check_ops(results, name, "the all-gather")
        expected = cost.collective_sent_bytes("all_gather", n * per_rank * 4, n)
        _check_bytes(results, name, expected, f"(n-1)/n * B with n={n}, B={n * per_rank * 4}",
                     "one chunk (one rank's input)")
    passed(name, f"matches all_gather on {' and '.join(map(str, nprocs))} ranks, "
                 "each rank sent (n-1)/n * B bytes")


# -- exercise 3: bytes per rank by hand ----------------------------------------------------------
_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def check_ring_bytes(fn) -> None:
    """``fn(op, nbytes, n)`` must give the bytes one rank sends, as ``minitp.cost`` counts them."""
    name = "ring bytes"
    for op, nbytes, n in itertools.product(_OPS, (2**20, 12_000), (4, 8, 2, 64)):
        try:
            got = fn(op, nbytes, n)
        except NotImplementedError:
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError).") from None
        want = cost.collective_sent_bytes(op, nbytes, n)
        if got is None:
            raise ExerciseError(
                f"{name}: fn({op!r}, {nbytes}, {n}) returned None; return a number of bytes.")
        if math.isclose(float(got), want, rel_tol=1e-9):
            continue
        hint = _bytes_hint(op, float(got), nbytes, n)
        raise wrong(name, f"for {op} of B = {nbytes} bytes over n = {n} ranks you gave {got:g} "
                          f"bytes per rank. {hint}", f"{want:g} bytes per rank")
    passed(name, "all-reduce 2(n-1)/n * B, all-gather and reduce-scatter (n-1)/n * B")


def _bytes_hint(op: str, got: float, B: int, n: int) -> str:
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1

    def near(x):
        return math.isclose(got, x, rel_tol=1e-9)

    if op == "all_reduce" and near((n - 1) / n * B):
        return ("That is one phase only: a ring all-reduce is a reduce-scatter followed by an "
                "all-gather.")
    if op != "all_reduce" and near(2 * (n - 1) / n * B):
        return f"That is an all-reduce; {op} is just one of its two phases."
    if near(steps * B):
        return "Each step sends one chunk of B/n bytes, not the whole buffer: divide by n."
    if near(steps * B / (n - 1)):
        return ("Count the steps again: n ranks need n - 1 steps per phase (a rank never sends to "
                "itself).")
    return (f"Count the steps ({steps} for {op} on {n} ranks) and the bytes of each step (one "
            "chunk, B/n).")


# -- exercise 4: a tree broadcast ----------------------------------------------------------------
def _broadcast_worker(fn, src: int, numel: int = 5):
    import torch.distributed as dist

    rank = dist.get_rank()
    data = _inputs(src, numel, seed=3)
    expected = data.clone() if rank == src else torch.zeros(numel)
    with trace.scope("reference"):
        comm.broadcast(expected, src=src)
    tensor = data.clone() if rank == src else torch.zeros(numel)
    with trace.scope(_ANSWER):
        fn(tensor, src)
    return {"tensor": tensor, "expected": expected}


def _tree_depth(received_from: dict[int, int], src: int, n: int) -> int:
    """The most messages in a row from ``src`` to any rank, following who each rank received
    from."""
    deepest = 0
    for rank in range(n):
        hops, at = 0, rank
        while at != src and hops <= n:
            at, hops = received_from.get(at, src), hops + 1
        deepest = max(deepest, hops)
    return deepest


def check_tree_broadcast(fn, runs: tuple[tuple[int, int], ...] = ((4, 0), (6, 2)),
                         timeout: float = 20.0) -> None:
    """Run ``fn(tensor, src)`` for each (world size, src); every rank must end with src's tensor,
    sent along a tree at most ⌈log2 n⌉ messages deep."""
    name = "tree broadcast"
    for n, src in runs:
        results = run_answer(_broadcast_worker, n, (fn, src), name, timeout, hang_hint=(
            "Every recv needs a matching send: in round k (step = 2**k) the ranks at distance d < "
            "step from src send to the rank at distance d + step, and the ranks at distance step "
            "<= d < 2·step receive from the rank at distance d - step (distance d = (rank - src) % "
            "n)."))
        where = f"on {n} ranks from src = {src}"
        for rank, r in enumerate(results):
            if not torch.equal(r["tensor"], r["expected"]):
                what = "zeros: it received nothing, or a copy sent before the sender had it" \
                    if not r["tensor"].any() else f"{r['tensor'].tolist()}"
                raise wrong(name, f"{name} {where}: rank {rank} ends with {what}, not src's "
                            "tensor. A rank may send only after it has received (or is src); "
                            "receive into `tensor` itself.",
                            f"src's tensor {r['expected'].tolist()} on every rank")
        _check_ops(results, name, "the broadcast")
        received_from = {}
        for tr in results.traces:
            recvs = [e for e in _answer_events(tr) if e.op == "recv"]
            if tr.rank != src and len(recvs) != 1:
                raise wrong(name, f"{name} {where}: the values are right, but rank {tr.rank} "
                            f"received {len(recvs)} messages; in a tree every rank but src "
                            "receives exactly once.")
            if recvs:
                received_from[tr.rank] = recvs[0].peer
        deepest = _tree_depth(received_from, src, n)
        rounds = math.ceil(math.log2(n))
        sends = [sum(e.op == "send" for e in _answer_events(tr)) for tr in results.traces]
        if deepest > rounds:
            shape = ("a chain: each rank passes it on to the next" if deepest == n - 1
                     else "a deep tree")
            raise wrong(name, f"{name} {where}: the values are right, but the data took {deepest} "
                        f"messages in a row to reach its farthest rank ({shape}); a binomial tree "
                        f"needs only ⌈log2 n⌉ = {rounds}: in each round every rank that has the "
                        "data sends it on, so the number that have it doubles.")
        busiest = max(range(n), key=lambda k: sends[k])
        if sends[busiest] > rounds:
            raise wrong(name, f"{name} {where}: the values are right, but rank {busiest} sent "
                        f"{sends[busiest]} messages, one after another, while the ranks that "
                        "already had the data sent none; a binomial tree takes ⌈log2 n⌉ = "
                        f"{rounds} rounds: each round, every rank that has the data sends it on, "
                        "so the number that have it doubles.")
    passed(name, f"matches broadcast on {' and '.join(str(n) for n, _ in runs)} ranks; every rank "
                 "received once, at most ⌈log2 n⌉ messages from src")


# -- worked problems: estimates from the hardware sheet (minitp.exercises.problems) ----------------
def _latency_equals_bandwidth_mb() -> float:
    """B at which an all-reduce's α term, 2(n-1)α, equals its bandwidth term, 2(n-1)/n · B/β: B =
    n·α·β."""
    link = cost.H100.intra
    return 8 * link.alpha_s * link.bytes_per_s / 1e6


def _reduce_scatter_8b_s() -> float:
    """A ring reduce-scatter of LLaMA-3-8B's bf16 gradients over 64 GPUs on InfiniBand."""
    from minitp.models import LLAMA3_8B

    return cost.collective_time("reduce_scatter", 2 * LLAMA3_8B.num_params(), 64, cost.H100.inter)


def _ring_latency_1024_ms() -> float:
    """The α term alone of a ring all-reduce over 1024 GPUs on InfiniBand: 2(n-1) steps of α."""
    return 2 * (1024 - 1) * cost.H100.inter.alpha_s * 1e3


PROBLEMS = {
    1: Problem("problem 1, latency against bandwidth", _latency_equals_bandwidth_mb, "MB",
               {1 / 8: "the bandwidth term of one step carries one chunk, B/n, not B"}),
    2: Problem("problem 2, a reduce-scatter over InfiniBand", _reduce_scatter_8b_s, "s",
               {2.0: "that is the all-reduce: a reduce-scatter is one of its two phases"}),
    3: Problem("problem 3, the latency of a long ring", _ring_latency_1024_ms, "ms",
               {0.5: "an all-reduce is two rings, reduce-scatter then all-gather"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 00: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
