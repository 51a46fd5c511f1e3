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
* ``check_gqa_attention(fn)``: ``fn(x, wq, wk, wv, wo, n_heads, n_kv_heads, group)`` is
  grouped-query attention (each key/value head shared by H/Hkv query heads) with both kinds of heads
  split over the ranks. Run on 2 ranks with (H, Hkv) = (4, 2) and (8, 4); compared with one process
  and ``minitp.tp.ParallelAttention`` (``minitp.exercises.heads``).
* ``check_sequence_parallel_norm(fn)``: ``fn(partial, residual, weight, eps, group)`` is sequence
  parallel between two regions: reduce-scatter the row-parallel layer's partial sums (B, S, D) along
  the sequence, add the residual (B, S/n, D), RMSNorm those S/n positions, all-gather them for the
  next column-parallel layer; it returns (h, full), backward included. Run on 2 and 4 processes with
  a column-parallel layer after it; output and every gradient compared with one process, messages
  with a reduce-scatter and an all-gather each way, as many bytes as one all-reduce.
* ``check_problem(n, answer)``: worked problems 1-3, estimates from the hardware sheet
  (``minitp.cost.H100``) checked against ``minitp.cost`` (``minitp.exercises.problems``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minitp import cost, regions, trace
from minitp.exercises import ExerciseError, passed, problems, refuse_own_deep, run_answer, wrong
from minitp.exercises.ch03 import ANSWER, TOL, answer_messages, max_diff, phase
from minitp.exercises.heads import causal_attention as causal_attention  # for the notebook
from minitp.exercises.heads import check_heads
from minitp.exercises.problems import Problem
from minitp.models import LLAMA3_70B
from minitp.models.llama import rms_norm
from minitp.tp import SequenceParallelRMSNorm, enter_parallel_region, leave_parallel_region

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
    """Which hidden units (indices along ``dim`` of ``full``) ``shard`` holds, in order; None if
    unknown."""
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
    y = regions.reduce_from_parallel(F.linear(F.silu(F.linear(xin, w1)) * F.linear(xin, w3), w2),
                                     None)
    y.pow(2).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad}


