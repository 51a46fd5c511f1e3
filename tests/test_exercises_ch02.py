"""The chapter 02 checkers accept the right answers and catch the usual mistakes with a useful message."""

import pytest
import torch
import torch.distributed as dist

from minitp import comm
from minitp.exercises import ExerciseError, ch02


# -- shard and unshard: the answer and planted mistakes -------------------------------------------
def shard_right(flat, rank, world_size):
    padded = -(-flat.numel() // world_size) * world_size
    full = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    s = padded // world_size
    return full[rank * s:(rank + 1) * s].clone()


def unshard_right(shard, numel):
    n = dist.get_world_size()
    out = torch.empty(n * shard.numel(), dtype=shard.dtype)
    comm.all_gather(out, shard)
    return out[:numel]


def shard_rounds_down(flat, rank, world_size):
    s = flat.numel() // world_size
    return flat[rank * s:(rank + 1) * s].clone()


def shard_off_by_one_padding(flat, rank, world_size):  # pads n - numel % n even when it divides
    padded = flat.numel() + world_size - flat.numel() % world_size
    full = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    s = padded // world_size
    return full[rank * s:(rank + 1) * s].clone()


def shard_wrong_index(flat, rank, world_size):
    return shard_right(flat, (rank + 1) % world_size, world_size)


def shard_strided(flat, rank, world_size):
    padded = -(-flat.numel() // world_size) * world_size
    return torch.cat([flat, flat.new_zeros(padded - flat.numel())])[rank::world_size].clone()


def shard_pads_with_garbage(flat, rank, world_size):
    padded = -(-flat.numel() // world_size) * world_size
    full = torch.cat([flat, flat.new_full((padded - flat.numel(),), 7.0)])
    s = padded // world_size
    return full[rank * s:(rank + 1) * s].clone()


def unshard_keeps_padding(shard, numel):
    n = dist.get_world_size()
    out = torch.empty(n * shard.numel(), dtype=shard.dtype)
    comm.all_gather(out, shard)
    return out


def unshard_untraced(shard, numel):
    out = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard)
    return out[:numel]


def unshard_with_all_reduce(shard, numel):
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(n * shard.numel(), dtype=shard.dtype)
    out[r * shard.numel():(r + 1) * shard.numel()] = shard
    comm.all_reduce(out)
    return out[:numel]


def shard_stub(flat, rank, world_size):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_shard_unshard_accepts_the_right_answer(capsys):
    ch02.check_shard_unshard(shard_right, unshard_right)
    assert "[ok] shard and unshard: correct" in capsys.readouterr().out


@pytest.mark.parametrize("shard, unshard, expected", [
    (shard_rounds_down, unshard_right, "rounded down"),
    (shard_off_by_one_padding, unshard_right, "already divides by n"),
    (shard_wrong_index, unshard_right, r"you returned rank \d's slice"),
    (shard_strided, unshard_right, "every n-th element"),
    (shard_pads_with_garbage, unshard_right, "padding is .*expected zeros"),
    (shard_right, unshard_keeps_padding, "padding leaked into the result"),
    (shard_right, unshard_untraced, "no message was traced"),
    (shard_right, unshard_with_all_reduce, "unshard called all_reduce"),
    (shard_stub, unshard_right, "not done yet"),
])
def test_shard_unshard_catches_mistake(shard, unshard, expected):
    with pytest.raises(ExerciseError, match=expected):
        ch02.check_shard_unshard(shard, unshard)


# -- the gradient reduce-scatter --------------------------------------------------------------------
def reduce_right(full_grad):
    n = dist.get_world_size()
    out = torch.empty(full_grad.numel() // n)
    comm.reduce_scatter(out, full_grad / n)
    return out


def reduce_forgets_mean(full_grad):
    out = torch.empty(full_grad.numel() // dist.get_world_size())
    comm.reduce_scatter(out, full_grad)
    return out


def reduce_with_all_reduce(full_grad):
    n, r = dist.get_world_size(), dist.get_rank()
    grad = full_grad / n
    comm.all_reduce(grad)
    return grad.chunk(n)[r]


def reduce_wrong_shard(full_grad):
    n, r = dist.get_world_size(), dist.get_rank()
    grad = full_grad / n
    comm.all_reduce(grad)
    return grad.chunk(n)[(r + 1) % n]


def reduce_returns_everything(full_grad):
    grad = full_grad / dist.get_world_size()
    comm.all_reduce(grad)
    return grad


def reduce_local_only(full_grad):
    n, r = dist.get_world_size(), dist.get_rank()
    return full_grad.chunk(n)[r] / n


def reduce_untraced(full_grad):
    n = dist.get_world_size()
    out = torch.empty(full_grad.numel() // n)
    dist.reduce_scatter_tensor(out, full_grad / n)
    return out


def reduce_stub(full_grad):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_reduce_gradient_accepts_the_right_answer(capsys):
    ch02.check_reduce_gradient(reduce_right)
    assert "[ok] gradient reduce-scatter: correct" in capsys.readouterr().out


@pytest.mark.parametrize("fn, expected", [
    (reduce_forgets_mean, "Divide by the world size"),
    (reduce_with_all_reduce, "you used an all-reduce"),
    (reduce_wrong_shard, r"you kept the averaged gradient of rank \d's shard"),
    (reduce_returns_everything, "whole averaged gradient"),
    (reduce_local_only, "own local gradient"),
    (reduce_untraced, "no message was traced"),
    (reduce_stub, "not done yet"),
])
def test_reduce_gradient_catches_mistake(fn, expected):
    with pytest.raises(ExerciseError, match=expected):
        ch02.check_reduce_gradient(fn)


# -- memory per rank by hand ------------------------------------------------------------------------
def memory_right(psi, n, zero):
    return 4 * psi / (n if zero >= 3 else 1) + 4 * psi / (n if zero >= 2 else 1) + 8 * psi / (n if zero >= 1 else 1)


def test_memory_per_rank_accepts_the_right_answer(capsys):
    ch02.check_memory_per_rank(memory_right)
    assert "[ok] memory per rank" in capsys.readouterr().out


def _stage_shift(psi, n, zero):  # ZeRO-1 already shards the gradients: one stage ahead
    return memory_right(psi, n, min(zero + 1, 3)) if zero else memory_right(psi, n, 0)


def _stub(psi, n, zero):
    raise NotImplementedError


@pytest.mark.parametrize("fn, expected", [
    (_stage_shift, "That is ZeRO-2's number"),
    (lambda psi, n, zero: 16 * psi / n, "Only ZeRO-3 divides all 16 bytes"),
    (lambda psi, n, zero: memory_right(psi, n, zero) + 4 * psi / (n if zero >= 1 else 1), "12 is mixed precision"),
    (lambda psi, n, zero: memory_right(psi, n, zero) - 4 * psi / (n if zero >= 1 else 1), "two moments"),
    (lambda psi, n, zero: memory_right(psi, n, zero) - 8 * psi / (n if zero >= 1 else 1), "left out the optimizer"),
    (lambda psi, n, zero: None, "returned None"),
    (_stub, "not done yet"),
])
def test_memory_per_rank_catches_mistake(fn, expected):
    with pytest.raises(ExerciseError, match=expected):
        ch02.check_memory_per_rank(fn)
