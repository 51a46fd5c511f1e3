"""Checkers for chapter 04, the SwiGLU MLP and attention under tensor parallel.

* ``check_split_swiglu(fn)``: ``fn(w1, w3, w2, rank, n)`` takes the full ``nn.Linear`` weights of a
  SwiGLU MLP (w1, w3: (F, D); w2: (D, F)) and returns this rank's slices. The slices are checked
  in the parent (shapes, which hidden units each rank holds), then used on 2 and 4 processes with
  minitp's f and g; output and input gradient compared with the plain MLP on one process.
* ``check_parallel_swiglu(fn)``: ``fn(x, w1, w3, w2, group)`` is the forward of the tensor-parallel
  SwiGLU from this rank's slices; run on 2 and 4 processes, output and every gradient compared with
  one process, messages with one all-reduce each way.
* ``check_swiglu_bytes_per_rank(fn)``: ``fn(dim, hidden, tp, dtype_bytes)`` gives the bytes of MLP
  weights (w1, w3 and w2) one rank holds; compared with ``minitp.cost``.
* ``check_gqa_attention(fn)``: ``fn(x, wq, wk, wv, wo, n_heads, n_kv_heads, group)`` is grouped-query
  attention (each key/value head shared by H/Hkv query heads) with both kinds of heads split over the
  ranks. Run on 2 ranks with (H, Hkv) = (4, 2) and (8, 4); compared with one process and
  ``minitp.tp.ParallelAttention`` (``minitp.exercises.heads``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minitp import cost, regions, trace
from minitp.exercises import ExerciseError, passed, run_answer, wrong
from minitp.exercises.ch03 import ANSWER, TOL, answer_messages, max_diff, phase
from minitp.exercises.heads import causal_attention, check_heads  # noqa: F401 (causal_attention: for the notebook)

D, HIDDEN = 8, 16  # the MLP the checkers use: small enough to read, divisible by 2 and 4


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(HIDDEN, D, generator=g) * 0.4  # nn.Linear(D, F).weight
    w3 = torch.randn(HIDDEN, D, generator=g) * 0.4
    w2 = torch.randn(D, HIDDEN, generator=g) * 0.4  # nn.Linear(F, D).weight
    x = torch.randn(2, 3, D, generator=g)
    return x, w1, w3, w2


def _off(got, want) -> bool:
    """True when ``got`` is not ``want`` to fp32 precision (relative to the size of ``want``)."""
    return got is None or max_diff(got, want) > TOL * max(1.0, want.abs().max().item())


def swiglu(x, w1, w3, w2):
    """(SiLU(x·W1) ⊙ (x·W3))·W2 with nn.Linear's weight layout."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _units(full: torch.Tensor, shard: torch.Tensor, dim: int) -> list[int] | None:
    """Which hidden units (indices along ``dim`` of ``full``) ``shard`` holds, in order; None if unknown."""
    out = []
    for i in range(shard.shape[dim]):
        piece = shard.select(dim, i)
        found = [j for j in range(full.shape[dim]) if torch.equal(full.select(dim, j), piece)]
        if not found:
            return None
        out.append(found[0])
    return out


# -- exercise 1: split the SwiGLU weights ---------------------------------------------------------
def _split_worker(w1s, w3s, w2s):
    import torch.distributed as dist

    rank = dist.get_rank()
    x, *_ = _weights()
    x = x.clone().requires_grad_()
    w1, w3, w2 = (t[rank].clone().requires_grad_() for t in (w1s, w3s, w2s))
    xin = regions.copy_to_parallel(x, None)
    y = regions.reduce_from_parallel(F.linear(F.silu(F.linear(xin, w1)) * F.linear(xin, w3), w2), None)
    y.pow(2).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad}


