"""The tensor-parallel figures, drawn from small real runs: each piece sits where the ranks' data says."""

import pytest
import torch
import torch.nn as nn

import minitp
from minitp import tp, trace
from minitp.models import TINY, build_model
from minitp.viz import tp as viz_tp


def _gids(fig) -> list[str]:
    return [a.get_gid() for ax in fig.axes for a in ax.get_children() if a.get_gid()]


def _split_run():
    torch.manual_seed(0)
    linear = nn.Linear(8, 12, bias=False)
    x = torch.randn(2, 3, 8, requires_grad=True)
    column = tp.ColumnParallelLinear(linear, None)
    row = tp.RowParallelLinear(nn.Linear(12, 8, bias=False), None)
    y_column = column(x)
    y = row(torch.tanh(y_column))
    y.pow(2).sum().backward()
    rank, n = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return {"x": x.detach(), "W": linear.weight.detach().T, "W_column": column.weight.detach().T,
            "y_column": y_column.detach(), "x_mine": x.detach().chunk(n, -1)[rank],
            "W_row": linear.weight.detach().T.chunk(n, 0)[rank]}


@pytest.fixture(scope="module")
def split_run():
    return minitp.launch(_split_run, 4, echo=False)


def test_locate_finds_each_ranks_slice_and_the_partial_sums(split_run):
    x, W = split_run[0]["x"], split_run[0]["W"]
    columns = viz_tp.locate(W, [r["W_column"] for r in split_run])
    assert [(p.kind, p.dim, p.start, p.stop) for p in columns] == [("slice", 1, 3 * r, 3 * r + 3) for r in range(4)]
    rows = viz_tp.locate(W, [r["W_row"] for r in split_run])
    assert [(p.kind, p.dim, p.start) for p in rows] == [("slice", 0, 2 * r) for r in range(4)]
    assert {p.kind for p in viz_tp.locate(x, [r["x"] for r in split_run])} == {"replicated"}
    x2 = x.reshape(-1, 8)
    partials = [r["x_mine"].reshape(-1, 2) @ r["W_row"] for r in split_run]
    assert {p.kind for p in viz_tp.locate(x2 @ W, partials)} == {"partial"}
    wrong = viz_tp.locate(W, [W.chunk(4, 1)[0]] * 3 + [torch.zeros(8, 3)])
    assert wrong[3].kind == "unknown"


def test_matmul_blocks_draws_one_block_per_rank_where_it_sits(split_run):
    x, W = split_run[0]["x"], split_run[0]["W"]
    Y = x @ W
    fig = viz_tp.matmul_blocks((x, [r["x"] for r in split_run]), (W, [r["W_column"] for r in split_run]),
                               (Y, [r["y_column"] for r in split_run]), title="column")
    assert len(fig.axes) == 3
    gids = _gids(fig)
    assert "block:X:all:replicated" in gids
    assert [g for g in gids if g.startswith("block:W:")] == [f"block:W:{r}:slice" for r in range(4)]
    assert [g for g in gids if g.startswith("block:Y:")] == [f"block:Y:{r}:slice" for r in range(4)]
    rect = next(a for a in fig.axes[1].patches if a.get_gid() == "block:W:2:slice")
    assert (rect.get_x(), rect.get_width(), rect.get_height()) == (6, 3, 8)  # W[:, 6:9], all 8 rows
    assert fig.axes[1].get_title() == "W  (8×12)"


def test_weight_shards_of_a_parallel_swiglu():
    def worker():
        mlp = tp.ParallelFeedForward(build_model(TINY).layers[0].feed_forward, None)
        return tp.local_shards(mlp)

    shards = minitp.launch(worker, 2, echo=False)
    fig = viz_tp.weight_shards(list(shards), ["w1.weight", "w3.weight", "w2.weight"], labels=["W1", "W3", "W2"])
    gids = _gids(fig)
    for name in ("W1", "W3", "W2"):
        assert [g for g in gids if g.startswith(f"block:{name}:")] == [f"block:{name}:{r}:slice" for r in range(2)]
    w1 = next(a for a in fig.axes[0].patches if a.get_gid() == "block:W1:1:slice")
    w2 = next(a for a in fig.axes[2].patches if a.get_gid() == "block:W2:1:slice")
    half = TINY.ffn_hidden // 2
    assert (w1.get_x(), w1.get_width()) == (half, half)  # W1 (D, F): rank 1 holds the second half of the columns
    assert (w2.get_y(), w2.get_height()) == (half, half)  # W2 (F, D): rank 1 holds the second half of the rows


