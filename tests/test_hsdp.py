"""minitp.hsdp (R replicas × S shard ranks) against its three oracles: one process, PyTorch's
``fully_shard`` on a 2-D DeviceMesh ("replicate", "shard"), and ``minitp.cost.hsdp_step_bytes`` /
``hsdp_memory_per_rank``; and the refusal of a grid that is not the world.

Each world size is launched once (its grids one after the other, minitp's run and PyTorch's on the
same seed and batches); the tests read what came back. The one-process run is the global batch in
R·S micro-batches, their gradients averaged in fp32 (why not the full batch itself:
``tests/test_fsdp.py``).
"""

import functools

import pytest
import torch

from minitp import cost
from minitp.fsdp import unit_numels
from minitp.hsdp import check_hsdp, hsdp_group_ranks
from minitp.launcher import launch
from minitp.models import build_model, get_config, loss_fn
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches

CFG = get_config("tiny")
TRAIN = TrainConfig(steps=3, batch_size=8)  # 8 splits over 2 and 4 ranks
GRIDS = {4: [(2, 2)], 2: [(1, 2), (2, 1)]}  # world size: the (replicate, shard) grids run on it
DIMS = ("dp_shard", "dp_replicate")


def _hsdp_worker(train, grids):
    """For each (R, S): minitp's HSDP trained (its steps traced), then fully_shard on a 2-D mesh;
    also what asking for a grid of another world size raises on a rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from minitp import trace
    from minitp.ddp import split_batch
    from minitp.hsdp import HybridShardedDataParallel, hsdp_groups
    from minitp.models import build_model, get_config, loss_fn
    from minitp.models.train import make_optimizer, synthetic_batches
    from minitp.runs import train_steps

    cfg, rank, out = get_config("tiny"), dist.get_rank(), []
    batches = synthetic_batches(cfg, train)
    try:
        hsdp_groups(2, dist.get_world_size())
        refused = ""
    except ValueError as error:
        refused = str(error)
    for replicate, shard in grids:
        shard_group, replicate_group = hsdp_groups(replicate, shard)
        model = build_model(cfg, seed=train.seed)
        hsdp = HybridShardedDataParallel(model, shard_group, replicate_group)
        optimizer = hsdp.attach(make_optimizer(hsdp.parameters(), train.lr))
        with trace.recording(rank) as tr:
            losses, _ = train_steps(model, hsdp, batches, split_batch, optimizer)
        events = tr.comm()
        mine = {"losses": losses, "state": hsdp.full_state_dict(), "memory": hsdp.held_bytes(),
                "sent": tr.sent_bytes(), "sent_by_dim": {d: tr.sent_bytes(dim=d) for d in DIMS},
                "groups": {d: sorted({e.group for e in events if e.dim == d}) for d in DIMS},
                "labels": {d: sorted({e.label for e in events if e.dim == d}) for d in DIMS}}

        theirs = build_model(cfg, seed=train.seed)
        mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
        for block in theirs.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(theirs, mesh=mesh)
        theirs_optimizer = make_optimizer(theirs.parameters(), train.lr)
        theirs_losses = []
        for tokens, targets in batches:
            theirs_optimizer.zero_grad()
            loss = loss_fn(theirs(split_batch(tokens)), split_batch(targets))
            loss.backward()
            theirs_optimizer.step()
            theirs_losses.append(loss.item())
        mine["torch_losses"] = theirs_losses
        mine["torch_state"] = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
        out.append(mine)
    return {"grids": out, "refused": refused}


@functools.cache
def _run(world_size: int):
    return launch(_hsdp_worker, world_size, TRAIN, GRIDS[world_size], echo=False)


def _results(replicate: int, shard: int) -> list[dict]:
    """Each rank's result for the grid R × S."""
    world = replicate * shard
    i = GRIDS[world].index((replicate, shard))
    return [r["grids"][i] for r in _run(world)]


