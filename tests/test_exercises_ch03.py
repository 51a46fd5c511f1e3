"""The chapter 03 checkers accept the right answers and catch the usual mistakes with a useful message."""

import pytest
import torch
from hint_levels import first_then_second

from minitp import comm, cost, regions
from minitp.exercises import ExerciseError, ch03
from minitp.exercises.heads import causal_attention


# -- the row-parallel forward --------------------------------------------------------------------
def row_right(x_shard, weight_shard, bias, group):
    return regions.reduce_from_parallel(x_shard @ weight_shard.T, group) + bias


def row_bias_on_every_rank(x_shard, weight_shard, bias, group):
    return regions.reduce_from_parallel(x_shard @ weight_shard.T + bias, group)


def row_no_all_reduce(x_shard, weight_shard, bias, group):
    return x_shard @ weight_shard.T + bias


def row_wrong_dimension(x_shard, weight_shard, bias, group):
    return regions.reduce_from_parallel(x_shard @ weight_shard, group) + bias


def row_all_reduce_in_backward_too(x_shard, weight_shard, bias, group):
    y = regions.reduce_from_parallel(regions.copy_to_parallel(x_shard @ weight_shard.T, group), group)
    return y + bias


def row_untraced(x_shard, weight_shard, bias, group):
    import torch.distributed as dist

    y = x_shard @ weight_shard.T
    dist.all_reduce(y)
    return y + bias


def row_stub(x_shard, weight_shard, bias, group):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_row_parallel_forward_accepts_the_answer(capsys):
    ch03.check_row_parallel_forward(row_right)
    assert "[ok] row-parallel forward" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (row_bias_on_every_rank, "added on every rank"),
    (row_no_all_reduce, "only its own partial sum"),
    (row_wrong_dimension, "not its transpose"),
    (row_all_reduce_in_backward_too, "nothing backward"),
    (row_untraced, "no message was traced"),
    (row_stub, "not done yet"),
])
def test_row_parallel_forward_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ch03.check_row_parallel_forward(answer)


# -- the f operator ------------------------------------------------------------------------------
class FRight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class FNoAllReduceInBackward(FRight):
    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FAllReduceInForward(FRight):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        comm.all_reduce(x, group=group)
        return x


class FAverages(FRight):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad / comm.group_size(ctx.group), None


class FStub(FRight):
    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_f_operator_accepts_the_answer(capsys):
    ch03.check_f_operator(FRight)
    assert "[ok] f operator" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (FNoAllReduceInBackward, "only this rank's part"),
    (FAllReduceInForward, "forward changed x"),
    (FAverages, "0.5 times the right one"),
    (FStub, "not done yet"),
])
def test_f_operator_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch03.check_f_operator(answer)


# -- bytes -----------------------------------------------------------------------------------------
def test_pair_bytes_accepts_the_formula(capsys):
    ch03.check_pair_bytes(lambda B, S, D, n, b: 2 * 2 * (n - 1) / n * B * S * D * b)
    assert "[ok]" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda B, S, D, n, b: 2 * (n - 1) / n * B * S * D * b, "f sends one more"),
    (lambda B, S, D, n, b: 2 * B * S * D * b, "not A"),
    (lambda B, S, D, n, b: 4 * (n - 1) / n * B * S * D, "bytes per element"),
    (lambda B, S, D, n, b: None, "returned None"),
])
def test_pair_bytes_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch03.check_pair_bytes(answer)


# -- exercise 4: attention split by heads (2 and 4 processes) --------------------------------------
def heads_attention(x, wq, wk, wv, wo, n_heads, group, *, f=True, g=True, split_dim=0):
    B, S, D = x.shape
    n, r = comm.group_size(group), comm.group_rank(group)
    dh, h = wq.shape[0] // n_heads, n_heads // n
    mine = slice(r * h * dh, (r + 1) * h * dh)
    if f:
        x = regions.copy_to_parallel(x, group)

    def heads(w):
        w = w[mine] if split_dim == 0 else w[:, mine].T  # planted: the input features split instead
        return (x @ w.T).view(B, S, h, dh).transpose(1, 2)

    out = causal_attention(heads(wq), heads(wk), heads(wv)).transpose(1, 2).reshape(B, S, h * dh)
    partial = out @ wo[:, mine].T
    return regions.reduce_from_parallel(partial, group) if g else partial


