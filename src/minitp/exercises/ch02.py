"""Checkers for chapter 02, fully sharded data parallel.

* ``check_shard_unshard(shard, unshard)``: ``shard(flat, rank, world_size)`` pads a flat parameter
  with zeros to a multiple of the world size and returns this rank's slice; ``unshard(shard,
  numel)`` all-gathers every rank's slice with ``minitp.comm`` and returns the flat parameter
  without its padding. Run on 4 and 3 ranks with sizes that do and do not divide; compared with the
  layout of ``minitp.fsdp`` and with the all-gather's bytes, (n-1)/n * B per rank.
* ``check_reduce_gradient(fn)``: ``fn(full_grad)`` turns this rank's local gradient of a whole unit
  (P,) into the averaged gradient of its own shard (P/n,) with one reduce-scatter. Compared with the
  mean over ranks and with the reduce-scatter's bytes.
* ``check_memory_per_rank(fn)``: ``fn(num_params, world_size, zero)`` gives the bytes one rank holds
  in fp32 parameters, gradients and AdamW moments at ZeRO stage ``zero`` (0: DDP); compared with
  ``minitp.cost.memory_per_rank``.
* ``check_fsdp_unit(cls)``: ``cls(module, group)`` is one ZeRO-3 unit that keeps only this rank's
  slice of the module's padded flat parameters, all-gathers them to run forward, frees them after,
  gathers them again in backward and reduce-scatters the gradient (averaged). Two units are trained
  for two SGD steps on 4 ranks (one unit padded); checked against one process, ``minitp.fsdp``'s
  shards and gradients, the bytes of ``minitp.cost.fsdp_step_bytes`` and the gathered bytes held at
  the peak.

The inputs are small integers stored as floats, so sums are exact whatever the order, and a wrong
value can be traced back to where it came from (another rank's slice, the padding, a missing /n).
* ``check_problem(n, answer)``: worked problems 1-3, estimates from the hardware sheet
  (``minitp.cost.H100``) checked against ``minitp.cost`` (``minitp.exercises.problems``).
"""

from __future__ import annotations

import math

import torch

from minitp import cost, trace
from minitp.exercises import ExerciseError, passed, problems, run_answer, wrong
from minitp.exercises.ch02_unit import check_fsdp_unit
from minitp.exercises.problems import Problem

_ANSWER = "answer"  # the scope the learner's calls are traced under
_SIZES = (10, 12, 7)  # 10 and 7 need padding on 4 and on 3 ranks; 12 divides both


def _ops(tr: trace.Trace) -> list[trace.Event]:
    return [e for e in tr.comm() if _ANSWER in e.scopes]


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([flat, flat.new_zeros(cost.padded_numel(flat.numel(), n) - flat.numel())])


# -- exercise 1: shard and unshard a flat parameter ------------------------------------------------
def _shard_worker(shard_fn, unshard_fn, sizes):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for numel in sizes:
        flat = torch.arange(1, numel + 1, dtype=torch.float32)  # no zero: padding stands out
        given = flat.clone()
        got = shard_fn(given, rank, n)
        got = got.detach().clone() if isinstance(got, torch.Tensor) else got
        s = cost.padded_numel(numel, n) // n
        # the right shard, so unshard is checked alone
        mine = _padded(flat, n)[rank * s:(rank + 1) * s]
        with trace.scope(_ANSWER):
            full = unshard_fn(mine.clone(), numel)
        full = full.detach().clone() if isinstance(full, torch.Tensor) else full
        out.append({"numel": numel, "flat": flat, "changed": not torch.equal(given, flat),
                    "shard": got, "full": full})
    return out


