"""Attention split by heads, the exercise of chapters 03 (multi-head) and 04 (grouped-query).

The learner writes ``fn(x, wq, wk, wv, wo, n_heads, n_kv_heads, group)``: from the FULL weights
(``nn.Linear`` layout: wq (H·Dh, D), wk and wv (Hkv·Dh, D), wo (D, H·Dh)) each rank takes the rows
of its heads (its columns of wo), computes their attention with ``causal_attention``, and returns
the (B, S, D) output on every rank, with f in front and g behind (``minitp.comm``). The checker runs
it on 2 (and 4) ranks, compares output and every gradient with one process and with
``minitp.tp.ParallelAttention`` (RoPE turned off: cos 1, sin 0), and the trace with one all-reduce
of the activation each way.
"""

from __future__ import annotations

import math

import torch

from minitp import trace
from minitp.exercises import ExerciseError, run_answer, wrong

ANSWER = "answer"
TOL = 1e-5
B, S, D = 2, 5, 16


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √Dh, causal) v for q, k, v of shape (B, heads, S, Dh): one score map per head.

    q, k and v must have the same number of heads: under grouped-query attention repeat each
    key/value head for the query heads of its group first."""
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"q has {q.shape[1]} heads, k {k.shape[1]} and v {v.shape[1]}: expected "
                         "the same number. Under grouped-query attention each key/value head "
                         "serves a group of H/Hkv query heads: repeat it for its group "
                         "(k.repeat_interleave(group, dim=1)) first.")
    seq = q.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, heads, S, S)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # (B, heads, S, Dh)


def attention(x, wq, wk, wv, wo, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """One process: the whole attention layer, (B, S, D) -> (B, S, D)."""
    b, s, _ = x.shape
    dh = wq.shape[0] // n_heads

    def heads(w, count):  # (B, S, count·Dh) -> (B, count, S, Dh)
        return (x @ w.T).view(b, s, count, dh).transpose(1, 2)

    q, k, v = heads(wq, n_heads), heads(wk, n_kv_heads), heads(wv, n_kv_heads)
    k, v = (t.repeat_interleave(n_heads // n_kv_heads, dim=1) for t in (k, v))
    out = causal_attention(q, k, v).transpose(1, 2).reshape(b, s, n_heads * dh)
    return out @ wo.T


def _setup(n_heads: int, n_kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dh = D // n_heads
    wq = torch.randn(n_heads * dh, D, generator=g) * 0.4
    wk = torch.randn(n_kv_heads * dh, D, generator=g) * 0.4
    wv = torch.randn(n_kv_heads * dh, D, generator=g) * 0.4
    wo = torch.randn(D, n_heads * dh, generator=g) * 0.4
    x = torch.randn(B, S, D, generator=g)
    # loss = (out * probe).sum(): every output element counts
    probe = torch.randn(B, S, D, generator=g)
    return x, (wq, wk, wv, wo), probe


def _library(weights, x, probe, n_heads: int, n_kv_heads: int):
    from minitp.models.llama import Attention, ModelConfig
    from minitp.tp import ParallelAttention

    layer = Attention(ModelConfig(dim=D, n_heads=n_heads, n_kv_heads=n_kv_heads))
    with torch.no_grad():
        for lin, w in zip((layer.wq, layer.wk, layer.wv, layer.wo), weights):
            lin.weight.copy_(w)
    parallel = ParallelAttention(layer, None)
    dh = D // n_heads
    cos, sin = torch.ones(S, dh // 2), torch.zeros(S, dh // 2)  # RoPE turned off
    out = parallel(x, cos, sin)
    (out * probe).sum().backward()
    return out.detach()


def _config(n_heads: int, n_kv_heads: int) -> str:
    """The name of the scope one configuration's answer runs in."""
    return f"{n_heads}_{n_kv_heads}"


def _worker(fn, configs, with_kv: bool):
    results = []
    for n_heads, n_kv_heads in configs:
        x, weights, probe = _setup(n_heads, n_kv_heads)
        x = x.requires_grad_(True)
        weights = [w.clone().requires_grad_(True) for w in weights]
        with trace.scope(ANSWER, _config(n_heads, n_kv_heads)):  # labels "answer/4_2/..."
            args = (x, *weights, n_heads) + ((n_kv_heads,) if with_kv else ()) + (None,)
            out = fn(*args)
            if isinstance(out, torch.Tensor) and out.shape == x.shape:
                with trace.scope("backward"):
                    (out * probe).sum().backward()
        with trace.scope("library", str(len(results))):
            library = _library([w.detach() for w in weights], x.detach().requires_grad_(True),
                               probe, n_heads, n_kv_heads)
        results.append({"out": out.detach() if isinstance(out, torch.Tensor) else out,
                        "x_grad": None if x.grad is None else x.grad.clone(),
                        "w_grads": [None if w.grad is None else w.grad.clone() for w in weights],
                        "library": library})
    return results


