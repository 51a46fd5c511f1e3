"""Every kind of figure the chapters store, drawn from small real runs (the workers of the other
test_viz_* files) or the same numbers the chapters draw, with every text it shows at least
``style.MIN_TEXT_PX`` pixels tall as the website shows it (``style.text_sizes_px``)."""

import matplotlib
import pytest
import test_viz_collectives
import test_viz_fsdp
import test_viz_mesh
import test_viz_pipeline
import test_viz_timeline
import test_viz_tp
import torch

import minitp
from minitp import cost, pp, trace
from minitp.models import TINY
from minitp.viz import (
    collectives,
    context,
    experts,
    fsdp,
    mesh,
    pipeline,
    profile,
    style,
    timeline,
    tp,
)

matplotlib.use("Agg")


def _ring_attention():
    from minitp import cp

    g = torch.Generator().manual_seed(3)
    shapes = [(1, 8, 64, 8), (1, 4, 64, 8), (1, 4, 64, 8)]  # q, k, v as chapter 07 draws them
    q, k, v = (cp.shard_sequence(torch.randn(*s, generator=g), None, True, dim=2).requires_grad_() for s in shapes)
    cp.ring_attention(q, k, v, None, causal=True, balanced=True, label="cp/ring")
    return None


def _tp_block():
    from minitp import tp as tensor_parallel
    from minitp.models import build_model

    model = tensor_parallel.parallelize(build_model(TINY), None, False)
    x = torch.randn(2, 8, TINY.dim, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with trace.span("forward"):
        y = model.layers[0](x, model.rope_cos[:8], model.rope_sin[:8])
    with trace.span("backward"):
        y.pow(2).sum().backward()
    return {name: tensor_parallel.local_shards(model.layers[0])[name] for name in
            ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
             "feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight")}


@pytest.fixture(scope="module")
def runs():
    """One small run of each kind the chapters draw, launched once for every figure here."""
    return {
        "collectives": minitp.launch(test_viz_collectives._run, 4, echo=False),
        "ring8": minitp.launch(test_viz_collectives._big_ring, 8, echo=False),
        "ddp": minitp.launch(test_viz_timeline._worker, 2, echo=False),
        "fsdp": minitp.launch(test_viz_fsdp._worker, 3, echo=False),
        "split": minitp.launch(test_viz_tp._split_run, 4, echo=False),
        "block": minitp.launch(_tp_block, 2, echo=False),
        "pipeline": minitp.launch(test_viz_pipeline._pipeline_run, 3, echo=False, timeout=120),
        "mesh": minitp.launch(test_viz_mesh._one_step, 8, echo=False),
        "cp": minitp.launch(_ring_attention, 4, echo=False),
    }


def _memory(n, scale=1.0):
    return [{"params": 4e5 * scale, "grads": 4e5 * scale, "optimizer": 8e5 * scale} for _ in range(n)]


def _chapter_00(r):
    held, ring8 = r["collectives"], r["ring8"]
    big = [e for e in ring8.events if e.label.startswith("big")]
    graph8 = collectives.message_graph(big, title="8 ranks: traced sends")
    graph8.set_size_inches(5.0, 4.7)  # as chapter 00's control draws 8 ranks
    return {
        "before_after": collectives.before_after([h["before"] for h in held], [h["summed"] for h in held],
                                                 title="all-reduce (sum): everyone gets the sum"),
        "ring_steps": collectives.ring_steps([h["record"] for h in held], columns=4),
        "message_graph": collectives.message_graph([e for e in held.events if e.label.startswith("ring")],
                                                   title="ring all-reduce on 4 ranks: traced sends"),
        "message_graph 8 ranks": graph8,
        "bytes_per_rank": collectives.bytes_per_rank(ring8.sent_bytes("big"), cost.collective_sent_bytes(
            "all_reduce", 4096, 8), title="ring all-reduce of B = 1 MiB on 8 ranks", formula="2(n-1)/n · B"),
    }


def _chapter_01(r):
    report = {"loss": [4.2, 4.0, 3.9], "reference_loss": [4.2, 4.0, 3.9000001], "strategy": "ddp", "world_size": 4,
              "memory": _memory(4), "memory_expected": _memory(4)}
    return {
        "timeline (DDP buckets)": timeline.timeline(r["ddp"], label_prefix="step", lane_height=1.3, width=9,
                                                    title="one DDP step on 2 ranks"),
        "loss_curve": timeline.loss_curve(report, title="DDP on 4 ranks against one process"),
        "memory_bars": timeline.memory_bars(report, title="what each of 4 DDP ranks holds"),
        "memory_bars with a limit": timeline.memory_bars(_memory(1, 1e5), names=["LLaMA-3-8B, DDP"],
                                                         limit=cost.H100.memory_bytes, limit_label="one H100: 80 GiB",
                                                         width=4.5, title="per GPU"),
    }


