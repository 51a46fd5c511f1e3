"""minitp.mesh: rank placement, the groups every rank builds, and 3D training against one process."""

import json

import pytest
import torch

from minitp import cli, comm, cost, mesh, runs
from minitp.launch import launch
from minitp.models import get_config


def test_ranks_are_placed_tp_fastest_then_pp_then_dp():
    groups = mesh.group_lists(dp=2, pp=2, tp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 1, 4), (3, 2, 1)])
def test_coordinates_invert_rank_of_and_every_group_partitions_the_world(dp, pp, tp):
    world = dp * pp * tp
    for rank in range(world):
        c = mesh.coordinates(rank, dp, pp, tp)
        assert mesh.rank_of(c.dp, c.pp, c.tp, pp, tp) == rank
    for dim, lists in mesh.group_lists(dp, pp, tp).items():
        assert sorted(r for g in lists for r in g) == list(range(world)), dim
        assert len(lists[0]) == {"dp": dp, "pp": pp, "tp": tp}[dim]


def test_a_mesh_whose_product_is_not_the_world_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"dp\*pp\*tp = 2\*2\*3 = 12 but the world has 8 ranks"):
        mesh.check_layout(2, 2, 3, 8)
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        mesh.check_layout(8, 1, 0, 8)


def test_tp_groups_straddling_machines_are_refused():
    mesh.check_tp_within_node(2, 4)
    with pytest.raises(ValueError, match="tp=4 does not divide the 6 processes per node"):
        mesh.check_tp_within_node(4, 6)


def _mesh_worker(dp, pp, tp):
    import torch.distributed as dist

    m = mesh.Mesh(dp, pp, tp)
    out = {"coords": (m.coords.dp, m.coords.pp, m.coords.tp), "ranks": m.group_ranks}
    for dim in mesh.DIMS:  # a sum over each group: every member's rank
        t = torch.tensor([float(dist.get_rank())])
        comm.all_reduce(t, m.group(dim), label=f"test/{dim}")
        out[dim] = t.item()
    return out


def test_mesh_builds_every_group_on_every_rank_and_each_group_sums_its_members():
    results = launch(_mesh_worker, 8, 2, 2, 2, echo=False)
    groups = mesh.group_lists(2, 2, 2)
    for rank, r in enumerate(results):
        assert r["coords"] == tuple(vars(mesh.coordinates(rank, 2, 2, 2)).values())
        for dim in mesh.DIMS:
            mine = next(g for g in groups[dim] if rank in g)
            assert r["ranks"][dim] == mine
            assert r[dim] == sum(mine)


def test_mesh_refuses_a_bad_product_inside_the_run_too():
    with pytest.raises(Exception, match=r"dp\*pp\*tp = 2\*2\*1 = 4 but the world has 2 ranks"):
        launch(lambda: mesh.Mesh(2, 2, 1), 2, echo=False)


# -- 3D training against the one-process reference ---------------------------------------------------------
LAYOUTS = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (2, 4, 1)]  # dp × tp × pp


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("dp,tp,pp", LAYOUTS, ids=[f"dp{a}xtp{b}xpp{c}" for a, b, c in LAYOUTS])
def test_3d_matches_single_process_with_traced_bytes_equal_to_the_formulas(dp, tp, pp, fsdp):
    report = runs.run_3d(nproc=8, dp=dp, tp=tp, pp=pp, fsdp=fsdp, steps=3)
    assert runs.check(report) == []
    assert report["max_abs_param_diff"] <= 1e-5
    assert max(abs(a - b) for a, b in zip(report["loss"], report["reference_loss"])) < 1e-5
    for traced, expected in zip(report["comm_bytes_traced_by_dim"], report["comm_bytes_expected_by_dim"]):
        assert traced == pytest.approx(expected, rel=1e-12, abs=1e-6)
    for dim, size in (("tp", tp), ("pp", pp), ("dp", dp)):  # a dimension of size 1 sends nothing, others do
        assert all((b[dim] > 0) == (size > 1) for b in report["comm_bytes_traced_by_dim"]), dim


def test_3d_with_the_gpipe_schedule_matches_too():
    report = runs.run_3d(nproc=8, dp=2, tp=2, pp=2, schedule="gpipe", microbatches=2, steps=2)
    assert runs.check(report) == [] and report["schedule"] == "gpipe" and report["microbatches"] == 2


def test_fsdp_with_a_pipeline_needs_zero_1_and_says_why():
    with pytest.raises(ValueError, match="FSDP with pp=2 needs zero=1, got zero=3"):
        runs.run_3d(nproc=8, dp=2, tp=2, pp=2, fsdp=True, zero=3)


def test_bad_layouts_are_refused_in_the_parent_with_the_numbers():
    with pytest.raises(ValueError, match=r"dp\*pp\*tp = 2\*2\*3 = 12 but the world has 8 ranks"):
        runs.run_3d(nproc=8, dp=2, tp=3, pp=2)
    with pytest.raises(ValueError, match="tp=8 does not divide n_heads=4"):
        runs.run_3d(nproc=8, dp=1, tp=8, pp=1)
    with pytest.raises(ValueError, match="pp=8 stages but the model has 4 blocks"):
        runs.run_3d(nproc=8, dp=1, tp=1, pp=8)
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by nproc=4"):
        runs.run_3d(nproc=8, dp=4, tp=2, pp=1, batch_size=6)
    with pytest.raises(ValueError, match="tp=3 does not divide n_heads=4"):
        cost.check_3d_layout(get_config("tiny"), 1, 1, 3)


def test_cli_run_3d_writes_the_report_and_exits_zero(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = cli.main(["run", "3d", "--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "2",
                   "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["layout"] == {"dp": 2, "tp": 2, "pp": 2}
    assert report["comm_bytes_traced"] == report["comm_bytes_expected"]
    assert "matches the reference" in capsys.readouterr().out
    assert cli.main(["run", "3d", "--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "3"]) == 2
    assert "dp*pp*tp = 2*3*2 = 12 but the world has 8 ranks" in capsys.readouterr().err
