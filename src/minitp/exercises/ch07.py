"""Checkers for chapter 07, context parallel (ring attention).

* ``check_balanced_chunks(fn)``: ``fn(seq_len, cp, rank)`` gives the positions rank holds under the
  load-balanced layout, as a list of ranges (chunks i and 2cp-1-i of 2cp); compared with
  ``minitp.layout.cp_chunks``.
* ``check_online_softmax(fn)``: ``fn(m, row_sum, acc, scores, v)`` folds one block of scores into
  the running max, sum and output; fed block by block, acc / row_sum must equal softmax(scores) @ v,
  even for scores in the thousands and rows whose first block is all masked.
* ``check_ring_attention(fn)``: ``fn(q, k, v, group)`` is full (unmasked) attention of this rank's
  queries against every rank's keys, the key/value blocks passed around the ring with
  ``comm.isend``/``comm.irecv``. Run on 2 and 4 ranks; output compared with one process, messages
  with cp-1 sends per rank, each to the next rank.
* ``check_ring_bytes(fn)``: ``fn(batch, seq, kv_heads, head_dim, cp, dtype_bytes)`` gives the bytes
  one rank sends for one attention forward and backward, (3cp-2)·2KV; compared with
  ``minitp.cost.cp_attention_bytes``.
* ``check_ring_backward(fn)``: ``fn(q, k, v, out, lse, dout, group)`` gives this rank's (dq, dk, dv)
  of full attention, the key/value blocks passed round the ring again with their dK/dV accumulators,
  which come home after cp hops. Run on 2 and 4 ranks; gradients compared with one process's
  autograd, messages with (cp-1)·2KV + cp·2KV bytes per rank, each to the next rank.
* ``check_problem(n, answer)``: the worked problems, estimates from ``minitp.cost.H100`` checked
  against ``minitp.cost`` (``PROBLEMS``).
"""

from __future__ import annotations

import math

import torch

from minitp import cost, cp, layout, trace
from minitp.exercises import (
    HANG_HINT,
    ExerciseError,
    not_implemented,
    passed,
    problems,
    refuse_own,
    run_answer,
    wrong,
)
from minitp.exercises.problems import Problem

ANSWER = "answer"
TOL = 1e-5


def _call(name: str, fn, *args):
    """Call a single-process answer; a stub or a crash becomes one ExerciseError."""
    try:
        return fn(*args)
    except ExerciseError:
        raise
    except Exception as err:  # the learner's code may raise anything
        if not_implemented(err):
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError). "
                "Replace the stub with your answer and run the check again.") from None
        raise ExerciseError(f"{name}: the function raised {type(err).__name__}: {err}") from None


