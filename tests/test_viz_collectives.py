"""The chapter 00 figures build from data a real launched run returned, with the panels and marks
the chapter describes."""

import pytest
import torch

import minitp
from minitp import comm, ring
from minitp.viz import collectives as vc


def _run():
    import torch.distributed as dist

    rank = dist.get_rank()
    before = torch.arange(1.0, 5.0) + 10 * rank
    broadcast = before.clone()
    comm.broadcast(broadcast, src=0)
    summed = before.clone()
    comm.all_reduce(summed)
    mine = torch.tensor([10.0 * rank + 1, 10.0 * rank + 2])
    gathered = torch.empty(8)
    comm.all_gather(gathered, mine)
    record = []
    ring.ring_all_reduce(torch.full((8,), float(2**rank)), label="ring", record=record)
    return {"before": before, "broadcast": broadcast, "summed": summed, "mine": mine,
            "gathered": gathered, "record": record}


@pytest.fixture(scope="module")
def run():
    return minitp.launch(_run, 4, echo=False)


def _boxes(ax):
    return [p for p in ax.patches if type(p).__name__ == "Rectangle"]


def test_before_after_has_one_box_per_value_and_colours_by_origin(run):
    fig = vc.before_after([r["mine"] for r in run], [r["gathered"] for r in run], "all-gather")
    before, after = fig.axes
    assert len(_boxes(before)) == 4 * 2 and len(_boxes(after)) == 4 * 8
    # after an all-gather, chunk k of every row has rank k's colour
    faces = [tuple(b.get_facecolor()) for b in _boxes(after)]
    assert faces[0] == faces[8] == faces[16] == faces[24]
    assert faces[0] != faces[2]
    assert [t.get_text() for t in after.texts][:4] == ["1", "2", "11", "12"]


def test_before_after_paints_sums_grey(run):
    from matplotlib.colors import to_rgba

    fig = vc.before_after([r["before"] for r in run], [r["summed"] for r in run])
    after = fig.axes[1]
    assert all(tuple(b.get_facecolor()) == to_rgba(vc.SUM_COLOR) for b in _boxes(after))
    assert after.texts[0].get_text() == str(1 + 11 + 21 + 31)


def test_ring_steps_draws_every_step_and_marks_received_chunks(run):
    records = [r["record"] for r in run]
    assert len(records[0]) == 1 + 2 * 3  # start + reduce-scatter + all-gather steps
    fig = vc.ring_steps(records)
    drawn = [ax for ax in fig.axes if ax.axison]
    assert len(drawn) == 7 and len(fig.axes) == 8
    assert drawn[0].get_title() == "start" and drawn[-1].get_title() == "all-gather step 3"
    assert all(len(_boxes(ax)) == 16 for ax in drawn)
    # at every step each rank received exactly one chunk: 4 thick outlines per panel but the start
    assert [sum(b.get_linewidth() > 2 for b in _boxes(ax)) for ax in drawn] == [0] + [4] * 6
    # at the end every cell holds every rank's data
    assert {t.get_text() for t in drawn[-1].texts} == {"all"}
    assert {t.get_text() for t in drawn[0].texts} == {"0", "1", "2", "3"}


def test_ring_steps_single_step_for_the_slider(run):
    fig = vc.ring_steps([r["record"] for r in run], steps=[3])
    assert len(fig.axes) == 1
    assert fig.axes[0].get_title() == "reduce-scatter step 3"


def test_message_graph_has_one_arrow_per_ring_link(run):
    events = [e for e in run.events if e.label.startswith("ring")]
    fig = vc.message_graph(events)
    ax = fig.axes[0]
    arrows = [p for p in ax.patches if type(p).__name__ == "FancyArrowPatch"]
    circles = [p for p in ax.patches if type(p).__name__ == "Circle"]
    assert len(arrows) == 4 and len(circles) == 4
    # 6 sends of 8 bytes (one 2-element chunk of float32) on each link
    assert sorted(t.get_text() for t in ax.texts if "msgs" in t.get_text()) == ["6 msgs, 48 B"] * 4


def test_bytes_per_rank_bars_match_the_trace(run):
    sent = run.sent_bytes("ring")
    fig = vc.bytes_per_rank(sent, minitp.cost.collective_sent_bytes("all_reduce", 32, 4))
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == sent == [48.0] * 4
    assert len(ax.lines) == 1 and ax.lines[0].get_ydata()[0] == 48.0


# -- finer checks: every box, arrow and bar says what the processes actually held and sent -------
N = 4


def _collectives():
    import torch
    import torch.distributed as dist

    from minitp import comm

    r = dist.get_rank()
    own = torch.arange(1, 3, dtype=torch.float32) + 10 * r  # 10r+1, 10r+2
    gathered = torch.empty(2 * dist.get_world_size())
    comm.all_gather(gathered, own)
    copied = own.clone()
    comm.broadcast(copied, src=0)
    return {"own": own, "all_gather": gathered, "broadcast": copied}


