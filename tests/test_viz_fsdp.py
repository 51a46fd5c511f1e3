"""The chapter 02 figures, drawn from a real 3-rank run: the shards each rank reported, the cycle of
every unit through a traced ZeRO-3 step, and the bytes of DDP against ZeRO-3."""

import matplotlib
import pytest

from minitp import cost
from minitp.fsdp import unit_numels
from minitp.launcher import launch
from minitp.models import TINY, build_model
from minitp.viz import fsdp as viz_fsdp

matplotlib.use("Agg")
N = 3  # the root unit (16,448 elements) needs one element of padding on 3 ranks


def _worker():
    import time

    import torch.distributed as dist

    from minitp import trace
    from minitp.ddp import DistributedDataParallel, split_batch
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.models import TINY, build_model, loss_fn
    from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches

    rank, train = dist.get_rank(), TrainConfig(steps=1, batch_size=6)
    tokens, targets = synthetic_batches(TINY, train)[0]
    model = build_model(TINY, seed=0)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model.parameters(), train.lr)
    with trace.scope("DDP"):
        loss_fn(ddp(split_batch(tokens)), split_batch(targets)).backward()
        optimizer.step()
    model = build_model(TINY, seed=0)
    fsdp = FullyShardedDataParallel(model, zero=3, prefetch=False)
    optimizer = fsdp.attach(make_optimizer(fsdp.parameters(), train.lr))
    tr, starts = trace.current(), {}

    def forward_done(unit):  # a forward hook must return None, or it replaces the block's output
        tr.add(trace.Event(rank, "compute", "forward", tr.label(f"fsdp/{unit}/compute.forward"), starts[unit],
                           time.perf_counter(), unit=unit, phase="forward"))

    for unit, block in zip(fsdp.units[1:], model.layers):
        block.register_forward_pre_hook(lambda m, a, u=unit.name: starts.__setitem__(u, time.perf_counter()))
        block.register_forward_hook(lambda m, a, o, u=unit.name: forward_done(u))
    with trace.scope("ZeRO-3"):
        loss_fn(fsdp(split_batch(tokens)), split_batch(targets)).backward()
        optimizer.step()
    return [{"unit": u.name, "padded": u.padded, "shard": [rank * u.shard_numel, (rank + 1) * u.shard_numel],
             "params": [(s.name, s.offset, s.numel) for s in u.plan.slots]} for u in fsdp.units]


@pytest.fixture(scope="module")
def run():
    return launch(_worker, N, echo=False)


def _patches(fig, prefix):
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)}


def test_shard_map_draws_every_rank_slice_and_the_padding(run):
    fig = viz_fsdp.shard_map(list(run))
    ax = fig.axes[0]
    numels = unit_numels(build_model(TINY), N)
    names = ["root"] + [f"layers.{i}" for i in range(TINY.n_layers)]
    shards = _patches(fig, "shard:")
    assert len(shards) == N * len(names)
    for name, numel in zip(names, numels):
        size = cost.padded_numel(numel, N) // N
        for rank in range(N):
            bar = shards[f"shard:{name}:{rank}"]
            assert bar.get_x() == rank * size and bar.get_width() == size
    padded = {f"pad:{name}" for name, numel in zip(names, numels) if numel % N}
    assert padded and set(_patches(fig, "pad:")) == padded  # a unit is padded where 3 does not divide it
    assert len(_patches(fig, "param:layers.0:")) == 9  # the block's 9 parameters laid side by side
    assert [t.get_text().split("\n")[0] for t in ax.get_yticklabels()] == list(reversed(names))
    assert any("+1 padding" in t.get_text() for t in ax.texts)


def test_unit_cycle_shows_two_gathers_per_block_one_for_the_root(run):
    fig = viz_fsdp.unit_cycle(run, rank=1, label_prefix="ZeRO-3")
    ax = fig.axes[0]
    held = set(_patches(fig, "held:"))
    blocks = [f"layers.{i}" for i in range(TINY.n_layers)]
    assert held == {"held:root:forward"} | {f"held:{b}:{p}" for b in blocks for p in ("forward", "backward")}
    assert len(_patches(fig, "all_gather:")) == 1 + 2 * TINY.n_layers
    assert len(_patches(fig, "reduce_scatter:")) == 1 + TINY.n_layers
    assert len(_patches(fig, "compute:")) == TINY.n_layers  # the forward spans the hooks recorded
    # forward: a block is freed when its compute ends, before its backward gather starts
    fwd, bwd = _patches(fig, "held:layers.1:forward")["held:layers.1:forward"], \
        _patches(fig, "held:layers.1:backward")["held:layers.1:backward"]
    assert fwd.get_x() + fwd.get_width() <= bwd.get_x()
    root = _patches(fig, "held:root")["held:root:forward"]  # the root is held through the whole step
    assert root.get_width() > fwd.get_width() + bwd.get_width()
    assert [t.get_text() for t in ax.get_yticklabels()] == list(reversed(["root", *blocks]))
    assert ax.get_xlabel() == "time (ms)"


def test_a_run_that_keeps_blocks_after_forward_frees_them_at_their_reduce_scatter(run):
    fig = viz_fsdp.unit_cycle(run, rank=1, label_prefix="ZeRO-3", reshard_after_forward=False)
    kept = _patches(fig, "held:layers.1:forward")["held:layers.1:forward"]
    scatter = min(p.get_x() for gid, p in _patches(fig, "reduce_scatter:layers.1:").items())
    assert kept.get_x() + kept.get_width() == pytest.approx(scatter)
    resharded = _patches(viz_fsdp.unit_cycle(run, rank=1, label_prefix="ZeRO-3"), "held:layers.1:forward")
    assert resharded["held:layers.1:forward"].get_width() < kept.get_width()


def test_bytes_by_stage_bars_equal_the_trace_and_the_formula(run):
    sent = {name: viz_fsdp.sent_by_op(run, name, rank=0) for name in ("DDP", "ZeRO-3")}
    numels = unit_numels(build_model(TINY), N)
    expected = {"DDP": cost.ddp_step_bytes(TINY.num_params(), N), "ZeRO-3": cost.fsdp_step_bytes(numels, N)}
    assert set(sent["DDP"]) == {"all_reduce"} and set(sent["ZeRO-3"]) == {"all_gather", "reduce_scatter"}
    for name in sent:
        assert sum(sent[name].values()) == pytest.approx(expected[name], rel=1e-12)
    fig = viz_fsdp.bytes_by_stage(sent, expected)
    bars = _patches(fig, "sent:")
    assert set(bars) == {"sent:DDP:all_reduce", "sent:ZeRO-3:all_gather", "sent:ZeRO-3:reduce_scatter"}
    assert bars["sent:DDP:all_reduce"].get_width() == pytest.approx(sent["DDP"]["all_reduce"] / 1e6)
    ticks = {line.get_gid(): line for line in fig.axes[0].lines}
    assert ticks["formula:ZeRO-3"].get_xdata()[0] == pytest.approx(expected["ZeRO-3"] / 1e6)
    ratio = expected["ZeRO-3"] / expected["DDP"]
    assert any(f"{ratio:.2f}x DDP" in t.get_text() for t in fig.axes[0].texts)


def test_figures_refuse_empty_input(run):
    with pytest.raises(ValueError, match="no layouts"):
        viz_fsdp.shard_map([])
    with pytest.raises(ValueError, match="no fsdp events"):
        viz_fsdp.unit_cycle(run, label_prefix="DDP")
    with pytest.raises(ValueError, match="sent is empty"):
        viz_fsdp.bytes_by_stage({})