@functools.cache
def _one_process(n: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: each global batch in n micro-batches, their gradients averaged in fp32, one
    AdamW step. Returns (the mean of the micro-batches' losses at each step, final parameters)."""
    model = build_model(CFG, seed=TRAIN.seed)
    optimizer = make_optimizer(model.parameters(), TRAIN.lr)
    params, losses = list(model.parameters()), []
    for tokens, targets in synthetic_batches(CFG, TRAIN):
        total, step_loss = [torch.zeros_like(p) for p in params], 0.0
        for x, y in zip(tokens.chunk(n), targets.chunk(n)):
            loss = loss_fn(model(x), y)
            for t, g in zip(total, torch.autograd.grad(loss, params)):
                t += g / n
            step_loss += loss.item() / n
        for p, t in zip(params, total):
            p.grad = t
        optimizer.step()
        losses.append(step_loss)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _max_diff(state, reference) -> float:
    return max((state[k] - v).abs().max().item() for k, v in reference.items())


def _mean_losses(results, key="losses") -> list[float]:
    """The loss of the whole batch at each step: the mean of the ranks' losses (equal slices)."""
    return [sum(step) / len(step) for step in zip(*(r[key] for r in results))]


GRID_IDS = [(2, 2), (1, 2), (2, 1)]


@pytest.mark.parametrize("replicate, shard", GRID_IDS, ids=lambda v: str(v))
def test_hsdp_matches_one_process_within_1e_5(replicate, shard):
    results = _results(replicate, shard)
    losses, state = _one_process(replicate * shard)
    assert max(abs(a - b) for a, b in zip(_mean_losses(results), losses)) <= 1e-5
    for rank, r in enumerate(results):
        assert _max_diff(r["state"], state) <= 1e-5, f"{replicate}x{shard} rank {rank}"


@pytest.mark.parametrize("replicate, shard", GRID_IDS, ids=lambda v: str(v))
def test_hsdp_matches_fully_shard_on_a_replicate_by_shard_device_mesh(replicate, shard):
    results = _results(replicate, shard)
    mean, theirs = _mean_losses(results), _mean_losses(results, "torch_losses")
    assert max(abs(a - b) for a, b in zip(mean, theirs)) <= 1e-5
    for rank, r in enumerate(results):
        assert _max_diff(r["state"], r["torch_state"]) <= 1e-5, f"{replicate}x{shard} rank {rank}"


@pytest.mark.parametrize("replicate, shard", GRID_IDS, ids=lambda v: str(v))
def test_hsdp_sends_per_group_and_holds_what_the_formulas_say(replicate, shard):
    results = _results(replicate, shard)
    numels = unit_numels(build_model(CFG), shard)  # padded to a multiple of S, not of R·S
    per_step = cost.hsdp_step_bytes(numels, replicate, shard)
    memory = cost.hsdp_memory_per_rank(numels, shard)
    groups = hsdp_group_ranks(replicate, shard)
    for rank, r in enumerate(results):
        where = f"{replicate}x{shard} rank {rank}"
        for dim in DIMS:
            assert r["sent_by_dim"][dim] == pytest.approx(TRAIN.steps * per_step[dim], rel=1e-12,
                                                          abs=1e-6), (where, dim)
        assert r["sent"] == pytest.approx(sum(r["sent_by_dim"].values()), rel=1e-12), where
        assert r["memory"] == pytest.approx(memory), where
        # every message went through this rank's own shard group or replicate group
        for dim in DIMS:
            assert r["groups"][dim] == [tuple(g) for g in groups[dim] if rank in g], (where, dim)
        assert "fsdp/layers.1/reduce_scatter" in r["labels"]["dp_shard"]
        assert "fsdp/layers.1/all_gather.backward" in r["labels"]["dp_shard"]
        assert r["labels"]["dp_replicate"] == sorted(
            f"hsdp/{unit}/all_reduce.replicate" for unit in ["root", *map(
                "layers.{}".format, range(CFG.n_layers))])


def test_the_formula_at_2x2_is_fsdp_on_2_ranks_plus_an_all_reduce_of_half_the_gradient():
    numels = unit_numels(build_model(CFG), 2)
    per_step = cost.hsdp_step_bytes(numels, 2, 2)
    assert per_step["dp_shard"] == cost.fsdp_step_bytes(numels, 2)
    # 2(R-1)/R = 1: each rank sends its whole fp32 gradient shard, Ψ/2 · 4 bytes
    assert per_step["dp_replicate"] == sum(numels) / 2 * 4
    assert cost.hsdp_step_bytes(numels, 1, 2)["dp_replicate"] == 0  # one replica: plain FSDP
    assert cost.hsdp_memory_per_rank(numels, 2) == cost.fsdp_memory_per_rank(numels, 2)


def test_a_grid_that_is_not_the_world_is_refused_with_what_was_expected():
    with pytest.raises(ValueError, match=r"^shard=3 does not divide the world's 4 ranks: HSDP needs "
                                         r"replicate × shard = 4$"):
        check_hsdp(2, 3, 4)
    with pytest.raises(ValueError, match=r"^replicate=2 × shard=2 = 4 ranks, expected the world's 2 "
                                         r"\(replicate=1\)$"):
        check_hsdp(2, 2, 2)
    with pytest.raises(ValueError, match=r"^replicate must be an integer >= 1, got 0$"):
        check_hsdp(0, 2, 2)
    with pytest.raises(ValueError, match=r"replicate and shard must be >= 1, got replicate=0"):
        cost.hsdp_step_bytes([64], 0, 2)
    # on the ranks, before any group is made: the same sentence
    assert {r["refused"] for r in _run(2)} == {
        "replicate=2 × shard=2 = 4 ranks, expected the world's 2 (replicate=1)"}


def test_minitp_run_hsdp_is_a_checked_run_with_each_groups_bytes_and_refuses_a_grid_that_is_not_the_world(capsys):
    from minitp import cli
    from minitp.runs import run_hsdp

    report = run_hsdp(nproc=4, replicate=2, steps=2)
    assert report.check() == []
    expected = report.details["bytes_by_group_expected"]
    assert expected["dp_shard"] > 0 and expected["dp_replicate"] > 0
    assert report.details["bytes_by_group_traced"] == [expected] * 4  # every rank, each group, to the byte
    assert cli.main(["run", "hsdp", "--nprocs", "4", "--replicate", "3"]) != 0
    said = capsys.readouterr().err
    assert "nproc=4 is not divisible by replicate=3" in said and said.count("\n") <= 2
