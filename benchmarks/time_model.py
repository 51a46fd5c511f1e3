"""The time model against this machine: measured / predicted step time of each strategy at 2 ranks.

    flock /tmp/minitp-heavy.lock .venv/bin/python benchmarks/time_model.py [--runs 3] [--stored] [--calibrations K]
    flock /tmp/minitp-heavy.lock .venv/bin/python benchmarks/time_model.py --count-ops

Calibrates once (``minitp calibrate``, into a file of its own unless ``--stored``: then it uses the
calibration ``minitp run`` reads), then runs ``minitp run STRATEGY --nprocs 2`` for ddp, fsdp, tp, pp,
cp and ep, ``--runs`` times each, and prints, per strategy, the median of measured / predicted over
the runs with its spread (lowest–highest), the predicted step and the load average before and after.
``--calibrations K`` does all of it K times and ends with each strategy's median over the K
calibrations, their range, and in how many of them it was inside its target: one calibration is one
draw of a machine that varies (two calibrations a minute apart have moved a strategy's ratio by 0.5).
The load average is there because the prediction assumes nothing else shares the cores: on a
machine that other jobs share, the measured steps grow and the ratios with them. Takes about two
minutes on 2 cores. Not a test: it times the machine.

``--count-ops`` times nothing: it counts the tensor operations one forward+backward dispatches under
ring attention and under expert parallel, at 2 and 4 ranks, less the plain model's, and prints them
beside ``minitp.cost.time.strategy_ops``, whose per-unit counts were taken this way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STRATEGIES = ("ddp", "fsdp", "tp", "pp", "cp", "ep")
# steps per run: each run's measured step is the median rank's median step after the first two
# (``minitp.runs.common.steady_step_s``): 10 of them; 6 (of 8) moved too much from run to run
STEPS = 12
TARGETS = {"ddp": (0.75, 1.25), "fsdp": (0.75, 1.25), "tp": (0.75, 1.25), "pp": (0.75, 1.25),
           "cp": (0.67, 1.5), "ep": (0.67, 1.5)}


def minitp(*args: str, env: dict) -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "minitp")
    done = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"minitp {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def one_run(strategy: str, nproc: int, env: dict, folder: str) -> tuple[float, float]:
    """(measured, predicted) seconds of one ``minitp run``: the median rank's median step after the first two, the
    prediction."""
    path = os.path.join(folder, f"{strategy}.json")
    minitp("run", strategy, "--nprocs", str(nproc), "--steps", str(STEPS), "--json", path, env=env)
    with open(path) as f:
        report = json.load(f)
    if report.get("predicted_step_s") is None:
        raise SystemExit(f"{strategy}: no prediction ({report.get('details', {}).get('predicted_step_note')})")
    return statistics.median(report["step_s"]), report["predicted_step_s"]


def _count_worker(kind: str, balanced: bool) -> int:
    """Tensor operations one forward+backward of this rank dispatches: the plain tiny model ("dense"),
    under ring attention ("cp") or its MoE under expert parallel ("ep"), batch 8 x 16 (cp: this rank's
    positions; dense and ep: half the batch)."""
    import torch

    from minitp import cp, ep
    from minitp.measure.calibrate import count_dispatched
    from minitp.models import TINY, build_model, loss_fn
    from minitp.models.moe import build_moe_model, moe_config, moe_loss

    torch.set_num_threads(1)
    tokens = torch.randint(0, TINY.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    if kind == "cp":
        model = build_model(TINY, seed=0)
        step, loss = cp.parallelize(model, None, balanced, "ring"), loss_fn
        x = cp.shard_sequence(tokens, None, balanced)  # (8, 16/cp): this rank's positions
    elif kind == "ep":
        model = build_moe_model(moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25), seed=0)
        step, loss, x = ep.ExpertParallel(model, None), moe_loss(model), tokens[:4]
    else:
        model = build_model(TINY, seed=0)
        step, loss, x = model, loss_fn, tokens[:4]
    loss(step(x), x).backward()  # warm-up: the first step builds what later ones reuse
    model.zero_grad(set_to_none=True)
    return count_dispatched(lambda: loss(step(x), x).backward())


def count_ops() -> None:
    """Count what cp and ep add to the plain model's operations, rank by rank, against ``strategy_ops``."""
    from minitp.cost.time import strategy_ops
    from minitp.launcher import launch
    from minitp.models import TINY
    from minitp.models.moe import moe_config

    moe = moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25)
    print(f"{'':24} {'counted (max over ranks)':>26} {'strategy_ops':>13}")
    for nproc in (2, 4):
        dense = max(launch(_count_worker, nproc, "dense", True, echo=False, timeout=120))
        for kind, balanced in (("cp", True), ("cp", False), ("ep", True)):
            counted = max(launch(_count_worker, nproc, kind, balanced, echo=False, timeout=120)) - dense
            model = strategy_ops(moe, 16, ep=nproc) if kind == "ep" else strategy_ops(TINY, 16, cp=nproc,
                                                                                    balanced=balanced)
            name = f"{kind} {'balanced' if balanced else 'contiguous'} " if kind == "cp" else "ep "
            print(f"{name + f'at {nproc} ranks':24} {counted:>26} {model:>13}")


