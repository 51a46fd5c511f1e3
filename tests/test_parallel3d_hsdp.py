"""HSDP inside the 3D composition: the mesh's dp axis split into dp/dp_shard replicas × dp_shard
shards, each stage's tp-sharded module under ``minitp.hsdp`` over its shard group, its gradient
shards all-reduced over its replicate group. Each layout (8 ranks) is run once with
``minitp run 3d --dp-shard``, against one process, the bytes of every group (tp, pp, dp_shard,
dp_replicate) against ``cost.threed_step_bytes(data_parallel="hsdp")`` and the memory against
``cost.threed_memory_per_rank``; a dp_shard that does not divide dp is refused in the parent."""

import functools

import pytest
import torch

from minitp import cli, cost, runs
from minitp.grid import coordinates
from minitp.launcher import launch
from minitp.models import build_model, get_config, loss_fn
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches

CFG = get_config("tiny")
# (dp, dp_shard, tp, pp): dp=4 as 2 replicas × 2 shards; dp=2 as 1 × 2 and as 2 × 1 under a pipeline
LAYOUTS = [(4, 2, 2, 1), (2, 2, 2, 2), (2, 1, 2, 2)]
IDS = [f"dp{dp}as{dp // s}x{s}-tp{tp}-pp{pp}" for dp, s, tp, pp in LAYOUTS]
HALVES = ("dp_shard", "dp_replicate")


@functools.cache
def _run(dp: int, dp_shard: int, tp: int, pp: int):
    return runs.run_3d(nproc=8, dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, steps=2)


def _groups(rank: int, dp: int, dp_shard: int, tp: int, pp: int) -> dict[str, tuple[int, ...]]:
    """The rank's shard group (dp_shard consecutive dp coordinates) and replicate group (its place
    in every replica), at its own (pp, tp)."""
    c = coordinates(rank, dp, pp, tp)
    first = c.dp - c.dp % dp_shard
    at = [(d * pp + c.pp) * tp + c.tp for d in range(dp)]  # the rank's dp group, by dp coordinate
    return {"dp_shard": tuple(at[first:first + dp_shard]),
            "dp_replicate": tuple(at[c.dp % dp_shard::dp_shard])}