def _explain_shard(got, flat: torch.Tensor, rank: int, n: int) -> str | tuple[str, str]:
    """What is wrong with rank ``rank``'s shard ("" when nothing), or (the mistake, the expected
    values)."""
    numel = flat.numel()
    padded = cost.padded_numel(numel, n)
    s = padded // n
    want = _padded(flat, n)[rank * s:(rank + 1) * s]
    where = f"flat parameter of {numel} elements on {n} ranks, rank {rank}"
    if not isinstance(got, torch.Tensor):
        return f"{where}: shard returned {type(got).__name__}, expected a tensor of {s} elements."
    got = got.reshape(-1)
    if got.numel() != s:
        if got.numel() == numel // n:
            hint = "You rounded down: with padding every shard has ceil(numel / n) elements."
        elif got.numel() == (numel + n) // n and numel % n == 0:
            hint = ("You padded a size that already divides by n: pad with (-numel) % n zeros, "
                    "none when n divides numel.")
        elif got.numel() == numel:
            hint = "That is the whole parameter: keep only this rank's 1/n of it."
        else:
            hint = f"Pad to P = ceil(numel / n) * n = {padded} elements, then every shard is P / n."
        return (f"{where}: your shard has {got.numel()} elements, expected P / n = {padded} / {n} "
                f"= {s}. {hint}")
    if torch.equal(got, want):
        return ""
    padded_flat = _padded(flat, n)
    for k in range(n):
        if k != rank and torch.equal(got, padded_flat[k * s:(k + 1) * s]):
            return (f"{where}: you returned rank {k}'s slice (elements "
                    f"{k * s}..{(k + 1) * s - 1}); rank {rank}'s shard is elements "
                    f"{rank * s}..{(rank + 1) * s - 1}, i.e. [rank * P/n, (rank + 1) * P/n).")
    strided = padded_flat[rank::n]
    if torch.equal(got, strided):
        return (f"{where}: you took every n-th element (flat[rank::n]); each rank keeps one "
                "contiguous slice, so that whole parameters stay mostly on one rank and the "
                "all-gather output is the flat buffer.")
    real = (got != 0) | (want != 0)
    if torch.equal(got[real & (want != 0)],
                   want[want != 0]) and not torch.equal(got[want == 0], want[want == 0]):
        return (f"{where}: the real elements are right but the padding is "
                f"{got[want == 0].tolist()}, expected zeros. Pad with zeros (torch.zeros, not "
                "torch.empty): the padding must never change a result.")
    return (f"{where}: your shard is {got.tolist()}, not this rank's slice. Pad the flat parameter "
            f"with zeros to P = {padded} elements; rank r keeps elements [r * P/n, (r + 1) * "
            "P/n).", str(want.tolist()))


def _explain_full(got, flat: torch.Tensor, n: int) -> str | tuple[str, str]:
    """What is wrong with an unshard's result ("" when nothing), or (the mistake, the expected
    values)."""
    numel = flat.numel()
    padded = cost.padded_numel(numel, n)
    where = f"unshard of a flat parameter of {numel} elements on {n} ranks"
    if not isinstance(got, torch.Tensor):
        return f"{where}: returned {type(got).__name__}, expected a tensor of {numel} elements."
    got = got.reshape(-1)
    if got.numel() == padded and padded != numel and torch.equal(got[:numel], flat):
        return (f"{where}: the padding leaked into the result: you returned all {padded} gathered "
                f"elements; drop the last {padded - numel} (return gathered[:numel]).")
    if got.numel() != numel:
        return (f"{where}: got {got.numel()} elements, expected {numel} (the parameter without its "
                "padding).")
    if torch.equal(got, flat):
        return ""
    s = padded // n
    own = [r for r in range(n) if torch.equal(got[:min(s, numel)],
                                              _padded(flat, n)[r * s:r * s + min(s, numel)])]
    hint = (" It starts with rank " + str(own[0])
            + "'s shard: chunk i of the gathered buffer must be rank i's "
            "shard.") if own and own[0] != 0 else ""
    hint = hint or " Gather every rank's shard in rank order, then drop the padding."
    return (f"{where}: you returned {got.tolist()}, not the parameter the shards came from.{hint}",
            str(flat.tolist()))


