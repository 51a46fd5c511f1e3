"""The chapter 07 checkers accept the right answers and catch the usual mistakes with a useful message."""

import math

import pytest
import torch
from hint_levels import first_then_second

from minitp import comm
from minitp.exercises import ExerciseError, ch07


def stub(*args):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


# -- balanced chunks ---------------------------------------------------------------------------------
def chunks_right(seq_len, cp, rank):
    size = seq_len // (2 * cp)
    return [range(i * size, (i + 1) * size) for i in (rank, 2 * cp - 1 - rank)]


def chunks_contiguous(seq_len, cp, rank):
    size = seq_len // cp
    return [range(rank * size, (rank + 1) * size)]


def chunks_wrong_mirror(seq_len, cp, rank):
    size = seq_len // (2 * cp)
    return [range(i * size, (i + 1) * size) for i in (rank, cp - 1 - rank)]


def test_balanced_chunks_accepts_the_answer(capsys):
    ch07.check_balanced_chunks(chunks_right)
    assert "[ok] balanced chunks" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (chunks_contiguous, "contiguous slice"),
    (chunks_wrong_mirror, "its partner lies as far from the end"),
    (stub, "not done yet"),
])
def test_balanced_chunks_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch07.check_balanced_chunks(answer)


def test_balanced_chunks_says_how_uneven_contiguous_slices_are():
    # the first case is cp = 2: rank r does r·c² + c(c+1)/2 pairs, the last about 2·cp-1 = 3 times rank 0
    with pytest.raises(ExerciseError, match=r"about 2·cp-1 = 3 times the first one's work"):
        ch07.check_balanced_chunks(chunks_contiguous)


# -- online softmax ----------------------------------------------------------------------------------
def softmax_right(m, row_sum, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(-1))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    correction, p = torch.exp(m - safe), torch.exp(scores - safe.unsqueeze(-1))
    return m_new, row_sum * correction + p.sum(-1), acc * correction.unsqueeze(-1) + p @ v


def softmax_no_max(m, row_sum, acc, scores, v):
    p = torch.exp(scores)
    return torch.maximum(m, scores.amax(-1)), row_sum + p.sum(-1), acc + p @ v


def softmax_forgets_acc(m, row_sum, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(-1))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    correction, p = torch.exp(m - safe), torch.exp(scores - safe.unsqueeze(-1))
    return m_new, row_sum * correction + p.sum(-1), acc + p @ v  # acc not rescaled


def softmax_replaces(m, row_sum, acc, scores, v):
    m_new = scores.amax(-1)
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(scores - safe.unsqueeze(-1))
    return m_new, p.sum(-1), p @ v


def test_online_softmax_accepts_the_answer(capsys):
    ch07.check_online_softmax(softmax_right)
    assert "[ok] online softmax" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (softmax_no_max, "inf or nan"),
    (softmax_forgets_acc, "multiply row_sum AND acc"),
    (softmax_replaces, "only the last block counts"),
    (stub, "not done yet"),
])
def test_online_softmax_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch07.check_online_softmax(answer)


def test_online_softmax_refuses_minitps_own_fold():
    from minitp import cp

    with pytest.raises(ExerciseError, match="the exercise is to write it"):
        ch07.check_online_softmax(cp.online_softmax_update)

    def calls_the_library(m, row_sum, acc, scores, v):
        return cp.online_softmax_update(m, row_sum, acc, scores, v)

    with pytest.raises(ExerciseError, match="your code calls minitp.cp.online_softmax_update"):
        ch07.check_online_softmax(calls_the_library)


# -- the ring ----------------------------------------------------------------------------------------
def _ring(q, k, v, group, to_next=True, steps=None):
    n, rank = comm.group_size(group), comm.group_rank(group)
    ranks = comm.group_ranks(group)
    peer_out, peer_in = (ranks[(rank + 1) % n], ranks[(rank - 1) % n]) if to_next else \
        (ranks[(rank - 1) % n], ranks[(rank + 1) % n])
    m = torch.full(q.shape[:-1], float("-inf"))
    row_sum, acc = torch.zeros(q.shape[:-1]), torch.zeros_like(q)
    kv = torch.stack([k, v])
    for step in range(n if steps is None else steps):
        if step < n - 1:
            incoming = torch.empty_like(kv)
            handles = [comm.isend(kv, peer_out, group), comm.irecv(incoming, peer_in, group)]
        scores = q @ kv[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
        m, row_sum, acc = softmax_right(m, row_sum, acc, scores, kv[1])
        if step < n - 1:
            for h in handles:
                h.wait()
            kv = incoming
    return acc / row_sum.unsqueeze(-1)


def ring_right(q, k, v, group):
    return _ring(q, k, v, group)


def ring_backwards(q, k, v, group):
    return _ring(q, k, v, group, to_next=False)


def ring_own_only(q, k, v, group):
    return _ring(q, k, v, group, steps=1)


def ring_averages_blocks(q, k, v, group):
    """Each block's softmax on its own, averaged: the blocks' normalisers never meet."""
    n, rank, ranks = comm.group_size(group), comm.group_rank(group), comm.group_ranks(group)
    kv, total = torch.stack([k, v]), 0
    for step in range(n):
        if step < n - 1:
            incoming = torch.empty_like(kv)
            handles = [comm.isend(kv, ranks[(rank + 1) % n], group), comm.irecv(incoming, ranks[(rank - 1) % n], group)]
        total = total + torch.softmax(q @ kv[0].transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ kv[1]
        if step < n - 1:
            for h in handles:
                h.wait()
            kv = incoming
    return total / n


def test_ring_attention_accepts_the_answer(capsys):
    ch07.check_ring_attention(ring_right)
    assert "[ok] ring attention" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (ring_backwards, "sends to the next one|every rank sends to the next"),
    (ring_own_only, "attended to its own keys only"),
    (ring_averages_blocks, "differs from one process"),
    (stub, "not done yet"),
])
def test_ring_attention_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch07.check_ring_attention(answer, nprocs=(4,) if answer is ring_backwards else (2,))