def one_calibration(args) -> dict[str, float]:
    """Calibrate (unless ``--stored``), run each strategy ``--runs`` times, print the table; return each
    strategy's median measured/predicted."""
    medians = {}
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as folder:
        if not args.stored:
            env["MINITP_CALIBRATION"] = os.path.join(folder, "calibration.json")
            print(f"load average {os.getloadavg()[0]:.2f} before calibrating")
            print(minitp("calibrate", env=env).strip())
        t0 = time.perf_counter()
        print(f"\n{'strategy':8} {'predicted':>10} {'measured':>22} {'measured/predicted':>26}  load (1 min)")
        for strategy in args.strategies.split(","):
            load_before = os.getloadavg()[0]
            runs = [one_run(strategy, args.nproc, env, folder) for _ in range(args.runs)]
            ratios = sorted(m / p for m, p in runs)
            measured = sorted(m for m, _ in runs)
            medians[strategy] = statistics.median(ratios)
            low, high = TARGETS.get(strategy, (0.0, float("inf")))
            mark = "" if low <= statistics.median(ratios) <= high else f"  (outside {low}-{high})"
            print(f"{strategy:8} {statistics.median(p for _, p in runs) * 1e3:7.1f} ms "
                  f"{statistics.median(measured) * 1e3:7.1f} ms ({measured[0] * 1e3:.1f}-{measured[-1] * 1e3:.1f}) "
                  f"{statistics.median(ratios):9.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}){mark:>10}  "
                  f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}")
        print(f"\n{args.runs} runs each at --nprocs {args.nproc}, {STEPS} steps, in {time.perf_counter() - t0:.0f} s; "
              f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
              f"{len(os.sched_getaffinity(0))} cores")
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nprocs", dest="nproc", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--stored", action="store_true", help="use the stored calibration, do not calibrate")
    parser.add_argument("--calibrations", type=int, default=1,
                        help="calibrate this many times, each followed by the runs, and sum up the spread")
    parser.add_argument("--count-ops", action="store_true", help="count the operations cp and ep add (no timing)")
    args = parser.parse_args(argv)
    for name in ("runs", "nproc", "calibrations"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.stored and args.calibrations > 1:
        parser.error("--calibrations calibrates each time; --stored uses the one stored calibration")
    if args.count_ops:
        count_ops()
        return 0
    summary: dict[str, list[float]] = {}
    for k in range(args.calibrations):
        if args.calibrations > 1:
            print(f"\n-- calibration {k + 1} of {args.calibrations}")
        for strategy, ratio in one_calibration(args).items():
            summary.setdefault(strategy, []).append(ratio)
    if args.calibrations > 1:  # the spread a single calibration hides
        print(f"\nover {args.calibrations} calibrations, each strategy's median measured/predicted:")
        for strategy, ratios in summary.items():
            low, high = TARGETS.get(strategy, (0.0, float("inf")))
            inside = sum(low <= r <= high for r in ratios)
            print(f"{strategy:8} median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}, "
                  f"inside {low}-{high} in {inside} of {len(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