def check_shard_unshard(shard_fn, unshard_fn, nprocs: tuple[int, ...] = (4, 3),
                        timeout: float = 20.0) -> None:
    """Run ``shard_fn`` and ``unshard_fn`` on each world size in ``nprocs`` with sizes that need
    padding."""
    name = "shard and unshard"
    for n in nprocs:
        results = run_answer(_shard_worker, n, (shard_fn, unshard_fn, _SIZES), name, timeout,
                             hang_hint="Every rank must call the all-gather, with an input of the "
                                       "same size (P / n) and an output of P elements.")
        for rank, per_size in enumerate(results):
            for r in per_size:
                if r["changed"]:
                    raise ExerciseError(
                        f"{name}: shard changed the flat parameter it was given (rank {rank}); "
                        "build a padded copy instead of writing into `flat`.")
                for problem in (_explain_shard(r["shard"], r["flat"], rank, n),
                                _explain_full(r["full"], r["flat"], n)):
                    if isinstance(problem, tuple):
                        raise wrong(name, *problem)
                    if problem:
                        raise ExerciseError(f"{name}: {problem}")
        tr = results.traces[0]
        ops = sorted({e.op for e in _ops(tr)})
        if not ops:
            raise ExerciseError(
                f"{name}: unshard gave the right values but no message was traced: gather with "
                "minitp.comm.all_gather (not torch.distributed directly) so the bytes are "
                "recorded.")
        if ops != ["all_gather"]:
            raise ExerciseError(
                f"{name}: unshard called {', '.join(ops)}; one comm.all_gather per parameter is "
                "all it takes (every rank brings its shard, every rank gets all of them).")
        want = sum(cost.collective_sent_bytes("all_gather", cost.padded_numel(m, n) * 4, n)
                   for m in _SIZES)
        got = tr.sent_bytes(scope=_ANSWER)
        if got != want:
            raise wrong(name, f"the values are right, but rank 0 sent {got:g} bytes for the three "
                              f"unshards, not (n-1)/n * P * 4 bytes each (n = {n}): gather once "
                              "per parameter, P elements out, P / n in.", f"{want:g} bytes")
    passed(name, f"padded layout of minitp.fsdp on {' and '.join(map(str, nprocs))} ranks, "
                 "one all-gather of (n-1)/n * B per unshard")


# -- exercise 2: the gradient's reduce-scatter -----------------------------------------------------
def _grad_worker(fn, per_rank: int, seed: int):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    local = torch.randint(-50, 50, (n * per_rank,), generator=g).to(torch.float32)  # (P,)
    with trace.scope(_ANSWER):
        got = fn(local.clone())
    got = got.detach().clone() if isinstance(got, torch.Tensor) else got
    return {"local": local, "got": got}


