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

**The gate counts the others' load, not ours** (``wait_for_quiet``). Before each comparison the
harness measures, over ``--sample`` seconds (1), the share of the machine that *other* processes
keep busy: the busy CPU time of all cores (``/proc/stat``) less that of the harness and every
process it started, over the CPU time all cores had. It runs the comparison once that share is at
most ``--max-foreign`` (0.25), waiting up to ``--wait`` seconds (30); if it stays above, the row is
recorded as skipped with the share it saw. Its own ranks do not count, so on a quiet machine a row
waits one sample, not the minute a load average takes to forget the row before (the old gate kept
``make bench`` from ever finishing). Why 0.25, half a core of 2: one light job beside the run (an
editor, an idle notebook kernel, a language server) uses well under that and passes; a second build
or test run takes a whole core (0.5 of 2), a core taken from ranks that already share two, and
waits. Every measured row also records the foreign share during its own run (``foreign_share``), so
a reader knows the load it ran under. Without ``/proc/stat`` (macOS, Windows) the gate falls back to
the old one, the 1-minute load average at most ``--max-load`` (1.5), which the harness's own ranks
raise too; the row's ``gate`` says which gate it passed.

**A run that finishes.** 25 comparisons take about 10 minutes on 2 quiet cores. Once the run has
spent ``--budget-s`` (1200), the comparisons left are recorded as skipped, not run, and one still
running then is stopped (its launch's timeout) and recorded as skipped too: a run ends within its
budget, give or take a few seconds. A comparison that raises (a rank's error, ``Diverged``) is
recorded with the error's first line and the run goes on. Every row that has no figures says why in
``skipped``.

**Written as it goes** (``save``). After every comparison, ``--out`` (one JSON document: the
machine, the date, the settings, ``"finished": false`` until the last row, and the rows so far) and
the Markdown table beside it are rewritten whole, each to a temporary file renamed over the old one
(``os.replace``): either file is complete and valid at every moment, and a run cut short keeps what
it measured.

    python benchmarks/harness.py [--only ddp,ring] [--models tiny,small] [--max-foreign 0.25]
                                 [--wait 30] [--budget-s 1200] [--quick] [--out build/bench.json]

prints one JSON line per comparison as it finishes, then the table.
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
TARGETS = {"ring": 1.15, "ddp": 1.0, "fsdp": 0.8, "tp": 0.8, "pp": 1.0, "train": 1.0}
BENCHMARKS = ("ring", "ddp", "fsdp", "tp", "pp", "train")  # modules bench_<name>.py, in the order they run
ROUNDS, STEPS, WARMUP = 11, 2, 3  # the defaults: every row, tiny and small alike
MAX_FOREIGN, SAMPLE_S, WAIT_S = 0.25, 1.0, 30.0  # the gate: others' share of the machine, over 1-s samples
MAX_LOAD, POLL_S = 1.5, 2.0  # the gate without /proc/stat: the 1-minute load average
BUDGET_S = 1200.0  # the whole run's seconds; the comparisons left after are recorded as skipped
RUN_TIMEOUT_S = 600.0  # one comparison, its gate's wait and its launch, at most


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


def proc_stat(path: str = "/proc/stat") -> tuple[float, float] | None:
    """All cores' CPU seconds since boot, (busy, total), from /proc/stat's first line: busy is user,
    nice, system, irq, softirq and steal (a hypervisor's other guests count as others' load), total
    adds idle and iowait. None where there is no /proc/stat (macOS, Windows)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    busy = user + nice + system + irq + softirq + steal
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, (busy + idle + iowait) / tick


def own_cpu_seconds() -> float:
    """CPU seconds used so far by this process and every process it started: the live ones read
    directly, the ended ones through what the kernel adds to their parent's children's times when it
    reaps them (psutil: a dev dependency, which ``make install`` installs)."""
    import psutil

    me = psutil.Process()
    total = _cpu_seconds(me)
    for child in me.children(recursive=True):
        try:
            total += _cpu_seconds(child)
        except psutil.Error:  # it ended between the listing and the reading
            continue
    return total


def _cpu_seconds(process) -> float:
    """A process's own CPU seconds and those of the children it has reaped."""
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


@dataclass
class Cpu:
    """Where the gate reads CPU time (tests give made-up readers): ``machine()``, all cores' (busy,
    total) seconds; ``own()``, the harness's own tree's seconds; ``cores``, for the messages."""

    machine: Callable[[], tuple[float, float] | None] = proc_stat
    own: Callable[[], float] = own_cpu_seconds
    cores: int = os.cpu_count() or 1

    def sample(self) -> tuple[float, float, float] | None:
        """(busy, total, own) CPU seconds now; None without /proc/stat."""
        machine = self.machine()
        if machine is None:
            return None
        return machine[0], machine[1], self.own()


def foreign_share(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """The share of the machine (0 to 1) that other processes kept busy between two ``Cpu.sample``s:
    all cores' busy seconds less the harness tree's own, over the seconds all cores had."""
    busy = after[0] - before[0]
    total = after[1] - before[1]
    own = after[2] - before[2]
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, (busy - own) / total))


@dataclass
class Gate:
    """What the gate found: ``quiet`` (run the comparison), the seconds it waited, what it saw (for
    the row) and, when not quiet, why (the row's reason for being skipped)."""

    quiet: bool
    waited: float
    seen: dict
    why: str = ""


def wait_for_quiet(max_foreign: float = MAX_FOREIGN, wait_s: float = WAIT_S, sample_s: float = SAMPLE_S,
                   max_load: float = MAX_LOAD, clock: Callable[[], float] | None = None,
                   sleep: Callable[[float], None] | None = None, cpu: Cpu | None = None) -> Gate:
    """Sample the machine every ``sample_s`` seconds until other processes use at most
    ``max_foreign`` of it, for at most ``wait_s`` seconds (``clock``, ``sleep``, ``cpu``:
    time.monotonic, time.sleep and the real readers unless given). The harness's own ranks do not
    count, so a quiet machine passes after one sample. Without /proc/stat: ``wait_for_load``."""
    clock, sleep, cpu = clock or time.monotonic, sleep or time.sleep, cpu or Cpu()
    start = clock()
    first = cpu.sample()
    if first is None:
        return wait_for_load(max_load, wait_s, clock=clock, sleep=sleep)
    last = first
    while True:
        sleep(sample_s)
        now = cpu.sample()
        share = foreign_share(last, now)
        waited = clock() - start
        if share <= max_foreign:
            return Gate(True, waited, {"by": "others' CPU", "foreign_share": round(share, 3)})
        if waited >= wait_s:
            mean = foreign_share(first, now)
            why = (f"other processes used {mean * cpu.cores:.1f} of {cpu.cores} cores (more than "
                   f"{max_foreign:g} of the machine) for {waited:.0f} s")
            return Gate(False, waited, {"by": "others' CPU", "foreign_share": round(mean, 3)}, why)
        last = now


def wait_for_load(max_load: float, wait_s: float = WAIT_S, poll_s: float = POLL_S,
                  clock: Callable[[], float] | None = None,
                  sleep: Callable[[float], None] | None = None) -> Gate:
    """The gate where there is no /proc/stat: wait until the 1-minute load average
    (``os.getloadavg``) is at most ``max_load``, polling every ``poll_s``, for at most ``wait_s``
    seconds. The harness's own ranks raise that load too, so a row may wait for the one before."""
    clock, sleep = clock or time.monotonic, sleep or time.sleep
    by = "1-minute load average (no /proc/stat)"
    start = clock()
    while True:
        now = os.getloadavg()[0]
        waited = clock() - start
        if now <= max_load:
            return Gate(True, waited, {"by": by, "load": now})
        if waited >= wait_s:
            why = f"1-minute load {now:.2f} stayed above {max_load:g} for {waited:.0f} s (no /proc/stat)"
            return Gate(False, waited, {"by": by, "load": now}, why)
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


def skipped(comparison: Comparison, why: str, gate: Gate | None = None) -> dict:
    """The line of a comparison that has no figures: refused by the gate, past the run's budget, or
    failed; ``why`` says which."""
    line = {"name": comparison.name, "model": comparison.model, "ranks": comparison.ranks, "skipped": why,
            "target": TARGETS.get(comparison.kind), "note": comparison.note}
    if gate is not None:
        line["gate"] = {**gate.seen, "waited_s": round(gate.waited, 1)}
    line.update({"loadavg": {"before": loadavg()}, "machine": machine()})
    return line


def first_line(error: BaseException) -> str:
    """'Diverged: ddp/one-bucket on tiny: the two sides' parameters differ ...': what a failed row says."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def timing_for(comparison: Comparison, rounds: int, steps: int, warmup: int, quick: bool = False) -> dict:
    """The rounds, steps and warm-up a comparison runs with (``quick``: those given, as they are)."""
    timing = {"rounds": rounds, "steps": steps, "warmup": warmup}
    if not quick:
        timing.update(comparison.timing)
    return timing


def run_comparison(comparison: Comparison, rounds: int, steps: int, warmup: int,
                   timeout: float = RUN_TIMEOUT_S, quick: bool = False, max_foreign: float = MAX_FOREIGN,
                   max_load: float = MAX_LOAD, wait_s: float = WAIT_S, sample_s: float = SAMPLE_S,
                   clock: Callable[[], float] | None = None, sleep: Callable[[float], None] | None = None,
                   cpu: Cpu | None = None) -> dict:
    """Wait for a quiet machine (``wait_for_quiet``), launch one comparison on its ranks and
    summarize it, with the share of the machine other processes used while it ran; or record it as
    skipped, not run, if the machine stays busy. ``timeout``: seconds for the whole comparison, the
    gate's wait included. Raises what the comparison raises."""
    from minitp.launcher import launch

    cpu = cpu or Cpu()
    gate = wait_for_quiet(max_foreign, wait_s, sample_s, max_load, clock=clock, sleep=sleep, cpu=cpu)
    if not gate.quiet:
        return skipped(comparison, gate.why, gate)
    timing = timing_for(comparison, rounds, steps, warmup, quick)
    load = loadavg()
    before = cpu.sample()
    per_rank = launch(comparison.worker, comparison.ranks, *comparison.args, *timing.values(),
                      echo=False, timeout=max(timeout - gate.waited, 1.0))
    after = cpu.sample()
    line = summarize(comparison, list(per_rank), load)
    line["gate"] = {**gate.seen, "waited_s": round(gate.waited, 1)}
    line["foreign_share"] = None if before is None or after is None else round(foreign_share(before, after), 3)
    return line


def _ratio(part: dict | None) -> str:
    if not part or part.get("ratio") is None:
        return "–"
    return f"{part['ratio']:.2f} ({part['iqr'][0]:.2f}–{part['iqr'][1]:.2f})"


def _ms(part: dict | None) -> str:
    if not part:
        return "–"
    return f"{part['minitp_ms']:.1f} / {part['torch_ms']:.1f}"


def _share(x: dict) -> str:
    share = x.get("foreign_share")
    return "–" if share is None else f"{share:.2f}"


def table(lines: list[dict]) -> str:
    """The comparisons as a Markdown table: per phase, minitp's and torch's milliseconds and the
    median paired ratio with its interquartile range; last, the share of the machine other processes
    used during the row."""
    rows = ["| comparison | model | ranks | fwd+bwd ms minitp / torch | ratio (IQR) | optimizer ms minitp / torch "
            "| ratio (IQR) | whole step ms minitp / torch | ratio (IQR) | target | others' share |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in lines:
        head = f"| {x['name']} | {x['model']} | {x['ranks']} |"
        if "skipped" in x:
            rows.append(f"{head} skipped: {x['skipped']} | | | | | | | |")
            continue
        target = x["target"]
        verdict = "" if target is None else f"≤ {target} {'met' if x['ratio'] <= target else 'not met'}"
        rows.append(f"{head} {_ms(x['step'])} | {_ratio(x['step'])} | {_ms(x['optimize'])} | "
                    f"{_ratio(x['optimize'])} | {_ms(x)} | {_ratio(x)} | {verdict} | {_share(x)} |")
    return "\n".join(rows)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated, of {', '.join(BENCHMARKS)}")
    parser.add_argument("--models", default="tiny,small", help="model presets, comma-separated")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps per side first")
    parser.add_argument("--max-foreign", type=float, default=MAX_FOREIGN,
                        help="run a comparison only once other processes use at most this share of the machine "
                             "(0 to 1; the harness and its ranks do not count)")
    parser.add_argument("--sample", type=float, default=SAMPLE_S,
                        help="seconds over which the gate measures the others' share")
    parser.add_argument("--max-load", type=float, default=MAX_LOAD,
                        help="only where there is no /proc/stat: run a comparison once the 1-minute load average "
                             "is at most this")
    parser.add_argument("--wait", type=float, default=WAIT_S,
                        help="seconds to wait for a quiet machine before skipping the comparison")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="seconds for the whole run: the comparisons left after are recorded as skipped")
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 1 step after 1 warm-up step: checks that everything runs (no figures)")
    parser.add_argument("--out", default="build/bench.json",
                        help="the JSON report, rewritten after every comparison; the Markdown table beside it")
    return parser


def load_comparisons(parser: argparse.ArgumentParser, only: str, models: str) -> list[Comparison]:
    """The comparisons of the benchmarks named in ``only`` (modules bench_<name>.py), in order."""
    sys.path.insert(0, str(Path(__file__).parent))
    comparisons = []
    for name in only.split(","):
        if name not in BENCHMARKS:
            parser.error(f"unknown benchmark {name!r}; expected some of {', '.join(BENCHMARKS)}")
        module = importlib.import_module(f"bench_{name}")
        comparisons += module.comparisons(models.split(","))
    return comparisons


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def markdown(report: dict) -> str:
    """The report as a header line and the table."""
    m = report["machine"]
    done = "" if report["finished"] else f"; unfinished: {len(report['comparisons'])} of {report['planned']} rows"
    header = (f"{report['date']}, {m['cores']} cores, torch {m['torch']}, {m['backend']}, "
              f"{m['threads_per_rank']} thread per rank; {report['seconds']:.0f} s in all{done}; each comparison "
              f"started once other processes used at most {report['max_foreign']:g} of the machine; ratios are "
              f"minitp / torch, the median of paired rounds (interquartile range)"
              + ("; --quick: not figures" if report["quick"] else ""))
    return f"{header}\n\n{table(report['comparisons'])}\n"


def save(out: Path, report: dict) -> None:
    """Rewrite ``out`` (the JSON report) and the Markdown table beside it, each whole (``_replace``):
    both are complete and valid at every moment, whenever the run stops."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _replace(out, json.dumps(report, indent=1) + "\n")
    _replace(out.with_suffix(".md"), markdown(report))


def main(argv: list[str] | None = None, comparisons: list[Comparison] | None = None,
         clock: Callable[[], float] | None = None) -> list[dict]:
    """Run the comparisons one after another (``comparisons``: those of ``--only`` unless given;
    ``clock``: time.monotonic, for the budget), saving the report after each."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    if comparisons is None:
        comparisons = load_comparisons(parser, args.only, args.models)
    clock = clock or time.monotonic
    started, date = clock(), datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = Path(args.out)
    report = {"date": date, "machine": machine(), "seconds": 0.0, "finished": False, "planned": len(comparisons),
              "max_foreign": args.max_foreign, "max_load": args.max_load, "wait_s": args.wait,
              "budget_s": args.budget_s, "quick": args.quick, "comparisons": []}
    for comparison in comparisons:
        line = run_within_budget(comparison, args, started, clock)
        if "skipped" in line:
            print(f"{comparison.name} on {comparison.model} skipped: {line['skipped']}", file=sys.stderr, flush=True)
        print(json.dumps(line), flush=True)
        report["comparisons"].append(line)
        report["seconds"] = round(clock() - started, 1)
        save(out, report)
    report["finished"] = True
    save(out, report)
    print("\n" + markdown(report))
    return report["comparisons"]


def run_within_budget(comparison: Comparison, args: argparse.Namespace, started: float,
                      clock: Callable[[], float]) -> dict:
    """One comparison's line: skipped if the run's budget is spent; else run, its gate's wait and
    its launch's timeout cut to the budget left; an error it raises becomes its line's reason."""
    budget = f"the run's budget of {args.budget_s:g} s"
    left = args.budget_s - (clock() - started)
    if left <= 0:
        return skipped(comparison, f"{budget} was spent")
    try:
        return run_comparison(comparison, args.rounds, args.steps, args.warmup, timeout=min(RUN_TIMEOUT_S, left),
                              quick=args.quick, max_foreign=args.max_foreign, max_load=args.max_load,
                              wait_s=min(args.wait, left), sample_s=args.sample, clock=clock)
    except Exception as error:  # one comparison's failure is its row, not the end of the run
        from minitp.launcher import LaunchTimeout

        if isinstance(error, LaunchTimeout) and clock() - started >= args.budget_s:
            return skipped(comparison, f"{budget} ran out while it ran")
        return skipped(comparison, f"it raised {first_line(error)}")


if __name__ == "__main__":
    main()