# -- exercise 1: the load-balanced chunks ----------------------------------------------------------
def check_balanced_chunks(fn) -> None:
    """``fn(seq_len, cp, rank)`` must give rank's two chunks: i and 2cp-1-i of 2cp equal ones."""
    name = "balanced chunks"
    for seq, n in ((16, 2), (16, 4), (24, 3), (64, 8)):
        for rank in range(n):
            want = layout.cp_chunks(seq, n, rank, balanced=True)
            got = _call(name, fn, seq, n, rank)
            got = [range(r.start, r.stop) for r in got] if isinstance(got, (list, tuple)) else got
            if got == want:
                continue
            hint = ""
            if got == layout.cp_chunks(seq, n, rank, balanced=False):
                hint = ("that is the contiguous slice: under a causal mask rank r attends to r "
                        "whole earlier slices and half of its own (r·c² + c(c+1)/2 query-key "
                        f"pairs, c = seq_len/cp), so the last rank does about 2·cp-1 = {2 * n - 1} "
                        "times the first one's work. Cut the sequence into 2·cp chunks and give "
                        "rank i two of them.")
            elif isinstance(got, list) and len(got) == 2 and got[0] == want[0]:
                hint = ("the first chunk is right but the second is not: its partner lies as far "
                        "from the end of the 2·cp chunks as the first lies from the start, so that "
                        "an early chunk (little to attend to) pairs with a late one (much).")
            elif isinstance(got, list) and got and all(len(r) == seq // n for r in got):
                hint = (f"each chunk must hold seq_len / (2·cp) = {seq // (2 * n)} positions, not "
                        "seq_len / cp.")
            raise wrong(name, f"for seq_len={seq}, cp={n}, rank {rank} you gave {got}: "
                        + (hint or "rank i holds chunks i and 2·cp-1-i of 2·cp equal chunks."),
                        str(want))
    passed(name, "every rank of cp = 2, 3, 4 and 8")


# -- exercise 2: the online softmax ----------------------------------------------------------------
def _softmax_case(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, 6, 12, generator=g) * scale  # (B, H, Sq, Sk)
    v = torch.randn(2, 3, 12, 4, generator=g)  # (B, H, Sk, Dh)
    scores[0, 0, 0, :4] = float("-inf")  # this row sees nothing in the first block
    return scores, v


def _fold(fn, scores, v, name):
    m = torch.full(scores.shape[:-1], float("-inf"))
    row_sum, acc = torch.zeros(scores.shape[:-1]), torch.zeros(*scores.shape[:-1], v.shape[-1])
    for cols in (slice(0, 4), slice(4, 8), slice(8, 12)):
        got = _call(name, fn, m, row_sum, acc, scores[..., cols], v[..., cols, :])
        if not isinstance(got, tuple) or len(got) != 3:
            raise ExerciseError(f"{name}: return the three running tensors (m, row_sum, acc), got "
                                f"{type(got).__name__}")
        m, row_sum, acc = got
    return m, row_sum, acc


def check_online_softmax(fn) -> None:
    """Fold three blocks of scores with ``fn``; acc / row_sum must be softmax(scores) @ v."""
    name = "online softmax"
    refuse_own(name, fn, cp.online_softmax_update)
    for scale, what in ((1.0, "ordinary scores"), (1000.0, "scores in the thousands")):
        scores, v = _softmax_case(0, scale)
        want = scores.softmax(-1) @ v
        m, row_sum, acc = _fold(fn, scores, v, name)
        out = acc / row_sum.unsqueeze(-1)
        if not torch.isfinite(out).all():
            raise ExerciseError(
                f"{name}: with {what} the result holds inf or nan. Subtract the running max before "
                "exp (exp(1000) overflows in fp32), and treat a row whose max is still -inf (no "
                "key seen yet) so that exp(-inf - (-inf)) never happens: use 0 as its max.")
        if (out - want).abs().max().item() <= TOL:
            if (m - scores.amax(-1)).abs().max().item() > TOL:
                raise ExerciseError(
                    f"{name}: the output is right but m is not the running max of the scores.")
            continue
        last_block = scores[..., 8:].softmax(-1) @ v[..., 8:, :]
        if (out - last_block).abs().max().item() <= 1e-4:
            raise ExerciseError(
                f"{name}: only the last block counts: the old sums were replaced, not carried. "
                "Scale row_sum and acc by exp(m_old - m_new) and add the new block's terms.")
        raise ExerciseError(
            f"{name}: with {what}, acc / row_sum differs from softmax(scores) @ v by up to "
            f"{(out - want).abs().max().item():.3g}. When the max grows from m_old to m_new, every "
            "term already summed was exp(s - m_old) and must become exp(s - m_new): multiply "
            "row_sum AND acc by exp(m_old - m_new).")
    passed(name, "three blocks, scores up to ~3000, a row masked in its first block")


# -- exercises 3 and 5: the ring on several processes, checked against one process -----------------
GRAD_TOL = 1e-4  # fp32 gradients, summed over the ring's blocks in another order than one process's


def _ring_case(n: int):
    """The whole sequence on one process: q, k, v, d(out), (B, H, S, Dh) each with S = 4n, and what
    the forward gives, out (B, H, S, Dh) and each row's log-sum-exp lse (B, H, S)."""
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, 2, 4 * n, 8, generator=g) for _ in range(4))
    out, lse = _attention(q, k, v)
    return q, k, v, out, lse, dout


def _attention(q, k, v):
    """Full (unmasked) attention on one process: softmax(q kᵀ/√Dh) v and each row's log-sum-exp."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Sq, Sk)
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def _rows(t: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """Rank's contiguous slice of the positions (dim 2): (B, H, S, ...) -> (B, H, S/n, ...)."""
    return t.chunk(n, dim=2)[rank].contiguous()


def _ring_worker(fn, backward: bool):
    """Run the answer on this rank's slice: ``fn(q, k, v, group)`` or, for the backward,
    ``fn(q, k, v, out, lse, dout, group)``; return what it gave, detached."""
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, out, lse, dout = (_rows(t, n, rank) for t in _ring_case(n))
    with trace.scope(ANSWER):
        got = fn(q, k, v, out, lse, dout, None) if backward else fn(q, k, v, None)
    if backward:
        grads = tuple(got) if isinstance(got, (tuple, list)) and len(got) == 3 else None
        return {"grads": None if grads is None else tuple(t.detach() if isinstance(t, torch.Tensor)
                                                          else t
                                                           for t in grads)}
    return {"out": got.detach() if isinstance(got, torch.Tensor) else None,
            "own": _attention(q, k, v)[0]}  # this rank's keys only


