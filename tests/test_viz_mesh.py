"""The 3D figures, drawn from a real 8-rank step: every rank, group, slice and message where the ranks say."""

import pytest
import torch

import minitp
from minitp import cost, trace
from minitp.models import TINY, build_model
from minitp.models.train import TrainConfig, synthetic_batches
from minitp.trainer import train_step
from minitp.viz import mesh as viz_mesh


def _gids(fig) -> list[str]:
    return [a.get_gid() for ax in fig.axes for a in ax.get_children() if a.get_gid()]


def _one_step():
    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D

    mesh = Mesh(2, 2, 2)
    par = Parallel3D(build_model(TINY, seed=0), mesh, microbatches=2)
    tokens, targets = synthetic_batches(TINY, TrainConfig(steps=1, batch_size=4, seq_len=8))[0]
    trace.current().clear()  # the step alone, without DDP's start-up broadcast
    train_step(par, tokens, targets)
    c = mesh.coords
    return {"rank": mesh.rank, "coords": [c.dp, c.pp, c.tp], "groups": mesh.group_ranks,
            "shards": par.local_shards()}


@pytest.fixture(scope="module")
def step():
    return minitp.launch(_one_step, 8, echo=False)


def test_mesh_cube_draws_every_group_of_every_dimension(step):
    fig = viz_mesh.mesh_cube(list(step))
    assert len(fig.axes) == 3
    gids = _gids(fig)
    for dim in ("tp", "pp", "dp"):
        assert sorted(g for g in gids if g.startswith(f"group:{dim}:")) == [f"group:{dim}:{i}" for i in range(4)]
        assert len([g for g in gids if g.startswith(f"rank:{dim}:")]) == 8
    assert "{0,1}" in fig.axes[0].get_title() and "{0,2}" in fig.axes[1].get_title()
    assert "{0,4}" in fig.axes[2].get_title()
    tp_pair = next(a for a in fig.axes[0].lines if a.get_gid() == "group:tp:0")
    assert list(tp_pair.get_xdata()) == [0.0, 1.0]  # ranks 0 and 1: one step along tp


def test_mesh_cube_refuses_ranks_that_disagree(step):
    wrong = [dict(r) for r in step]
    wrong[1] = {**wrong[1], "groups": {**wrong[1]["groups"], "tp": [1, 3]}}
    with pytest.raises(ValueError, match="reports another one"):
        viz_mesh.mesh_cube(wrong)


def test_block_shards_labels_each_slice_with_the_ranks_that_held_it(step):
    names = ["layers.0.attention.wq.weight", "layers.0.feed_forward.w2.weight", "layers.2.feed_forward.w1.weight"]
    fig = viz_mesh.block_shards(list(step), names, labels=["wq", "w2", "w1 (block 2)"])
    gids = _gids(fig)
    assert sorted(g for g in gids if g.startswith("slice:wq:")) == [f"slice:wq:{r}" for r in (0, 1, 4, 5)]
    assert sorted(g for g in gids if g.startswith("slice:w1 (block 2):")) == [
        f"slice:w1 (block 2):{r}" for r in (2, 3, 6, 7)]
    d, f = TINY.dim, TINY.ffn_hidden
    wq1 = next(a for a in fig.axes[0].patches if a.get_gid() == "slice:wq:5")
    assert (wq1.get_x(), wq1.get_width(), wq1.get_height()) == (d // 2, d // 2, d)  # W's second half of columns
    w2 = next(a for a in fig.axes[1].patches if a.get_gid() == "slice:w2:1")
    assert (w2.get_y(), w2.get_height()) == (f // 2, f // 2)  # row-parallel: the second half of the rows
    assert "stage 1" in fig.axes[2].get_title()
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "ranks\n0, 4" in texts and "ranks\n1, 5" in texts


def test_block_shards_outlines_a_slice_found_nowhere(step):
    broken = [dict(r) for r in step]
    name = "layers.0.attention.wq.weight"
    t, dim = broken[4]["shards"][name]
    broken[4] = {**broken[4], "shards": {**broken[4]["shards"], name: (torch.zeros_like(t), dim)}}
    gids = _gids(viz_mesh.block_shards(broken, [name]))
    assert f"slice:{name}:4:unknown" in gids and f"slice:{name}:0" in gids


def test_messages_by_dim_puts_every_message_in_its_dimension(step):
    fig = viz_mesh.messages_by_dim(step)
    gids = _gids(fig)
    for tr in step.traces:
        for dim in ("tp", "pp", "dp"):
            want = [e for e in tr.comm() if e.dim == dim]
            assert len([g for g in gids if g.startswith(f"msg:{tr.rank}:{dim}:")]) == len(want) > 0
    expected = cost.threed_step_bytes(TINY, 4, 8, 2, 2, 2, stage=0)
    texts = {t.get_gid(): t.get_text() for t in fig.axes[0].texts}
    from minitp.viz.timeline import format_bytes

    for d in ("tp", "pp", "dp"):  # rank 0's bytes per dimension, written at the end of its row
        assert texts[f"sent:0:{d}"] == f"{d} {format_bytes(expected[d])}"
    assert {e.dim for e in step.events if e.kind == "comm"} == {"tp", "pp", "dp"}  # every message has its group's


def _message(rank: int, dim: str, sent: float) -> trace.Event:
    return trace.Event(rank, "comm", "all_reduce", "any label", 0.0, 1e-3, group=(0, 1), dim=dim, sent_bytes=sent)


def test_messages_by_dim_reads_the_dimension_of_the_group_never_the_label():
    events = [_message(0, "fsdp", 2000.0), _message(1, "fsdp", 2000.0), _message(0, "", 5000.0)]
    gids = _gids(viz_mesh.messages_by_dim(events))
    assert sorted(g for g in gids if g.startswith("msg:")) == ["msg:0:fsdp:0", "msg:1:fsdp:0"]  # unnamed: left out
    with pytest.raises(ValueError, match="no message through a named group"):
        viz_mesh.messages_by_dim([_message(0, "", 8.0)])


def test_bytes_by_dim_stacks_traced_beside_the_formula(step):
    traced = trace.sent_bytes_by_dim(step.traces)  # read from each message's group, in rank order
    expected = [cost.threed_step_bytes(TINY, 4, 8, 2, 2, 2, stage=r["coords"][1]) for r in step]
    assert traced == expected
    assert trace.sent_bytes_per_rank(step.traces, dim="pp") == [b["pp"] for b in expected]
    fig = viz_mesh.bytes_by_dim(traced, expected)
    gids = _gids(fig)
    assert len([g for g in gids if g.startswith("traced:")]) == 24
    assert len([g for g in gids if g.startswith("expected:")]) == 24
    bar = next(a for a in fig.axes[0].patches if a.get_gid() == "traced:2:pp")
    assert bar.get_height() == pytest.approx(expected[2]["pp"] / 1e3)
    with pytest.raises(ValueError, match="8 traced entries but 1 expected"):
        viz_mesh.bytes_by_dim(traced, expected[:1])
