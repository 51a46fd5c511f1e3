"""The chapter 02 checkers accept the right answers and catch the usual mistakes with a useful message."""

import pytest
import torch
import torch.distributed as dist
from hint_levels import first_then_second as _first_then_second

from minitp import comm, cost
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


# -- exercise 4: one ZeRO-3 unit (runs on 4 and 3 processes) ----------------------------------------
class GatherRunFree(torch.autograd.Function):
    """The notebook's answer: gather, run, free; in backward gather again, rerun, reduce-scatter."""

    mean = True

    @staticmethod
    def forward(ctx, shard, x, unit):
        full = unit.gather(shard, "forward")
        y = unit.run(full, x)
        ctx.unit = unit
        ctx.save_for_backward(shard, x)
        return y  # `full` goes out of scope here: freed

    @staticmethod
    def backward(ctx, grad_y):
        shard, x = ctx.saved_tensors
        unit = ctx.unit
        full = unit.gather(shard, "backward")
        with torch.enable_grad():
            full.requires_grad_(True)
            x = x.detach().requires_grad_(True)
            y = unit.run(full, x)
        grad_full, grad_x = torch.autograd.grad(y, (full, x), grad_y)
        if unit.mean:
            grad_full = grad_full / unit.n
        grad_shard = torch.empty_like(shard)
        comm.reduce_scatter(grad_shard, grad_full, group=unit.group)
        return grad_shard, grad_x, None


class KeepsGathered(torch.autograd.Function):
    """Saves the gathered parameters for backward instead of freeing them (and gathers nothing there)."""

    @staticmethod
    def forward(ctx, shard, x, unit):
        full = unit.gather(shard, "forward")
        ctx.unit = unit
        ctx.save_for_backward(shard, x, full)
        return unit.run(full, x)

    @staticmethod
    def backward(ctx, grad_y):
        shard, x, full = ctx.saved_tensors
        unit = ctx.unit
        with torch.enable_grad():
            full = full.detach().requires_grad_(True)
            x = x.detach().requires_grad_(True)
            y = unit.run(full, x)
        grad_full, grad_x = torch.autograd.grad(y, (full, x), grad_y)
        grad_shard = torch.empty_like(shard)
        comm.reduce_scatter(grad_shard, grad_full / unit.n, group=unit.group)
        return grad_shard, grad_x, None