# -- the bytes ---------------------------------------------------------------------------------------
def bytes_right(batch, seq, kv_heads, head_dim, cp, dtype_bytes):
    kv = batch * kv_heads * seq / cp * head_dim * dtype_bytes
    return (cp - 1) * 2 * kv + (cp - 1) * 2 * kv + cp * 2 * kv


def bytes_forward_only(batch, seq, kv_heads, head_dim, cp, dtype_bytes):
    return (cp - 1) * 2 * batch * kv_heads * seq / cp * head_dim * dtype_bytes


def bytes_no_home_hop(batch, seq, kv_heads, head_dim, cp, dtype_bytes):
    return 3 * bytes_forward_only(batch, seq, kv_heads, head_dim, cp, dtype_bytes)


def bytes_whole_sequence(batch, seq, kv_heads, head_dim, cp, dtype_bytes):
    return bytes_right(batch, seq * cp, kv_heads, head_dim, cp, dtype_bytes)


def bytes_4cp_minus_3(batch, seq, kv_heads, head_dim, cp, dtype_bytes):
    return (4 * cp - 3) * 2 * batch * kv_heads * seq / cp * head_dim * dtype_bytes


def test_ring_bytes_accepts_the_answer(capsys):
    ch07.check_ring_bytes(bytes_right)
    assert "[ok] ring bytes" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (bytes_forward_only, "forward alone"),
    (bytes_no_home_hop, "cp hops, not cp-1"),
    (bytes_whole_sequence, "S/cp positions"),
    (bytes_4cp_minus_3, "Count the hops"),
    (stub, "not done yet"),
])
def test_ring_bytes_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch07.check_ring_bytes(answer)


# -- hints in levels: the expected value shows from the second wrong try on ----------------------------
def test_balanced_chunks_show_the_expected_chunks_from_the_second_try():
    want = str([range(0, 4), range(12, 16)])  # the first case: seq_len=16, cp=2, rank 0, chunks of 4
    with pytest.raises(ExerciseError) as first:
        ch07.check_balanced_chunks(chunks_wrong_mirror)
    assert want not in str(first.value) and "show_expected('balanced chunks')" in str(first.value)
    with pytest.raises(ExerciseError) as second:
        ch07.check_balanced_chunks(chunks_wrong_mirror)
    assert f"Expected: {want}" in str(second.value)


def test_ring_bytes_show_the_expected_bytes_from_the_second_try():
    want = f"{bytes_right(1, 4096, 8, 128, 4, 2):,.0f} bytes"  # the first case
    with pytest.raises(ExerciseError) as first:
        ch07.check_ring_bytes(bytes_4cp_minus_3)
    assert want not in str(first.value) and "Expected:" not in str(first.value)
    with pytest.raises(ExerciseError, match=f"Expected: {want}"):
        ch07.check_ring_bytes(bytes_4cp_minus_3)


def test_ring_bytes_refuses_minitps_own_formula():
    from minitp import cost

    with pytest.raises(ExerciseError, match="the exercise is to write it"):
        ch07.check_ring_bytes(cost.cp_attention_bytes)


def test_ring_attention_shows_the_expected_peer_from_the_second_try():
    first_then_second(ch07.check_ring_attention, ring_backwards, nprocs=(4,), expected="rank 0 sends to rank 1 only")