def _pair_messages():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 8, requires_grad=True)
    col = tp.ColumnParallelLinear(nn.Linear(8, 16, bias=False), None)
    row = tp.RowParallelLinear(nn.Linear(16, 8, bias=False), None)
    with trace.scope("pair"):
        row(col(x).tanh()).pow(2).sum().backward()


def test_message_flow_puts_g_forward_and_f_backward():
    results = minitp.launch(_pair_messages, 2, echo=False)
    fig = viz_tp.message_flow(results, rank=1, label_prefix="pair")
    gids = _gids(fig)
    assert "msg:forward:0:all_reduce" in gids and "msg:backward:0:all_reduce" in gids
    assert len([g for g in gids if g.startswith("msg:")]) == 2
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "all-reduce\ntp\ng\n192 B" in texts
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["forward", "backward"]
    # the phase is the event's own field, set where the message was sent (never read from the label)
    phases = {e.label: viz_tp.phase_of(e) for e in results.traces[1].comm()}
    assert phases == {"pair/tp/g.forward": "forward", "pair/tp/f.backward": "backward"}
    assert viz_tp.phase_of(trace.Event(0, "comm", "all_reduce", "f.backward", 0.0, 0.0)) == "forward"  # unset


def test_matmul_blocks_draws_partial_sums_as_a_stack_and_flags_a_wrong_split(split_run):
    x, W = split_run[0]["x"], split_run[0]["W"]
    x2 = x.reshape(-1, 8)
    partials = [r["x_mine"].reshape(-1, 2) @ r["W_row"] for r in split_run]
    fig = viz_tp.matmul_blocks((x2, [r["x_mine"].reshape(-1, 2) for r in split_run]),
                               (W, [r["W_row"] for r in split_run]), (x2 @ W, partials))
    gids = _gids(fig)
    assert [g for g in gids if g.startswith("block:X:")] == [f"block:X:{r}:slice" for r in range(4)]
    assert sorted(g for g in gids if g.startswith("block:Y:")) == [f"block:Y:{r}:partial" for r in range(4)]
    assert any("partial sums" in t.get_text() for t in fig.axes[2].texts)
    swapped = [r["W_column"] for r in split_run][::-1]  # rank 0 holding rank 3's columns is still a slice...
    wrong = [torch.zeros_like(swapped[0])] + swapped[1:]  # ...but zeros are no slice of W
    fig = viz_tp.matmul_blocks((x, [x] * 4), (W, wrong), (x @ W, [r["y_column"] for r in split_run]))
    gids = _gids(fig)
    assert "block:W:all:unknown" in gids and "block:W:0:slice" not in gids
    rect = next(a for a in fig.axes[1].patches if a.get_gid() == "block:W:1:slice")
    assert rect.get_x() == 6  # rank 1 returned columns 6:9, and is drawn where they sit


def _gids(fig) -> list[str]:
    return [a.get_gid() for ax in fig.axes for a in ax.get_children() if a.get_gid()]


def _attention_shards():
    attention = tp.ParallelAttention(build_model(TINY).layers[0].attention, None)
    return tp.local_shards(attention)


def test_weight_shards_marks_grouped_query_heads_along_the_split_dimension():
    shards = list(minitp.launch(_attention_shards, 2, echo=False))
    q = [f"q{j}" for j in range(TINY.n_heads)]
    kv = [f"kv{i}" for i in range(TINY.kv_heads)]
    fig = viz_tp.weight_shards(shards, ["wq.weight", "wk.weight", "wo.weight"], labels=["WQ", "WK", "WO"],
                               heads={"wq.weight": q, "wk.weight": kv, "wo.weight": q}, head_groups={"wq.weight": kv})
    wq, wk, wo = fig.axes
    assert [t.get_text() for t in wq.get_xticklabels()] == q
    assert [t.get_text() for t in wq.get_xticklabels(minor=True)] == kv  # the key/value head each pair reads
    assert [t.get_text() for t in wk.get_xticklabels()] == kv
    assert [t.get_text() for t in wo.get_yticklabels()] == q  # row-parallel: heads run down the rows
    assert sum(g.startswith("head:WQ:") for g in _gids(fig)) == TINY.n_heads - 1
    lines = {line.get_gid(): line for line in wq.get_lines()}
    assert list(lines["head:WQ:2"].get_xdata()) == [2 * TINY.head_dim] * 2
    assert lines["head:WQ:2"].get_linestyle() == "-" and lines["head:WQ:1"].get_linestyle() != "-"  # group edge
    with pytest.raises(ValueError, match="do not make 3 equal heads"):
        viz_tp.weight_shards(shards, ["wk.weight"], heads={"wk.weight": ["a", "b", "c"]})
