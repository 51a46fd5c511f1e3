"""One harness for every benchmark: minitp against PyTorch's own implementation of the same thing,
on equal work, timed in one run on the same ranks.

How a comparison is timed, inside each rank (``time_sides``):

1. **warm-up**: each side takes ``warmup`` untimed steps (the first steps allocate, build plans,
   open connections);
2. **rounds**: each round runs both sides, ``steps`` steps each, and the order is swapped every
   round, so neither side always runs right after the other has loaded (or warmed) the machine;
3. **a barrier before every step**, so the ranks start it together; a step's time is the slowest
   rank's, since a step is over only when every rank is done.

In the parent (``summarize``) a side's time for a round is the median of its steps there, its time
the median of its rounds; the range is the lowest and highest ratio of single rounds. At the end the
two sides' parameters are compared on every rank: if they differ by more than ``tol`` the comparison
fails (``Diverged``), since a fast side that trains something else measures nothing.

    python benchmarks/harness.py [--only ddp,ring] [--models tiny,small] [--quick] [--out build/bench.json]

prints one JSON line per comparison as it finishes, then a table, and writes ``--out`` (the lines,
with the machine and date) and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

SIDES = ("minitp", "torch")
# The ratio minitp / torch each kind of comparison aims at (the targets).
TARGETS = {"ring": 1.2, "ddp": 1.05, "fsdp": 0.9, "tp": 0.9, "pp": 1.0, "train": 1.05}
BENCHMARKS = ("ring", "ddp", "fsdp", "tp", "pp", "train")  # modules bench_<name>.py, in the order they run
# Fewer rounds for the model whose steps take long, so that everything fits in about 10 minutes.
MODEL_TIMING = {"small": {"rounds": 4, "warmup": 1}}


class Diverged(AssertionError):
    """The two sides of a comparison ended with different parameters."""


@dataclass
class Side:
    """One contender: ``step(i)`` takes training step i (batch i), ``params()`` returns this rank's
    parameters at the end, keyed and shaped like the other side's (called on every rank, so it may
    use collectives)."""

    step: Callable[[int], None]
    params: Callable[[], dict[str, torch.Tensor]]


@dataclass
class Comparison:
    """One line of the table: ``worker(*args, rounds=, steps=, warmup=)`` runs on ``ranks`` ranks and
    returns ``time_sides``'s result."""

    name: str  # "ddp/several-buckets"
    model: str  # "tiny", "small", or a size for the ring
    ranks: int
    worker: Callable
    args: tuple = ()
    tol: float = 1e-4  # largest allowed difference of the two sides' final parameters
    note: str = ""
    timing: dict = field(default_factory=dict)  # rounds / steps / warmup overrides

    @property
    def kind(self) -> str:
        return self.name.split("/")[0]


def train_config(model_name: str, steps: int, rows: int | None = None):
    """The global batch (B, S) a comparison trains on: (16, 32) on the tiny model, (8, 64) on the
    small one (``rows`` replaces B)."""
    from minitp.models.train import TrainConfig

    batch, seq = {"tiny": (16, 32)}.get(model_name, (8, 64))
    return TrainConfig(steps=steps, batch_size=rows or batch, seq_len=seq)


def rows_for(model_name: str) -> int | None:
    """Rows of the global batch for DDP, FSDP and TP: on the small model 4, one per data-parallel
    rank, which is still well over 50 ms of compute per step and keeps `make bench` short."""
    return 4 if model_name == "small" else None


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element-wise difference of two parameter sets (inf if their names or shapes differ)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return math.inf
    diffs = [(a[k].detach().float() - b[k].detach().float()).abs().max().item() for k in a if a[k].numel()]
    return _worst(diffs)


def _worst(diffs: list[float]) -> float:
    """The largest difference, nan if any is nan (Python's max would let a nan slip by)."""
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


