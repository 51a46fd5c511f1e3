"""minitp.mesh: rank placement (``minitp.layout``) and the groups every rank builds. Training on a mesh is
in test_parallel3d.py."""

import pytest
import torch

from minitp import comm, grid, layout, mesh
from minitp.launcher import launch


def test_ranks_are_placed_tp_fastest_then_pp_then_dp():
    groups = grid.group_lists(dp=2, pp=2, tp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 1, 4), (3, 2, 1)])
def test_coordinates_invert_rank_of_and_every_group_partitions_the_world(dp, pp, tp):
    world = dp * pp * tp
    for rank in range(world):
        c = grid.coordinates(rank, dp, pp, tp)
        assert grid.rank_of(c.dp, c.pp, c.tp, pp, tp) == rank
    for dim, lists in grid.group_lists(dp, pp, tp).items():
        assert sorted(r for g in lists for r in g) == list(range(world)), dim
        assert len(lists[0]) == {"dp": dp, "pp": pp, "tp": tp}[dim]


def test_a_mesh_whose_product_is_not_the_world_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"dp\*pp\*tp = 2\*2\*3 = 12 but the world has 8 ranks"):
        grid.check_layout(2, 2, 3, 8)
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        grid.check_layout(8, 1, 0, 8)


def test_tp_groups_straddling_machines_are_refused():
    grid.check_tp_within_node(2, 4)
    with pytest.raises(ValueError, match="tp=4 does not divide the 6 processes per node"):
        grid.check_tp_within_node(4, 6)


def _mesh_worker(dp, pp, tp):
    import torch.distributed as dist

    m = mesh.Mesh(dp, pp, tp)
    out = {"coords": (m.coords.dp, m.coords.pp, m.coords.tp), "ranks": m.group_ranks}
    for dim in layout.AXES:  # a sum over each group: every member's rank
        t = torch.tensor([float(dist.get_rank())])
        comm.all_reduce(t, m.group(dim), label=f"test/{dim}")
        out[dim] = t.item()
    return out


def test_mesh_builds_every_group_on_every_rank_and_each_group_sums_its_members():
    results = launch(_mesh_worker, 8, 2, 2, 2, echo=False)
    groups = grid.group_lists(2, 2, 2)
    for rank, r in enumerate(results):
        assert r["coords"] == tuple(vars(grid.coordinates(rank, 2, 2, 2)).values())
        for dim in layout.AXES:
            mine = next(g for g in groups[dim] if rank in g)
            assert r["ranks"][dim] == mine
            assert r[dim] == sum(mine)


def test_mesh_refuses_a_bad_product_inside_the_run_too():
    with pytest.raises(Exception, match=r"dp\*pp\*tp = 2\*2\*1 = 4 but the world has 2 ranks"):
        launch(lambda: mesh.Mesh(2, 2, 1), 2, echo=False)


def _cp_ep_worker(dp, pp, tp, cp, ep):
    m = mesh.Mesh(dp, pp, tp, cp=cp, ep=ep)
    out = {dim: m.group_ranks.get(dim) for dim in ("dp", "pp", "tp", "cp", "ep", "expert_dp")}
    for dim in ("cp", "ep"):  # each group made by the mesh sums its members' ranks, and is named
        group = m.group(dim)
        if group is not None:
            t = torch.tensor([float(m.rank)])
            torch.distributed.all_reduce(t, group=group)
            out[f"{dim}_sum"] = t.item()
            out[f"{dim}_name"] = comm.group_dim(group)
    return out


def test_the_mesh_splits_each_dp_group_into_cp_groups_and_ep_groups():
    # dp axis of 4 (2 replicas × cp 2), tp 2: rank = dp_rank·2 + tp_rank; cp groups: consecutive dp ranks
    results = launch(_cp_ep_worker, 8, 4, 1, 2, 2, 1, echo=False)
    for rank, r in enumerate(results):
        d, t = divmod(rank, 2)
        assert r["dp"] == [t, 2 + t, 4 + t, 6 + t] and r["tp"] == [2 * d, 2 * d + 1]
        first = (d // 2) * 2
        assert r["cp"] == [first * 2 + t, (first + 1) * 2 + t] and r["cp_sum"] == sum(r["cp"])
        assert r["cp_name"] == "cp" and r["ep"] is None
    # dp 4 with ep 2: ep groups are runs of 2 dp ranks; the ranks at the same place in every run hold
    # the same experts (an expert-dp group, named "dp")
    results = launch(_cp_ep_worker, 4, 4, 1, 1, 1, 2, echo=False)
    for rank, r in enumerate(results):
        assert r["ep"] == ([0, 1] if rank < 2 else [2, 3]) and r["ep_sum"] == sum(r["ep"])
        assert r["expert_dp"] == ([0, 2] if rank % 2 == 0 else [1, 3]) and r["ep_name"] == "ep"


def test_the_mesh_refuses_cp_or_ep_that_does_not_divide_its_dp_axis():
    with pytest.raises(Exception, match="the mesh.s dp=2 is not divisible by cp=3"):
        launch(lambda: mesh.Mesh(2, 1, 1, cp=3), 2, echo=False)