def _close(a, b, tol: float = GRAD_TOL) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= tol


def _check_shape(name: str, n: int, rank: int, what: str, got, want: torch.Tensor) -> None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise wrong(name, f"{name} on {n} ranks: rank {rank} returned {shape} for {what}: one row "
                    "per position this rank holds, (B, H, S/n, Dh), the shape of its "
                    "q.", f"shape {tuple(want.shape)}")


def _ring_sends(name: str, tr, n: int):
    """This rank's traced sends of the answer; each must go to the next rank on the ring."""
    sends = [e for e in tr.comm() if e.op == "send" and ANSWER in e.scopes]
    if not sends:
        raise ExerciseError(
            f"{name}: the result is right but no send was traced. Pass the blocks with "
            "minitp.comm.isend / comm.irecv so every byte is recorded.")
    nxt = (tr.rank + 1) % n
    if any(e.peer != nxt for e in sends):
        raise wrong(name, f"{name} on {n} ranks: rank {tr.rank} sent to rank(s) "
                    f"{sorted({e.peer for e in sends})}; on this ring every rank sends to the next "
                    "one, rank + 1 (mod n), and receives from the previous "
                    "one.", f"rank {tr.rank} sends to rank {nxt} only")
    return sends


# -- exercise 3: the ring, with isend/irecv --------------------------------------------------------
def check_ring_attention(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(q, k, v, group)``: this rank's rows of full attention, keys and values passed round the
    ring."""
    name = "ring attention"
    for n in nprocs:
        out_all = _ring_case(n)[3]  # (B, H, S, Dh) on one process
        want = [_rows(out_all, n, r) for r in range(n)]
        results = run_answer(_ring_worker, n, (fn, False), name,
                             hint="Post the isend and the irecv, compute, "
                             "then wait on both before using the received block.")
        for rank, r in enumerate(results):
            out = r["out"]
            _check_shape(name, n, rank, "the output", out, want[rank])
            if _close(out, want[rank], TOL):
                continue
            if _close(out, r["own"], TOL):
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank} attended to its own keys only; the blocks "
                    "of the other ranks must come round the ring (cp steps, cp-1 messages).")
            raise ExerciseError(
                f"{name} on {n} ranks: rank {rank}'s output differs from one process by up to "
                f"{(out - want[rank]).abs().max().item():.3g}. Each of the cp steps must fold the "
                "block held then into the running (m, row_sum, acc), and the output is acc / "
                "row_sum after the last; check that the block you compute with is the one received "
                "(after wait), and that none is used twice.")
        for tr in results.traces:
            sends = _ring_sends(name, tr, n)
            if len(sends) != n - 1:
                raise wrong(name, f"{name} on {n} ranks: rank {tr.rank} sent {len(sends)} "
                            "messages. The ring has cp steps, and the block held at the last step "
                            "goes nowhere; send k and v together (torch.stack), one message per "
                            "step.", f"{n - 1} sends per rank")
    passed(name, f"{', '.join(map(str, nprocs))} ranks, cp-1 messages each to the next rank")


# -- exercise 4: the bytes of the ring -------------------------------------------------------------
def check_ring_bytes(fn) -> None:
    """``fn(batch, seq, kv_heads, head_dim, cp, dtype_bytes)`` must give cost.cp_attention_bytes."""
    name = "ring bytes"
    refuse_own(name, fn, cost.cp_attention_bytes)
    for args in ((1, 4096, 8, 128, 4, 2), (2, 1024, 2, 64, 2, 4), (1, 131072, 8, 128, 16, 2)):
        batch, seq, hkv, dh, n, b = args
        want = cost.cp_attention_bytes(*args)
        got = _call(name, fn, *args)
        if got is None:
            raise ExerciseError(f"{name}: the function returned None; return a number of bytes.")
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        kv = batch * hkv * seq / n * dh * b
        known = {
            (n - 1) * 2 * kv: "that is the forward alone; backward sends the blocks round again "
                              "and their gradients dK, dV with them",
            (n - 1) * 2 * kv * 3: "the gradients dK, dV make cp hops, not cp-1: one more brings "
                                  "each rank's own home",
            want / 2: "keys AND values travel: 2·KV per hop",
            want * n: "KV is one rank's block: S/cp positions, not S",
        }
        for value, why in known.items():
            if math.isclose(got, value, rel_tol=1e-9):
                raise wrong(name, f"for B={batch}, S={seq}, Hkv={hkv}, Dh={dh}, cp={n}, b={b} you "
                                  f"gave {got:,.0f}: {why}.", f"{want:,.0f} bytes")
        raise wrong(name, f"for B={batch}, S={seq}, Hkv={hkv}, Dh={dh}, cp={n}, b={b} you gave "
                          f"{got:,.0f}. One rank's block is KV = B·Hkv·(S/cp)·Dh·b bytes of keys, "
                          "as many of values. Count the hops: in forward the blocks go round the "
                          "ring; in backward they go round again, and their gradients dK, dV "
                          "travel with them and must end on the rank that owns the block.",
                    f"{want:,.0f} bytes")
    passed(name, "three shapes, LLaMA-3-8B at 128K tokens among them")


# -- exercise 5: the backward ring -----------------------------------------------------------------
def _backward_parts(n: int) -> dict:
    """Everything the checker compares a rank's (dq, dk, dv) with, on one process: autograd's
    gradients and the results of the usual mistakes, each cut into the ranks' slices."""
    q, k, v, out, lse, dout = _ring_case(n)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _attention(*leaves)[0].backward(dout)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, S, S)
    p = torch.exp(scores - lse.unsqueeze(-1))  # the whole row's softmax
    dp = dout @ v.transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    c = q.shape[2] // n
    block = [slice(i * c, (i + 1) * c) for i in range(n)]

    def rank_rows(t):
        return [t[:, :, b] for b in block]

    # each block's own softmax
    local_p = [scores[:, :, i, j].softmax(-1) for i in block for j in block]
    return {
        "want": [rank_rows(t.grad) for t in leaves],  # [dq, dk, dv][rank]
        "no statistics dv": [sum(local_p[i * n + j].transpose(-2, -1) @ dout[:, :, block[i]]
                                 for i in range(n))
                             for j in range(n)],
        "own dk": [ds[:, :, b, b].transpose(-2, -1) @ q[:, :, b] * scale for b in block],
        "own dv": [p[:, :, b, b].transpose(-2, -1) @ dout[:, :, b] for b in block],
        "no delta dk": rank_rows((p * dp).transpose(-2, -1) @ q * scale),
        "last dq": [ds[:, :, block[r], block[(r + 1) % n]] @ k[:, :, block[(r + 1) % n]] * scale
                    for r in range(n)],
    }


