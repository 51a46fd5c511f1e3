"""The chapter 04 checkers accept the right answers and catch the usual mistakes with a useful message."""

import pytest
import torch
import torch.nn.functional as F
from hint_levels import first_then_second

from minitp import comm, regions
from minitp.exercises import ExerciseError, ch04
from minitp.exercises.heads import causal_attention
from minitp.models.llama import rms_norm


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


# -- exercise 5: sequence parallel around the norm (2 and 4 processes) --------------------------------
def _gather_positions(x, group, dim=1, flat=False):
    n = comm.group_size(group)
    out = torch.empty((n, *x.shape))
    comm.all_gather(out.view(-1), x.contiguous().view(-1), group=group)
    if flat:  # planted: the buffer read as (B, S, D), rank after rank
        return out.view(x.shape[0], n * x.shape[1], *x.shape[2:])
    return torch.cat(out.unbind(0), dim=dim)


def _scatter_positions(x, group, flat=False):
    n = comm.group_size(group)
    if flat:  # planted: a flat reduce-scatter, which splits dim 0 (the batch)
        out = torch.empty(x.shape[0] // n, *x.shape[1:])
        comm.reduce_scatter(out.view(-1), x.contiguous().view(-1), group=group)
        return out
    chunks = torch.stack(x.chunk(n, dim=1)).contiguous()
    out = torch.empty_like(chunks[0])
    comm.reduce_scatter(out.view(-1), chunks.view(-1), group=group)
    return out


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, flat=False):
        ctx.group = group
        return _scatter_positions(x, group, flat)

    @staticmethod
    def backward(ctx, grad):
        return _gather_positions(grad, ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim=1, flat=False, split_backward=False):
        ctx.group, ctx.split = group, split_backward
        return _gather_positions(x, group, dim, flat)

    @staticmethod
    def backward(ctx, grad):
        if ctx.split:  # planted: keep this rank's slice instead of summing the ranks' parts
            n, r = comm.group_size(ctx.group), comm.group_rank(ctx.group)
            return grad.chunk(n, dim=1)[r].contiguous(), None, None, None, None
        return _scatter_positions(grad, ctx.group), None, None, None, None


def sp_right(partial, residual, weight, eps, group):
    h = _Scatter.apply(partial, group) + residual  # (B, S/n, D)
    return h, _Gather.apply(rms_norm(h, weight, eps), group)  # (B, S, D)


def sp_keeps_all_reduce(partial, residual, weight, eps, group):
    n, r = comm.group_size(group), comm.group_rank(group)
    h = regions.reduce_from_parallel(partial, group).chunk(n, dim=1)[r] + residual
    return h, _Gather.apply(rms_norm(h, weight, eps), group)


def sp_gathers_flat(partial, residual, weight, eps, group):
    h = _Scatter.apply(partial, group) + residual
    return h, _Gather.apply(rms_norm(h, weight, eps), group, 1, True)


def sp_gathers_along_the_batch(partial, residual, weight, eps, group):
    h = _Scatter.apply(partial, group) + residual
    return h, _Gather.apply(rms_norm(h, weight, eps), group, 0)


def sp_scatters_flat(partial, residual, weight, eps, group):
    h = _Scatter.apply(partial, group, True)
    return h, _Gather.apply(rms_norm(h, weight, eps), group)


def sp_norm_on_the_full_sequence(partial, residual, weight, eps, group):
    h = _Scatter.apply(partial, group) + residual
    return h, rms_norm(_Gather.apply(h, group), weight, eps)


def sp_without_autograd(partial, residual, weight, eps, group):
    h = _scatter_positions(partial, group) + residual
    return h, _gather_positions(rms_norm(h, weight, eps), group)


def sp_without_autograd_detached(partial, residual, weight, eps, group):
    h = _scatter_positions(partial.detach(), group) + residual
    return h, _gather_positions(rms_norm(h, weight, eps).detach(), group)


def sp_gather_backward_slices(partial, residual, weight, eps, group):
    h = _Scatter.apply(partial, group) + residual
    return h, _Gather.apply(rms_norm(h, weight, eps), group, 1, False, True)


def sp_sums_the_weight_gradient(partial, residual, weight, eps, group):
    h = _Scatter.apply(partial, group) + residual
    return h, _Gather.apply(rms_norm(h, regions.copy_to_parallel(weight, group), eps), group)


def sp_calls_the_library(partial, residual, weight, eps, group):
    h = regions.reduce_scatter_to_sequence_parallel(partial, group) + residual
    return h, regions.gather_from_sequence_parallel(rms_norm(h, weight, eps), group)


def sp_hides_the_library_in_a_function(partial, residual, weight, eps, group):
    h = _LibraryScatter.apply(partial, group) + residual
    return h, _Gather.apply(rms_norm(h, weight, eps), group)


class _LibraryScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return regions._reduce_scatter_along(x, 1, group, "sp")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sp_stub(partial, residual, weight, eps, group):
    raise NotImplementedError


def test_sequence_parallel_norm_accepts_the_answer(capsys):
    ch04.check_sequence_parallel_norm(sp_right)
    out = capsys.readouterr().out
    assert "[ok] sequence parallel around the norm" in out and "the bytes of one all-reduce" in out