class FSDPUnit(torch.nn.Module):
    function = GatherRunFree
    mean = True

    def __init__(self, module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.n, self.rank = comm.group_size(group), comm.group_rank(group)
        self.shapes = {name: p.shape for name, p in module.named_parameters()}
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        flat = torch.nn.functional.pad(flat, (0, cost.padded_numel(flat.numel(), self.n) - flat.numel()))
        self.shard = torch.nn.Parameter(self.keep(flat).clone())

    def keep(self, flat):
        k = flat.numel() // self.n
        return flat[self.rank * k:(self.rank + 1) * k]

    def gather(self, shard, label):
        full = torch.empty(shard.numel() * self.n)
        comm.all_gather(full, shard.detach(), group=self.group, label=label)
        return full

    def run(self, full, x):
        params, offset = {}, 0
        for name, shape in self.shapes.items():
            params[name] = full[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return torch.func.functional_call(self.module, params, (x,))

    def forward(self, x):
        return self.function.apply(self.shard, x, self)


class UnitSums(FSDPUnit):
    mean = False


class UnitKeepsGathered(FSDPUnit):
    function = KeepsGathered


class UnitWrongShard(FSDPUnit):
    def keep(self, flat):
        k = flat.numel() // self.n
        other = self.n - 1 - self.rank
        return flat[other * k:(other + 1) * k]


class UnitStridedShard(FSDPUnit):
    def keep(self, flat):
        return flat[self.rank::self.n]


class UnitStub(FSDPUnit):
    def __init__(self, module, group=None):
        raise NotImplementedError


def test_fsdp_unit_passes(capsys):
    ch02.check_fsdp_unit(FSDPUnit)
    assert "[ok] FSDP unit" in capsys.readouterr().out


@pytest.mark.parametrize("cls, message", [
    (UnitSums, "SUM over the ranks"),
    (UnitKeepsGathered, "still held"),
    (UnitWrongShard, "rank 1's slice"),
    (UnitStridedShard, "strided"),
    (UnitStub, "not done yet"),
])
def test_fsdp_unit_mistakes_caught(cls, message):
    with pytest.raises(ExerciseError, match=message):
        ch02.check_fsdp_unit(cls, nprocs=(2,))


# -- hints in levels: the expected value shows from the second wrong try on ----------------------------
def shard_off_by_one_value(flat, rank, world_size):
    return shard_right(flat, rank, world_size) + 1


def unshard_reversed(shard, numel):
    return unshard_right(shard, numel).flip(0)


def unshard_gathers_twice(shard, numel):
    unshard_right(shard, numel)
    return unshard_right(shard, numel)


def test_shard_values_show_from_the_second_try():
    # the first flat parameter: 1..10 (as _shard_worker builds it) on 2 ranks: rank 0 keeps 1..5
    flat = torch.arange(1, 11, dtype=torch.float32)
    _first_then_second(ch02.check_shard_unshard, shard_off_by_one_value, unshard_right, (2,),
                       expected=str(flat[:5].tolist()))


def test_unshard_values_show_from_the_second_try():
    _first_then_second(ch02.check_shard_unshard, shard_right, unshard_reversed, (2,),
                       expected=str(torch.arange(1, 11, dtype=torch.float32).tolist()))


def test_unshard_bytes_show_from_the_second_try():
    want = sum(cost.collective_sent_bytes("all_gather", cost.padded_numel(m, 2) * 4, 2) for m in ch02._SIZES)
    _first_then_second(ch02.check_shard_unshard, shard_right, unshard_gathers_twice, (2,),
                       expected=f"{want:g} bytes")


def reduce_plus_one(full_grad):
    return reduce_right(full_grad) + 1


def reduce_scatters_twice(full_grad):
    reduce_right(full_grad)
    return reduce_right(full_grad)


def test_reduce_gradient_values_show_from_the_second_try():
    with pytest.raises(ExerciseError) as first:
        ch02.check_reduce_gradient(reduce_plus_one, (2,))
    assert "not this rank's shard of the mean gradient" in str(first.value)
    assert "Expected:" not in str(first.value)
    with pytest.raises(ExerciseError, match=r"Expected: \[-?\d"):
        ch02.check_reduce_gradient(reduce_plus_one, (2,))


def test_reduce_gradient_bytes_show_from_the_second_try():
    _first_then_second(ch02.check_reduce_gradient, reduce_scatters_twice, (2,),
                       expected=f"{cost.collective_sent_bytes('reduce_scatter', 2 * 3 * 4, 2):g} bytes each")


def test_memory_per_rank_shows_the_expected_bytes_from_the_second_try():
    # the first case checked: the tiny model's Ψ = 164,416 on 4 ranks, DDP: 16 bytes per parameter
    _first_then_second(ch02.check_memory_per_rank, lambda psi, n, zero: 1.0, expected=f"{16 * 164_416:,} bytes")


def test_show_expected_shows_the_expected_bytes_on_the_first_try(capsys):
    from minitp.exercises import show_expected
    show_expected("memory per rank")
    with pytest.raises(ExerciseError, match=f"Expected: {16 * 164_416:,} bytes"):
        ch02.check_memory_per_rank(lambda psi, n, zero: 1.0)


class UnitShardPlusOne(FSDPUnit):
    def keep(self, flat):
        return super().keep(flat) + 1


def test_fsdp_unit_shard_values_show_from_the_second_try():
    with pytest.raises(ExerciseError) as first:
        ch02.check_fsdp_unit(UnitShardPlusOne, nprocs=(2,))
    assert "not this rank's slice" in str(first.value) and "Expected:" not in str(first.value)
    with pytest.raises(ExerciseError, match=r"Expected: \[-?\d"):
        ch02.check_fsdp_unit(UnitShardPlusOne, nprocs=(2,))