def _diff(a, b) -> float:
    """The largest difference, relative to the size of ``b`` once that is above 1 (fp32 sums of
    ranks)."""
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def check_heads(fn, name: str, configs, nprocs, with_kv: bool, timeout: float = 40.0) -> str:
    """Run ``fn`` on each world size for each (n_heads, n_kv_heads); raise on the first thing
    wrong."""
    hint = ("Hints: nn.Linear stores weights as (out, in): a head's Dh rows of wq, wk, wv are "
            "contiguous, so split wq, wk, wv along dim 0 (rows) and wo along dim 1 (its columns "
            "are the heads' features).")
    if with_kv:
        hint += (" Rank r holds query heads [r·H/n, (r+1)·H/n) and key/value heads [r·Hkv/n, "
                 "(r+1)·Hkv/n) (rows of wk and wv: fewer than wq's).")
    for n in nprocs:
        results = run_answer(_worker, n, (fn, configs, with_kv), name, timeout, hint=hint)
        for ci, (n_heads, n_kv) in enumerate(configs):
            x, weights, probe = _setup(n_heads, n_kv)
            x.requires_grad_(True)
            weights = [w.requires_grad_(True) for w in weights]
            want = attention(x, *weights, n_heads, n_kv)
            (want * probe).sum().backward()
            setup = f"H = {n_heads}" + (f", Hkv = {n_kv}" if with_kv else "") + f" on {n} ranks"
            per_rank = n_heads // n
            for rank, rr in enumerate(results):
                r = rr[ci]
                out, where = r["out"], f"{name} ({setup}), rank {rank}"
                if not isinstance(out, torch.Tensor) or out.shape != want.shape:
                    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise wrong(
                        name, f"{where}: returned {got}, not the full (B, S, D) output; every rank "
                                      "returns the whole output.",
                                      f"shape {tuple(want.shape)} on every rank")
                if _diff(out, want) > TOL:
                    mine = slice(rank * per_rank * (D // n_heads),
                                 (rank + 1) * per_rank * (D // n_heads))
                    own = _partial(x.detach(), [w.detach() for w in weights], n_heads, n_kv, mine,
                                   n)
                    if _diff(out, own) <= TOL:
                        raise wrong(name, f"{where}: the output is this rank's heads' share only: "
                                "the partial sums of wo's columns are never added up. End the "
                                "region with g (regions.reduce_from_parallel), an all-reduce in "
                                "forward.")
                    grouped = "" if n_kv == n_heads else (
                        " Query head j reads key/value head j // (H/Hkv): rank r holds query heads "
                        "[r·H/n, (r+1)·H/n) and key/value heads [r·Hkv/n, (r+1)·Hkv/n), each "
                        "repeated (repeat_interleave) for the H/Hkv query heads of its group.")
                    raise wrong(name, f"{where}: the output differs from one process by "
                                      f"{_diff(out, want):.3g}."
                                + grouped + " " + hint)
                if _diff(r["x_grad"], x.grad) > TOL:
                    raise wrong(name, f"{where}: the output is right but dL/dx is not: each rank's "
                                "backward gives only its heads' share of x's gradient. Start the "
                                "region with f (regions.copy_to_parallel): identity forward, "
                                "all-reduce backward.")
                # pragma: no cover - the library matches one process
                if _diff(r["out"], r["library"]) > TOL:
                    raise ExerciseError(f"{where}: differs from minitp.tp.ParallelAttention.")
            for i, wname in enumerate(("wq", "wk", "wv", "wo")):
                grads = [rr[ci]["w_grads"][i] for rr in results]
                if any(g is None for g in grads):
                    raise wrong(name,
                                f"{name} ({setup}): {wname} got no gradient: use the slices of the "
                                "weights you were given (slicing keeps autograd's link to them).")
                if _diff(sum(grads), weights[i].grad) > TOL:
                    raise wrong(
                        name, f"{name} ({setup}): the gradients of {wname}, added over the ranks, "
                        f"differ from one process by {_diff(sum(grads), weights[i].grad):.3g}.")
        _check_messages(name, results, configs, n)
    return (f"as one process and minitp.tp.ParallelAttention on {' and '.join(map(str, nprocs))} "
            "ranks; one all-reduce of (B, S, D) forward, one backward")


def _partial(x, weights, n_heads, n_kv, q_rows: slice, n: int) -> torch.Tensor:
    """What one rank's heads add to the output (before g), had it computed them right."""
    wq, wk, wv, wo = weights
    dh = D // n_heads
    kv_per_rank = n_kv // n
    rank = q_rows.start // ((n_heads // n) * dh)
    kv_rows = slice(rank * kv_per_rank * dh, (rank + 1) * kv_per_rank * dh)
    return attention(x, wq[q_rows], wk[kv_rows], wv[kv_rows], wo[:, q_rows], n_heads // n,
                     kv_per_rank)


def _check_messages(name: str, results, configs, n: int) -> None:
    activation = B * S * D * 4
    for ci, (n_heads, n_kv) in enumerate(configs):
        events = [e for e in results.traces[0].comm() if e.within(ANSWER, _config(n_heads, n_kv))]
        forward = [e for e in events if not e.within(ANSWER, _config(n_heads, n_kv), "backward")]
        backward = [e for e in events if e.within(ANSWER, _config(n_heads, n_kv), "backward")]
        for when, got in (("forward", forward), ("backward", backward)):
            ops = [(e.op, e.bytes) for e in got]
            if ops != [("all_reduce", activation)]:
                raise wrong(name,
                            f"the values are right, but rank 0's {when} sent {ops or 'nothing'}; "
                            "one all-reduce of the (B, S, D) activation goes each way. Each head's "
                            "work stays on its rank: the only messages are f's and g's.",
                            f"[('all_reduce', {activation})] in {when}")
        sent = sum(e.sent_bytes for e in events)
        library = sum(e.sent_bytes for e in results.traces[0].comm()
                      if e.within("library", str(ci)))
        if sent != library:  # pragma: no cover - follows from the two all-reduces above
            raise ExerciseError(
                f"{name}: rank 0 sent {sent:g} bytes, minitp.tp.ParallelAttention {library:g}.")


__all__ = ["causal_attention", "attention", "check_heads"]