@pytest.mark.parametrize("dp,dp_shard,tp,pp", LAYOUTS, ids=IDS)
def test_hsdp_in_3d_matches_one_process_with_each_groups_bytes_and_memory_equal_to_the_formulas(
        dp, dp_shard, tp, pp):
    report = _run(dp, dp_shard, tp, pp)
    assert runs.check(report) == []
    assert report["max_abs_param_diff"] <= 1e-5
    assert max(abs(a - b) for a, b in zip(report["loss"], report["reference_loss"])) < 1e-5
    assert report["layout"] == {"dp": dp, "tp": tp, "pp": pp, "dp_shard": dp_shard}
    replicate = dp // dp_shard
    zero = 1 if pp > 1 else 3  # a pipeline's micro-batches add up whole: ZeRO-1
    for rank, (traced, expected) in enumerate(zip(report["comm_bytes_traced_by_dim"],
                                                  report["comm_bytes_expected_by_dim"])):
        stage = report["coords"][rank][1]
        assert set(expected) == {"tp", "pp", *HALVES}
        for dim, value in expected.items():
            assert traced[dim] == pytest.approx(value, rel=1e-12, abs=1e-6), (rank, dim)
        assert traced["dp"] == 0, "the dp group itself sends nothing: its two halves do"
        for dim, size in (("tp", tp), ("pp", pp), ("dp_shard", dp_shard),
                          ("dp_replicate", replicate)):
            assert (traced.get(dim, 0.0) > 0) == (size > 1), (rank, dim)
        # the replicate group's all-reduce: 2(R-1)/R of the stage's 1/S gradient shard, fp32
        numels = cost.stage_unit_numels(CFG, tp, pp, stage)
        shard = sum(-(-n // dp_shard) for n in numels)
        assert expected["dp_replicate"] == pytest.approx(
            report["steps"] * 2 * (replicate - 1) / replicate * shard * 4)
        assert report["memory"][rank] == pytest.approx(
            cost.hsdp_memory_per_rank(numels, dp_shard, zero)), rank
    for rank, trace in enumerate(report.traces):  # every message of a half in the rank's own group
        want = _groups(rank, dp, dp_shard, tp, pp)
        for dim in HALVES:
            assert {e.group for e in trace.comm() if e.dim == dim} == {want[dim]}, (rank, dim)


def test_a_dp_shard_that_does_not_divide_dp_is_refused_in_one_line_before_any_process_starts(
        no_launch, capsys):
    with pytest.raises(ValueError, match=r"^dp=4 is not divisible by dp_shard=3: HSDP makes "
                                         r"dp/dp_shard replicas of dp_shard shards each "
                                         r"\(dp_shard one of 1, 2, 4\)$"):
        runs.run_3d(nproc=8, dp=4, tp=2, pp=1, dp_shard=3)
    with pytest.raises(ValueError, match=r"HSDP \(dp_shard=2\) composes with dp, pp and tp"):
        runs.run_3d(nproc=8, dp=2, cp=2, tp=2, pp=1, dp_shard=2)
    assert cli.main(["run", "3d", "--dp", "4", "--tp", "2", "--pp", "1", "--dp-shard", "3"]) == 2
    said = capsys.readouterr().err
    assert "dp=4 is not divisible by dp_shard=3" in said and said.count("\n") == 1


def test_the_formula_with_one_shard_group_is_fsdp_and_with_one_rank_each_an_all_reduce():
    whole = dict(cfg=CFG, batch=8, seq=16, dp=4, tp=2, pp=1, stage=0)
    fsdp = cost.threed_step_bytes(**whole, data_parallel="fsdp", state_dict=True)
    one_group = cost.threed_step_bytes(**whole, data_parallel="hsdp", dp_shard=4, state_dict=True)
    assert one_group["dp_shard"] == fsdp["dp"] and one_group["dp_replicate"] == 0
    # shards of one rank: each unit's whole gradient all-reduced over the 4 replicas
    alone = cost.threed_step_bytes(**whole, data_parallel="hsdp", dp_shard=1)
    numels = cost.stage_unit_numels(CFG, 2, 1, 0)
    assert alone["dp_shard"] == 0
    assert alone["dp_replicate"] == pytest.approx(2 * 3 / 4 * sum(numels) * 4)
    assert alone["dp"] == alone["dp_replicate"]


# -- Parallel3D's own API, with the global norm clipping reads ------------------------------------
def _clipped_hsdp_steps(train):
    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D
    from minitp.trainer import train_step

    cfg = get_config("tiny")
    try:  # refused before any group is made
        Mesh(4, 1, 1, dp_shard=3)
        refused = ""
    except ValueError as error:
        refused = str(error)
    par = Parallel3D(build_model(cfg, seed=train.seed), Mesh(4, 1, 1, dp_shard=2), "hsdp",
                     lr=train.lr)
    norms = [train_step(par, x, y, clip=0.0).norm for x, y in synthetic_batches(cfg, train)]
    groups = {dim: par.mesh.group_ranks[dim] for dim in HALVES}
    return {"norms": norms, "groups": groups, "wrapper": type(par.fsdp).__name__,
            "refused": refused, "mesh": repr(par.mesh)}


def test_parallel3d_hsdp_takes_the_meshs_two_groups_and_counts_each_element_once_in_the_norm():
    train = TrainConfig(steps=2, batch_size=8)
    results = launch(_clipped_hsdp_steps, 4, train, echo=False)
    model = build_model(CFG, seed=train.seed)
    optimizer = make_optimizer(model.parameters(), train.lr)
    expected = []
    for tokens, targets in synthetic_batches(CFG, train):  # one process, the whole batch
        optimizer.zero_grad()
        loss_fn(model(tokens), targets).backward()
        expected.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        optimizer.step()
    for rank, r in enumerate(results):
        assert r["wrapper"] == "HybridShardedDataParallel"
        assert r["refused"].startswith("dp=4 is not divisible by dp_shard=3")
        assert "dp_shard=2" in r["mesh"]
        assert r["groups"] == {"dp_shard": [rank - rank % 2, rank - rank % 2 + 1],
                               "dp_replicate": [rank % 2, rank % 2 + 2]}
        # counted R times (each replica's shards) it would be sqrt(2) times too big
        assert r["norms"] == pytest.approx(expected, rel=1e-5), rank
