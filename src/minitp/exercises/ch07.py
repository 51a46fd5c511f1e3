"""Checkers for chapter 07, context parallel (ring attention).

* ``check_balanced_chunks(fn)``: ``fn(seq_len, cp, rank)`` gives the positions rank holds under the
  load-balanced layout, as a list of ranges (chunks i and 2cp-1-i of 2cp); compared with
  ``minitp.layout.cp_chunks``.
* ``check_online_softmax(fn)``: ``fn(m, row_sum, acc, scores, v)`` folds one block of scores into the
  running max, sum and output; fed block by block, acc / row_sum must equal softmax(scores) @ v, even for
  scores in the thousands and rows whose first block is all masked.
* ``check_ring_attention(fn)``: ``fn(q, k, v, group)`` is full (unmasked) attention of this rank's
  queries against every rank's keys, the key/value blocks passed around the ring with
  ``comm.isend``/``comm.irecv``. Run on 2 and 4 ranks; output compared with one process, messages with
  cp-1 sends per rank, each to the next rank.
* ``check_ring_bytes(fn)``: ``fn(batch, seq, kv_heads, head_dim, cp, dtype_bytes)`` gives the bytes one
  rank sends for one attention forward and backward, (3cp-2)·2KV; compared with
  ``minitp.cost.cp_attention_bytes``.
"""

from __future__ import annotations

import math

import torch

from minitp import cost, cp, layout, trace
from minitp.exercises import ExerciseError, not_implemented, passed, refuse_own, run_answer, wrong

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
            raise ExerciseError(f"{name}: not done yet (the function still raises NotImplementedError). "
                                "Replace the stub with your answer and run the check again.") from None
        raise ExerciseError(f"{name}: the function raised {type(err).__name__}: {err}") from None


# -- exercise 1: the load-balanced chunks ------------------------------------------------------------
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
                hint = ("that is the contiguous slice: under a causal mask rank r attends to r whole earlier slices "
                        "and half of its own (r·c² + c(c+1)/2 query-key pairs, c = seq_len/cp), so the last rank "
                        f"does about 2·cp-1 = {2 * n - 1} times the first one's work. Cut the sequence into 2·cp "
                        "chunks and give rank i two of them.")
            elif isinstance(got, list) and len(got) == 2 and got[0] == want[0]:
                hint = ("the first chunk is right but the second is not: its partner lies as far from the end of "
                        "the 2·cp chunks as the first lies from the start, so that an early chunk (little to "
                        "attend to) pairs with a late one (much).")
            elif isinstance(got, list) and got and all(len(r) == seq // n for r in got):
                hint = f"each chunk must hold seq_len / (2·cp) = {seq // (2 * n)} positions, not seq_len / cp."
            raise wrong(name, f"for seq_len={seq}, cp={n}, rank {rank} you gave {got}: "
                        + (hint or "rank i holds chunks i and 2·cp-1-i of 2·cp equal chunks."), str(want))
    passed(name, "every rank of cp = 2, 3, 4 and 8")


# -- exercise 2: the online softmax ------------------------------------------------------------------------
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
            raise ExerciseError(f"{name}: return the three running tensors (m, row_sum, acc), got {type(got).__name__}")
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
                f"{name}: with {what} the result holds inf or nan. Subtract the running max before exp "
                "(exp(1000) overflows in fp32), and treat a row whose max is still -inf (no key seen yet) "
                "so that exp(-inf - (-inf)) never happens: use 0 as its max.")
        if (out - want).abs().max().item() <= TOL:
            if (m - scores.amax(-1)).abs().max().item() > TOL:
                raise ExerciseError(f"{name}: the output is right but m is not the running max of the scores.")
            continue
        last_block = scores[..., 8:].softmax(-1) @ v[..., 8:, :]
        if (out - last_block).abs().max().item() <= 1e-4:
            raise ExerciseError(f"{name}: only the last block counts: the old sums were replaced, not carried. "
                                "Scale row_sum and acc by exp(m_old - m_new) and add the new block's terms.")
        raise ExerciseError(
            f"{name}: with {what}, acc / row_sum differs from softmax(scores) @ v by up to "
            f"{(out - want).abs().max().item():.3g}. When the max grows from m_old to m_new, every term "
            "already summed was exp(s - m_old) and must become exp(s - m_new): multiply row_sum AND acc by "
            "exp(m_old - m_new).")
    passed(name, "three blocks, scores up to ~3000, a row masked in its first block")