def check_reduce_gradient(fn, nprocs: tuple[int, ...] = (4, 3), timeout: float = 20.0) -> None:
    """Run ``fn(full_grad)`` on each world size; it must return this rank's shard of the mean
    gradient."""
    name = "gradient reduce-scatter"
    per_rank = 3
    for n in nprocs:
        results = run_answer(_grad_worker, n, (fn, per_rank, n), name, timeout,
                             hang_hint="Every rank must call comm.reduce_scatter once, with the "
                                       "(P,) gradient as input and a (P/n,) output.")
        locals_ = [r["local"] for r in results]
        mean = sum(locals_) / n  # (P,)
        for rank, r in enumerate(results):
            got = r["got"]
            want = mean[rank * per_rank:(rank + 1) * per_rank]
            where = f"on {n} ranks, rank {rank}"
            if not isinstance(got, torch.Tensor):
                raise ExerciseError(
                    f"{name} {where}: returned {type(got).__name__}; return the (P/n,) shard.")
            got = got.reshape(-1).float()
            if got.numel() == mean.numel():
                if torch.allclose(got, mean):
                    raise ExerciseError(
                        f"{name} {where}: you returned the whole averaged gradient ({got.numel()} "
                        f"elements); a rank keeps only its own shard, {per_rank} elements.")
                raise ExerciseError(
                    f"{name} {where}: you returned {got.numel()} elements, expected the shard of "
                    f"{per_rank} (P / n).")
            if got.numel() != per_rank:
                raise ExerciseError(f"{name} {where}: you returned {got.numel()} elements, "
                                    f"expected P / n = {per_rank}.")
            if torch.allclose(got, want, rtol=1e-6, atol=1e-6):
                continue
            if torch.allclose(got, want * n, rtol=1e-6, atol=1e-6):
                raise ExerciseError(
                    f"{name} {where}: your shard is the SUM over ranks, {n} times the expected "
                    "mean. Divide by the world size: each rank's loss is the mean over its part "
                    "of the batch, so the gradient of the whole batch is the mean of the ranks'.")
            others = [k for k in range(n) if k != rank
                      and torch.allclose(got, mean[k * per_rank:(k + 1) * per_rank], rtol=1e-6,
                                         atol=1e-6)]
            if others:
                raise ExerciseError(
                    f"{name} {where}: you kept the averaged gradient of rank {others[0]}'s shard; "
                    f"rank {rank} owns elements [rank * P/n, (rank + 1) * P/n).")
            mine = locals_[rank][rank * per_rank:(rank + 1) * per_rank]
            if torch.allclose(got, mine, rtol=1e-6,
                              atol=1e-6) or torch.allclose(got, mine / n, rtol=1e-6, atol=1e-6):
                raise ExerciseError(
                    f"{name} {where}: that is this rank's own local gradient, not summed over the "
                    "ranks: the reduce-scatter adds every rank's chunk `rank` into this rank's "
                    "output.")
            raise wrong(name, f"{name} {where}: you returned {got.tolist()}, not this rank's shard "
                              "of the mean gradient: reduce-scatter the (P,) gradient with the "
                              "sum, then divide by n.",
                        str(want.tolist()))
        ops = sorted({e.op for e in _ops(results.traces[0])})
        if not ops:
            raise ExerciseError(f"{name}: the values are right but no message was traced: use "
                                "minitp.comm.reduce_scatter (not torch.distributed directly).")
        if "all_reduce" in ops:
            raise ExerciseError(f"{name}: the values are right, but you used an all-reduce, which "
                                "sends 2(n-1)/n * B per rank, twice a reduce-scatter's (n-1)/n * "
                                "B, and leaves every rank the whole gradient it does not need. Use "
                                "comm.reduce_scatter: each rank gets only its shard.")
        if ops != ["reduce_scatter"]:
            raise ExerciseError(
                f"{name}: you called {', '.join(ops)}; one comm.reduce_scatter is all it takes.")
        want_bytes = cost.collective_sent_bytes("reduce_scatter", n * per_rank * 4, n)
        sent = trace.sent_bytes_per_rank(results.traces, scope=_ANSWER)
        if any(s != want_bytes for s in sent):
            raise wrong(name, "the values are right, but the ranks sent "
                              f"{[f'{s:g}' for s in sent]} bytes, not (n-1)/n * B each: one "
                              "reduce-scatter of the fp32 gradient.",
                        f"{want_bytes:g} bytes each")
    passed(name, f"the mean gradient's shard on {' and '.join(map(str, nprocs))} ranks, "
                 "one reduce-scatter of (n-1)/n * B per rank")


# -- exercise 3: memory per rank by hand -----------------------------------------------------------
def _fp32(psi: float, n: int, zero: int) -> float:
    return cost.total_memory(cost.memory_per_rank(psi, n, zero=zero, precision="fp32"))


def _memory_hint(got: float, psi: float, n: int, zero: int) -> str:
    def near(x):
        return math.isclose(got, x, rel_tol=1e-9)

    stage = lambda z: "DDP" if z == 0 else f"ZeRO-{z}"  # noqa: E731
    if near(16 * psi / n):
        return (f"Only ZeRO-3 divides all 16 bytes per parameter by n; {stage(zero)} keeps some "
                "parts whole.")
    for other in range(4):
        if other != zero and near(_fp32(psi, n, other)):
            sharded = {0: "nothing", 1: "only the optimizer state",
                       2: "the optimizer state and the gradients",
                       3: "the optimizer state, the gradients and the parameters"}
            return (f"That is {stage(other)}'s number. {stage(zero)} shards {sharded[zero]}; "
                    "whatever it does not shard is held whole on every rank.")
    if near(16 * psi):
        return (
            "That is every byte held whole: which of the three parts does this stage divide by n?")
    params = 4 * psi / (n if zero >= 3 else 1)
    grads = 4 * psi / (n if zero >= 2 else 1)
    if near(params + grads + 12 * psi / (n if zero >= 1 else 1)):
        return ("The optimizer state is 8 bytes per parameter in fp32 (two moments); 12 is mixed "
                "precision's, which adds a 4-byte fp32 master copy.")
    if near(params + grads + 4 * psi / (n if zero >= 1 else 1)):
        return "AdamW keeps two moments per parameter (exp_avg and exp_avg_sq): 8 bytes, not 4."
    if near(params + grads):
        return "You left out the optimizer state: AdamW's two fp32 moments, 8 bytes per parameter."
    return ("Add three parts: parameters 4Ψ, gradients 4Ψ, AdamW moments 8Ψ; ZeRO-1 divides the "
            "moments by n, ZeRO-2 the gradients too, ZeRO-3 the parameters too.")


