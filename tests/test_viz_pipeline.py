"""The pipeline figures, drawn from a real run on 3 processes: one lane per rank, one bar per
action at the time it was recorded, pieces where the stages held them."""

import pytest

from minitp import cost, pp
from minitp.launcher import launch
from minitp.viz import pipeline as viz_pp

STAGES, M = 3, 4


def _pipeline_run():
    import torch.distributed as dist

    from minitp.models import TINY, build_model
    from minitp.models.train import TrainConfig, synthetic_batches

    cfg = TINY.with_(n_layers=5)  # 2, 2, 1 blocks: the spare ones to the first stages
    tokens, targets = synthetic_batches(cfg, TrainConfig(steps=1, batch_size=8))[0]
    out = {"rank": dist.get_rank()}
    for schedule in ("gpipe", "1f1b"):
        pipe = pp.Pipeline(build_model(cfg, seed=0), None, schedule, M)
        record = pipe.forward_backward(tokens, targets)
        out[schedule] = {"timeline": record.timeline, "peak": record.peak_in_flight}
    out["held"] = {k: v.numel() for k, v in pipe.module.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def run():
    return launch(_pipeline_run, STAGES, echo=False, timeout=120)


def _bars(fig):
    return {c.get_gid(): c for ax in fig.axes for c in ax.collections if c.get_gid()}


def _lines(fig):
    return {line.get_gid(): line for ax in fig.axes for line in ax.lines if line.get_gid()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gantt_has_one_lane_per_rank_and_one_bar_per_recorded_action(run, schedule):
    timelines = [r[schedule]["timeline"] for r in run]
    fig = viz_pp.gantt(timelines, title=schedule)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 2", "rank 1", "rank 0"]
    bars = _bars(fig)
    want = {f"action:{s}:{kind}{i}" for s in range(STAGES) for kind in "FB" for i in range(M)}
    assert set(bars) == want
    t0 = min(t[0][1] for t in timelines)
    for s, timeline in enumerate(timelines):
        for action, start, end in timeline:
            (path,) = bars[f"action:{s}:{action!r}"].get_paths()
            (x, y), (x1, _) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            assert x == pytest.approx((start - t0) * 1e3)  # drawn where it was recorded, in ms
            assert x1 - x == pytest.approx((end - start) * 1e3)
            assert y == pytest.approx(STAGES - 1 - s - 0.38)  # in its rank's lane, rank 0 on top


def test_gantt_reads_a_report_timeline_and_a_simulated_one(run):
    timelines = [r["1f1b"]["timeline"] for r in run]
    as_report = {"last_step_timeline": [[[a.kind, a.microbatch, s, e] for a, s, e in t] for t in timelines]}
    assert set(_bars(viz_pp.gantt(as_report))) == set(_bars(viz_pp.gantt(timelines)))
    ideal = pp.simulate(pp.one_f_one_b(STAGES, M), 1.0, 2.0)
    fig = viz_pp.gantt(ideal, unit="slots")
    assert len(_bars(fig)) == 2 * M * STAGES
    assert fig.axes[0].get_xlabel() == "time (slots of one forward)"


def test_stage_map_draws_each_piece_in_the_colour_of_the_rank_that_held_it(run):
    fig = viz_pp.stage_map([r["held"] for r in run])
    bars = _bars(fig)
    assert set(bars) == {"piece:0:embedding", "piece:0:layers.0", "piece:0:layers.1", "piece:1:layers.2",
                         "piece:1:layers.3", "piece:2:layers.4", "piece:2:norm + output"}
    widths = {gid: bar.get_paths()[0].vertices[:, 0].max() - bar.get_paths()[0].vertices[:, 0].min()
              for gid, bar in bars.items()}
    total = sum(sum(r["held"].values()) for r in run)
    block = sum(v for k, v in run[0]["held"].items() if k.startswith("layers.0."))
    assert widths["piece:1:layers.2"] == pytest.approx(block / total)
    assert set(_lines(fig)) == {"rank:0", "rank:1", "rank:2"}


def test_stage_map_refuses_overlapping_stages(run):
    with pytest.raises(ValueError, match="held by rank 0 and rank 1"):
        viz_pp.stage_map([run[0]["held"], run[0]["held"]])


def test_in_flight_peaks_are_the_recorded_ones(run):
    fig = viz_pp.in_flight({s: [r[s]["timeline"] for r in run] for s in ("gpipe", "1f1b")})
    lines = _lines(fig)
    assert len(fig.axes) == 2 and len(lines) == 2 * STAGES
    for schedule in ("gpipe", "1f1b"):
        for s, r in enumerate(run):
            peak = max(lines[f"held:{schedule}:{s}"].get_ydata())
            assert peak == r[schedule]["peak"] == cost.pp_peak_microbatches_in_flight(STAGES, M, s, schedule)


def test_bubble_curve_draws_the_measured_points_next_to_the_formula():
    fig = viz_pp.bubble_curve([1, 2, 4, 8], [0.8, 0.7, 0.6, 0.5], 4)
    lines = _lines(fig)
    assert list(lines["measured"].get_ydata()) == [0.8, 0.7, 0.6, 0.5]
    xs, ys = lines["formula"].get_data()
    assert ys[0] == pytest.approx(3 / 4) and ys[-1] == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="4 values of m but 3 measurements"):
        viz_pp.bubble_curve([1, 2, 4, 8], [0.8, 0.7, 0.6], 4)


def test_gantt_draws_each_message_from_the_action_that_made_it_to_the_one_that_used_it(run):
    timelines = [r["1f1b"]["timeline"] for r in run]
    fig = viz_pp.gantt(timelines, messages=True)
    arrows = {t.get_gid(): t for t in fig.axes[0].texts if (t.get_gid() or "").startswith("message:")}
    forward = {f"message:{s}->{s + 1}:F{i}" for s in range(STAGES - 1) for i in range(M)}
    backward = {f"message:{s}->{s - 1}:B{i}" for s in range(1, STAGES) for i in range(M)}
    assert set(arrows) == forward | backward  # activations down, gradients up, nothing else
    t0 = min(t[0][1] for t in timelines)
    at = {(s, a.kind, a.microbatch): (start, end) for s, t in enumerate(timelines) for a, start, end in t}
    arrow = arrows["message:0->1:F2"]
    assert arrow.xyann[0] == pytest.approx((at[0, "F", 2][1] - t0) * 1e3)  # leaves when F2 ends on rank 0
    assert arrow.xy[0] == pytest.approx((at[1, "F", 2][0] - t0) * 1e3)  # arrives when F2 starts on rank 1
    assert not [t for t in viz_pp.gantt(timelines).axes[0].texts if (t.get_gid() or "").startswith("message:")]


def test_the_grid_draws_every_schedules_table_with_its_weight_gradients_and_chunks():
    p, m = 4, 8
    tables = {name: pp.make_schedule(name, p, m, 2 if name == "interleaved" else 1)
              for name in ("gpipe", "1f1b", "interleaved", "zb")}
    ideal = {name: pp.simulate(t) for name, t in tables.items()}
    fig = viz_pp.gantt_grid(ideal, {n: cost.pp_bubble_fraction(p, m, n, pp.chunks_of(t[0])) for n, t in tables.items()},
                            unit="slots")
    assert [ax.get_title() for ax in fig.axes[:2]] == ["gpipe: idle 0.273, formula 0.273",
                                                       "1f1b: idle 0.273, formula 0.273"]
    drawn = [c.get_gid() for ax in fig.axes for c in ax.collections if (c.get_gid() or "").startswith("action:")]
    assert len(drawn) == sum(len(a) for t in tables.values() for a in t)  # every action of every table
    bars = _bars(fig)
    assert "action:3:W7" in bars and bars["action:3:W7"].get_facecolor()[0][1] > 0.5  # W in green
    assert "action:0:F3c1" in bars and bars["action:0:F3c1"].get_hatch()  # chunk 1 hatched
    assert len({ax.get_xlim() for ax in fig.axes}) == 1  # one time axis for all