# -- exercise 3: the ring, with isend/irecv --------------------------------------------------------
def _ring_case(n: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2, 2, 4 * n, 8, generator=g) for _ in range(3)]  # q, k, v: (B, H, S, Dh)


def _ring_worker(fn):
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    q, k, v = (t.chunk(n, dim=2)[rank].contiguous() for t in _ring_case(n))  # (B, H, S/n, Dh) each
    with trace.scope(ANSWER):
        out = fn(q, k, v, None)
    return {"out": None if not isinstance(out, torch.Tensor) else out.detach(),
            "own": torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v}


def check_ring_attention(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(q, k, v, group)``: this rank's rows of full attention, keys and values passed round the ring."""
    name = "ring attention"
    for n in nprocs:
        q, k, v = _ring_case(n)
        want = (torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v).chunk(n, dim=2)
        results = run_answer(_ring_worker, n, (fn,), name, hint="Post the isend and the irecv, compute, then "
                             "wait on both before using the received block.")
        for rank, r in enumerate(results):
            out = r["out"]
            if out is None or out.shape != want[rank].shape:
                got = None if out is None else tuple(out.shape)
                raise ExerciseError(f"{name} on {n} ranks: rank {rank} returned {got}, expected a tensor of shape "
                                    f"{tuple(want[rank].shape)}: this rank's queries' outputs.")
            if (out - want[rank]).abs().max().item() <= TOL:
                continue
            if (out - r["own"]).abs().max().item() <= TOL:
                raise ExerciseError(f"{name} on {n} ranks: rank {rank} attended to its own keys only; the blocks "
                                    "of the other ranks must come round the ring (cp steps, cp-1 messages).")
            raise ExerciseError(
                f"{name} on {n} ranks: rank {rank}'s output differs from one process by up to "
                f"{(out - want[rank]).abs().max().item():.3g}. Each of the cp steps must fold the block held "
                "then into the running (m, row_sum, acc), and the output is acc / row_sum after the last; "
                "check that the block you compute with is the one received (after wait), and that none is used twice.")
        for tr in results.traces:
            sends = [e for e in tr.comm() if e.op == "send" and ANSWER in e.scopes]
            nxt = (tr.rank + 1) % n
            if not sends:
                raise ExerciseError(f"{name}: the output is right but no send was traced. Pass the blocks with "
                                    "minitp.comm.isend / comm.irecv so every byte is recorded.")
            if len(sends) != n - 1:
                raise ExerciseError(f"{name} on {n} ranks: rank {tr.rank} sent {len(sends)} messages; the ring "
                                    f"needs cp-1 = {n - 1} (the block held at the last step goes nowhere). Send "
                                    "k and v together (torch.stack) as one message per step.")
            if any(e.peer != nxt for e in sends):
                raise ExerciseError(f"{name} on {n} ranks: rank {tr.rank} sent to {sorted({e.peer for e in sends})}; "
                                    f"on this ring every rank sends to the next one, {nxt}, and receives from "
                                    f"the previous one, {(tr.rank - 1) % n}.")
    passed(name, f"{', '.join(map(str, nprocs))} ranks, cp-1 messages each to the next rank")


# -- exercise 4: the bytes of the ring ---------------------------------------------------------------------
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
            (n - 1) * 2 * kv: "that is the forward alone; backward sends the blocks round again and their "
                              "gradients dK, dV with them",
            (n - 1) * 2 * kv * 3: "the gradients dK, dV make cp hops, not cp-1: one more brings each rank's "
                                  "own home",
            want / 2: "keys AND values travel: 2·KV per hop",
            want * n: "KV is one rank's block: S/cp positions, not S",
        }
        for value, why in known.items():
            if math.isclose(got, value, rel_tol=1e-9):
                raise wrong(name, f"for B={batch}, S={seq}, Hkv={hkv}, Dh={dh}, cp={n}, b={b} you gave {got:,.0f}: "
                                  f"{why}.", f"{want:,.0f} bytes")
        raise wrong(name, f"for B={batch}, S={seq}, Hkv={hkv}, Dh={dh}, cp={n}, b={b} you gave {got:,.0f}. One "
                          "rank's block is KV = B·Hkv·(S/cp)·Dh·b bytes of keys, as many of values. Count the hops: "
                          "in forward the blocks go round the ring; in backward they go round again, and their "
                          "gradients dK, dV travel with them and must end on the rank that owns the block.",
                    f"{want:,.0f} bytes")
    passed(name, "three shapes, LLaMA-3-8B at 128K tokens among them")