def _chapter_02(r):
    run = r["fsdp"]
    sent = {name: fsdp.sent_by_op(run, name, rank=0) for name in ("DDP", "ZeRO-3")}
    expected = {name: sum(v.values()) for name, v in sent.items()}
    return {
        "shard_map": fsdp.shard_map(list(run), title="3 ranks: the slice of each unit every rank holds"),
        "unit_cycle": fsdp.unit_cycle(run, rank=0, label_prefix="ZeRO-3", title="rank 0, one ZeRO-3 step"),
        "timeline (ZeRO-3)": timeline.timeline(run, label_prefix="ZeRO-3", ranks=[0, 1], text=False, title="ZeRO-3"),
        "memory_bars by stage": timeline.memory_bars(_memory(4), _memory(4), title="what one of 4 ranks holds",
                                                     names=["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]),
        "bytes_by_stage": fsdp.bytes_by_stage(sent, expected, title="bytes one of 3 ranks sent in one step"),
    }


def _chapter_03_04(r):
    split, block = r["split"], r["block"]
    x, W = split[0]["x"], split[0]["W"]
    q_names = [f"q{j}" for j in range(TINY.n_heads)]
    kv_names = [f"kv{i}" for i in range(TINY.kv_heads)]
    return {
        "matmul_blocks column": tp.matmul_blocks((x, [s["x"] for s in split]), (W, [s["W_column"] for s in split]),
                                                 (x @ W, [s["y_column"] for s in split]), title="column-parallel"),
        "matmul_blocks row": tp.matmul_blocks((x, [s["x_mine"] for s in split]), (W, [s["W_row"] for s in split]),
                                              (x @ W, [s["x_mine"].reshape(-1, 2) @ s["W_row"] for s in split]),
                                              title="row-parallel"),
        "message_flow": tp.message_flow(split, rank=0, title="column then row on 4 ranks: what rank 0 sent"),
        "timeline (tp)": timeline.timeline(split, title="column then row, forward and backward, 4 ranks"),
        "message_flow (block)": tp.message_flow(block, rank=0, label_prefix="tp/layers.0.", title="one block"),
        "timeline (block)": timeline.timeline(block, title="one block, forward then backward, 2 ranks"),
        "weight_shards mlp": tp.weight_shards(list(block), ["feed_forward.w1.weight", "feed_forward.w3.weight",
                                                            "feed_forward.w2.weight"], labels=["W1", "W3", "W2"],
                                              title="SwiGLU on 2 ranks"),
        "weight_shards narrow": tp.weight_shards(list(block), ["feed_forward.w1.weight", "feed_forward.w2.weight"],
                                                 labels=["W1", "W2"], width=6.0, title="n = 2"),
        "weight_shards attention": tp.weight_shards(
            list(block), ["attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight"],
            labels=["WQ", "WK", "WV", "WO"], width=9.0, height=3.0,
            heads={"attention.wq.weight": q_names, "attention.wk.weight": kv_names,
                   "attention.wv.weight": kv_names, "attention.wo.weight": q_names},
            head_groups={"attention.wq.weight": [f"→{k}" for k in kv_names]}, title="attention of block 0"),
    }


def _chapter_05(r):
    run = r["pipeline"]
    timelines = {name: [s[name]["timeline"] for s in run] for name in ("gpipe", "1f1b")}
    p, m = 4, 8
    tables = {name: pp.make_schedule(name, p, m, 2 if name == "interleaved" else 1)
              for name in ("gpipe", "1f1b", "interleaved", "zb")}
    ideal = {name: pp.simulate(t, forward_time=1.0 / pp.chunks_of(t[0]), backward_time=2.0 / pp.chunks_of(t[0]))
             for name, t in tables.items()}
    formulas = {name: cost.pp_bubble_fraction(p, m, name, pp.chunks_of(t[0])) for name, t in tables.items()}
    return {
        "stage_map": pipeline.stage_map([s["held"] for s in run], title="what each of the 3 ranks held"),
        "gantt (slots)": pipeline.gantt(pp.simulate(pp.one_f_one_b(p, m), 1.0, 2.0), unit="slots", title="1F1B, ideal"),
        "gantt (messages)": pipeline.gantt(timelines["1f1b"], messages=True, title="1f1b, measured"),
        "gantt (no text)": pipeline.gantt(timelines["gpipe"], text=False, title="gpipe, measured"),
        "bubble_curve": pipeline.bubble_curve([1, 2, 4, 8], [0.6, 0.45, 0.3, 0.2], 4, title="1F1B on 4 processes"),
        "in_flight": pipeline.in_flight(timelines, title="micro-batches held per rank"),
        "gantt_grid": pipeline.gantt_grid(ideal, formulas, unit="slots", title="the four schedules, ideal"),
    }


def _chapter_06(r):
    step = r["mesh"]
    traced = [{d: sum(e.sent_bytes for e in t.comm() if e.dim == d) for d in mesh.AXES} for t in step.traces]
    return {
        "mesh_cube": mesh.mesh_cube(list(step)),
        "block_shards": mesh.block_shards(list(step), ["layers.0.attention.wq.weight",
                                                       "layers.0.feed_forward.w2.weight",
                                                       "layers.2.feed_forward.w1.weight", "output.weight"],
                                          labels=["block 0: Wq", "block 0: W2", "block 2: W1", "output"],
                                          title="each rank holds one stage's blocks"),
        "messages_by_dim": mesh.messages_by_dim(step, title="one training step on 8 ranks: every message"),
        "bytes_by_dim": mesh.bytes_by_dim(traced, traced, title="bytes sent in one step, per rank"),
        "memory_bars (3D)": timeline.memory_bars(_memory(8), _memory(8), title="per rank: held and minitp.cost",
                                                 width=7.0),
        "step_profile": profile.step_profile(_profiled_step(), title="dp = 2: the last step of each rank"),
    }


def _profiled_step():
    """Two ranks' spans, operators and one dp message, as a profiled step records them (seconds)."""
    def rank(r):
        ev = trace.Event
        return [ev(r, "compute", "forward", "", 0.0, 0.010), ev(r, "compute", "backward", "", 0.010, 0.030),
                ev(r, "compute", "optimizer", "", 0.031, 0.034), ev(r, "op", "aten::mm", "", 0.001, 0.004),
                ev(r, "op", "aten::_softmax", "", 0.004, 0.005), ev(r, "op", "aten::add", "", 0.011, 0.02 + r / 200),
                ev(r, "op", "aten::add_", "", 0.0315, 0.033),
                ev(r, "comm", "all_reduce", "ddp/bucket0", 0.026, 0.030, dim="dp", group=(0, 1), bytes=8)]
    return [rank(0), rank(1)]


def _chapter_07(r):
    return {
        "attention_work": context.attention_work(16, 4),
        "attention_work one layout": context.attention_work(1024, 4, layouts=(True,)),
        "ring_steps (ring attention)": context.ring_steps(r["cp"], prefix="cp/ring/forward",
                                                          title="ring attention forward, 4 ranks"),
        "rank_times": context.rank_times({"contiguous": [0.012, 0.004], "balanced": [0.008, 0.0079]}),
    }


def _chapter_08(r):
    counts = [[5, 3, 0, 2, 4, 1, 3, 2], [2, 2, 4, 1, 0, 3, 5, 3], [1, 4, 2, 3, 3, 2, 2, 3], [3, 0, 3, 4, 2, 5, 1, 2]]
    routed = [sum(c[e] for c in counts) + (e % 3) for e in range(8)]
    kept = [sum(c[e] for c in counts) for e in range(8)]
    events = [trace.Event(rank, "comm", "all_to_all", f"ep/layers.0/{what}.{phase}", 1e-3 * i, 1e-3 * i + 4e-4,
                          group=(0, 1, 2, 3), bytes=4096, phase=phase)
              for rank in range(4) for i, (what, phase) in enumerate(
                  [("dispatch", "forward"), ("combine", "forward"), ("combine", "backward"), ("dispatch", "backward")])]
    return {
        "expert_load": experts.expert_load(routed, kept, ep=4, capacity=12, title="layer 0: load per expert"),
        "dispatch_matrix": experts.dispatch_matrix(counts, dim=32, title="layer 0 dispatch"),
        "timeline (all-to-alls)": timeline.timeline(events, label_prefix="ep/layers.0", title="layer 0's all-to-alls"),
    }


CHAPTERS = {"00": _chapter_00, "01": _chapter_01, "02": _chapter_02, "03-04": _chapter_03_04, "05": _chapter_05,
            "06": _chapter_06, "07": _chapter_07, "08": _chapter_08}


def smallest_text(figures: dict) -> dict[str, tuple[float, str]]:
    """{figure name: (the smallest text's px, that text)} as the website shows the figures."""
    out = {}
    for name, fig in figures.items():
        sizes = style.text_sizes_px(fig)
        px, text = min(((px, text) for text, px in sizes), default=(float("inf"), ""))
        out[name] = (px, text)
    return out


@pytest.mark.parametrize("chapter", list(CHAPTERS))
def test_every_text_of_every_stored_figure_is_at_least_9_px_on_the_site(runs, chapter):
    figures = CHAPTERS[chapter](runs)
    too_small = [f"{name}: {text!r} at {px:.1f} px" for name, fig in figures.items()
                 for text, px in style.text_sizes_px(fig) if px < style.MIN_TEXT_PX - 1e-9]
    assert not too_small, f"chapter {chapter}: texts under {style.MIN_TEXT_PX} px:\n" + "\n".join(too_small)


def test_text_sizes_scale_down_a_figure_wider_than_the_column():
    fig = style.figure(width=22.5, height=2.0)  # 1800 px: shown at half its size
    fig.add_subplot().set_title("half", fontsize=18)
    assert dict(style.text_sizes_px(fig, column_px=900))["half"] == pytest.approx(18 * 80 / 72 / 2)


def test_a_yellow_rank_reads_on_white_and_labels_on_boxes_take_black_or_white():
    assert style.luminance(style.rank_text_color(6)) < style.luminance(style.rank_color(6)) / 2
    assert style.text_on(style.rank_color(6)) == "black" and style.text_on(style.rank_color(0)) == "white"

