"""The benchmark harness's logic (benchmarks/harness.py), on recorded timings, made-up CPU readings and
a trivial run: no benchmark runs here and nothing depends on how fast this machine is."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import minitp

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import harness  # noqa: E402

KEYS = {"name", "minitp_ms", "torch_ms", "ratio", "iqr", "step", "optimize", "model", "ranks", "machine"}


def _comparison(tol=1e-4, name="ddp/several-buckets"):
    return harness.Comparison(name, "tiny", 2, worker=None, tol=tol)


def _rank(minitp, torch_, minitp_opt=None, torch_opt=None, diff=0.0):
    """One rank's time_sides result: per phase and side, rounds of step times in seconds (an
    optimizer that takes no time unless given)."""
    def zeros(rounds):
        return [[0.0] * len(r) for r in rounds]

    optimize = {"minitp": minitp_opt or zeros(minitp), "torch": torch_opt or zeros(torch_)}
    return {"times": {"step": {"minitp": minitp, "torch": torch_}, "optimize": optimize},
            "param_diff": diff, "threads": 1, "optimizes": True}


def test_the_figure_is_the_median_of_paired_round_ratios_with_their_quartiles():
    # 5 rounds of one step; the machine slows down in rounds 3 and 4 for both sides alike
    minitp_ = [[0.010], [0.011], [0.030], [0.033], [0.012]]
    torch_ = [[0.020], [0.020], [0.031], [0.032], [0.010]]
    line = harness.summarize(_comparison(), [_rank(minitp_, torch_)], [0.5, 0.5, 0.5])
    # paired ratios 0.5, 0.55, 0.968, 1.031, 1.2: median 0.968, quartiles 0.55 and 1.031
    assert line["ratio"] == pytest.approx(0.968, abs=1e-3)
    assert line["iqr"] == pytest.approx([0.55, 1.031], abs=1e-3)
    # not the ratio of the medians (12 ms over 20 ms)
    assert line["minitp_ms"] == pytest.approx(12.0) and line["torch_ms"] == pytest.approx(20.0)
    assert line["ratio"] != pytest.approx(0.6, abs=0.05)
    assert line["target"] == harness.TARGETS["ddp"] and line["rounds"] == 5


def test_quartiles_interpolate_between_the_values():
    assert harness.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    assert harness.quartiles([1.0, 2.0, 3.0, 4.0]) == (1.75, 2.5, 3.25)
    assert harness.quartiles([0.7]) == (0.7, 0.7, 0.7)


def test_a_step_counts_its_slowest_rank_per_phase_and_reports_each_phase_apart():
    per_rank = [_rank([[0.010, 0.010], [0.030, 0.030], [0.020, 0.020]], [[0.020, 0.020]] * 3,
                      [[0.001, 0.001]] * 3, [[0.008, 0.008]] * 3),
                _rank([[0.012, 0.012], [0.010, 0.010], [0.010, 0.010]], [[0.010, 0.040]] * 3,
                      [[0.002, 0.002]] * 3, [[0.004, 0.012]] * 3)]
    line = harness.summarize(_comparison(), per_rank, [0.5, 0.5, 0.5])
    # forward+backward, slowest rank per step: minitp rounds 12, 30, 20 ms; torch steps 20 and 40 (median 30)
    assert line["step"]["minitp_ms"] == pytest.approx(20.0) and line["step"]["torch_ms"] == pytest.approx(30.0)
    assert line["step"]["ratio"] == pytest.approx(0.667, abs=1e-3)  # rounds' ratios 0.4, 1.0, 0.667
    assert line["step"]["iqr"] == pytest.approx([0.533, 0.833], abs=1e-3)
    # optimizer: minitp 2 ms every step, torch 8 and 12 ms (median 10): 0.2 every round
    assert line["optimize"]["minitp_ms"] == pytest.approx(2.0) and line["optimize"]["torch_ms"] == pytest.approx(10.0)
    assert line["optimize"]["ratio"] == pytest.approx(0.2) and line["optimize"]["iqr"] == pytest.approx([0.2, 0.2])
    # whole step = the two phases' slowest ranks added: minitp 14, 32, 22; torch 28 and 52 (median 40)
    assert line["minitp_ms"] == pytest.approx(22.0) and line["torch_ms"] == pytest.approx(40.0)
    assert line["ratio"] == pytest.approx(0.55)  # rounds' ratios 0.35, 0.8, 0.55


def test_a_side_with_no_optimizer_reports_no_optimizer_figures():
    per_rank = [{**_rank([[0.01]] * 3, [[0.02]] * 3), "optimizes": False}]
    line = harness.summarize(_comparison(name="ring/16MB"), per_rank, [0.0, 0.0, 0.0])
    assert line["optimize"] is None and line["ratio"] == pytest.approx(0.5)
    row = harness.table([line]).splitlines()[-1]
    assert "| – | – |" in row and "0.50 (0.50–0.50)" in row


def test_the_json_line_has_its_keys_and_is_one_line():
    line = harness.summarize(_comparison(), [_rank([[0.01]], [[0.01]])], [0.0, 0.0, 0.0])
    assert KEYS <= line.keys()
    assert {"cores", "torch"} <= line["machine"].keys()
    assert "\n" not in json.dumps(line)


@pytest.mark.parametrize("diff", [1e-3, math.inf, math.nan])
def test_sides_that_diverge_fail_the_comparison(diff):
    with pytest.raises(harness.Diverged, match="parameters differ"):
        harness.summarize(_comparison(tol=1e-4), [_rank([[0.01]], [[0.01]]), _rank([[0.01]], [[0.01]], diff=diff)],
                          [0.0, 0.0, 0.0])


def test_parameters_that_differ_in_names_or_shapes_count_as_diverged():
    a = {"w": torch.zeros(2, 2)}
    assert harness.max_abs_diff(a, {"w": torch.full((2, 2), 0.5)}) == 0.5
    assert harness.max_abs_diff(a, {"v": torch.zeros(2, 2)}) == math.inf
    assert harness.max_abs_diff(a, {"w": torch.zeros(4)}) == math.inf


# -- the gate: the others' share of the machine -------------------------------------------------------


class _FakeTime:
    """A clock that only moves when slept on, and a load average that follows a script."""

    def __init__(self, monkeypatch, loads=(0.0,)):
        self.now, self.loads, self.slept = 100.0, list(loads), []
        monkeypatch.setattr(harness.os, "getloadavg", self.load)

    def load(self):
        one = self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]
        return one, one, one

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


class _FakeCpu(harness.Cpu):
    """Made-up /proc/stat and own-tree readings on 2 cores: over each second slept, the harness's
    tree uses ``own`` cores and other processes ``others`` (the last pair repeats)."""

    def __init__(self, fake_time, loads):
        super().__init__(machine=self.read_machine, own=self.read_own, cores=2)
        self.time, self.loads = fake_time, list(loads)
        self.busy = self.total = self.own_s = 0.0
        self.seen = fake_time.now

    def advance(self):
        """Run the machine up to the fake clock at the next scripted load."""
        seconds = self.time.now - self.seen
        self.seen = self.time.now
        if seconds:
            own, others = self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]
            self.busy += (own + others) * seconds
            self.total += 2 * seconds
            self.own_s += own * seconds

    def read_machine(self):
        self.advance()
        return self.busy, self.total

    def read_own(self):
        return self.own_s


def test_the_gate_passes_when_only_the_harnesss_own_tree_is_busy(monkeypatch):
    fake = _FakeTime(monkeypatch, [9.0])  # a load average that would have kept the old gate shut
    cpu = _FakeCpu(fake, [(2.0, 0.0)])  # the harness's ranks keep both cores busy, nothing else runs
    gate = harness.wait_for_quiet(0.25, wait_s=30, sample_s=1, clock=fake.clock, sleep=fake.sleep, cpu=cpu)
    assert gate.quiet and gate.waited == 1 and fake.slept == [1]  # one sample
    assert gate.seen == {"by": "others' CPU", "foreign_share": 0.0}


def test_one_light_job_beside_the_run_passes_the_default_threshold(monkeypatch):
    fake = _FakeTime(monkeypatch)
    cpu = _FakeCpu(fake, [(0.1, 0.4)])  # an editor or a notebook kernel: 0.4 of a core
    gate = harness.wait_for_quiet(clock=fake.clock, sleep=fake.sleep, cpu=cpu)
    assert gate.quiet and gate.seen["foreign_share"] == pytest.approx(0.2)


def test_the_gate_refuses_while_other_processes_are_busy(monkeypatch):
    fake = _FakeTime(monkeypatch)
    cpu = _FakeCpu(fake, [(0.6, 1.3)])  # another job keeps 1.3 cores busy
    gate = harness.wait_for_quiet(0.25, wait_s=30, sample_s=1, clock=fake.clock, sleep=fake.sleep, cpu=cpu)
    assert not gate.quiet and gate.waited == 30 and sum(fake.slept) == 30
    assert gate.why == "other processes used 1.3 of 2 cores (more than 0.25 of the machine) for 30 s"
    assert gate.seen["foreign_share"] == pytest.approx(0.65)


def test_the_gate_waits_for_the_other_job_to_end(monkeypatch):
    fake = _FakeTime(monkeypatch)
    cpu = _FakeCpu(fake, [(0.0, 2.0), (0.0, 2.0), (0.0, 2.0), (0.0, 0.1)])
    gate = harness.wait_for_quiet(0.25, wait_s=30, sample_s=1, clock=fake.clock, sleep=fake.sleep, cpu=cpu)
    assert gate.quiet and gate.waited == 4 and gate.seen["foreign_share"] == pytest.approx(0.05)


def test_proc_stat_counts_busy_and_total_cpu_seconds(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice, then a core's own line
    stat.write_text("cpu  100 20 30 400 50 6 7 8 90 9\ncpu0 100 20 30 400 50 6 7 8 90 9\n")
    tick = harness.os.sysconf("SC_CLK_TCK")
    assert harness.proc_stat(str(stat)) == (pytest.approx(171 / tick), pytest.approx(621 / tick))
    assert harness.proc_stat(str(tmp_path / "missing")) is None


def test_the_own_tree_includes_processes_the_harness_started_and_reaped():
    import subprocess

    before = harness.own_cpu_seconds()
    # a child that burns 0.3 s of CPU time (however long that takes here), then is reaped
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.3: pass"], check=True)
    assert harness.own_cpu_seconds() - before >= 0.25


def test_without_proc_stat_the_old_load_gate_decides_and_the_row_says_so(monkeypatch):
    fake = _FakeTime(monkeypatch, [3.0, 2.2, 1.4])
    cpu = harness.Cpu(machine=lambda: None, own=lambda: 0.0)
    gate = harness.wait_for_quiet(max_load=1.5, wait_s=60, clock=fake.clock, sleep=fake.sleep, cpu=cpu)
    assert gate.quiet and gate.waited == 4 and fake.slept == [2, 2]
    assert gate.seen == {"by": "1-minute load average (no /proc/stat)", "load": 1.4}


def test_the_load_gate_gives_up_at_its_bound(monkeypatch):
    fake = _FakeTime(monkeypatch, [2.5])
    gate = harness.wait_for_load(1.5, wait_s=60, poll_s=7, clock=fake.clock, sleep=fake.sleep)
    assert not gate.quiet and gate.seen["load"] == 2.5 and gate.waited == 60
    assert sum(fake.slept) == 60 and max(fake.slept) == 7  # the last wait cut to the bound
    assert gate.why == "1-minute load 2.50 stayed above 1.5 for 60 s (no /proc/stat)"


def test_a_comparison_the_gate_refuses_is_recorded_as_skipped_and_not_run(monkeypatch):
    fake = _FakeTime(monkeypatch)
    cpu = _FakeCpu(fake, [(0.0, 1.5)])

    def never(*args, **kwargs):
        raise AssertionError("a refused comparison must not run")

    comparison = harness.Comparison("ddp/one-bucket", "small", 4, worker=never)
    line = harness.run_comparison(comparison, 11, 2, 3, wait_s=30, clock=fake.clock, sleep=fake.sleep, cpu=cpu)
    assert line["skipped"] == "other processes used 1.5 of 2 cores (more than 0.25 of the machine) for 30 s"
    assert line["gate"]["waited_s"] == 30 and "ratio" not in line and "minitp_ms" not in line
    row = harness.table([line]).splitlines()[-1]
    assert row.startswith("| ddp/one-bucket | small | 4 | skipped: other processes used 1.5 of 2 cores")


def test_a_measured_row_records_the_others_share_during_its_run(monkeypatch):
    import minitp.launcher

    fake = _FakeTime(monkeypatch)
    cpu = _FakeCpu(fake, [(0.0, 0.2)])

    def launch(worker, ranks, *args, timeout, **kwargs):
        assert timeout == 99  # the comparison's 100 s, less the gate's one sample
        cpu.loads = [(1.8, 0.2)]  # while the ranks run (10 s), another job takes 0.2 of a core
        fake.now += 10
        return [_rank([[0.01]] * 3, [[0.02]] * 3)] * ranks

    monkeypatch.setattr(minitp.launcher, "launch", launch)
    line = harness.run_comparison(_comparison(), 3, 1, 0, timeout=100, clock=fake.clock, sleep=fake.sleep, cpu=cpu)
    assert line["gate"] == {"by": "others' CPU", "foreign_share": 0.1, "waited_s": 1.0}
    assert line["foreign_share"] == pytest.approx(0.1) and line["ratio"] == pytest.approx(0.5)
    assert harness.table([line]).splitlines()[-1].endswith("| 0.10 |")


def test_the_command_line_takes_the_gate_and_the_budget():
    args = harness.make_parser().parse_args([])
    assert (args.max_foreign, args.wait, args.max_load, args.budget_s) == (0.25, 30, 1.5, 1200)
    args = harness.make_parser().parse_args(["--max-foreign", "0.4", "--wait", "10", "--budget-s", "600"])
    assert (args.max_foreign, args.wait, args.budget_s) == (0.4, 10, 600)


# -- a run that finishes, written as it goes ----------------------------------------------------------


def _names(n):
    return [harness.Comparison(f"ring/{k}", "tiny", 2, worker=None) for k in range(n)]


def _measured(comparison):
    return {**harness.summarize(comparison, [_rank([[0.01]], [[0.02]])], [0.0, 0.0, 0.0]), "foreign_share": 0.0}


def test_each_row_is_saved_before_the_next_comparison_and_an_error_is_a_row(monkeypatch, tmp_path):
    out = tmp_path / "bench.json"
    calls = []

    def run_comparison(comparison, *args, **kwargs):
        calls.append(comparison.name)
        if comparison.name == "ring/1":
            saved = json.loads(out.read_text())  # the first row is on disk, whole, before this one runs
            assert [x["name"] for x in saved["comparisons"]] == ["ring/0"] and not saved["finished"]
            assert "| ring/0 | tiny | 2 |" in out.with_suffix(".md").read_text()
            raise RuntimeError("a rank died\nits long traceback")
        return _measured(comparison)

    monkeypatch.setattr(harness, "run_comparison", run_comparison)
    lines = harness.main(["--out", str(out)], comparisons=_names(3))
    assert calls == ["ring/0", "ring/1", "ring/2"]  # the error did not end the run
    assert lines[1]["skipped"] == "it raised RuntimeError: a rank died"
    saved = json.loads(out.read_text())
    assert saved["finished"] and saved["planned"] == 3 and len(saved["comparisons"]) == 3
    assert "ratio" in saved["comparisons"][2]
    assert not list(tmp_path.glob("*.tmp"))


def test_the_budget_skips_the_comparisons_left_with_a_reason(monkeypatch, tmp_path):
    now = [0.0]
    timeouts = []

    def run_comparison(comparison, *args, timeout, wait_s, **kwargs):
        timeouts.append((timeout, wait_s))
        now[0] += 500  # each comparison takes 500 s
        return _measured(comparison)

    monkeypatch.setattr(harness, "run_comparison", run_comparison)
    lines = harness.main(["--out", str(tmp_path / "b.json"), "--budget-s", "1200"], comparisons=_names(5),
                         clock=lambda: now[0])
    assert ["skipped" in x for x in lines] == [False, False, False, True, True]
    assert lines[3]["skipped"] == "the run's budget of 1200 s was spent"
    assert timeouts == [(600, 30), (600, 30), (200, 30)]  # the last one cut to the budget left
    assert json.loads((tmp_path / "b.json").read_text())["finished"]


def test_a_comparison_the_budget_cuts_short_is_skipped_with_that_reason(monkeypatch, tmp_path):
    from minitp.launcher import LaunchTimeout

    now = [0.0]

    def run_comparison(comparison, *args, timeout, **kwargs):
        now[0] += timeout
        raise LaunchTimeout(f"launch timed out after {timeout:g} s", {})

    monkeypatch.setattr(harness, "run_comparison", run_comparison)
    lines = harness.main(["--out", str(tmp_path / "b.json"), "--budget-s", "100"], comparisons=_names(2),
                         clock=lambda: now[0])
    assert [x["skipped"] for x in lines] == ["the run's budget of 100 s ran out while it ran",
                                            "the run's budget of 100 s was spent"]


# -- the same timing and the same work on every row ---------------------------------------------------


def _all_comparisons():
    import importlib

    return [c for name in harness.BENCHMARKS
            for c in importlib.import_module(f"bench_{name}").comparisons(["tiny", "small"])]


def test_every_row_runs_at_least_9_rounds_after_2_warm_up_steps():
    comparisons = _all_comparisons()
    assert {c.model for c in comparisons} >= {"tiny", "small"}
    for c in comparisons:
        timing = harness.timing_for(c, harness.ROUNDS, harness.STEPS, harness.WARMUP)
        assert timing["rounds"] >= 9 and timing["warmup"] >= 2 and timing["steps"] >= 1, (c.name, c.model, timing)


def _torch_ddp_settings():
    import bench_ddp

    from minitp.models import build_model, get_config

    wrapped = bench_ddp.torch_ddp(build_model(get_config("tiny"), seed=0), 2**20)
    return {"broadcast_buffers": wrapped.broadcast_buffers, "as_views": wrapped.gradient_as_bucket_view}


def test_pytorchs_ddp_broadcasts_no_buffer_as_minitps_does_not():
    results = minitp.launch(_torch_ddp_settings, 2, echo=False)
    assert all(r == {"broadcast_buffers": False, "as_views": True} for r in results)


def test_torch_runs_minitps_own_zero_bubble_table():
    import bench_pp
    from torch.distributed.pipelining.schedules import _validate_schedule

    from minitp.pp_schedules import zero_bubble_h1

    table = zero_bubble_h1(2, bench_pp.MICROBATCHES)
    order = bench_pp.torch_actions(table)
    # the same actions in the same order, B as torch's input gradient "I"
    assert [[str(a) for a in order[r]] for r in (0, 1)] == [
        [f"{r}{'I' if a.kind == 'B' else a.kind}{a.microbatch}" for a in table[r]] for r in (0, 1)]
    assert _validate_schedule(order, 2, 2, bench_pp.MICROBATCHES) == {0: 0, 1: 1}  # torch accepts it whole


def _trivial(offset, rounds, steps, warmup):
    """Both sides add 1 to a tensor each step and 10 each optimizer step; the torch side starts
    ``offset`` apart. Records the order the phases ran in."""
    state, order = {"minitp": torch.zeros(3), "torch": torch.full((3,), float(offset))}, []

    def side(name):
        def step(i):
            order.append((name, "step", i))
            state[name] += 1

        def optimize(i):
            order.append((name, "optimize", i))
            state[name] += 10
        return harness.Side(step, lambda: {"x": state[name]}, optimize)

    return {**harness.time_sides({n: side(n) for n in harness.SIDES}, rounds, steps, warmup), "order": order}


def test_time_sides_warms_up_alternates_the_order_times_each_phase_and_compares_the_end():
    results = minitp.launch(_trivial, 2, 0.0, 3, 2, 1, echo=False)
    order = results[0]["order"]
    # warm-up (1 step each), then rounds of 2 steps: minitp first, then torch first, then minitp first
    who = [name for name, phase, _ in order if phase == "step"]
    assert who == ["minitp", "torch"] + ["minitp"] * 2 + ["torch"] * 4 + ["minitp"] * 4 + ["torch"] * 2
    # each step is followed by its own optimizer step, on the same batch
    assert all(order[k + 1] == (name, "optimize", i) for k, (name, phase, i) in enumerate(order) if phase == "step")
    assert [i for name, phase, i in order if name == "torch" and phase == "step"] == list(range(7))
    for r in results:
        for phase in harness.PHASES:
            assert len(r["times"][phase]["minitp"]) == 3 and len(r["times"][phase]["minitp"][0]) == 2
    assert results[0]["param_diff"] == 0.0
    apart = minitp.launch(_trivial, 2, 0.5, 1, 1, 0, echo=False)
    with pytest.raises(harness.Diverged):
        harness.summarize(_comparison(), list(apart), [0.0, 0.0, 0.0])