def _diagnose_backward(n: int, rank: int, got, parts: dict) -> str | None:
    """What is wrong with rank's (dq, dk, dv), or None when nothing is."""
    dq, dk, dv = got
    want_dq, want_dk, want_dv = (g[rank] for g in parts["want"])
    if _close(dq, want_dq) and _close(dk, want_dk) and _close(dv, want_dv):
        return None
    neighbour = (rank + 1) % n
    if not _close(dv, want_dv):
        if _close(dv, parts["no statistics dv"][rank]):
            return ("dv was computed with each block's own softmax, normalised over that block's "
                    "keys only. A query's probabilities are over the whole sequence: exp(scores - "
                    "lse), with the lse the forward gave (the softmax statistics), so that each "
                    "row sums to 1 over all n blocks.")
        if n > 1 and _close(dv, parts["want"][2][neighbour]) and _close(
            dk, parts["want"][1][neighbour]):
            return (f"dk and dv are right, but they are rank {neighbour}'s: one hop short. After "
                    "the n steps the accumulator a rank holds belongs to the next rank's block; "
                    "send it on once more, so that the gradients travel n hops and each block's "
                    "dK, dV arrive home.")
        if _close(dv, parts["own dv"][rank]) or _close(dk, parts["own dk"][rank]):
            return ("dk and dv hold only what this rank's own queries give its keys. Every rank's "
                    "queries read them: the dK/dV accumulator must travel round the ring with its "
                    "block, each rank adding its queries' part, and come back to the block's "
                    "owner.")
        return ("dv differs from one process. At each step add P_blockᵀ @ dout to the accumulator "
                "of the block held then (P_block = exp(q kᵀ/√Dh - lse) for that block), pass the "
                "accumulator on with the block, and return the one that arrives after n hops.")
    if not _close(dk, want_dk):
        if _close(dk, parts["no delta dk"][rank]):
            return (
                "dv is right but dk (and dq) are not: the softmax's backward is dS = P·(dP - Δ), "
                "dP = dout @ vᵀ, where Δ = rowsum(dout · out) is one number per query row (the "
                "forward's out gives it; no block alone does).")
        if _close(dk, want_dk * math.sqrt(dq.shape[-1])):
            return ("dk is √Dh times too big: the scores were q kᵀ/√Dh, so dk = dSᵀ @ q / √Dh (and "
                    "dq likewise).")
        return ("dv is right but dk differs from one process: dk of a block is dSᵀ @ q / √Dh, with "
                "dS = P·(dP - Δ), added into the accumulator that travels with the block.")
    if _close(dq, parts["last dq"][rank]):
        return ("dq holds only the last step's block: each step's part replaced the sum. The "
                "queries stay here and meet all n blocks; dq is the sum of dS @ k_block / √Dh over "
                "the n steps.")
    if _close(dq * n, want_dq):
        return ("dq is n times too small: the blocks' parts add up (each covers other keys), not "
                "average.")
    if _close(dq, want_dq * math.sqrt(dq.shape[-1])):
        return "dq is √Dh times too big: the scores were q kᵀ/√Dh, so dq = dS @ k / √Dh."
    return (
        "dk and dv are right but dq differs from one process: dq is the sum over the n steps of "
        "dS @ k_block / √Dh, with k_block the keys held at that step.")


