"""Checkers for chapter 11, overlap and schedules: the collective matmul, HSDP and the V.

* ``check_gather_matmul(fn)`` (2 and 3 processes): ``fn(x_shard, weight, group)`` returns
  ``F.linear(all_gather(x_shard along dim 1), weight)``, every position, as a ring of
  ``comm.isend`` / ``comm.irecv`` between neighbours; each received chunk must travel while a
  matmul runs (read from the trace's post and wait times beside the matmuls the answer ran), and
  each rank sends (n - 1)/n of the gathered input, as ``tp_overlap.all_gather_matmul`` does.
* ``check_hsdp_ranks(fn)``: ``fn(world, replicate)`` returns ``(shard_groups, replicate_groups)``,
  the global ranks of every group of an HSDP grid, shard groups of consecutive ranks; compared with
  ``minitp.hsdp.hsdp_group_ranks``.
* ``check_hsdp_reduce(fn)`` (4 and 2 processes): ``fn(grad, shard_group, replicate_group)`` returns
  this rank's shard of the mean of every rank's flat gradient: a reduce-scatter inside the shard
  group, then an all-reduce of the shard across the replicas; values against the mean, the bytes
  of each group against ``minitp.cost``.
* ``check_v_placement(fn)``: ``fn(p)`` returns, for each of the 2p pieces of the model, the rank
  that holds it in the V of ZB-V and DualPipeV; compared with ``minitp.pp_schedules.V_SHAPE``.
* ``check_exposed(fn)``: ``fn(chunk_s, message_s, n)`` returns ``(unfused, overlapped)``, the
  seconds an all-gather ring leaves exposed beside its matmul chunks; compared with
  ``minitp.cost.ring_exposed_s``.
* ``check_problem(n, answer)``: the worked problems, on LLaMA-3 at scale.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from minitp import comm, cost, trace
from minitp.exercises import (
    ExerciseError,
    call_answer,
    passed,
    problems,
    refuse_own,
    run_answer,
    wrong,
)
from minitp.exercises.problems import Problem
from minitp.models import LLAMA3_8B, LLAMA3_70B
from minitp.offload import MATMUL_OPS
from minitp.pp_schedules import V_SHAPE

GIB = 2**30
_ANSWER = "answer"  # the scope the learner's calls are traced under


# -- exercise 1: the all-gather ring with its matmul -----------------------------------------------
class _MatmulClock(TorchDispatchMode):
    """Notes the start and end (``time.perf_counter``, as the trace's messages) of every matrix
    multiply the answer runs."""

    def __init__(self):
        super().__init__()
        self.spans: list[tuple[float, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in MATMUL_OPS:  # what F.linear and @ run as: mm, addmm, bmm, baddbmm
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.spans.append((start, time.perf_counter()))
        return out


def _gather_worker(fn, batch: int, local: int, dim: int, out: int):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(batch, n * local, dim, generator=g)  # every rank draws the whole input
    weight = torch.randn(out, dim, generator=g)
    mine = x[:, rank * local:(rank + 1) * local].clone()  # (B, S/n, D): this rank's positions
    clock = _MatmulClock()
    with clock, trace.scope(_ANSWER):
        got = fn(mine, weight, None)
    got = got.detach().clone() if isinstance(got, torch.Tensor) else got
    return {"got": got, "want": F.linear(x, weight), "matmuls": clock.spans,
            "changed": not torch.equal(mine, x[:, rank * local:(rank + 1) * local])}


def _gather_values(name: str, n: int, results) -> None:
    for rank, r in enumerate(results):
        got, want = r["got"], r["want"]
        if not isinstance(got, torch.Tensor):
            raise wrong(name, f"on {n} ranks rank {rank} returned {type(got).__name__}; return the "
                        f"(B, S, out) tensor {tuple(want.shape)}: every position's output")
        if tuple(got.shape) != tuple(want.shape):
            raise wrong(name, f"on {n} ranks rank {rank} returned shape {tuple(got.shape)}; "
                        "every position's output is (B, S, out) with S = n · S/n: write chunk c's "
                        f"rows (positions c·S/n to (c+1)·S/n) of an output for all of them",
                        str(tuple(want.shape)))
        if torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            continue
        local = want.shape[1] // n
        bad = [c for c in range(n) if not torch.allclose(got[:, c * local:(c + 1) * local],
                                                         want[:, c * local:(c + 1) * local],
                                                         atol=1e-5, rtol=1e-5)]
        hint = ("only the rows of this rank's own chunk are wrong" if bad == [rank] else
                "at step k rank r holds chunk (r - k) mod n (its own first, then its left "
                "neighbour's, ...): write F.linear(held, weight) into that chunk's rows")
        raise wrong(name, f"on {n} ranks rank {rank}'s output is wrong in the rows of chunks "
                    f"{bad}: {hint}.")


def _gather_messages(name: str, n: int, results, chunk_bytes: int) -> None:
    for tr in results.traces:
        events = [e for e in tr.comm() if _ANSWER in e.scopes]
        others = sorted({e.op for e in events} - {"send", "recv"})
        if others:
            raise wrong(name, f"rank {tr.rank} called {', '.join(others)}: a collective blocks "
                        "until every byte has moved, so nothing can compute meanwhile; pass the "
                        "chunks round the ring with comm.isend / comm.irecv.")
        neighbours = {(tr.rank + 1) % n, (tr.rank - 1) % n}
        far = sorted({e.peer for e in events} - neighbours)
        if far:
            raise wrong(name, f"rank {tr.rank} exchanged messages with ranks {far}: in a ring each "
                        "rank sends only to one neighbour and receives only from the other, "
                        "passing on what it received.")
        sent = sum(e.sent_bytes for e in events)
        if sent != (n - 1) * chunk_bytes:
            more = "more" if sent > (n - 1) * chunk_bytes else "less"
            raise wrong(name, f"on {n} ranks rank {tr.rank} sent {sent:g} bytes, {more} than the "
                        f"ring's n - 1 = {n - 1} chunks of {chunk_bytes} bytes: each step passes "
                        "on the one chunk this rank holds.", f"{(n - 1) * chunk_bytes} bytes")


def _gather_hidden(name: str, n: int, results) -> None:
    for tr, r in zip(results.traces, results):
        matmuls = r["matmuls"]
        if not matmuls:
            raise wrong(name, f"rank {tr.rank} ran no matrix multiply: compute each chunk's rows "
                        "with F.linear (or @) as the chunk is held.")
        for e in (e for e in tr.comm() if _ANSWER in e.scopes and e.op == "recv"):
            if not any(e.start <= start and end <= e.end for start, end in matmuls):
                raise wrong(name, f"on {n} ranks rank {tr.rank}'s receive of a chunk from rank "
                            f"{e.peer} was waited for before any matmul ran beside it: nothing "
                            "hides it. Post the send and the receive, multiply the chunk you "
                            "hold, and only then wait.")


def check_gather_matmul(fn, nprocs: tuple[int, ...] = (2, 3), timeout: float = 30.0) -> None:
    """``fn(x_shard, weight, group)``: the all-gather of the positions and the matmul, as one ring
    hidden behind its matmul chunks; run on each world size in ``nprocs``."""
    from minitp import tp_overlap

    name = "gather matmul"
    refuse_own(name, fn, tp_overlap.all_gather_matmul)
    batch, local, dim, out = 2, 4, 8, 6
    for n in nprocs:
        results = run_answer(_gather_worker, n, (fn, batch, local, dim, out), name, timeout,
                             hang_hint=(
                                 "Each step, every rank posts comm.isend of the chunk it holds to "
                                 "(rank + 1) % n and comm.irecv of the next from (rank - 1) % n, "
                                 "for n - 1 steps: a rank that waits for a message its neighbour "
                                 "never sends waits forever."))
        if any(r["changed"] for r in results):
            raise wrong(name, "your function changed x_shard: leave this rank's input as it is "
                        "(send it, or a copy, and receive into new buffers).")
        _gather_values(name, n, results)
        _gather_messages(name, n, results, batch * local * dim * 4)
        _gather_hidden(name, n, results)
    passed(name, f"equal to F.linear of the gathered input on {' and '.join(map(str, nprocs))} "
                 "ranks; each rank sent n - 1 chunks to its neighbour, every chunk received while "
                 "a matmul ran")


# -- exercise 2: HSDP's groups ---------------------------------------------------------------------
def _as_lists(groups) -> list[list[int]] | None:
    try:
        return sorted(sorted(int(r) for r in g) for g in groups)
    except (TypeError, ValueError):
        return None


def check_hsdp_ranks(fn) -> None:
    """``fn(world, replicate)`` -> (shard_groups, replicate_groups), each a list of lists of
    global ranks."""
    from minitp import hsdp

    name = "HSDP groups"
    refuse_own(name, fn, hsdp.hsdp_group_ranks)
    for world, replicate in ((4, 2), (8, 2), (8, 4), (16, 2), (4, 1), (4, 4)):
        shard = world // replicate
        want = hsdp.hsdp_group_ranks(replicate, shard)
        got = call_answer(name, fn, world, replicate)
        where = f"world = {world}, replicate = {replicate} (shard = {shard})"
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise wrong(name, f"{where}: return a pair (shard_groups, replicate_groups), got "
                        f"{got!r}")
        shards, replicas = (_as_lists(g) for g in got)
        want_shards, want_replicas = sorted(want[hsdp.SHARD]), sorted(want[hsdp.REPLICATE])
        if shards == want_shards and replicas == want_replicas:
            continue
        if shards == want_replicas and replicas == want_shards:
            raise wrong(name, f"{where}: the two are swapped. A shard group is S = {shard} "
                        "consecutive ranks (one machine: its all-gathers and reduce-scatters run "
                        "every layer, on the fast links); a replicate group takes one rank at the "
                        "same place of each shard group.")
        if shards != want_shards:
            raise wrong(name, f"{where}: the shard groups are {shards}: there should be R = "
                        f"{replicate} of them, each S = {shard} consecutive ranks.",
                        str(want_shards))
        raise wrong(name, f"{where}: the replicate groups are {replicas}: there should be S = "
                    f"{shard} of them, each the R = {replicate} ranks at one place of the shard "
                    "groups (ranks s, s + S, s + 2S, ...).", str(want_replicas))
    passed(name, "6 grids, equal to minitp.hsdp.hsdp_group_ranks")


# -- exercise 3: HSDP's gradient reduction ---------------------------------------------------------
def _grad(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-8, 9, (numel,), generator=g).to(torch.float32)


def _reduce_worker(fn, replicate: int, shard: int, numel: int):
    import torch.distributed as dist

    from minitp import hsdp

    shard_group, replicate_group = hsdp.hsdp_groups(replicate, shard)
    rank, world = dist.get_rank(), dist.get_world_size()
    grad = _grad(rank, numel)
    with trace.scope(_ANSWER):
        got = fn(grad.clone(), shard_group, replicate_group)
    mean = torch.stack([_grad(r, numel) for r in range(world)]).mean(0)
    got = got.detach().clone() if isinstance(got, torch.Tensor) else got
    return {"got": got, "want": mean.chunk(shard)[comm.group_rank(shard_group)].clone(),
            "mean": mean}


def _reduce_values(name: str, where: str, results, replicate: int, shard: int) -> None:
    world = replicate * shard
    for rank, r in enumerate(results):
        got, want = r["got"], r["want"]
        if not isinstance(got, torch.Tensor) or got.dim() != 1:
            raise wrong(name, f"{where}: rank {rank} returned {getattr(got, 'shape', got)!r}; "
                        f"return this rank's flat shard, {want.numel()} numbers (1/S of the "
                        "gradient).")
        if got.numel() == r["mean"].numel() and shard > 1:
            raise wrong(name, f"{where}: rank {rank} returned the whole gradient; under HSDP a "
                        "rank keeps only its shard (1/S), the one its optimizer updates.")
        if got.shape != want.shape:
            raise wrong(name, f"{where}: rank {rank} returned {got.numel()} numbers; its shard "
                        f"is {want.numel()}.")
        if torch.allclose(got, want, atol=1e-6):
            continue
        for k in sorted({float(replicate), float(shard), float(world)} - {1.0}):
            if torch.allclose(got, want * k, atol=1e-5):
                why = ("not divided at all" if k == world else
                       f"divided by one group's size only (R = {replicate}, S = {shard})")
                raise wrong(name, f"{where}: rank {rank}'s shard is {k:g}× the mean: {why}. Every "
                            f"rank's gradient counts once in the mean over the R · S = {world} "
                            "ranks.")
        raise wrong(name, f"{where}: rank {rank}'s shard is not the mean of its S-th of every "
                    "rank's gradient: reduce-scatter inside the shard group (rank s of it keeps "
                    "chunk s), then all-reduce that chunk over the replicate group.")


def _reduce_bytes(name: str, where: str, results, replicate: int, shard: int, numel: int) -> None:
    from minitp import hsdp

    want = {hsdp.SHARD: cost.collective_sent_bytes("reduce_scatter", numel * 4, shard),
            hsdp.REPLICATE: cost.collective_sent_bytes("all_reduce", numel * 4 // shard,
                                                       replicate)}
    for tr in results.traces:
        events = [e for e in tr.comm() if _ANSWER in e.scopes]
        outside = sorted({e.dim or "the world" for e in events} - set(want))
        if outside:
            raise wrong(name, f"{where}: rank {tr.rank} sent over {', '.join(outside)}: use the "
                        "two groups you are given, shard_group then replicate_group.")
        got = {dim: sum(e.sent_bytes for e in events if e.dim == dim) for dim in want}
        if got[hsdp.REPLICATE] > want[hsdp.REPLICATE] and got[hsdp.SHARD] <= want[hsdp.SHARD]:
            raise wrong(name, f"{where}: the values are right, but rank {tr.rank} sent "
                        f"{got[hsdp.REPLICATE]:g} bytes across the replicas, "
                        f"{got[hsdp.REPLICATE] / want[hsdp.REPLICATE]:g}× the "
                        f"{want[hsdp.REPLICATE]:g} of an all-reduce of its shard. The replicate "
                        "group is the slow link between machines: reduce-scatter first, then "
                        "all-reduce only the 1/S that is left.")
        if got != want:
            raise wrong(name, f"{where}: rank {tr.rank} sent {got}, expected a reduce-scatter of "
                        "the gradient inside the shard group and an all-reduce of the shard "
                        "across the replicas.", str(want))


def check_hsdp_reduce(fn, timeout: float = 30.0) -> None:
    """``fn(grad, shard_group, replicate_group)`` -> this rank's shard of the mean gradient; run
    on a 2 × 2 grid (4 processes) and a 2 × 1 grid (2 processes)."""
    from minitp import hsdp

    name = "HSDP reduce"
    refuse_own(name, fn, hsdp.HybridShardedDataParallel._reduce_across_replicas)
    numel = 24
    for replicate, shard in ((2, 2), (2, 1)):
        where = f"R = {replicate} replicas × S = {shard}"
        results = run_answer(_reduce_worker, replicate * shard, (fn, replicate, shard, numel),
                             name, timeout)
        _reduce_values(name, where, results, replicate, shard)
        _reduce_bytes(name, where, results, replicate, shard, numel)
    passed(name, "the mean gradient's shard on 2 × 2 and 2 × 1 grids, a reduce-scatter in each "
                 "shard group and an all-reduce of 1/S across the replicas")


# -- exercise 4: the V -----------------------------------------------------------------------------
def check_v_placement(fn) -> None:
    """``fn(p)`` -> the rank holding each of the 2p pieces of the model, in model order."""
    name = "V placement"
    for p in (1, 2, 3, 4, 8):
        want = [V_SHAPE.holder(p, k)[0] for k in range(2 * p)]
        got = call_answer(name, fn, p)
        try:
            got = [int(r) for r in got]
        except (TypeError, ValueError):
            raise ExerciseError(f"{name}: return a list of 2p ranks, got {got!r}") from None
        if got == want:
            continue
        if len(got) != 2 * p:
            raise wrong(name, f"p = {p}: {len(got)} pieces; the model is cut in 2p = {2 * p}, "
                        "two per rank.")
        if got == [k % p for k in range(2 * p)]:
            raise wrong(name, f"p = {p}: {got} is interleaved 1F1B's placement: piece p goes from "
                        "the last rank back to rank 0, a message. In the V the second half runs "
                        "back up the ranks, so the turn (pieces p - 1 and p) stays on one rank.",
                        str(want))
        raise wrong(name, f"p = {p}: {got}. Down the ranks on the first half (piece k on rank k), "
                    "then back up on the second: piece 2p - 1 - r on rank r.", str(want))
    passed(name, "p = 1, 2, 3, 4, 8: the V of minitp.pp_schedules.V_SHAPE; the turn stays on the "
                 "last rank, the loss on rank 0")


# -- exercise 5: what stays exposed ----------------------------------------------------------------
def check_exposed(fn) -> None:
    """``fn(chunk_s, message_s, n)`` -> (unfused, overlapped) exposed seconds of an all-gather
    ring beside its n matmul chunks."""
    name = "exposed time"
    for chunk_s, message_s, n in ((2.0, 3.0, 4), (3.0, 2.0, 4), (1.0, 1.0, 2), (0.5, 4.0, 8),
                                  (5.0, 1.0, 1)):
        got = call_answer(name, fn, chunk_s, message_s, n)
        want = tuple(cost.ring_exposed_s(chunk_s, message_s, n, o) for o in (False, True))
        try:
            got = tuple(float(x) for x in got)
        except (TypeError, ValueError):
            raise ExerciseError(f"{name}: return a pair of seconds (unfused, overlapped), got "
                                f"{got!r}") from None
        if len(got) == 2 and all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(got, want)):
            continue
        where = f"chunk {chunk_s:g} s, message {message_s:g} s, n = {n}"
        unfused, overlapped = got if len(got) == 2 else (math.nan, math.nan)
        if math.isclose(unfused, n * message_s) and n > 1:
            raise wrong(name, f"{where}: unfused {unfused:g} s counts n messages; the ring has "
                        "n - 1 steps (the own chunk never travels).", str(want))
        if math.isclose(overlapped, max(0.0, (n - 1) * message_s - n * chunk_s)) \
                and not math.isclose(overlapped, want[1]):
            raise wrong(name, f"{where}: overlapped {overlapped:g} s lets a message hide behind "
                        "any chunk; each can hide only behind the chunk computed while it "
                        "travels, the next step needs it.", str(want))
        raise wrong(name, f"{where}: got {got}. Unfused, every step's message waits; overlapped, "
                    "each step's message is exposed only for what it takes beyond its chunk.",
                    str(want))
    passed(name, "5 cases, equal to minitp.cost.ring_exposed_s")


# -- worked problems -------------------------------------------------------------------------------
def _chunk_over_message() -> float:
    """LLaMA-3-70B, tp = 8 in an H100 machine, 8192 tokens of bf16: the w1 and w3 matmul chunk of
    one ring step over the time its 1/8 of the input takes on NVLink."""
    cfg, tp, seq, h100 = LLAMA3_70B, 8, 8192, cost.H100
    flops = 2 * (seq // tp) * cfg.dim * (2 * cfg.ffn_hidden // tp)
    chunk_s = flops / (h100.flops_per_s * h100.efficiency)
    message_s = cost.collective_time("send", seq // tp * cfg.dim * 2, 2, h100.intra)
    return chunk_s / message_s


def _replicate_gib() -> float:
    """LLaMA-3-8B under HSDP on 128 machines of 8 H100s, shard = 8: GiB each GPU sends across
    machines per step, its fp32 gradient shard all-reduced over 128 replicas."""
    return cost.collective_sent_bytes("all_reduce", LLAMA3_8B.num_params() / 8 * 4, 128) / GIB


def _dualpipev_idle() -> float:
    return cost.pp_bubble_fraction(8, 32, "dualpipev")


PROBLEMS = {
    1: Problem("problem 1, matmul chunk over message", _chunk_over_message, "",
               {0.6: "at the sheet's peak: the time model runs matmuls at efficiency 0.6",
                0.5: "half the FLOPs: a multiply-add is 2 FLOPs, and both w1 and w3 (F/tp "
                     "columns each) meet every chunk"}),
    2: Problem("problem 2, GiB across machines per step", _replicate_gib, "GiB",
               {8.0: "that is the whole gradient: the replicas all-reduce only the shard, 1/8",
                0.5: "an all-reduce sends 2(R-1)/R of its buffer: a reduce-scatter and an "
                     "all-gather"}),
    3: Problem("problem 3, DualPipeV's idle share", _dualpipev_idle, "",
               {(7 / 39) / (7 / 199): "that is 1F1B's (p-1)/(m+p-1)",
                (7 / 103) / (7 / 199): "one chunk per rank: each rank computes 2 chunks × 3 "
                                       "slots × m"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 11: ``answer()`` returns the estimate, in the unit asked."""
    problems.check_problem(PROBLEMS, number, answer)