def check_split_swiglu(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(w1, w3, w2, rank, n)`` must return this rank's (w1, w3, w2) slices for tensor
    parallel."""
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
                raise ExerciseError(f"{name}: not done yet (the function still raises "
                                    "NotImplementedError).") from None
            if not (isinstance(got, tuple | list) and len(got) == 3):
                raise ExerciseError(f"{name}: return a tuple (w1_slice, w3_slice, w2_slice), got "
                                    f"{type(got).__name__}.")
            per_rank.append([t.detach() for t in got])
        expected_shapes = [(HIDDEN // n, D), (HIDDEN // n, D), (D, HIDDEN // n)]
        for rank, slices in enumerate(per_rank):
            for which, t, shape in zip(("w1", "w3", "w2"), slices, expected_shapes):
                if tuple(t.shape) == shape:
                    continue
                if which in ("w1", "w3") and tuple(t.shape) == (HIDDEN, D // n):
                    raise wrong(name,
                        f"{name} on {n} ranks: {which} slice has shape {tuple(t.shape)}. You split "
                        f"{which} along D, its input (dim 1 of nn.Linear.weight): that makes it "
                        "row-parallel, and SiLU would then act on partial sums. Split the hidden "
                        "units F, dim 0.", f"shape {shape}")
                if which == "w2" and tuple(t.shape) == (D // n, HIDDEN):
                    raise wrong(name,
                        f"{name} on {n} ranks: w2 slice has shape {tuple(t.shape)}. You split w2 "
                        "the same way as w1 (its output features, dim 0). w2 must be split the "
                        "other way, along its input F (dim 1 of nn.Linear.weight): row-parallel, "
                        "reading the hidden units this rank's w1 and w3 "
                        "produced.", f"shape {shape}")
                raise wrong(name, f"{name} on {n} ranks: rank {rank}'s {which} slice has shape "
                                  f"{tuple(t.shape)}, not 1/n of the hidden units "
                                  "F.", f"shape {shape}")
        units = []
        for rank, (s1, s3, s2) in enumerate(per_rank):
            u1, u3, u2 = _units(w1, s1, 0), _units(w3, s3, 0), _units(w2, s2, 1)
            if None in (u1, u3, u2):
                raise wrong(name, f"{name} on {n} ranks: rank {rank}'s slices hold values that are "
                                  "not rows (w1, w3) or columns (w2) of the full weights; slice, "
                                  "do not transform.")
            if u1 != u3:
                raise wrong(name,
                    f"{name} on {n} ranks: on rank {rank}, w1 holds hidden units {u1} but w3 holds "
                    f"{u3}. W1 and W3 must be split the same way: SiLU(x·W1) ⊙ (x·W3) multiplies "
                    "unit j of one by unit j of the other, so both factors of unit j must live on "
                    "the same rank.")
            if u2 != u1:
                raise wrong(name,
                    f"{name} on {n} ranks: on rank {rank}, w1 and w3 hold hidden units {u1} but w2 "
                    f"reads units {u2}. w2's slice must take exactly the units this rank's w1 and "
                    "w3 produce, in the same order.")
            units.append(u1)
        everyone = sorted(u for us in units for u in us)
        if everyone != list(range(HIDDEN)):
            repeated = sorted({u for u in everyone if everyone.count(u) > 1})
            raise wrong(
                name, f"{name} on {n} ranks: the ranks together do not hold every hidden unit once "
                              f"(held twice: {repeated}). Rank r should take the r-th of n equal "
                              "chunks.")
        stacks = tuple([s[i] for s in per_rank] for i in range(3))
        results = run_answer(_split_worker, n, stacks, name)
        for rank, r in enumerate(results):
            if _off(r["y"], want) or _off(r["x_grad"], xr.grad):
                raise wrong(name,
                            f"{name} on {n} ranks: the parallel MLP built from your slices differs "
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
    """``fn(x, w1, w3, w2, group)`` must give the plain SwiGLU's output and gradients on every
    rank."""
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
                raise wrong(name,
                            f"{name}: rank {rank} returned no tensor; return the MLP's output.")
            if y.shape != want.shape:
                raise wrong(name, f"{name} on {n} ranks: rank {rank} returned shape "
                                  f"{tuple(y.shape)}, not the input's (B, S, D): every rank "
                                  "returns the whole output.",
                            f"shape {tuple(want.shape)}")
            if _off(y, want):
                if not _off(y, r["partial"]):
                    raise wrong(name,
                        f"{name} on {n} ranks: rank {rank} returned only its partial sum: its F/n "
                        "hidden units times its rows of W2. Leave the region with g "
                        "(regions.reduce_from_parallel) after w2.")
                raise wrong(name,
                    f"{name} on {n} ranks: rank {rank}'s output differs from the plain MLP by up "
                    f"to {max_diff(y, want):.3g}. SiLU and the product act on this rank's hidden "
                    "units as they are; sum over the ranks only once, after w2 (summing before a "
                    "SiLU is not the same).")
        for rank, r in enumerate(results):
            if _off(r["x_grad"], xr.grad):
                raise wrong(name,
                    f"{name} on {n} ranks: the output is right but dL/dx on rank {rank} is wrong: "
                    "each rank's w1 and w3 slices give only part of it. Enter the region with f "
                    "(regions.copy_to_parallel) once, before w1 and w3, so backward sums the "
                    "parts.")
            for which, got, w, dim in zip(("w1", "w3", "w2"), r["grads"], full, (0, 0, 1)):
                if _off(got, w.grad.chunk(n, dim)[rank]):
                    raise wrong(name, f"{name} on {n} ranks: the gradient of {which} on rank "
                                      f"{rank} is wrong.")
        for tr in results.traces:
            msgs = answer_messages(tr)
            if not msgs:
                raise wrong(name, f"{name}: the numbers are right but no message was traced; use "
                                  "minitp.comm's f and g so every byte is recorded.")
            fwd = [e.op for e in msgs if phase(e) == "forward"]
            bwd = [e.op for e in msgs if phase(e) == "backward"]
            if fwd != ["all_reduce"] or bwd != ["all_reduce"]:
                raise wrong(name,
                    f"{name}: the numbers are right, but rank {tr.rank} sent {fwd} forward and "
                    f"{bwd} backward; one all-reduce each way is enough. Apply f once to x (not "
                    "once per linear): w1 and w3 read the same x, and one all-reduce of its "
                    "gradient serves both.")
    passed(name, f"matches one process on {' and '.join(map(str, nprocs))} ranks, one all-reduce "
                 "each way")


# -- exercise 3: bytes of MLP weights per rank -----------------------------------------------------
def check_swiglu_bytes_per_rank(fn) -> None:
    """``fn(dim, hidden, tp, dtype_bytes)``: bytes of w1, w3 and w2 one rank holds under tensor
    parallel."""
    name = "SwiGLU weights per rank"
    cases = [(4096, 14336, 1, 2), (4096, 14336, 2, 2), (4096, 14336, 8, 2), (8192, 28672, 4, 4),
             (64, 128, 4, 4)]
    for dim, hidden, tp, b in cases:
        try:
            got = fn(dim, hidden, tp, b)
        except NotImplementedError:
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError).") from None
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
                    "Three D x F matrices, each split over tp ranks, dtype_bytes bytes per "
                    "element.")
        raise wrong(name, f"for D={dim}, F={hidden}, tp={tp}, {b} bytes per element you gave "
                          f"{float(got):,.0f} bytes. {hint}", f"{want:,.0f} bytes")
    passed(name, "3·D·F·b / tp bytes per rank")


# -- exercise 4: grouped-query attention split by heads --------------------------------------------
def check_gqa_attention(fn, nprocs: tuple[int, ...] = (2,)) -> None:
    """``fn(x, wq, wk, wv, wo, n_heads, n_kv_heads, group)``: GQA with query and key/value heads
    split."""
    name = "grouped-query attention split by heads"
    detail = check_heads(fn, name, [(4, 2), (8, 4)], nprocs, with_kv=True)
    passed(name, detail)


# -- exercise 5: sequence parallel around the norm -------------------------------------------------
# batch, sequence, model dim, the next layer's width: S and F divide by 2 and 4
SP_B, SP_S, SP_D, SP_F = 2, 8, 8, 16
SP_EPS = 1e-5
_SP_OWN = (regions.gather_from_sequence_parallel, regions.reduce_scatter_to_sequence_parallel,
           regions._gather_along, regions._reduce_scatter_along, enter_parallel_region,
           leave_parallel_region, SequenceParallelRMSNorm)
_SP_HINT = (
    "Rank i keeps positions [i·S/n, (i+1)·S/n) of dim 1: reduce-scatter the (B, S, D) partial sums "
    "chunked along dim 1, and put the gathered pieces back in rank order along dim 1.")


_SP_AUTOGRAD = ("comm's collectives write into buffers autograd does not follow: wrap each in a "
                "torch.autograd.Function whose backward is the other collective.")


def _sp_setup(n: int):
    """Every rank's partial sums, the residual, the norm weight, the next column-parallel weight and
    the probes of the loss, the same in every process: (partials (n, B, S, D), residual (B, S, D),
    weight (D,), w_next (F, D), probe_full (B, S, F), probe_h (B, S, D))."""
    g = torch.Generator().manual_seed(40 + n)
    partials = torch.randn(n, SP_B, SP_S, SP_D, generator=g)
    residual = torch.randn(SP_B, SP_S, SP_D, generator=g)
    weight = 1 + 0.2 * torch.randn(SP_D, generator=g)
    w_next = torch.randn(SP_F, SP_D, generator=g) * 0.4  # nn.Linear(D, F).weight: column-parallel
    return partials, residual, weight, w_next, torch.randn(SP_B, SP_S, SP_F, generator=g), \
        torch.randn(SP_B, SP_S, SP_D, generator=g)


def _sp_reference(n: int) -> dict:
    """One process: h = the sum of the partials + the residual, the norm, the next layer, and the
    gradients of the loss (the next layer's output and h, each against a probe)."""
    partials, residual, weight, w_next, probe_full, probe_h = _sp_setup(n)
    # dL/d(partial_r) = dL/d(the sum), the same on every rank
    partial = partials.sum(0).requires_grad_()
    residual, weight = residual.clone().requires_grad_(), weight.clone().requires_grad_()
    h = partial + residual
    full = rms_norm(h, weight, SP_EPS)
    ((F.linear(full, w_next) * probe_full).sum() + (h * probe_h).sum()).backward()
    return {"h": h.detach(), "full": full.detach(), "partial_grad": partial.grad,
            "residual_grad": residual.grad, "weight_grad": weight.grad}


def _sp_worker(fn):
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    partials, residual, weight, w_next, probe_full, probe_h = _sp_setup(n)
    mine = slice(rank * SP_S // n, (rank + 1) * SP_S // n)  # this rank's positions
    partial = partials[rank].clone().requires_grad_()  # (B, S, D): this rank's partial sums
    # (B, S/n, D): the residual stream's shard
    residual = residual[:, mine].clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    kept = []  # the shape of every tensor autograd keeps for backward inside the answer

    def keep(t):
        kept.append(tuple(t.shape))
        return t

    with trace.scope(ANSWER), trace.scope(
        "forward"), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = fn(partial, residual, weight, SP_EPS, None)
    if not (isinstance(out, tuple | list) and len(out) == 2 and all(isinstance(t, torch.Tensor)
                                                                    for t in out)):
        return {"bad": type(out).__name__ if not isinstance(out, tuple | list)
                else f"{len(out)} values"}
    h, full = out
    result = {"h": h.detach().clone(), "full": full.detach().clone(), "kept": kept}
    shapes_right = h.shape == (SP_B, SP_S // n, SP_D) and full.shape == (SP_B, SP_S, SP_D)
    if shapes_right and full.requires_grad:
        # the next column-parallel layer: this rank's F/n features
        z = F.linear(full, w_next.chunk(n, 0)[rank])
        loss = (z * probe_full.chunk(n, -1)[rank]).sum() + (h * probe_h[:, mine]).sum()
        with trace.scope(ANSWER), trace.scope("backward"):
            loss.backward()
    result.update(grad=full.requires_grad, partial_grad=partial.grad, residual_grad=residual.grad,
                  weight_grad=weight.grad)
    return result


def check_sequence_parallel_norm(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(partial, residual, weight, eps, group)`` -> (h, full): sequence parallel between two
    regions.

    partial (B, S, D): this rank's partial sums out of a row-parallel layer; residual (B, S/n, D):
    the residual stream at this rank's positions; h = the summed partials at those positions +
    residual (B, S/n, D); full (B, S, D): RMSNorm(h) of every position, the next column-parallel
    layer's input."""
    name = "sequence parallel around the norm"
    refuse_own_deep(name, fn, *_SP_OWN)
    for n in nprocs:
        want = _sp_reference(n)
        s = SP_S // n
        results = run_answer(_sp_worker, n, (fn,), name, hint=_SP_HINT + " " + _SP_AUTOGRAD)
        for tr in results.traces:
            forward = [e.op for e in answer_messages(tr) if phase(e) == "forward"]
            if "all_reduce" in forward:
                raise wrong(name, f"on {n} ranks, rank {tr.rank} sent {forward} forward: the "
                            "all-reduce is still there. Sequence parallel replaces it: a "
                            "reduce-scatter along the sequence leaves each rank the sum at its own "
                            "S/n positions, and the norm runs on those.",
                            "['reduce_scatter', 'all_gather'] forward")
        for rank, r in enumerate(results):
            where = f"{name} on {n} ranks, rank {rank}"
            if "bad" in r:
                raise wrong(name,
                            f"{where} returned {r['bad']}; return a pair (h, full): h the residual "
                            "stream at this rank's positions, full the norm's output at every "
                            "position.")
            h, full = r["h"], r["full"]
            mine = slice(rank * s, (rank + 1) * s)
            if tuple(h.shape) == (SP_B // n, SP_S, SP_D):
                raise wrong(name, f"{where}: h has shape {tuple(h.shape)}: the reduce-scatter "
                            "split the batch (dim 0, what a flat reduce-scatter of a (B, S, D) "
                            "tensor splits), not the sequence. "
                            + _SP_HINT, f"h of shape {(SP_B, s, SP_D)}")
            if tuple(h.shape) != (SP_B, s, SP_D):
                raise wrong(name,
                            f"{where}: h has shape {tuple(h.shape)}, not this rank's S/n = {s} "
                            "positions of (B, S, D). " + _SP_HINT, f"h of shape {(SP_B, s, SP_D)}")
            if tuple(full.shape) in ((n * SP_B, s, SP_D), (SP_B, s, n * SP_D)):
                dim = 0 if full.shape[0] == n * SP_B else 2
                raise wrong(
                    name, f"{where}: full has shape {tuple(full.shape)}: the pieces were gathered "
                    f"along dim {dim}, not along the sequence (dim 1). " + _SP_HINT,
                    f"full of shape {(SP_B, SP_S, SP_D)}")
            if tuple(full.shape) != (SP_B, SP_S, SP_D):
                raise wrong(name, f"{where}: full has shape {tuple(full.shape)}, not every "
                                  "position of (B, S, D).",
                            f"full of shape {(SP_B, SP_S, SP_D)}")
            if _off(h, want["h"][:, mine]):
                partials, residual, *_ = _sp_setup(n)
                unsummed = partials[rank][:, mine] + residual[:, mine]
                why = ("it is this rank's own partial sum: the other ranks' parts were never added "
                       "(a reduce-scatter sums, then scatters)" if not _off(h, unsummed) else
                       "the sum of every rank's partials at this rank's positions, plus the "
                       "residual")
                raise wrong(name, f"{where}: h differs from one process by "
                            f"{max_diff(h, want['h'][:, mine]):.3g}; it should be "
                            f"{why}.", f"h[0, 0] = {want['h'][0, mine.start].tolist()}")
            if _off(full, want["full"]):
                # pieces back to back, flat
                laid = torch.stack(want["full"].chunk(n, dim=1)).reshape(full.shape)
                if not _off(full, laid):
                    raise wrong(name, f"{where}: full holds the right numbers in the wrong places: "
                                "the all-gathered pieces were laid out along the wrong dimension "
                                "(all_gather puts them one after another, rank by rank, in a flat "
                                "buffer). " + _SP_HINT,
                                f"full[0, :, 0] = {want['full'][0, :, 0].tolist()}")
                if not _off(full, torch.cat([q["h"] for q in results], dim=1)):
                    raise wrong(name, f"{where}: full is h gathered, before the norm: gather the "
                                      "norm's output.",
                                f"full[0, :, 0] = {want['full'][0, :, 0].tolist()}")
                raise wrong(name, f"{where}: full differs from one process by "
                            f"{max_diff(full, want['full']):.3g}: it should be RMSNorm(h) at every "
                            "position, rank i's S/n positions at [i·S/n, "
                            "(i+1)·S/n).", f"full[0, :, 0] = {want['full'][0, :, 0].tolist()}")
        for rank, r in enumerate(results):
            where = f"{name} on {n} ranks, rank {rank}"
            mine = slice(rank * s, (rank + 1) * s)
            if not r["grad"] or r["partial_grad"] is None:
                raise wrong(name, f"{where}: the output is right but no gradient reached partial: "
                            + _SP_AUTOGRAD)
            if _off(r["partial_grad"], want["partial_grad"]):
                from minitp.exercises.ch03 import _ratio

                raise wrong(name,
                            f"{where}: the output is right but the gradient of partial is wrong"
                            f"{_ratio(r['partial_grad'], want['partial_grad'])}. Backward of the "
                            "all-gather must add up the ranks' gradients for this rank's positions "
                            "(every rank's slice of the next layer gives a part of each): a "
                            "reduce-scatter, not a slice. Backward of the reduce-scatter "
                            "all-gathers the gradient of h.")
            if r["residual_grad"] is None or _off(r["residual_grad"],
                                                  want["residual_grad"][:, mine]):
                raise wrong(name, f"{where}: the gradient of the residual is wrong: add it to the "
                            "reduce-scattered sum at this rank's positions, in the graph (no "
                            "detach, no in-place write).")
        weight_grads = [r["weight_grad"] for r in results]
        if any(g is None for g in weight_grads):
            raise wrong(name, f"{name} on {n} ranks: the norm weight got no gradient: use the "
                              "weight given.")
        summed = sum(weight_grads)
        if _off(summed, want["weight_grad"]):
            if not any(_off(g, want["weight_grad"]) for g in weight_grads):
                raise wrong(name, f"{name} on {n} ranks: every rank's norm weight gradient is "
                            "already the sum over the ranks (an all-reduce of it, as minitp's own "
                            "norm sends). Here leave each rank the part of its own positions: the "
                            "checker adds them up.")
            raise wrong(name, f"{name} on {n} ranks: the norm weight's gradient, added over the "
                        "ranks, differs from one process by "
                        f"{max_diff(summed, want['weight_grad']):.3g}.")
        # the right numbers, but the norm's work and memory not split
        for rank, r in enumerate(results):
            whole = [shape for shape in r["kept"] if math.prod(shape) > SP_B * s * SP_D]
            if whole:
                raise wrong(name, f"{name} on {n} ranks: the numbers are right, but rank {rank} "
                            f"keeps tensors of shape {whole[0]} for backward, every position: "
                            "every rank normalised every position. Run the norm on this rank's S/n "
                            "positions, between the reduce-scatter and the all-gather: 1/n of the "
                            "work and of the activations it keeps.")
        activation = SP_B * SP_S * SP_D * 4
        for tr in results.traces:
            msgs = answer_messages(tr)
            for when in ("forward", "backward"):
                got = sorted(e.op for e in msgs if phase(e) == when)
                if got != ["all_gather", "reduce_scatter"]:
                    raise wrong(name, f"on {n} ranks the values are right, but rank {tr.rank} sent "
                                f"{got or 'nothing'} in {when}; one reduce-scatter and one "
                                "all-gather of the (B, S, D) activation go each way, through "
                                "minitp.comm so that they are traced.",
                                f"['reduce_scatter', 'all_gather'] in {when}")
                sent = sum(e.sent_bytes for e in msgs if phase(e) == when)
                one_all_reduce = cost.collective_sent_bytes("all_reduce", activation, n)
                if sent != one_all_reduce:
                    raise wrong(name, f"on {n} ranks rank {tr.rank} sent {sent:g} bytes in {when}: "
                                "a reduce-scatter and an all-gather of the whole (B, S, D) "
                                "activation send what one all-reduce of it sends, 2(n-1)/n of "
                                "it.", f"{one_all_reduce:g} bytes")
    passed(name, f"matches one process on {' and '.join(map(str, nprocs))} ranks, output and "
                 "gradients; each way a reduce-scatter and an all-gather, together the bytes of "
                 "one all-reduce")


# -- worked problems: estimates from the hardware sheet (minitp.exercises.problems) ----------------
def _swiglu_messages_over_compute(cfg=LLAMA3_70B, n: int = 8) -> float:
    """One token through one SwiGLU MLP at tp = n, bf16: the seconds of its two all-reduces of D·2
    bytes (g forward, f backward) on NVLink, bandwidth only, over the seconds of the rank's share of
    its training FLOPs, 6 per weight: 6·3·D·F/n."""
    sent = cost.tp_mlp_bytes(1, 1, cfg.dim, n, dtype_bytes=2) / cost.H100.intra.bytes_per_s
    return sent / cost.compute_time(6 * cost.tp_mlp_params_per_rank(cfg.dim, cfg.ffn_hidden, n),
                                    cost.H100)


def _replicated_kv_cache_mib(cfg=LLAMA3_70B, n: int = 16, tokens: int = 8192) -> float:
    """The KV cache one rank holds for one sequence at tp = n > H_kv, each key/value head replicated
    on the n/H_kv ranks whose query heads read it: one whole head per rank, as at tp = H_kv."""
    return cost.kv_cache_bytes(cfg, tokens, tp=min(n, cfg.kv_heads)) / 2**20


def _sequence_parallel_saving_mib(cfg=LLAMA3_70B, n: int = 8, seq: int = 8192) -> float:
    """What sequence parallel saves of one LLaMA block's activations on one rank (minitp's count,
    ``llama_block_activation_bytes``), one sequence of ``seq`` tokens, bf16, tp = n."""
    plain = cost.llama_block_activation_bytes(cfg, 1, seq, tp=n)
    sp = cost.llama_block_activation_bytes(cfg, 1, seq, tp=n, sequence_parallel=True)
    return (plain - sp) / 2**20


PROBLEMS = {
    1: Problem("problem 1, the SwiGLU's messages against its compute",
               _swiglu_messages_over_compute, "",
               {0.5: "two all-reduces per token: g's forward and f's backward",
                3.0: "a training step costs 6 FLOPs per weight (2 forward, 4 backward), not 2",
                8 / 7: "a ring all-reduce sends 2(n-1)/n of the buffer per rank, not twice the "
                       "buffer"}),
    2: Problem("problem 2, a replicated key/value head", _replicated_kv_cache_mib, "MiB",
               {0.5: "a key/value head cannot be split: both ranks that read it keep all of it",
                2.0: "8 key/value heads over 16 ranks: each rank keeps one, not two"}),
    3: Problem("problem 3, what sequence parallel saves", _sequence_parallel_saving_mib, "MiB",
               {1.5: "minitp keeps the all-gathered (N, D) input of the column-parallel layers "
                     "whole: that tensor is not split",
                8 / 7: "sequence parallel keeps 1/t of the norms' tensors: it saves (1 - 1/t) of "
                       "them",
                0.5: "a block has two norms"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 04: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