def check_ring_backward(fn, nprocs: tuple[int, ...] = (2, 4), timeout: float = 30.0) -> None:
    """``fn(q, k, v, out, lse, dout, group)``: this rank's (dq, dk, dv) of full attention, the
    key/value blocks and their dK/dV accumulators passed round the ring, each accumulator arriving
    home."""
    name = "ring backward"
    refuse_own(name, fn, cp.ring_attention, cp.RingAttention, cp.block_attention_backward)
    for n in nprocs:
        parts = _backward_parts(n)
        results = run_answer(_ring_worker, n, (fn, True), name, timeout,
                             hint="Post each isend with its irecv, "
                             "compute, then wait before using what arrived.", hang_hint=HANG_HINT
                             + " On the ring every isend needs its irecv on the next rank, in the "
                             "same order: the block at each step but the last, its dK/dV "
                             "accumulator at every step.")
        for rank, r in enumerate(results):
            if r["grads"] is None:
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank} returned no (dq, dk, dv) triple.")
            for what, got, want in zip(("dq", "dk", "dv"), r["grads"],
                                       (g[rank] for g in parts["want"])):
                _check_shape(name, n, rank, what, got, want)
            why = _diagnose_backward(n, rank, r["grads"], parts)
            if why:
                raise ExerciseError(f"{name} on {n} ranks, rank {rank}: {why}")
        _, _, _, _, _, dout = _ring_case(n)
        B, H, S, Dh = dout.shape
        want_bytes = cost.cp_attention_bytes(B, S, H, Dh, n) - cost.cp_attention_bytes(
            B, S, H, Dh, n, backward=False)
        kv2 = 2 * cost.cp_kv_block_bytes(B, S, H, Dh, n)
        for tr in results.traces:
            sends = _ring_sends(name, tr, n)
            sent = sum(e.sent_bytes for e in sends)
            if sent != want_bytes:
                why = ("the block held at the last step need go nowhere: the blocks travel n-1 "
                       "hops, their accumulators n" if sent == 2 * n * kv2 else
                       "the blocks travel n-1 hops and their dK/dV accumulators n, 2KV bytes each "
                       "hop")
                raise wrong(name,
                            f"{name} on {n} ranks: rank {tr.rank} sent {sent:,.0f} bytes; {why}.",
                            f"{want_bytes:,.0f} bytes per rank, (n-1)·2KV + n·2KV")
            if len(sends) not in (2 * n - 1, n):
                raise wrong(name, f"{name} on {n} ranks: rank {tr.rank} sent {len(sends)} "
                            "messages. Send k and v together (torch.stack), and dK and dV "
                            "together: one block at each step but the last, one accumulator at "
                            "every step.", f"{2 * n - 1} sends per rank")
    passed(name,
           f"dq, dk, dv match one process's autograd on {' and '.join(map(str, nprocs))} ranks; "
                 "every message to the next rank, every dK/dV accumulator home after n hops")