# -- the backward ring -------------------------------------------------------------------------------
def _back_ring(q, k, v, out, lse, dout, group, home=True, statistics=True, delta=True, sum_dq=True,
               own_only=False, last_block_too=False, hang=False):
    """The ring's backward, by the book unless a flag plants a mistake."""
    n, rank, ranks = comm.group_size(group), comm.group_rank(group), comm.group_ranks(group)
    nxt, prev = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    scale = 1 / math.sqrt(q.shape[-1])
    rowwise = (dout * out).sum(-1, keepdim=True) if delta else 0
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    dkv = torch.zeros_like(kv)
    for step in range(n):
        travels = step < n - 1 or last_block_too
        if travels:
            incoming = torch.empty_like(kv)
            handles = [comm.isend(kv, nxt, group), comm.irecv(incoming, prev, group)]
        scores = q @ kv[0].transpose(-2, -1) * scale
        p = torch.exp(scores - lse.unsqueeze(-1)) if statistics else scores.softmax(-1)
        ds = p * (dout @ kv[1].transpose(-2, -1) - rowwise)
        part = ds @ kv[0] * scale
        dq = dq + part if sum_dq else part
        if not own_only or step == 0:
            dkv = dkv + torch.stack([ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout])
        if own_only:
            own = dkv
        grads_hop = home or step < n - 1
        if grads_hop and not own_only:
            arriving = torch.empty_like(dkv)
            grad_handles = [comm.irecv(arriving, prev, group)] + ([] if hang and step == n - 1 else
                                                                  [comm.isend(dkv, nxt, group)])
        if travels:
            for h in handles:
                h.wait()
            kv = incoming
        if grads_hop and not own_only:
            for h in grad_handles:
                h.wait()
            dkv = arriving
    if own_only:
        dkv = own
    return dq, dkv[0], dkv[1]


def back_right(q, k, v, out, lse, dout, group):
    return _back_ring(q, k, v, out, lse, dout, group)


def back_one_hop_short(q, k, v, out, lse, dout, group):
    return _back_ring(q, k, v, out, lse, dout, group, home=False)


def back_never_sent_home(q, k, v, out, lse, dout, group):
    return _back_ring(q, k, v, out, lse, dout, group, own_only=True)


def back_no_statistics(q, k, v, out, lse, dout, group):
    return _back_ring(q, k, v, out, lse, dout, group, statistics=False)


def back_no_delta(q, k, v, out, lse, dout, group):
    return _back_ring(q, k, v, out, lse, dout, group, delta=False)


def back_dq_replaced(q, k, v, out, lse, dout, group):
    return _back_ring(q, k, v, out, lse, dout, group, sum_dq=False)


def back_sends_the_last_block(q, k, v, out, lse, dout, group):
    return _back_ring(q, k, v, out, lse, dout, group, last_block_too=True)


def back_hangs(q, k, v, out, lse, dout, group):
    return _back_ring(q, k, v, out, lse, dout, group, hang=True)


def back_calls_the_library(q, k, v, out, lse, dout, group):
    from minitp import cp

    return cp.block_attention_backward(q, k, v, lse, dout, (dout * out).sum(-1), [range(4)], [range(4)], False)


def test_ring_backward_accepts_the_answer(capsys):
    ch07.check_ring_backward(back_right)
    assert "[ok] ring backward" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (back_one_hop_short, "one hop short"),
    (back_never_sent_home, "only what this rank's own queries give its keys"),
    (back_no_statistics, "each block's own softmax"),
    (back_no_delta, r"Δ = rowsum\(dout · out\)"),
    (back_dq_replaced, "dq holds only the last step's block"),
    (back_sends_the_last_block, "the block held at the last step need go nowhere"),
    (stub, "not done yet"),
])
def test_ring_backward_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch07.check_ring_backward(answer, nprocs=(2,))


def test_ring_backward_catches_a_mistake_on_4_ranks_too():
    with pytest.raises(ExerciseError, match="on 4 ranks, rank 0: dk and dv are right, but they are rank 1's"):
        ch07.check_ring_backward(back_one_hop_short, nprocs=(4,))


def test_ring_backward_names_a_hang():
    with pytest.raises(ExerciseError, match="hung .*every isend needs its irecv on the next rank"):
        ch07.check_ring_backward(back_hangs, nprocs=(2,), timeout=5.0)


def test_ring_backward_refuses_minitps_own_backward():
    with pytest.raises(ExerciseError, match="your code calls minitp.cp.block_attention_backward"):
        ch07.check_ring_backward(back_calls_the_library)


def test_ring_backward_shows_the_expected_bytes_from_the_second_try():
    want = f"{(2 * 2 - 1) * 2 * 2 * 2 * 4 * 8 * 4:,.0f} bytes per rank"  # (2n-1)·2KV, KV = B·H·(S/n)·Dh·4 = 512
    first_then_second(ch07.check_ring_backward, back_sends_the_last_block, nprocs=(2,), expected=want)


def ring_every_row_twice(q, k, v, group):
    out = _ring(q, k, v, group)
    return torch.cat([out, out], dim=2)


def test_ring_attention_names_a_wrong_shape_and_shows_the_shape_from_the_second_try():
    with pytest.raises(ExerciseError, match=r"one row per position this rank holds, \(B, H, S/n, Dh\)"):
        ch07.check_ring_attention(ring_every_row_twice, nprocs=(2,))
    with pytest.raises(ExerciseError, match=r"Expected: shape \(2, 2, 4, 8\)"):
        ch07.check_ring_attention(ring_every_row_twice, nprocs=(2,))