def check_memory_per_rank(fn) -> None:
    """``fn(num_params, world_size, zero)`` must give the fp32 bytes per rank that ``minitp.cost``
    gives."""
    name = "memory per rank"
    for psi in (164_416, 8_030_261_248):  # the tiny model's Ψ and LLaMA-3-8B's
        for n in (4, 8, 1, 64):
            for zero in (0, 1, 2, 3):
                try:
                    got = fn(psi, n, zero)
                except NotImplementedError:
                    raise ExerciseError(
                        f"{name}: not done yet (the function still raises NotImplementedError).") \
                        from None
                if got is None:
                    raise ExerciseError(
                        f"{name}: fn({psi}, {n}, {zero}) returned None; return a number of bytes.")
                want = _fp32(psi, n, zero)
                if math.isclose(float(got), want, rel_tol=1e-9):
                    continue
                raise wrong(name,
                            f"for Ψ = {psi:,} parameters on n = {n} ranks at ZeRO-{zero} you gave "
                            f"{float(got):,.0f} bytes. {_memory_hint(float(got), psi, n, zero)}",
                            f"{want:,.0f} bytes")
    passed(name, "DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/n, ZeRO-2 4Ψ + 12Ψ/n, ZeRO-3 16Ψ/n")


__all__ = ["check_shard_unshard", "check_reduce_gradient", "check_memory_per_rank",
           "check_fsdp_unit"]


# -- worked problems: estimates from the hardware sheet (minitp.exercises.problems) ----------------
def _tokens_zero3_compute_bound() -> float:
    """Tokens per GPU per step at which ZeRO-3's bytes (two all-gathers of the bf16 parameters and a
    reduce-scatter of the bf16 gradients) over InfiniBand take as long as the step's 6 FLOPs per
    parameter and token: Ψ cancels."""
    n, rate = 64, cost.H100.flops_per_s * cost.H100.efficiency
    sent = 2 * cost.collective_sent_bytes("all_gather", 2.0,
                                          n) + cost.collective_sent_bytes("reduce_scatter", 2.0, n)
    return sent / cost.H100.inter.bytes_per_s * rate / 6


def _states_70b_zero3_gib(n: int = 64) -> float:
    from minitp.models import LLAMA3_70B

    return cost.total_memory(cost.memory_per_rank(LLAMA3_70B.num_params(), n, zero=3,
                                                  precision="bf16")) / 2**30


def _fewest_gpus_70b() -> int:
    """The fewest GPUs whose ZeRO-3 share of 70B's mixed-precision states is at most 60 GiB."""
    n = 1
    while _states_70b_zero3_gib(n) > 60:
        n += 1
    return n


PROBLEMS = {
    1: Problem("problem 1, when ZeRO-3 stops waiting for the network", _tokens_zero3_compute_bound,
               "tokens",
               {2 / 3: "ZeRO-3 gathers the parameters twice, for forward and again for backward",
                1.5: "the whole step's 6 FLOPs per parameter and token hide the messages, not the "
                     "backward's 4"}),
    2: Problem("problem 2, LLaMA-3-70B's states on 64 GPUs", _states_70b_zero3_gib, "GiB",
               {64.0: "ZeRO-3 shards all of it, parameters included, over the 64 ranks"}),
    3: Problem("problem 3, the fewest GPUs for 70B", _fewest_gpus_70b, "GPUs", rel=0.01),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 02: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
