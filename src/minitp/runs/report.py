"""What a checked run returns: the ``Report``, how it is judged against its oracles, and its table.

Every strategy's runner (``minitp.runs``) fills the same fields, so a report reads the same whatever
trained it: the losses next to the one-process reference's, the largest parameter difference, the
bytes each rank sent (traced) next to the formula's, the bytes each rank held next to the formula's,
and the step times. What only one strategy has (ZeRO's stage, a pipeline's bubble, the 3D mesh
coordinates) sits in ``details``; ``report["bubble_fraction_measured"]`` reads either kind.

The launched run itself (its per-rank traces, for figures) rides along in ``results`` and is not
part of the JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from minitp.layout import AXES
from minitp.pp_schedules import SCHEDULES

PARAM_TOLERANCE = 1e-5  # fp32: max |parameter - reference| allowed after training
# fp32: |loss - reference| a step may show (a table prints the verdict, not the noise)
LOSS_TOLERANCE = 1e-5
# a bf16 run's loss against the fp32 reference's: bf16 keeps 8 bits of mantissa
BF16_LOSS_TOLERANCE = 5e-3
PRINTED = tuple(reversed(AXES))  # ("tp", "pp", "dp"): the order the 3D byte table prints


@dataclass
class Report:
    """One checked run: the run beside its one-process reference and its formulas."""

    strategy: str
    world_size: int
    layout: dict[str, int]  # {"dp", "tp", "pp"}
    model: str
    num_params: int
    steps: int
    batch_size: int
    loss: list[float]  # per step, over the whole global batch
    reference_loss: list[float]
    max_abs_param_diff: float  # largest |parameter - reference| over every rank
    comm_bytes_traced: list[float]  # per rank: bytes it sent over the run (ring model)
    comm_bytes_expected: list[float]  # the same from minitp.cost
    # per rank {"params", "grads", "optimizer"} held after the last step
    memory: list[dict[str, int]]
    memory_expected: list[dict[str, float]]
    wall_s: float  # the launched run, start-up included
    step_s: list[float]  # per rank, median seconds of a training step after the first two
    param_tolerance: float = PARAM_TOLERANCE
    loss_tolerance: float = LOSS_TOLERANCE
    reference: str = "one process, the whole batch"
    start_step: int = 0
    # per rank {dim: bytes}
    comm_bytes_traced_by_dim: list[dict[str, float]] = field(default_factory=list)
    comm_bytes_expected_by_dim: list[dict[str, float]] = field(default_factory=list)
    # the time model on this machine's calibration (None: none stored)
    predicted_step_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)  # what only this strategy reports
    # minitp.launcher.Results, with traces
    results: Any = field(default=None, repr=False, compare=False)

    # -- reading --------------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key in _FIELDS:
            return getattr(self, key)
        if key in self.details:
            return self.details[key]
        raise KeyError(f"{self.strategy} report has no {key!r}; it has {sorted(self.keys())}")

    def __contains__(self, key: str) -> bool:
        return key in _FIELDS or key in self.details

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __iter__(self):
        return iter(self.keys())

    def keys(self) -> list[str]:
        return [f for f in _FIELDS if f not in ("details", "results")] + list(self.details)

    @property
    def traces(self) -> list:
        """Each rank's trace of the run, in rank order (empty when the run was loaded from JSON)."""
        return list(self.results.traces) if self.results is not None else []

    # -- writing --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data, the details at the top level (the JSON ``minitp run --json`` writes)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("details", "results")}
        return {**asdict_plain(out), **asdict_plain(self.details)}

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        own = {k: v for k, v in data.items() if k in _FIELDS and k not in ("details", "results")}
        return cls(**own, details={k: v for k, v in data.items() if k not in _FIELDS})

    # -- judging --------------------------------------------------------------------------------
    def check(self, tolerance: float | None = None) -> list[str]:
        """What is wrong with the run, as sentences; empty when it matches every oracle."""
        return check(self, tolerance)

    def format(self) -> str:
        return format_report(self)


_FIELDS = {f.name for f in fields(Report)}