def time_sides(sides: dict[str, Side], rounds: int, steps: int, warmup: int) -> dict:
    """Run inside each rank: warm-up, then ``rounds`` rounds in alternating order, a barrier before
    every step. Returns this rank's step times {side: [[s, ...] per round]} and the difference of
    the two sides' final parameters on this rank."""
    import torch.distributed as dist

    if set(sides) != set(SIDES):
        raise ValueError(f"sides must be {SIDES}, got {tuple(sides)}")
    taken = dict.fromkeys(SIDES, 0)  # steps each side has taken: its next batch

    def run(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        sides[name].step(taken[name])
        taken[name] += 1
        return time.perf_counter() - t0

    for name in SIDES:
        for _ in range(warmup):
            run(name)
    times = {name: [] for name in SIDES}
    for r in range(rounds):
        for name in (SIDES if r % 2 == 0 else SIDES[::-1]):
            times[name].append([run(name) for _ in range(steps)])
    dist.barrier()
    diff = max_abs_diff(sides["minitp"].params(), sides["torch"].params())
    return {"times": times, "param_diff": diff, "threads": torch.get_num_threads()}


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (the machine is shared: they say how much)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return [float(x) for x in os.getloadavg()]


def machine() -> dict:
    return {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "backend": "gloo (CPU)", "threads_per_rank": 1, "platform": platform.platform(terse=True)}


def summarize(comparison: Comparison, per_rank: list[dict], load_before: list[float]) -> dict:
    """Turn every rank's ``time_sides`` result into the comparison's JSON line; raise ``Diverged``
    if the sides ended apart."""
    diff = _worst([r["param_diff"] for r in per_rank])
    if not diff <= comparison.tol:  # (nan and inf fail too)
        raise Diverged(f"{comparison.name} on {comparison.model}: the two sides' parameters differ by "
                       f"{diff:.3g}, more than the allowed {comparison.tol:g}; the timing is void")
    rounds = {}
    for name in SIDES:
        n_rounds, n_steps = len(per_rank[0]["times"][name]), len(per_rank[0]["times"][name][0])
        rounds[name] = [statistics.median(max(r["times"][name][i][j] for r in per_rank) for j in range(n_steps))
                        for i in range(n_rounds)]  # per round: the median step, each the slowest rank's
    minitp_s, torch_s = (statistics.median(rounds[name]) for name in SIDES)
    round_ratios = [m / t for m, t in zip(rounds["minitp"], rounds["torch"])]
    return {
        "name": comparison.name, "model": comparison.model, "ranks": comparison.ranks,
        "minitp_ms": round(minitp_s * 1e3, 3), "torch_ms": round(torch_s * 1e3, 3),
        "ratio": round(minitp_s / torch_s, 3), "range": [round(min(round_ratios), 3), round(max(round_ratios), 3)],
        "target": TARGETS.get(comparison.kind), "rounds": len(round_ratios), "steps_per_round": n_steps,
        "param_diff": diff, "note": comparison.note,
        "loadavg": {"before": load_before, "after": loadavg()},
        "machine": {**machine(), "threads_per_rank": per_rank[0]["threads"]},
    }


def run_comparison(comparison: Comparison, rounds: int, steps: int, warmup: int, timeout: float = 600,
                   quick: bool = False) -> dict:
    """Launch one comparison on its ranks and summarize it (``quick``: the timing given, as is)."""
    from minitp.launcher import launch

    timing = {"rounds": rounds, "steps": steps, "warmup": warmup}
    if not quick:
        timing.update({**MODEL_TIMING.get(comparison.model, {}), **comparison.timing})
    load = loadavg()
    per_rank = launch(comparison.worker, comparison.ranks, *comparison.args, *timing.values(),
                      echo=False, timeout=timeout)
    return summarize(comparison, list(per_rank), load)


def table(lines: list[dict]) -> str:
    """The comparisons as a Markdown table."""
    rows = ["| comparison | model | ranks | minitp ms | torch ms | ratio | rounds' range | target |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for x in lines:
        target = x["target"]
        verdict = "" if target is None else f"≤ {target} {'met' if x['ratio'] <= target else 'not met'}"
        rows.append(f"| {x['name']} | {x['model']} | {x['ranks']} | {x['minitp_ms']:.1f} | {x['torch_ms']:.1f} | "
                    f"{x['ratio']:.2f} | {x['range'][0]:.2f}–{x['range'][1]:.2f} | {verdict} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated, of {', '.join(BENCHMARKS)}")
    parser.add_argument("--models", default="tiny,small", help="model presets, comma-separated")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 step: checks that everything runs")
    parser.add_argument("--out", default="build/bench.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    sys.path.insert(0, str(Path(__file__).parent))
    comparisons = []
    for name in args.only.split(","):
        if name not in BENCHMARKS:
            parser.error(f"unknown benchmark {name!r}; expected some of {', '.join(BENCHMARKS)}")
        module = importlib.import_module(f"bench_{name}")
        comparisons += module.comparisons(args.models.split(","))
    started, date = time.time(), datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = []
    for comparison in comparisons:
        line = run_comparison(comparison, args.rounds, args.steps, args.warmup, quick=args.quick)
        print(json.dumps(line), flush=True)
        lines.append(line)
    report = {"date": date, "machine": machine(), "seconds": round(time.time() - started, 1), "comparisons": lines}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    header = (f"{report['date']}, {m['cores']} cores, torch {m['torch']}, {m['backend']}, "
              f"{m['threads_per_rank']} thread per rank; {report['seconds']:.0f} s in all")
    text = f"{header}\n\n{table(lines)}\n"
    out.with_suffix(".md").write_text(text)
    print("\n" + text)
    return lines


if __name__ == "__main__":
    main()
