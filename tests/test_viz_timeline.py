"""The chapter 01 figures, drawn from a real 2-rank DDP run: the timeline of backward compute and bucket
all-reduces, the memory each rank held next to the formula, and the loss against one process."""

import matplotlib
import pytest

from minitp import cost, runs
from minitp.launcher import launch
from minitp.models import TINY
from minitp.viz.timeline import format_bytes, loss_curve, memory_bars, timeline

matplotlib.use("Agg")
N = 2
BLOCKS = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]


def _worker():
    from minitp import trace
    from minitp.ddp import DistributedDataParallel, split_batch
    from minitp.measure import spans
    from minitp.models import TINY, build_model, loss_fn
    from minitp.models.train import TrainConfig, synthetic_batches

    model = build_model(TINY, seed=0)
    recorder = spans.record_compute(model)
    ddp = DistributedDataParallel(model, bucket_mb=0.25)
    tokens, targets = synthetic_batches(TINY, TrainConfig(steps=1, batch_size=4))[0]
    with trace.scope("step"):
        loss = loss_fn(ddp(split_batch(tokens)), split_batch(targets))
        with trace.span("backward"):
            loss.backward()
    recorder.remove()
    return [b.nbytes for b in ddp.buckets]


@pytest.fixture(scope="module")
def run():
    return launch(_worker, N, echo=False)


def _by_gid(fig, prefix):
    """gid -> artist, for the bars (patches) and broken_barh collections of every axes."""
    out = {}
    for ax in fig.axes:
        for artist in [*ax.patches, *ax.collections]:
            gid = artist.get_gid() or ""
            if gid.startswith(prefix):
                out[gid] = artist
    return out


def test_timeline_has_a_lane_per_rank_with_every_bucket(run):
    fig = timeline(run, label_prefix="step")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 1", "rank 0"]  # rank 0 on top
    comm = _by_gid(fig, "comm:")
    buckets = run[0]
    assert len(buckets) == 3 and sum(buckets) == 4 * TINY.num_params()
    for rank in range(N):
        want = {f"comm:{rank}:all_reduce:ddp/bucket{i}" for i in range(len(buckets))}
        assert {g for g in comm if g.startswith(f"comm:{rank}:")} == want
    # the init broadcast was outside the "step" scope: not drawn
    assert not any("broadcast" in g for g in comm)


def test_timeline_compute_spans_are_the_blocks(run):
    fig = timeline(run, label_prefix="step")
    compute = _by_gid(fig, "compute:")
    for rank in range(N):
        for block in BLOCKS:
            assert f"compute:{rank}:forward:{block}" in compute
            assert f"compute:{rank}:backward:{block}" in compute
        assert f"compute:{rank}:backward:step" in compute  # the whole backward, drawn as a phase
    # a lane's bars sit within its band: rank 0 around y = 1, rank 1 around y = 0
    for gid, artist in compute.items():
        rank = int(gid.split(":")[1])
        ys = artist.get_paths()[0].vertices[:, 1]
        base = N - 1 - rank
        assert base - 0.5 <= ys.min() and ys.max() <= base + 0.5


def test_timeline_labels_carry_bytes(run):
    """The real run's buckets, each drawn a second long: a label's room is its bar's length, which a loaded
    machine can make as short as it likes (a bucket of 0.01 ms at width 100 did not fit, on a fresh clone)."""
    from dataclasses import replace

    from minitp.viz.timeline import collect_events

    comm = [e for e in collect_events(run) if e.kind == "comm" and e.labelled("step")]
    spaced = [replace(e, start=float(k), end=k + 0.9) for k, e in enumerate(comm)]
    fig = timeline(spaced, label_prefix="step", width=100)  # wide enough for every label to fit
    texts = {t.get_text() for t in fig.axes[0].texts}
    for i, nbytes in enumerate(run[0]):
        assert f"ddp/bucket{i}  {format_bytes(nbytes)}" in texts
    assert format_bytes(230_144) == "230.1 KB"


def test_timeline_rank_filter_and_empty(run):
    fig = timeline(run, label_prefix="step", ranks=[1])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 1"]
    assert all(g.split(":")[1] == "1" for g in _by_gid(fig, "comm:"))
    with pytest.raises(ValueError, match="no events"):
        timeline(run, label_prefix="nothing-here")


@pytest.fixture(scope="module")
def report():
    return runs.run_ddp(nproc=N, steps=2, batch_size=4)


def test_memory_bars_measured_next_to_formula(report):
    fig = memory_bars(report)
    bars = _by_gid(fig, "")
    psi = TINY.num_params()
    expected = cost.memory_per_rank(psi, N, zero=0, num_tensors=39)
    for rank in range(N):
        for kind in ("params", "grads", "optimizer"):
            held = bars[f"held:{rank}:{kind}"].get_height() * 1e6  # drawn in MB
            formula = bars[f"expected:{rank}:{kind}"].get_height() * 1e6
            assert held == pytest.approx(report["memory"][rank][kind])
            assert formula == pytest.approx(expected[kind])
            assert held == pytest.approx(formula)
    assert fig.axes[0].get_ylabel() == "held (MB)"
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["rank 0", "rank 1"]


def test_memory_bars_limit_line():
    m = cost.memory_per_rank(8_030_261_248, precision="bf16")
    hbm = cost.H100.memory_bytes  # 80 GiB
    fig = memory_bars([m], names=["8B"], limit=hbm, limit_label="one H100: 80 GiB")
    ax = fig.axes[0]
    assert [line.get_gid() for line in ax.lines] == ["limit"]
    assert ax.lines[0].get_ydata()[0] == pytest.approx(85.90, abs=0.01)  # drawn in GB: 80·2**30 bytes
    total = sum(_by_gid(fig, "held:0:")[f"held:0:{k}"].get_height() for k in ("params", "grads", "optimizer"))
    assert total == pytest.approx(128.48, abs=0.01)


def test_loss_curve_against_reference(report):
    fig = loss_curve(report)
    ax, ax_diff = fig.axes
    lines = {line.get_gid(): line for line in ax.lines}
    assert list(lines["reference"].get_ydata()) == report["reference_loss"]
    assert list(lines[f"loss:ddp, {N} ranks"].get_ydata()) == pytest.approx(report["loss"])
    assert ax_diff.get_yscale() == "log"