@pytest.mark.parametrize("answer, message", [
    (sp_keeps_all_reduce, "the all-reduce is still there"),
    (sp_gathers_flat, "laid out along the wrong dimension"),
    (sp_gathers_along_the_batch, "gathered along dim 0, not along the sequence"),
    (sp_scatters_flat, "split the batch"),
    (sp_norm_on_the_full_sequence, "every rank normalised every position"),
    (sp_without_autograd, "wrap each in a torch.autograd.Function"),
    (sp_without_autograd_detached, "no gradient reached partial"),
    (sp_gather_backward_slices, "a reduce-scatter, not a slice"),
    (sp_sums_the_weight_gradient, "already the sum over the ranks"),
    (sp_calls_the_library, "minitp's own answer"),
    (sp_hides_the_library_in_a_function, "minitp's own answer"),
    (sp_stub, "not done yet"),
])
def test_sequence_parallel_norm_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch04.check_sequence_parallel_norm(answer, nprocs=(2,))


def test_sequence_parallel_norm_catches_a_flat_gather_on_4_ranks_too():
    with pytest.raises(ExerciseError, match="on 4 ranks.*wrong dimension"):
        ch04.check_sequence_parallel_norm(sp_gathers_flat, nprocs=(4,))


def test_sequence_parallel_norm_shows_the_expected_layout_from_the_second_try():
    want = ch04._sp_reference(2)["full"][0, :, 0].tolist()
    first_then_second(ch04.check_sequence_parallel_norm, sp_gathers_flat, nprocs=(2,),
                      expected=f"full[0, :, 0] = {want}")


# -- worked problems -----------------------------------------------------------------------------------
def test_the_problems_answers_are_the_numbers_by_hand():
    D, F, n = 8192, 28672, 8  # LLaMA-3-70B at tp = 8
    sent = 2 * 2 * (n - 1) / n * D * 2 / 450e9  # g forward, f backward: 2(n-1)/n of D·2 bytes each, per token
    compute = 6 * 3 * D * F / n / (989e12 * 0.6)
    assert ch04.PROBLEMS[1].want() == pytest.approx(sent / compute) == pytest.approx(0.1431, abs=1e-4)
    assert ch04.PROBLEMS[1].want() == pytest.approx(8 * (n - 1) * 989e12 * 0.6 / (18 * F * 450e9))  # D cancels
    assert ch04.PROBLEMS[2].want() == 2 * 80 * 1 * 128 * 2 * 8192 / 2**20 == 320  # one whole head per rank
    N = 8192  # one sequence: tokens
    assert ch04.PROBLEMS[3].want() == pytest.approx(2 * (2 * N * D + N) * (1 - 1 / n) * 2 / 2**20)  # 448 MiB
    assert round(ch04.PROBLEMS[3].want()) == 448


@pytest.mark.parametrize("number, factor, slip", [
    (1, 0.5, "g's forward and f's backward"),
    (1, 3.0, "6 FLOPs per weight"),
    (1, 8 / 7, "not twice the buffer"),
    (2, 0.5, "cannot be split"),
    (2, 2.0, "each rank keeps one"),
    (3, 1.5, "column-parallel layers whole"),
    (3, 8 / 7, "saves \\(1 - 1/t\\)"),
    (3, 0.5, "two norms"),
])
def test_a_problems_slip_is_named(number, factor, slip):
    with pytest.raises(ExerciseError, match=slip):
        ch04.check_problem(number, lambda: ch04.PROBLEMS[number].want() * factor)


def test_a_problem_shows_its_answer_only_from_the_second_try():
    first_then_second(ch04.check_problem, 2, lambda: 1.0, expected="320 MiB")


def test_the_problems_solutions_state_minitp_costs_numbers():
    import json
    from pathlib import Path

    from minitp import cost
    from minitp.models import LLAMA3_8B, LLAMA3_70B

    cells = json.loads((Path(__file__).parents[1] / "notebooks" / "04_swiglu_attention.ipynb").read_text())["cells"]
    text = " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())
    cfg, n, h = LLAMA3_70B, 8, cost.H100
    sent = cost.tp_mlp_bytes(1, 1, cfg.dim, n, dtype_bytes=2)
    flops = 6 * cost.tp_mlp_params_per_rank(cfg.dim, cfg.ffn_hidden, n)
    sent_text = f"{sent:,.0f}".replace(",", "{,}")  # 57{,}344 in TeX
    assert f"= {sent_text}$ bytes, {sent / h.intra.bytes_per_s * 1e6:.2f} µs at 450 GB/s" in text
    assert f"= {flops / 1e6:.0f} MFLOP, {cost.compute_time(flops, h) * 1e6:.2f} µs at 0.6 × 989 TFLOP/s" in text
    eight_b = ch04._swiglu_messages_over_compute(LLAMA3_8B)
    assert f"**{ch04.PROBLEMS[1].want():.2f}**" in text and f"it doubles, {eight_b:.2f}" in text
    assert f"**{ch04.PROBLEMS[2].want():.0f} MiB**, as at tp = 8" in text
    saving = ch04.PROBLEMS[3].want()
    assert f"**{saving:.0f} MiB**, {cfg.n_layers * saving / 2**10:.0f} GiB over the 80 blocks" in text
    gathered_inputs = 2 * 8192 * cfg.dim * (1 - 1 / n) * 2  # the two (N, D) inputs Megatron-LM also splits
    assert f"{gathered_inputs / 2**20:.0f} MiB per block" in text
    assert "448 MiB less per LLaMA-3-70B block at n = 8" in text
