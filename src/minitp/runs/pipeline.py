"""Checked runs of pipeline parallelism: one stage (or v interleaved chunks) per rank, a schedule of
micro-batches: GPipe, 1F1B, interleaved 1F1B or zero-bubble (ZB-H1)."""

from __future__ import annotations

import statistics
import time

import torch

from minitp import cost, layout, pp
from minitp import trace as _trace
from minitp.launcher import launch
from minitp.measure.memory import held_bytes
from minitp.models import build_model, get_config
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches
from minitp.pp_schedules import RUNNER_SCHEDULES
from minitp.runs.common import build_report, check_run, worker_summary
from minitp.runs.registry import Option, Strategy, register
from minitp.runs.report import Report


def _pp_worker(model_name: str, train: TrainConfig, schedule: str, microbatches: int,
               virtual_stages: int) -> dict:
    cfg = get_config(model_name)
    # the world is the pipeline
    pipe = pp.Pipeline(build_model(cfg, seed=train.seed), None, schedule, microbatches,
                       virtual_stages=virtual_stages)
    optimizer = make_optimizer(pipe.parameters(), train.lr)
    losses, times, timelines, peaks = [], [], [], []
    for tokens, targets in synthetic_batches(cfg, train):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        record = pipe.forward_backward(tokens, targets)
        with _trace.span("optimizer"):
            optimizer.step()
        times.append(time.perf_counter() - t0)
        if record.loss is not None:  # only the last stage computes the loss
            losses.append(record.loss)
        timelines.append(record.timeline)
        peaks.append(record.peak_in_flight)
    return worker_summary(losses, times, held_bytes(pipe.parameters(), optimizer),
                          stage_state=pipe.state_dict(), timelines=timelines,
                          peak_in_flight=max(peaks), num_tensors=len(list(pipe.parameters())))


def bubble_decomposition(timelines: list[pp.Timeline]) -> tuple[float, float]:
    """One step's measured timelines (one per rank) played again with free messages, as two
    bubbles (means over ranks) between the formula's and the measured one:

    * stage times: every action of a rank as long as that rank's median action of its kind, so
      what the unequal stages alone leave (the last one adds the output layer and the loss);
    * compute only: every action as long as it took (``pp.replay``), so the stages plus uneven
      actions; what the measured bubble has above it is the hand-over of messages and the loop.
    """
    medians = [{kind: statistics.median([e - s for a, s, e in t if a.kind == kind] or [0.0])
                for kind in "FBW"}
               for t in timelines]
    stage_times = pp.simulate([[a for a, _, _ in t] for t in timelines], [m["F"] for m in medians],
                              [m["B"] + m["W"] for m in medians], [m["W"] for m in medians])
    return (statistics.fmean(pp.bubble_fraction(stage_times)),
            statistics.fmean(pp.bubble_fraction(pp.replay(timelines))))


def handover_costs(timelines: list[pp.Timeline]) -> tuple[float, float]:
    """What one step's hand-over cost, measured from its timelines (one per rank, one clock):

    * message: where a rank sat idle waiting for another rank's action, the mean time from that
      action's end to the waiting action's start (the message's trip, wait and hand-over);
    * gap: where an action needed nothing from another rank still running, the mean time between
      the rank's previous action's end and its start (the loop's own time, posting and sending).

    Means, not medians: a step's time is the sum of its gaps and waits, so the mean is what adds up
    (a few slow hand-overs, a send that met a busy core, are part of the cost; the median leaves
    them out and explained about a third of the hand-over where the mean explains nearly all of it).
    ``pp.replay(timelines, message, gap)`` plays the step again with these costs added."""
    p = len(timelines)
    v = max(pp.chunks_of([a for a, _, _ in t]) for t in timelines)
    ends = {(a.kind, a.chunk * p + s, a.microbatch): e for s, t in enumerate(timelines)
            for a, _, e in t}
    waits, gaps = [], []
    for s, t in enumerate(timelines):
        for j in range(1, len(t)):
            (a, start, _), previous_end = t[j], t[j - 1][2]
            need = pp.needs(a, a.chunk * p + s, p * v - 1)
            arrived = ends[need] if need is not None and need[1] % p != s else None
            if arrived is not None and arrived > previous_end:
                waits.append(start - arrived)
            else:
                gaps.append(start - previous_end)
    return statistics.fmean(waits or [0.0]), statistics.fmean(gaps or [0.0])


def rank_blocks(n_layers: int, pp_size: int, virtual_stages: int = 1) -> list[list[range]]:
    """Per rank, the block ranges of its chunks: piece c·p + r of the p·v pieces for chunk c."""
    pieces = layout.stage_blocks(n_layers, pp_size * virtual_stages)  # refuses too many pieces
    return [[pieces[c * pp_size + r] for c in range(virtual_stages)] for r in range(pp_size)]