def check_split_swiglu(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(w1, w3, w2, rank, n)`` must return this rank's (w1, w3, w2) slices for tensor parallel."""
    name = "split the SwiGLU weights"
    x, w1, w3, w2 = _weights()
    xr = x.clone().requires_grad_()
    want = swiglu(xr, w1, w3, w2)
    want.pow(2).sum().backward()
    for n in nprocs:
        per_rank = []
        for rank in range(n):
            try:
                got = fn(w1.clone(), w3.clone(), w2.clone(), rank, n)
            except NotImplementedError:
                raise ExerciseError(f"{name}: not done yet (the function still raises NotImplementedError).") from None
            if not (isinstance(got, tuple | list) and len(got) == 3):
                raise ExerciseError(f"{name}: return a tuple (w1_slice, w3_slice, w2_slice), got {type(got).__name__}.")
            per_rank.append([t.detach() for t in got])
        expected_shapes = [(HIDDEN // n, D), (HIDDEN // n, D), (D, HIDDEN // n)]
        for rank, slices in enumerate(per_rank):
            for which, t, shape in zip(("w1", "w3", "w2"), slices, expected_shapes):
                if tuple(t.shape) == shape:
                    continue
                if which in ("w1", "w3") and tuple(t.shape) == (HIDDEN, D // n):
                    raise ExerciseError(
                        f"{name} on {n} ranks: {which} slice has shape {tuple(t.shape)}, expected {shape}. You "
                        f"split {which} along D, its input (dim 1 of nn.Linear.weight): that makes it row-parallel, "
                        "and SiLU would then act on partial sums. Split the hidden units F, dim 0.")
                if which == "w2" and tuple(t.shape) == (D // n, HIDDEN):
                    raise ExerciseError(
                        f"{name} on {n} ranks: w2 slice has shape {tuple(t.shape)}, expected {shape}. You split w2 "
                        "the same way as w1 (its output features, dim 0). w2 must be split the other way, along "
                        "its input F (dim 1 of nn.Linear.weight): row-parallel, reading the hidden units this "
                        "rank's w1 and w3 produced.")
                raise ExerciseError(f"{name} on {n} ranks: rank {rank}'s {which} slice has shape {tuple(t.shape)}, "
                                    f"expected {shape}.")
        units = []
        for rank, (s1, s3, s2) in enumerate(per_rank):
            u1, u3, u2 = _units(w1, s1, 0), _units(w3, s3, 0), _units(w2, s2, 1)
            if None in (u1, u3, u2):
                raise ExerciseError(f"{name} on {n} ranks: rank {rank}'s slices hold values that are not rows "
                                    "(w1, w3) or columns (w2) of the full weights; slice, do not transform.")
            if u1 != u3:
                raise ExerciseError(
                    f"{name} on {n} ranks: on rank {rank}, w1 holds hidden units {u1} but w3 holds {u3}. W1 and "
                    "W3 must be split the same way: SiLU(x·W1) ⊙ (x·W3) multiplies unit j of one by unit j "
                    "of the other, so both factors of unit j must live on the same rank.")
            if u2 != u1:
                raise ExerciseError(
                    f"{name} on {n} ranks: on rank {rank}, w1 and w3 hold hidden units {u1} but w2 reads units "
                    f"{u2}. w2's slice must take exactly the units this rank's w1 and w3 produce, in the same order.")
            units.append(u1)
        everyone = sorted(u for us in units for u in us)
        if everyone != list(range(HIDDEN)):
            repeated = sorted({u for u in everyone if everyone.count(u) > 1})
            raise ExerciseError(f"{name} on {n} ranks: the ranks together do not hold every hidden unit once "
                                f"(held twice: {repeated}). Rank r should take the r-th of n equal chunks.")
        stacks = tuple([s[i] for s in per_rank] for i in range(3))
        results = run_answer(_split_worker, n, stacks, name)
        for rank, r in enumerate(results):
            if _off(r["y"], want) or _off(r["x_grad"], xr.grad):
                raise ExerciseError(f"{name} on {n} ranks: the parallel MLP built from your slices differs "
                                    f"from one process on rank {rank} (output or dL/dx).")
    passed(name, f"W1 and W3 split by hidden units, W2 the other way; matches one process on "
                 f"{' and '.join(map(str, nprocs))} ranks")


# -- exercise 2: the tensor-parallel SwiGLU forward -----------------------------------------------
def _swiglu_worker(fn):
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    x, w1, w3, w2 = _weights()
    x = x.clone().requires_grad_()
    mine = [w1.chunk(n, 0)[rank], w3.chunk(n, 0)[rank], w2.chunk(n, 1)[rank]]
    mine = [t.clone().requires_grad_() for t in mine]
    with trace.scope(ANSWER), trace.scope("forward"):
        y = fn(x, *mine, None)
    if not isinstance(y, torch.Tensor):
        return {"y": None}
    out = {"y": y.detach().clone()}
    with torch.no_grad():
        out["partial"] = swiglu(x, *mine)
    if y.shape == x.shape and y.requires_grad:
        with trace.scope(ANSWER), trace.scope("backward"):
            y.pow(2).sum().backward()
    out.update(x_grad=x.grad, grads=[t.grad for t in mine])
    return out


def check_parallel_swiglu(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(x, w1, w3, w2, group)`` must give the plain SwiGLU's output and gradients on every rank."""
    name = "tensor-parallel SwiGLU"
    x, w1, w3, w2 = _weights()
    xr = x.clone().requires_grad_()
    full = [w.clone().requires_grad_() for w in (w1, w3, w2)]
    want = swiglu(xr, *full)
    want.pow(2).sum().backward()
    for n in nprocs:
        results = run_answer(_swiglu_worker, n, (fn,), name)
        for rank, r in enumerate(results):
            y = r["y"]
            if y is None:
                raise ExerciseError(f"{name}: rank {rank} returned no tensor; return the MLP's output.")
            if y.shape != want.shape:
                raise ExerciseError(f"{name} on {n} ranks: rank {rank} returned shape {tuple(y.shape)}, expected "
                                    f"{tuple(want.shape)} (B, S, D), the same on every rank.")
            if _off(y, want):
                if not _off(y, r["partial"]):
                    raise ExerciseError(
                        f"{name} on {n} ranks: rank {rank} returned only its partial sum: its F/n hidden units "
                        "times its rows of W2. Leave the region with g (regions.reduce_from_parallel) after w2.")
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank}'s output differs from the plain MLP by up to "
                    f"{max_diff(y, want):.3g}. SiLU and the product act on this rank's hidden units as they "
                    "are; sum over the ranks only once, after w2 (summing before a SiLU is not the same).")
        for rank, r in enumerate(results):
            if _off(r["x_grad"], xr.grad):
                raise ExerciseError(
                    f"{name} on {n} ranks: the output is right but dL/dx on rank {rank} is wrong: each rank's "
                    "w1 and w3 slices give only part of it. Enter the region with f (regions.copy_to_parallel) "
                    "once, before w1 and w3, so backward sums the parts.")
            for which, got, w, dim in zip(("w1", "w3", "w2"), r["grads"], full, (0, 0, 1)):
                if _off(got, w.grad.chunk(n, dim)[rank]):
                    raise ExerciseError(f"{name} on {n} ranks: the gradient of {which} on rank {rank} is wrong.")
        for tr in results.traces:
            msgs = answer_messages(tr)
            if not msgs:
                raise ExerciseError(f"{name}: the numbers are right but no message was traced; use minitp.comm's "
                                    "f and g so every byte is recorded.")
            fwd = [e.op for e in msgs if phase(e) == "forward"]
            bwd = [e.op for e in msgs if phase(e) == "backward"]
            if fwd != ["all_reduce"] or bwd != ["all_reduce"]:
                raise ExerciseError(
                    f"{name}: the numbers are right, but rank {tr.rank} sent {fwd} forward and {bwd} backward; "
                    "one all-reduce each way is enough. Apply f once to x (not once per linear): w1 and w3 "
                    "read the same x, and one all-reduce of its gradient serves both.")
    passed(name, f"matches one process on {' and '.join(map(str, nprocs))} ranks, one all-reduce each way")


# -- exercise 3: bytes of MLP weights per rank -----------------------------------------------------
def check_swiglu_bytes_per_rank(fn) -> None:
    """``fn(dim, hidden, tp, dtype_bytes)``: bytes of w1, w3 and w2 one rank holds under tensor parallel."""
    name = "SwiGLU weights per rank"
    cases = [(4096, 14336, 1, 2), (4096, 14336, 2, 2), (4096, 14336, 8, 2), (8192, 28672, 4, 4), (64, 128, 4, 4)]
    for dim, hidden, tp, b in cases:
        try:
            got = fn(dim, hidden, tp, b)
        except NotImplementedError:
            raise ExerciseError(f"{name}: not done yet (the function still raises NotImplementedError).") from None
        if got is None:
            raise ExerciseError(f"{name}: the function returned None; return a number of bytes.")
        want = cost.tp_mlp_params_per_rank(dim, hidden, tp) * b
        if math.isclose(float(got), want, rel_tol=1e-9):
            continue
        one = dim * hidden * b
        hints = [
            (one / tp, "That is one matrix: the MLP has three, w1, w3 and w2, each D x F."),
            (3 * one, "That is the whole MLP: each rank holds 1/tp of every matrix."),
            (2 * one / tp, "That is w1 and w3: w2 is D x F too (F x D, the same count)."),
            (3 * dim * hidden / tp, "Multiply by the bytes per element."),
            (3 * one * 8 / tp, "Count bytes, not bits."),
        ]
        hint = next((h for v, h in hints if math.isclose(float(got), v, rel_tol=1e-9)),
                    "Three D x F matrices, each split over tp ranks, dtype_bytes bytes per element.")
        raise wrong(name, f"for D={dim}, F={hidden}, tp={tp}, {b} bytes per element you gave {float(got):,.0f} "
                          f"bytes. {hint}", f"{want:,.0f} bytes")
    passed(name, "3·D·F·b / tp bytes per rank")


# -- exercise 4: grouped-query attention split by heads --------------------------------------------
def check_gqa_attention(fn, nprocs: tuple[int, ...] = (2,)) -> None:
    """``fn(x, wq, wk, wv, wo, n_heads, n_kv_heads, group)``: GQA with query and key/value heads split."""
    name = "grouped-query attention split by heads"
    detail = check_heads(fn, name, [(4, 2), (8, 4)], nprocs, with_kv=True)
    passed(name, detail)