def _big_ring(numel=8, big_numel=1024):
    import torch
    import torch.distributed as dist

    from minitp.ring import ring_all_reduce

    r = dist.get_rank()
    record = []
    ring_all_reduce(torch.full((numel,), float(2**r)), label="ring", record=record)
    ring_all_reduce(torch.ones(big_numel), label="big")
    return record


@pytest.fixture(scope="module")
def held():
    return minitp.launch(_collectives, N, echo=False)


@pytest.fixture(scope="module")
def big_ring():
    return minitp.launch(_big_ring, N, echo=False)


def _rounded(color):
    from matplotlib.colors import to_rgba

    return tuple(round(c, 4) for c in to_rgba(color))


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def test_before_after_all_gather_rows_repeat_the_inputs_colours_in_rank_order(held):
    fig = vc.before_after([h["own"] for h in held], [h["all_gather"] for h in held], title="all-gather")
    before, after = fig.axes
    assert _texts(before) == [f"{10 * r + i}" for r in range(N) for i in (1, 2)]
    assert _texts(after) == [f"{10 * j + i}" for _ in range(N) for j in range(N) for i in (1, 2)]
    before_faces = [_rounded(p.get_facecolor()) for p in _boxes(before)]
    after_faces = [_rounded(p.get_facecolor()) for p in _boxes(after)]
    for r in range(N):  # on every rank, chunk j of the output has rank j's colour
        assert after_faces[r * 2 * N:(r + 1) * 2 * N] == before_faces
    assert len(set(before_faces)) == N
    assert fig._suptitle.get_text() == "all-gather"


def test_before_after_paints_a_broadcast_in_the_sources_colour(held):
    fig = vc.before_after([h["own"] for h in held], [h["broadcast"] for h in held])
    source = {_rounded(p.get_facecolor()) for p in _boxes(fig.axes[0])[:2]}
    assert {_rounded(p.get_facecolor()) for p in _boxes(fig.axes[1])} == source
    assert _texts(fig.axes[1]) == ["1", "2"] * N


def test_ring_steps_shows_who_holds_what_and_who_sent_it(big_ring):
    from minitp.viz.style import OP_COLORS, rank_color

    records = list(big_ring)
    panels = [ax for ax in vc.ring_steps(records, columns=4).axes if ax.axison]
    assert [ax.get_title() for ax in panels] == (
        ["start"] + [f"reduce-scatter step {s}" for s in (1, 2, 3)] + [f"all-gather step {s}" for s in (1, 2, 3)])
    assert _texts(panels[0]) == [str(r) for r in range(N) for _ in range(N)]
    assert {_rounded(p.get_facecolor()) for p in _boxes(panels[-1])} == {_rounded(OP_COLORS["all_reduce"])}
    # after the reduce-scatter, rank r holds chunk (r + 1) % n complete, and only that one
    rs_end = _texts(panels[N - 1])
    for r in range(N):
        assert [c for c, t in enumerate(rs_end[r * N:(r + 1) * N]) if t == "all"] == [(r + 1) % N]
    # the chunk a rank just received is outlined in its left neighbour's colour
    for k, ax in enumerate(panels[1:], start=1):
        boxes = _boxes(ax)
        for r in range(N):
            got = records[r][k]["received"]
            assert [c for c in range(N) if boxes[r * N + c].get_linewidth() > 1.5] == [got]
            assert _rounded(boxes[r * N + got].get_edgecolor()) == _rounded(rank_color((r - 1) % N))


def test_message_graph_colours_each_arrow_by_sender_and_sums_its_bytes(big_ring):
    from minitp.viz.style import rank_color

    events = [e for e in big_ring.events if e.label.startswith("big")]
    ax = vc.message_graph(events, title="ring").axes[0]
    arrows = [p for p in ax.patches if type(p).__name__ == "FancyArrowPatch"]
    assert {_rounded(a.get_edgecolor()) for a in arrows} == {_rounded(rank_color(r)) for r in range(N)}
    # 2(n-1) = 6 sends of one 1,024-byte chunk (256 float32) on each link: 6,144 bytes
    assert [t for t in _texts(ax) if "msgs" in t] == ["6 msgs, 6.1 KB"] * N
    assert ax.get_title() == "ring"


def test_bytes_per_rank_scales_its_axis_and_draws_the_formula(big_ring):
    sent = big_ring.sent_bytes("big")
    formula = minitp.cost.collective_sent_bytes("all_reduce", 1024 * 4, N)
    assert sent == [formula] * N
    ax = vc.bytes_per_rank(sent, formula, title="ring", formula="2(n-1)/n · B").axes[0]
    assert [b.get_height() for b in _boxes(ax)] == pytest.approx([s / 1000 for s in sent])
    assert ax.get_ylabel() == "bytes sent (KB)"
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == pytest.approx([formula / 1000] * 2)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["2(n-1)/n · B", "traced"]
