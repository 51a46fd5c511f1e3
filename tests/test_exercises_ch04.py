"""The chapter 04 checkers accept the right answers and catch the usual mistakes with a useful message."""

import pytest
import torch.nn.functional as F

from minitp import comm, regions
from minitp.exercises import ExerciseError, ch04
from minitp.exercises.heads import causal_attention


# -- splitting the weights -------------------------------------------------------------------------
def split_right(w1, w3, w2, rank, n):
    return w1.chunk(n, dim=0)[rank], w3.chunk(n, dim=0)[rank], w2.chunk(n, dim=1)[rank]


def split_w1_along_d(w1, w3, w2, rank, n):
    return w1.chunk(n, dim=1)[rank], w3.chunk(n, dim=1)[rank], w2.chunk(n, dim=1)[rank]


def split_w2_like_w1(w1, w3, w2, rank, n):
    return w1.chunk(n, dim=0)[rank], w3.chunk(n, dim=0)[rank], w2.chunk(n, dim=0)[rank]


def split_w1_and_w3_differently(w1, w3, w2, rank, n):
    return w1.chunk(n, dim=0)[rank], w3.chunk(n, dim=0)[(rank + 1) % n], w2.chunk(n, dim=1)[rank]


def split_w1_strided(w1, w3, w2, rank, n):  # interleaved units for w1 only
    return w1[rank::n], w3.chunk(n, dim=0)[rank], w2.chunk(n, dim=1)[rank]


def split_w2_wrong_units(w1, w3, w2, rank, n):
    return w1.chunk(n, dim=0)[rank], w3.chunk(n, dim=0)[rank], w2.chunk(n, dim=1)[(rank + 1) % n]


def split_every_rank_the_same(w1, w3, w2, rank, n):
    return w1.chunk(n, dim=0)[0], w3.chunk(n, dim=0)[0], w2.chunk(n, dim=1)[0]


def split_stub(w1, w3, w2, rank, n):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_split_swiglu_accepts_the_answer(capsys):
    ch04.check_split_swiglu(split_right)
    assert "[ok] split the SwiGLU weights" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (split_w1_along_d, "split w1 along D"),
    (split_w2_like_w1, "the same way as w1"),
    (split_w1_and_w3_differently, "W1 and W3 must be split the same way"),
    (split_w1_strided, "W1 and W3 must be split the same way"),
    (split_w2_wrong_units, "w2 reads units"),
    (split_every_rank_the_same, "held twice"),
    (split_stub, "not done yet"),
])
def test_split_swiglu_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch04.check_split_swiglu(answer)


# -- the parallel forward -----------------------------------------------------------------------------
def swiglu_right(x, w1, w3, w2, group):
    x = regions.copy_to_parallel(x, group)
    h = F.silu(F.linear(x, w1)) * F.linear(x, w3)
    return regions.reduce_from_parallel(F.linear(h, w2), group)


def swiglu_forgets_g(x, w1, w3, w2, group):
    x = regions.copy_to_parallel(x, group)
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def swiglu_forgets_f(x, w1, w3, w2, group):
    return regions.reduce_from_parallel(F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2), group)


def swiglu_sums_before_silu(x, w1, w3, w2, group):
    x = regions.copy_to_parallel(x, group)
    a = regions.reduce_from_parallel(F.linear(x, w1), group)
    return regions.reduce_from_parallel(F.linear(F.silu(a) * F.linear(x, w3), w2), group)


def swiglu_f_per_linear(x, w1, w3, w2, group):
    h = F.silu(F.linear(regions.copy_to_parallel(x, group), w1)) * F.linear(regions.copy_to_parallel(x, group), w3)
    return regions.reduce_from_parallel(F.linear(h, w2), group)


def test_parallel_swiglu_accepts_the_answer(capsys):
    ch04.check_parallel_swiglu(swiglu_right)
    assert "[ok] tensor-parallel SwiGLU" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (swiglu_forgets_g, "only its partial sum"),
    (swiglu_forgets_f, "Enter the region with f"),
    (swiglu_sums_before_silu, "summing before a SiLU"),
    (swiglu_f_per_linear, "Apply f once"),
])
def test_parallel_swiglu_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch04.check_parallel_swiglu(answer)


# -- bytes per rank --------------------------------------------------------------------------------
def test_swiglu_bytes_accepts_the_formula(capsys):
    ch04.check_swiglu_bytes_per_rank(lambda d, f, tp, b: 3 * d * f * b / tp)
    assert "[ok]" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda d, f, tp, b: 3 * d * f * b, "1/tp of every matrix"),
    (lambda d, f, tp, b: d * f * b / tp, "That is one matrix"),
    (lambda d, f, tp, b: 2 * d * f * b / tp, "w1 and w3"),
    (lambda d, f, tp, b: 3 * d * f / tp, "bytes per element"),
])
def test_swiglu_bytes_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch04.check_swiglu_bytes_per_rank(answer)


# -- exercise 4: grouped-query attention split by heads (2 processes) ------------------------------
def gqa_attention(x, wq, wk, wv, wo, n_heads, n_kv_heads, group, *, g=True, repeat="interleave",
                  kv_like_q=False):
    B, S, D = x.shape
    n, r = comm.group_size(group), comm.group_rank(group)
    dh = wq.shape[0] // n_heads
    hq, hkv = n_heads // n, n_kv_heads // n
    q_rows = slice(r * hq * dh, (r + 1) * hq * dh)
    kv_rows = q_rows if kv_like_q else slice(r * hkv * dh, (r + 1) * hkv * dh)
    x = regions.copy_to_parallel(x, group)

    def heads(w, rows):
        w = w[rows]
        return (x @ w.T).view(B, S, w.shape[0] // dh, dh).transpose(1, 2)

    q, k, v = heads(wq, q_rows), heads(wk, kv_rows), heads(wv, kv_rows)
    group_size = q.shape[1] // k.shape[1]
    if repeat == "interleave":
        k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
    elif repeat == "tile":  # planted: heads 0,1,0,1 instead of 0,0,1,1
        k, v = k.repeat(1, group_size, 1, 1), v.repeat(1, group_size, 1, 1)
    out = causal_attention(q, k, v).transpose(1, 2).reshape(B, S, hq * dh)
    partial = out @ wo[:, q_rows].T
    return regions.reduce_from_parallel(partial, group) if g else partial


def test_gqa_attention_passes(capsys):
    ch04.check_gqa_attention(gqa_attention)
    assert "[ok] grouped-query attention" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    ({"repeat": None}, "repeat it for its group"),
    ({"repeat": "tile"}, "j // \\(H/Hkv\\)"),
    ({"kv_like_q": True}, "key/value heads \\[r·Hkv/n"),
    ({"g": False}, "never added up"),
])
def test_gqa_attention_mistakes_caught(kwargs, message):
    def answer(*args):
        return gqa_attention(*args, **kwargs)

    with pytest.raises(ExerciseError, match=message):
        ch04.check_gqa_attention(answer)


def test_swiglu_bytes_show_the_expected_bytes_from_the_second_try():
    # the first case: D=4096, F=14336, tp=1, 2 bytes per element: 3·D·F·b
    want = f"Expected: {3 * 4096 * 14336 * 2:,} bytes"
    with pytest.raises(ExerciseError) as first:
        ch04.check_swiglu_bytes_per_rank(lambda d, f, tp, b: 1.0)
    assert f"{3 * 4096 * 14336 * 2:,}" not in str(first.value) and "show_expected" in str(first.value)
    with pytest.raises(ExerciseError, match=want):
        ch04.check_swiglu_bytes_per_rank(lambda d, f, tp, b: 1.0)
