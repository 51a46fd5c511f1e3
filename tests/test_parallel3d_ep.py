"""Expert parallel on the 3D mesh: a MoE model's experts over ep of the dp ranks, dp/ep copies of each."""

import pytest

from minitp import cli, cost, runs


@pytest.fixture(scope="module")
def ep_mesh_run():
    return runs.run_3d(dp=4, ep=2, tp=1, pp=1, steps=2)


def test_experts_over_two_of_four_dp_ranks_match_one_process_with_bytes_per_dimension(ep_mesh_run):
    report = ep_mesh_run
    assert runs.check(report) == [] and report.world_size == 4
    assert report.layout == {"dp": 4, "tp": 1, "pp": 1, "ep": 2}
    for traced, expected in zip(report.comm_bytes_traced_by_dim, report.comm_bytes_expected_by_dim):
        assert traced["ep"] == expected["ep"] > 0 and traced["dp"] == expected["dp"] > 0
        assert traced["tp"] == traced["pp"] == 0
    # the two ep groups, ranks {0, 1} and {2, 3}, route their own tokens: each pair sends what its routing says
    ep_bytes = [d["ep"] for d in report.comm_bytes_traced_by_dim]
    assert ep_bytes[0] == ep_bytes[1] and ep_bytes[2] == ep_bytes[3]


def test_each_rank_holds_half_the_experts_and_every_replicated_parameter(ep_mesh_run):
    from minitp.models import get_config
    from minitp.models.moe import moe_config

    cfg = moe_config(get_config("tiny"), n_experts=8)
    replicated, experts = cost.moe_param_split(cfg)
    assert ep_mesh_run["params_per_rank"] == replicated + experts // 2
    assert all(m["params"] == 4 * (replicated + experts // 2) for m in ep_mesh_run.memory)


def test_the_data_parallel_bytes_are_two_all_reduces_replicated_over_dp_and_experts_over_their_copies():
    # 4 dp ranks, ep 2: replicated gradients over 4 ranks (2·3/4 of them), each rank's experts over its 2 copies
    # (2·1/2 of them); 2 steps; the all-to-alls from a routing written by hand (ep 2, 4 experts, D 8)
    counts = [[3, 1, 0, 2], [1, 1, 4, 0]]  # rank 0 keeps 3+1 rows for rank 0's experts, 0+2 for rank 1's
    got = cost.ep3d_run_bytes([[counts]] * 2, 0, dim=8, replicated_params=100, expert_params=40, dp=4, ep=2)
    assert got["dp"] == 2 * (400 * 2 * 3 / 4 + 160 * 2 * 1 / 2)
    rows = 2 + 2  # sent to rank 1: 2 rows; received from rank 1: its 1+1 rows for rank 0's experts
    counts_bytes = 4 * 8 * 1 / 2  # 4 int64 counts, half leave the rank
    assert got["ep"] == 2 * (2 * rows * 8 * 4 + counts_bytes)
    assert got["tp"] == got["pp"] == 0
    with pytest.raises(ValueError, match="dp=6 is not divisible by ep=4"):
        cost.ep3d_run_bytes([[counts]], 0, 8, 100, 40, dp=6, ep=4)


def test_one_ep_group_over_all_dp_ranks_sends_what_the_expert_parallel_run_sends():
    mesh = runs.run_3d(dp=2, ep=2, tp=1, pp=1, steps=2)
    alone = runs.run_ep(nproc=2, steps=2)
    assert runs.check(mesh) == [] and mesh.comm_bytes_traced == alone.comm_bytes_traced
    assert mesh.loss == pytest.approx(alone.loss, abs=1e-6)


@pytest.mark.parametrize("args, message", [
    (dict(dp=4, ep=3), "dp=4 is not divisible by ep=3"),
    (dict(dp=2, tp=2, ep=2), "ep=2 composes with dp \\(DDP\\) and pp: tp must be 1"),
    (dict(dp=2, pp=2, ep=2, schedule="interleaved"), "without --cp, --fsdp or the interleaved schedule"),
    (dict(dp=4, ep=4, experts=6), "experts=6 is not divisible by ep=4"),
])
def test_3d_refuses_an_ep_layout_it_cannot_run_before_starting(args, message):
    with pytest.raises(ValueError, match=message):
        runs.run_3d(**{"tp": 1, "pp": 1, **args})


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_experts_in_a_pipeline_match_one_process_each_stage_adding_its_auxiliary_loss(schedule):
    # dp 2 × pp 2, ep 2: each stage's two ranks split the experts of the stage's blocks; the last stage's
    # loss is the cross-entropy and every stage's MoE layers give their auxiliary loss its gradient
    report = runs.run_3d(dp=2, ep=2, tp=1, pp=2, steps=2, schedule=schedule)
    assert runs.check(report) == [] and report.max_abs_param_diff <= 1e-5
    assert report.loss == pytest.approx(report.reference_loss, abs=1e-5)  # cross-entropy + 0.01·Σ aux
    assert report.layout == {"dp": 2, "tp": 1, "pp": 2, "ep": 2}
    D, S, rows = 64, 16, 8 // 2  # each replica's rows cross the stage boundary, (S, D) fp32 each way
    for traced, expected in zip(report.comm_bytes_traced_by_dim, report.comm_bytes_expected_by_dim):
        assert traced == expected and traced["ep"] > 0 and traced["dp"] > 0
        assert traced["pp"] == 2 * rows * S * D * 4  # 2 steps; stage 0 forward, stage 1 backward


def test_an_expert_parallel_checkpoint_moves_between_a_pipeline_and_none(tmp_path):
    saved = runs.run_3d(dp=2, ep=2, tp=1, pp=2, steps=2, save_to=str(tmp_path / "pp"))
    resumed = runs.run_3d(dp=4, ep=4, tp=1, pp=1, steps=3, resume_from=str(tmp_path / "pp"))
    assert runs.check(saved) == [] and runs.check(resumed) == [] and resumed.start_step == 2


def test_cli_runs_3d_with_ep_and_refuses_ep_zero(capsys):
    assert cli.main(["run", "3d", "--dp", "2", "--tp", "1", "--pp", "1", "--ep", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "ep=2" in out and "ep traced" in out and "matches the reference" in out
    assert cli.main(["run", "3d", "--dp", "2", "--tp", "1", "--pp", "1", "--ep", "0"]) == 2
    assert "--ep 0 is not allowed" in capsys.readouterr().err