# -- worked problems: estimates from the hardware sheet (minitp.exercises.problems) ----------------
SEQ_128K = 131072


def _hidden_tokens_per_rank(tp: int = 8) -> float:
    """LLaMA-3-70B, tp ranks in a machine (H/tp query and Hkv/tp key/value heads per GPU), cp across
    machines, bf16, causal with the balanced chunks: the fewest positions per rank Sl at which one
    ring step's forward (half of a full Sl x Sl block: 2·(H/tp)·Dh·Sl² FLOPs) takes as long as
    sending the step's key/value block over InfiniBand (2·(Hkv/tp)·Sl·Dh·2 bytes). The send grows as
    Sl, the compute as Sl²."""
    from minitp.models import LLAMA3_70B as cfg

    device = cost.H100
    send_per_position = 2 * cost.cp_kv_block_bytes(1, 1, cfg.kv_heads // tp, cfg.head_dim, 1, 2) \
        / device.inter.bytes_per_s  # seconds per position of the block
    compute_per_position_squared = cost.compute_time(2 * (cfg.n_heads // tp) * cfg.head_dim, device)
    # 2,967 exactly, not above
    return math.ceil(send_per_position / compute_per_position_squared - 1e-9)


def _ring_over_ulysses(n: int = 8) -> float:
    """LLaMA-3-70B, one 128K-token sequence in bf16, cp = n: what one rank sends for one layer's
    attention, forward and backward, the ring's bytes over Ulysses'."""
    from minitp.models import LLAMA3_70B as cfg

    ring = cost.cp_attention_bytes(1, SEQ_128K, cfg.kv_heads, cfg.head_dim, n, 2)
    ulysses = cost.ulysses_attention_bytes(1, SEQ_128K, cfg.n_heads, cfg.kv_heads, cfg.head_dim, n,
                                           2)
    return ring / ulysses


def _gathered_kv_gib(tp: int = 8) -> float:
    """LLaMA-3-70B, one 128K-token sequence in bf16, tp = 8, all-gather context parallel: the
    gathered keys and values of every layer, kept for backward, on one GPU, in GiB: a KV cache of
    the whole sequence (2·L·(Hkv/tp)·Dh·b per position), whatever cp is."""
    from minitp.models import LLAMA3_70B as cfg

    return cost.kv_cache_bytes(cfg, SEQ_128K, tp=tp, dtype_bytes=2) / 2**30


_P2 = _ring_over_ulysses()
PROBLEMS = {
    1: Problem("problem 1, where the ring stops hiding", _hidden_tokens_per_rank, "tokens",
               {0.5: "a causal step with the balanced chunks computes half of a full block (two of "
                     "its four chunk pairs), and the block sent holds keys AND values",
                2.0: "bf16: 2 bytes per number",
                8.0: "the ratio of heads: the block carries Hkv/tp = 1 key/value head, the compute "
                     "runs H/tp = 8 query heads",
                1 / 9: "that is NVLink's 450 GB/s: with tp = 8 filling a machine, the cp ring "
                       "crosses machines (InfiniBand, 50 GB/s)",
                1 / 0.6: "the compute runs at 0.6 × 989 TFLOP/s (cost.H100.efficiency), not the "
                         "peak"}),
    2: Problem("problem 2, Ulysses against the ring", _ring_over_ulysses, "",
               {21 / 22: "the ring's gradients take cp hops, not cp-1: 3cp-2 = 22 hops of 2KV",
                7 / 8: "each all-to-all keeps its own (1/cp) share: (cp-1)/cp of each tensor "
                       "leaves the rank",
                (2 * 64 + 2 * 8) / (4 * 64): "k and v carry Hkv = 8 heads, q and the output H = 64",
                7 / 22: "count backward for the ring too: forward (cp-1)·2KV, in all (3cp-2)·2KV",
                1 / _P2**2: "that is Ulysses' bytes over the ring's; the question asks the ring's "
                            "over Ulysses'"},
               rel=0.02),
    3: Problem("problem 3, the all-gather's keys and values", _gathered_kv_gib, "GiB",
               {8.0: "a GPU holds Hkv/tp = 1 of the key/value heads (tp = 8 splits them), and only "
                     "key/value heads are gathered, not the 64 query heads",
                1 / 16: "that is this rank's own S/cp positions, what the ring keeps; the "
                        "all-gather keeps all S",
                0.5: "keys AND values: 2·L·(Hkv/tp)·Dh·b per position",
                1 / 80: "that is one layer; the question asks for all 80"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 07: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