def test_parallel_attention_passes(capsys):
    ch03.check_parallel_attention(heads_attention)
    assert "[ok] attention split by heads" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    ({"g": False}, "never added up"),
    ({"f": False}, "copy_to_parallel"),
    ({"split_dim": 1}, "along dim 0"),
])
def test_parallel_attention_mistakes_caught(kwargs, message):
    def answer(*args):
        return heads_attention(*args, **kwargs)

    with pytest.raises(ExerciseError, match=message):
        ch03.check_parallel_attention(answer, nprocs=(2,))


# -- what the chapter says at real scale, recomputed from the hardware sheet ----------------------
def _chapter(name: str, kind: str) -> str:
    """A chapter's Markdown (kind "markdown"), whitespace collapsed, or its stored text outputs (kind "outputs")."""
    import json
    from pathlib import Path

    cells = json.loads((Path(__file__).parent.parent / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    if kind == "outputs":
        return "\n".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", []))
    return " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())


def test_chapter_03_llama3_8b_tensor_parallel_bytes_take_nine_times_as_long_over_infiniband():
    from minitp import cost
    from minitp.models import LLAMA3_8B

    nvlink, infiniband = cost.H100.intra.bytes_per_s, cost.H100.inter.bytes_per_s
    step = {n: LLAMA3_8B.n_layers * cost.tp_block_bytes(1, 8192, LLAMA3_8B.dim, n, dtype_bytes=2) for n in (2, 4, 8)}
    assert round(step[8] / 1e9) == 15
    assert [round(step[n] / nvlink * 1e3, 1) for n in (2, 4, 8)] == [19.1, 28.6, 33.4]
    assert [round(step[n] / infiniband * 1e3, 1) for n in (2, 4, 8)] == [171.8, 257.7, 300.6]
    assert round(nvlink / infiniband) == 9 and (nvlink, infiniband) == (450e9, 50e9)
    text, outputs = _chapter("03_tensor_parallel", "markdown"), _chapter("03_tensor_parallel", "outputs")
    assert "At n = 8 that is 15 GB per rank per training step of one 8192-token sequence" in text
    assert "the same bytes take nine times as long (InfiniBand's 50 GB/s against NVLink's 450 GB/s)" in text
    for n in (2, 4, 8):
        assert (f"n = {n}: {step[n] / 1e9:5.2f} GB per rank per step: {step[n] / nvlink * 1e3:5.1f} ms of transfer at "
                f"450 GB/s, {step[n] / infiniband * 1e3:5.1f} ms at 50 GB/s") in outputs


# -- hints in levels: the expected value shows only from the second wrong try -------------------------
def row_doubled(x_shard, weight_shard, bias, group):  # planted: no named mistake, just wrong numbers
    return 2 * regions.reduce_from_parallel(x_shard @ weight_shard.T, group) + bias


def test_row_parallel_forward_shows_the_expected_output_from_the_second_try():
    x, weight, bias = ch03._row_setup()
    want = torch.nn.functional.linear(x, weight, bias)[0, 0].tolist()
    first_then_second(ch03.check_row_parallel_forward, row_doubled, nprocs=(2,), expected=f"y[0, 0] = {want}")


def test_pair_bytes_show_the_expected_bytes_from_the_second_try():
    want = cost.tp_region_bytes(8, 16, 64, 4, dtype_bytes=4)  # the first case
    first_then_second(ch03.check_pair_bytes, lambda B, S, D, n, b: 1.0, expected=f"{want:,.0f} bytes")


def heads_with_an_extra_message(x, wq, wk, wv, wo, n_heads, group):
    comm.all_reduce(torch.zeros(3), group=group)  # planted: a message attention does not need
    return heads_attention(x, wq, wk, wv, wo, n_heads, group)


def test_attention_shows_the_expected_messages_from_the_second_try():
    from minitp.exercises import heads

    activation = heads.B * heads.S * heads.D * 4
    first_then_second(ch03.check_parallel_attention, heads_with_an_extra_message, nprocs=(2,),
                      expected=f"[('all_reduce', {activation})] in forward")