def run_pp(nproc: int = 4, steps: int = 4, microbatches: int = 8, schedule: str = "1f1b",
           virtual_stages: int = 1, model: str = "tiny", batch_size: int = 8, seq_len: int = 16,
           lr: float = 3e-3, seed: int = 0, backend: str = "gloo",
           timeout: float = 300.0) -> Report:
    """Train with ``minitp.pp`` (``nproc`` stages, ``microbatches`` per step, GPipe, 1F1B,
    interleaved 1F1B over ``virtual_stages`` chunks per rank, or zero-bubble ZB-H1) and report it
    against the three oracles, plus the bubble: measured (``minitp.pp.bubble_fraction``, the mean
    over ranks, the median over the steps after the first) and expected
    (``cost.pp_bubble_fraction``), and between them where the difference comes from
    (``bubble_decomposition``, medians over the same steps): ``bubble_fraction_stage_times``
    (unequal stages), ``bubble_fraction_compute_only`` (also uneven actions); the measured bubble's
    excess over the latter is the hand-over of messages."""
    if schedule == "interleaved" and virtual_stages == 1:
        virtual_stages = 2  # interleaving means at least two chunks per rank
    train = check_run("pp", locals(), data_parallel=1)
    cfg = get_config(model)
    # refuse a bad split here, in the parent
    blocks = rank_blocks(cfg.n_layers, nproc, virtual_stages)
    pp.make_schedule(schedule, nproc, microbatches, virtual_stages)
    if virtual_stages > 1 and nproc == 1:
        raise ValueError("interleaving needs at least 2 ranks in the pipeline, got nproc=1")
    pp.split_microbatches(torch.empty(batch_size), microbatches)
    results = launch(_pp_worker, nproc, model, train, schedule, microbatches, virtual_stages,
                     backend=backend, timeout=timeout, echo=False)
    full = {k: v for r in results for k, v in r["stage_state"].items()}  # the stages put together
    per_rank = [{**{k: v for k, v in r.items() if k != "stage_state"}, "state": full}
                for r in results]
    v = virtual_stages
    expected_bytes = [cost.pp_run_bytes(batch_size, seq_len, cfg.dim, nproc, s, steps,
                                        virtual_stages=v)
                      for s in range(nproc)]
    expected_memory = [cost.pp_memory_per_rank(cfg, sum(len(b) for b in blocks[s]), s == 0,
                                               s == nproc - 1,
                                               num_tensors=results[s]["num_tensors"])
                                               for s in range(nproc)]
    # per step, one per rank
    step_timelines = [[r["timelines"][k] for r in results] for k in range(steps)]
    timed = [pp.bubble_fraction(t) for t in step_timelines]
    timed = timed[1:] or timed  # the first step also warms up (allocations, first messages)
    after_first = step_timelines[1:] or step_timelines
    decomposed = [bubble_decomposition(t) for t in after_first]
    costs = [handover_costs(t) for t in after_first]
    with_costs = [statistics.fmean(pp.bubble_fraction(pp.replay(t, *c)))
                  for t, c in zip(after_first, costs)]
    last = [r["timelines"][-1] for r in results]
    t0 = min(t[0][1] for t in last)
    return build_report(
        "pp", {"dp": 1, "tp": 1, "pp": nproc}, per_rank, results, model, train, expected_bytes,
        expected_memory, schedule=schedule, microbatches=microbatches, virtual_stages=v,
        stage_blocks=[[c[0].start, c[0].stop] for c in blocks] if v == 1 else None,
        rank_blocks=[[[b.start, b.stop] for b in chunks] for chunks in blocks],
        bubble_fraction_measured=statistics.median(statistics.fmean(b) for b in timed),
        bubble_fraction_measured_per_rank=[statistics.median(b[s] for b in timed)
                                           for s in range(nproc)],
        bubble_fraction_expected=cost.pp_bubble_fraction(nproc, microbatches, schedule, v),
        bubble_fraction_stage_times=statistics.median(d[0] for d in decomposed),
        bubble_fraction_compute_only=statistics.median(d[1] for d in decomposed),
        bubble_fraction_with_handover=statistics.median(with_costs),
        handover_message_s=statistics.median(c[0] for c in costs),
        handover_gap_s=statistics.median(c[1] for c in costs),
        peak_microbatches_in_flight=[r["peak_in_flight"] for r in results],
        peak_microbatches_in_flight_expected=[cost.pp_peak_microbatches_in_flight(
            nproc, microbatches, s, schedule, v)
                                              for s in range(nproc)],
        last_step_timeline=[[[a.kind, a.microbatch, s - t0, e - t0, a.chunk] for a, s, e in t]
                            for t in last])


register(Strategy("pp", run_pp,
                  "pipeline parallel: one stage of blocks per rank, micro-batches on a schedule", (
    Option("microbatches", int, 8, "micro-batches per step", low=1),
    Option("schedule", str, "1f1b", "pipeline schedule", choices=RUNNER_SCHEDULES),
    Option("virtual_stages", int, 1, "chunks per rank (interleaved only; 1 means 2 there)", low=1),
)))
