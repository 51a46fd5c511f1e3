"""One harness for every benchmark: minitp against PyTorch's own implementation of the same thing,
on equal work, timed in one run on the same ranks.

How a comparison is timed, inside each rank (``time_sides``):

1. **warm-up**: each side takes ``warmup`` untimed steps (the first steps allocate, build plans,
   open connections; PyTorch's DDP rebuilds its buckets after its first iteration);
2. **rounds**: each round runs both sides, ``steps`` steps each, and the order is swapped every
   round, so neither side always runs right after the other has loaded (or warmed) the machine;
3. **two phases per step, timed apart**: ``step(i)``, forward and backward with the communication
   they carry, then ``optimize(i)``, the optimizer step (with what a side sends there), each after
   a barrier so the ranks start it together; a phase's time is the slowest rank's, since it is over
   only when every rank is done.

In the parent (``summarize``) a side's time for a round is the median of its steps there. The
figure reported is the median of the **paired** ratios, minitp's time over torch's in the same
round, with their interquartile range: each round compares the two sides under the same load, so a
machine that slows down half-way moves both. The same is given for each phase. At the end the two
sides' parameters are compared on every rank: if they differ by more than ``tol`` the comparison
fails (``Diverged``), since a fast side that trains something else measures nothing.

**The load gate**: before each comparison the harness waits (up to ``--wait``, 60 s) until the
1-minute load average is at most ``--max-load`` (1.5); if it stays above, that comparison is not
run and is recorded as skipped, with the load. The harness's own ranks raise the load too, so a
comparison may wait for the one before it to fade.

    python benchmarks/harness.py [--only ddp,ring] [--models tiny,small] [--max-load 1.5] [--quick]

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
PHASES = ("step", "optimize")  # forward + backward (+ their messages); the optimizer step
# The ratio minitp / torch each kind of comparison aims at (of the whole step).
TARGETS = {"ring": 1.15, "ddp": 1.0, "fsdp": 0.8, "tp": 0.8, "pp": 1.0, "train": 1.05}
BENCHMARKS = ("ring", "ddp", "fsdp", "tp", "pp", "train")  # modules bench_<name>.py, in the order they run
ROUNDS, STEPS, WARMUP = 11, 2, 3  # the defaults: every row, tiny and small alike
MAX_LOAD, WAIT_S, POLL_S = 1.5, 60.0, 2.0  # the load gate


class Diverged(AssertionError):
    """The two sides of a comparison ended with different parameters."""


@dataclass
class Side:
    """One contender: ``step(i)`` runs forward and backward of training step i (batch i), with the
    messages they need; ``optimize(i)`` then steps the optimizer (None: a side with no optimizer,
    such as an all-reduce alone); ``params()`` returns this rank's parameters at the end, keyed and
    shaped like the other side's (called on every rank, so it may use collectives)."""

    step: Callable[[int], None]
    params: Callable[[], dict[str, torch.Tensor]]
    optimize: Callable[[int], None] | None = None


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
    """Run inside each rank: warm-up, then ``rounds`` rounds in alternating order, each step in two
    phases with a barrier before each. Returns this rank's times {phase: {side: [[s, ...] per
    round]}} and the difference of the two sides' final parameters on this rank."""
    import torch.distributed as dist

    if set(sides) != set(SIDES):
        raise ValueError(f"sides must be {SIDES}, got {tuple(sides)}")
    taken = dict.fromkeys(SIDES, 0)  # steps each side has taken: its next batch

    def timed(fn: Callable[[int], None] | None, i: int) -> float:
        dist.barrier()
        if fn is None:
            return 0.0
        t0 = time.perf_counter()
        fn(i)
        return time.perf_counter() - t0

    def run(name: str) -> tuple[float, float]:
        i = taken[name]
        taken[name] += 1
        return timed(sides[name].step, i), timed(sides[name].optimize, i)

    for name in SIDES:
        for _ in range(warmup):
            run(name)
    times = {phase: {name: [] for name in SIDES} for phase in PHASES}
    for r in range(rounds):
        for name in (SIDES if r % 2 == 0 else SIDES[::-1]):
            pairs = [run(name) for _ in range(steps)]
            for k, phase in enumerate(PHASES):
                times[phase][name].append([pair[k] for pair in pairs])
    dist.barrier()
    diff = max_abs_diff(sides["minitp"].params(), sides["torch"].params())
    return {"times": times, "param_diff": diff, "threads": torch.get_num_threads(),
            "optimizes": all(sides[name].optimize is not None for name in SIDES)}


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (the machine is shared: they say how much)."""
    return [round(float(x), 2) for x in os.getloadavg()]


def wait_for_quiet(max_load: float, wait_s: float = WAIT_S, poll_s: float = POLL_S,
                   clock: Callable[[], float] | None = None,
                   sleep: Callable[[float], None] | None = None) -> tuple[bool, float, float]:
    """Wait until the 1-minute load average (``os.getloadavg``) is at most ``max_load``, polling
    every ``poll_s``, for at most ``wait_s`` seconds (``clock`` and ``sleep``: time.monotonic and
    time.sleep unless given). Returns (quiet enough, the last 1-minute load, seconds waited)."""
    clock, sleep = clock or time.monotonic, sleep or time.sleep
    start = clock()
    while True:
        now = os.getloadavg()[0]
        waited = clock() - start
        if now <= max_load:
            return True, now, waited
        if waited >= wait_s:
            return False, now, waited
        sleep(min(poll_s, wait_s - waited))


def machine() -> dict:
    return {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "backend": "gloo (CPU)", "threads_per_rank": 1, "platform": platform.platform(terse=True)}


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile), the quartiles interpolated between the values
    (``statistics.quantiles``' inclusive method); one value is all three."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def paired(minitp_rounds: list[float], torch_rounds: list[float]) -> dict | None:
    """The median and interquartile range of minitp's time over torch's, round by round (None if a
    round of torch's took no time: a phase that side does not have)."""
    if len(minitp_rounds) != len(torch_rounds):
        raise ValueError(f"{len(minitp_rounds)} rounds of minitp against {len(torch_rounds)} of torch")
    if not all(t > 0 for t in torch_rounds):
        return None
    q1, median, q3 = quartiles([m / t for m, t in zip(minitp_rounds, torch_rounds)])
    return {"ratio": round(median, 3), "iqr": [round(q1, 3), round(q3, 3)]}


def _round_times(per_rank: list[dict], phase: str, name: str) -> list[float]:
    """Per round: the median step, each the slowest rank's."""
    rounds = [r["times"][phase][name] for r in per_rank]
    return [statistics.median(max(rank[i][j] for rank in rounds) for j in range(len(rounds[0][i])))
            for i in range(len(rounds[0]))]


def _whole_times(per_rank: list[dict], name: str) -> list[float]:
    """Per round: the median of whole steps, a whole step being its two phases' slowest ranks' times
    added (a barrier stands between the phases)."""
    step = [r["times"]["step"][name] for r in per_rank]
    opt = [r["times"]["optimize"][name] for r in per_rank]
    return [statistics.median(max(rank[i][j] for rank in step) + max(rank[i][j] for rank in opt)
                              for j in range(len(step[0][i])))
            for i in range(len(step[0]))]


def summarize(comparison: Comparison, per_rank: list[dict], load_before: list[float]) -> dict:
    """Turn every rank's ``time_sides`` result into the comparison's JSON line; raise ``Diverged``
    if the sides ended apart."""
    diff = _worst([r["param_diff"] for r in per_rank])
    if not diff <= comparison.tol:  # (nan and inf fail too)
        raise Diverged(f"{comparison.name} on {comparison.model}: the two sides' parameters differ by "
                       f"{diff:.3g}, more than the allowed {comparison.tol:g}; the timing is void")
    whole = {name: _whole_times(per_rank, name) for name in SIDES}
    line = {"name": comparison.name, "model": comparison.model, "ranks": comparison.ranks}
    line.update({f"{name}_ms": round(statistics.median(whole[name]) * 1e3, 3) for name in SIDES})
    line.update(paired(whole["minitp"], whole["torch"]))
    optimizes = per_rank[0].get("optimizes", True)
    for phase in PHASES:
        if phase == "optimize" and not optimizes:
            line[phase] = None
            continue
        rounds = {name: _round_times(per_rank, phase, name) for name in SIDES}
        line[phase] = {**{f"{name}_ms": round(statistics.median(rounds[name]) * 1e3, 3) for name in SIDES},
                       **(paired(rounds["minitp"], rounds["torch"]) or {"ratio": None, "iqr": None})}
    n_rounds = len(whole["minitp"])
    line.update({
        "target": TARGETS.get(comparison.kind), "rounds": n_rounds,
        "steps_per_round": len(per_rank[0]["times"]["step"]["minitp"][0]),
        "param_diff": diff, "note": comparison.note,
        "loadavg": {"before": load_before, "after": loadavg()},
        "machine": {**machine(), "threads_per_rank": per_rank[0]["threads"]},
    })
    return line


def skipped(comparison: Comparison, load_now: float, waited: float, max_load: float) -> dict:
    """The line of a comparison the load gate refused: recorded, not timed."""
    return {"name": comparison.name, "model": comparison.model, "ranks": comparison.ranks,
            "skipped": f"1-minute load {load_now:.2f} stayed above {max_load:g} for {waited:.0f} s",
            "target": TARGETS.get(comparison.kind), "note": comparison.note,
            "loadavg": {"before": loadavg()}, "machine": machine()}


def timing_for(comparison: Comparison, rounds: int, steps: int, warmup: int, quick: bool = False) -> dict:
    """The rounds, steps and warm-up a comparison runs with (``quick``: those given, as they are)."""
    timing = {"rounds": rounds, "steps": steps, "warmup": warmup}
    if not quick:
        timing.update(comparison.timing)
    return timing


def run_comparison(comparison: Comparison, rounds: int, steps: int, warmup: int, timeout: float = 600,
                   quick: bool = False, max_load: float = MAX_LOAD, wait_s: float = WAIT_S,
                   clock: Callable[[], float] | None = None, sleep: Callable[[float], None] | None = None) -> dict:
    """Wait for a quiet machine, launch one comparison on its ranks and summarize it (or record it
    as skipped, not run, if the load stays above ``max_load``)."""
    from minitp.launcher import launch

    quiet, now, waited = wait_for_quiet(max_load, wait_s, clock=clock, sleep=sleep)
    if not quiet:
        return skipped(comparison, now, waited, max_load)
    timing = timing_for(comparison, rounds, steps, warmup, quick)
    load = loadavg()
    per_rank = launch(comparison.worker, comparison.ranks, *comparison.args, *timing.values(),
                      echo=False, timeout=timeout)
    line = summarize(comparison, list(per_rank), load)
    line["waited_s"] = round(waited, 1)
    return line


def _ratio(part: dict | None) -> str:
    if not part or part.get("ratio") is None:
        return "–"
    return f"{part['ratio']:.2f} ({part['iqr'][0]:.2f}–{part['iqr'][1]:.2f})"


def _ms(part: dict | None) -> str:
    if not part:
        return "–"
    return f"{part['minitp_ms']:.1f} / {part['torch_ms']:.1f}"


def table(lines: list[dict]) -> str:
    """The comparisons as a Markdown table: per phase, minitp's and torch's milliseconds and the
    median paired ratio with its interquartile range."""
    rows = ["| comparison | model | ranks | fwd+bwd ms minitp / torch | ratio (IQR) | optimizer ms minitp / torch "
            "| ratio (IQR) | whole step ms minitp / torch | ratio (IQR) | target |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in lines:
        head = f"| {x['name']} | {x['model']} | {x['ranks']} |"
        if "skipped" in x:
            rows.append(f"{head} skipped: {x['skipped']} | | | | | | |")
            continue
        target = x["target"]
        verdict = "" if target is None else f"≤ {target} {'met' if x['ratio'] <= target else 'not met'}"
        rows.append(f"{head} {_ms(x['step'])} | {_ratio(x['step'])} | {_ms(x['optimize'])} | "
                    f"{_ratio(x['optimize'])} | {_ms(x)} | {_ratio(x)} | {verdict} |")
    return "\n".join(rows)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated, of {', '.join(BENCHMARKS)}")
    parser.add_argument("--models", default="tiny,small", help="model presets, comma-separated")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps per side first")
    parser.add_argument("--max-load", type=float, default=MAX_LOAD,
                        help="run a comparison only once the 1-minute load average is at most this")
    parser.add_argument("--wait", type=float, default=WAIT_S,
                        help="seconds to wait for that load before skipping the comparison")
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 1 step after 1 warm-up step: checks that everything runs (no figures)")
    parser.add_argument("--out", default="build/bench.json")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    parser = make_parser()
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
        line = run_comparison(comparison, args.rounds, args.steps, args.warmup, quick=args.quick,
                              max_load=args.max_load, wait_s=args.wait)
        if "skipped" in line:
            print(f"{comparison.name} on {comparison.model} skipped: {line['skipped']}", file=sys.stderr, flush=True)
        print(json.dumps(line), flush=True)
        lines.append(line)
    report = {"date": date, "machine": machine(), "seconds": round(time.time() - started, 1),
              "max_load": args.max_load, "quick": args.quick, "comparisons": lines}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    header = (f"{report['date']}, {m['cores']} cores, torch {m['torch']}, {m['backend']}, "
              f"{m['threads_per_rank']} thread per rank; {report['seconds']:.0f} s in all; each comparison "
              f"started at a 1-minute load ≤ {args.max_load:g}; ratios are minitp / torch, the median of "
              f"paired rounds (interquartile range)" + ("; --quick: not figures" if args.quick else ""))
    text = f"{header}\n\n{table(lines)}\n"
    out.with_suffix(".md").write_text(text)
    print("\n" + text)
    return lines


if __name__ == "__main__":
    main()