def asdict_plain(value: Any) -> Any:
    """Dataclasses, tuples and nested containers as JSON-ready lists and dicts."""
    if hasattr(value, "__dataclass_fields__"):
        return asdict_plain(asdict(value))
    if isinstance(value, dict):
        return {k: asdict_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [asdict_plain(v) for v in value]
    return value


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


def check(report: Report | dict, tolerance: float | None = None) -> list[str]:
    """What is wrong with a run, as sentences; an empty list when it matches every oracle.
    ``tolerance`` defaults to the report's own ``param_tolerance`` (bf16 runs), else 1e-5.
    A report read back from its JSON (a dict) is judged the same way."""
    if isinstance(report, dict):
        report = Report.from_dict(report)
    tolerance = report.param_tolerance if tolerance is None else tolerance
    problems = []
    if not report.max_abs_param_diff <= tolerance:
        problems.append(f"parameters differ from the one-process reference by "
                        f"{report.max_abs_param_diff:.3g} > {tolerance:g}")
    for rank, (traced, expected) in enumerate(zip(report.comm_bytes_traced,
                                                  report.comm_bytes_expected)):
        if not _close(traced, expected):
            problems.append(
                f"rank {rank} sent {traced:,.1f} bytes, the formula says {expected:,.1f}")
    for rank, (traced, expected) in enumerate(zip(report.comm_bytes_traced_by_dim,
                                                  report.comm_bytes_expected_by_dim)):
        for dim, value in expected.items():  # each mesh dimension on its own
            if not _close(traced.get(dim, 0.0), value):
                problems.append(f"rank {rank} sent {traced.get(dim, 0.0):,.1f} bytes over {dim}, "
                                f"the formula says {value:,.1f}")
    for rank, (held, formula) in enumerate(zip(report.memory, report.memory_expected)):
        for kind in ("params", "grads", "optimizer"):
            if not _close(held[kind], formula[kind]):
                problems.append(f"rank {rank} holds {held[kind]:,} bytes of {kind}, "
                                f"the formula says {formula[kind]:,.0f}")
    for rank, (peak, formula) in enumerate(zip(report.get("gathered_peak", []),
                                               report.get("gathered_peak_expected", []))):
        if peak != formula:
            problems.append(f"rank {rank} held at most {peak:,} bytes of gathered parameters, "
                            f"the formula says {formula:,}")
    return problems




def verdict(difference: float, tolerance: float) -> str:
    """A difference as a table prints it: within its tolerance, or the number that broke it.

    Below the tolerance the digits are rounding noise, different on every CPU (AVX2 and AVX-512
    sum in other orders), so they are not printed; a difference over it is the news and is."""
    if difference <= tolerance:
        return f"<= {tolerance:g}: OK"
    return f"= {difference:.2e} > {tolerance:g}: FAIL"


def format_report(report: Report | dict) -> str:
    """The short table ``minitp run`` prints."""
    if isinstance(report, dict):
        report = Report.from_dict(report)
    lay = report.layout
    lines = [
        f"minitp run {report.strategy}: {report.world_size} ranks "
        f"({' '.join(f'{k}={v}' for k, v in lay.items())}), model {report.model} "
        f"({report.num_params:,} parameters), {report.steps} steps, global batch "
        f"{report.batch_size}",
        "",
        f"{'step':>4}  {'loss':>8}  {'reference':>9}  |loss - reference|",
    ]
    for s, (a, b) in enumerate(zip(report.loss, report.reference_loss), start=report.start_step):
        lines.append(f"{s:>4}  {a:>8.4f}  {b:>9.4f}  {verdict(abs(a - b), report.loss_tolerance)}")
    lines += ["", "max |parameter - reference| "
                  f"{verdict(report.max_abs_param_diff, report.param_tolerance)}"]
    if report.reference != Report.reference:
        lines.append(f"  reference: {report.reference}")
    lines += ["", f"{'rank':>4}  {'sent (traced)':>14}  {'sent (formula)':>14}  "
                  f"{'params':>10}  {'grads':>10}  {'optimizer':>10}  {'step':>9}"]
    for r in range(report.world_size):
        m = report.memory[r]
        lines.append(f"{r:>4}  {report.comm_bytes_traced[r]:>14,.0f} "
                     f" {report.comm_bytes_expected[r]:>14,.0f}  {m['params']:>10,} "
                     f" {m['grads']:>10,}  {m['optimizer']:>10,}  {report.step_s[r] * 1e3:>6.1f} "
                     "ms")
    if "gathered_peak" in report:
        lines += ["", "peak gathered parameters per rank (bytes): "
                  + ", ".join(f"{p:,}" for p in report["gathered_peak"])
                  + f"  (formula {report['gathered_peak_expected'][0]:,})"]
    if report.comm_bytes_expected_by_dim:  # the bytes split by mesh dimension
        # e.g. "ep"
        extra = sorted({d for e in report.comm_bytes_expected_by_dim for d in e} - set(PRINTED))
        dims = [*PRINTED, *extra]
        lines += ["", f"{'rank':>4}  {'(dp,pp,tp)':>10}  "
                      + "  ".join(f"{dim + ' traced':>12}  {dim + ' formula':>12}" for dim in dims)]
        for r, (t, e) in enumerate(zip(report.comm_bytes_traced_by_dim,
                                       report.comm_bytes_expected_by_dim)):
            coords = "(" + ",".join(str(c) for c in report["coords"][r]) + ")"
            lines.append(f"{r:>4}  {coords:>10}  "
                         + "  ".join(f"{t.get(dim, 0.0):>12,.0f}  {e.get(dim, 0.0):>12,.0f}"
                                     for dim in dims))
    if "bubble_fraction_measured" in report:
        lines += ["", f"schedule {report['schedule']}, {report['microbatches']} micro-batches; "
                      "bubble (idle share of the step) measured "
                      f"{report['bubble_fraction_measured']:.3f}, expected "
                      f"{SCHEDULES.get(report.get('schedule'), SCHEDULES['1f1b']).bubble_words} = "
                      f"{report['bubble_fraction_expected']:.3f}; per rank "
                  + ", ".join(f"{b:.3f}" for b in report["bubble_fraction_measured_per_rank"])]
        if "bubble_fraction_compute_only" in report:  # where the excess over the formula comes from
            expected, stages = (report["bubble_fraction_expected"],
                                report["bubble_fraction_stage_times"])
            compute, measured_bubble = (report["bubble_fraction_compute_only"],
                                        report["bubble_fraction_measured"])
            lines.append(f"  of it: formula {expected:.3f}, unequal stages "
                         f"{stages - expected:+.3f}, uneven actions {compute - stages:+.3f}, "
                         f"hand-over of messages {measured_bubble - compute:+.3f}")
            if "bubble_fraction_with_handover" in report:
                handover = report["bubble_fraction_with_handover"]
                lines.append("  the hand-over measured (means): "
                             f"{report['handover_message_s'] * 1e3:.2f} ms a message, "
                             f"{report['handover_gap_s'] * 1e3:.2f} ms between a rank's actions; "
                             f"replayed with them it is {handover - compute:+.3f}, leaving "
                             f"{measured_bubble - handover:+.3f}")
        lines += ["peak micro-batches in flight per rank: "
                  + ", ".join(str(p) for p in report["peak_microbatches_in_flight"]) + "  (formula "
                  + ", ".join(str(p) for p in report["peak_microbatches_in_flight_expected"]) + ")"]
    measured = sorted(report.step_s)[len(report.step_s) // 2] if report.step_s else 0.0
    if report.predicted_step_s is not None:
        lines += ["", f"step time: measured {measured * 1e3:.1f} ms (median rank), predicted "
                      f"{report.predicted_step_s * 1e3:.1f} ms (minitp.cost.step_time, this "
                      "machine's calibration)"]
        if "load_average" in report:
            lines.append(
                f"  load average {report['load_average']:.1f} while it ran; the prediction assumes "
                "nothing else shares the cores")
    else:
        lines += ["", f"step time: measured {measured * 1e3:.1f} ms (median rank); no prediction: "
                  + report.get("predicted_step_note",
                                   "this machine is not calibrated (minitp calibrate)")]
    lines += ["", "bytes: payload each rank sent (ring model) and bytes held after the last step",
              f"wall time {report.wall_s:.2f} s (start-up included)"]
    problems = check(report)
    lines.append("check: " + ("matches the reference, the traced bytes and the memory formulas"
                              if not problems else "FAILED\n  " + "\n  ".join(problems)))
    return "\n".join(lines)
