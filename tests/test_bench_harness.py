"""The benchmark harness's logic (benchmarks/harness.py), on made-up timings and a trivial run:
no benchmark runs here."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import minitp

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import harness  # noqa: E402

KEYS = {"name", "minitp_ms", "torch_ms", "ratio", "range", "model", "ranks", "machine"}


def _comparison(tol=1e-4):
    return harness.Comparison("ddp/several-buckets", "tiny", 2, worker=None, tol=tol)


def _rank(minitp, torch_, diff=0.0):
    """One rank's time_sides result: per side, rounds of step times in seconds."""
    return {"times": {"minitp": minitp, "torch": torch_}, "param_diff": diff, "threads": 1}


def test_a_step_counts_its_slowest_rank_and_a_side_the_median_of_its_rounds():
    per_rank = [_rank([[0.010, 0.010], [0.030, 0.030], [0.020, 0.020]], [[0.020, 0.020]] * 3),
                _rank([[0.012, 0.012], [0.010, 0.010], [0.010, 0.010]], [[0.010, 0.040]] * 3)]
    line = harness.summarize(_comparison(), per_rank, [0.5, 0.5, 0.5])
    # slowest rank per step: minitp rounds 12, 30, 20 ms (median 20); torch steps 20 and 40 ms (median 30)
    assert line["minitp_ms"] == pytest.approx(20.0)
    assert line["torch_ms"] == pytest.approx(30.0)
    assert line["ratio"] == pytest.approx(0.667, abs=1e-3)
    assert line["range"] == pytest.approx([0.4, 1.0])  # the rounds' own ratios: 12/30, 30/30, 20/30
    assert line["target"] == harness.TARGETS["ddp"]


def test_the_json_line_has_its_keys_and_is_one_line():
    line = harness.summarize(_comparison(), [_rank([[0.01]], [[0.01]])], [0.0, 0.0, 0.0])
    assert KEYS <= line.keys()
    assert {"cores", "torch"} <= line["machine"].keys()
    assert "\n" not in json.dumps(line)


@pytest.mark.parametrize("diff", [1e-3, math.inf, math.nan])
def test_sides_that_diverge_fail_the_comparison(diff):
    with pytest.raises(harness.Diverged, match="parameters differ"):
        harness.summarize(_comparison(tol=1e-4), [_rank([[0.01]], [[0.01]]), _rank([[0.01]], [[0.01]], diff)],
                          [0.0, 0.0, 0.0])


def test_parameters_that_differ_in_names_or_shapes_count_as_diverged():
    a = {"w": torch.zeros(2, 2)}
    assert harness.max_abs_diff(a, {"w": torch.full((2, 2), 0.5)}) == 0.5
    assert harness.max_abs_diff(a, {"v": torch.zeros(2, 2)}) == math.inf
    assert harness.max_abs_diff(a, {"w": torch.zeros(4)}) == math.inf


def _trivial(offset, rounds, steps, warmup):
    """Both sides add 1 to a tensor each step; the torch side starts ``offset`` apart. Records the
    order the sides ran in."""
    state, order = {"minitp": torch.zeros(3), "torch": torch.full((3,), float(offset))}, []

    def side(name):
        def step(i):
            order.append((name, i))
            state[name] += 1
        return harness.Side(step, lambda: {"x": state[name]})

    return {**harness.time_sides({n: side(n) for n in harness.SIDES}, rounds, steps, warmup), "order": order}


def test_time_sides_warms_up_alternates_the_order_and_compares_the_end():
    results = minitp.launch(_trivial, 2, 0.0, 3, 2, 1, echo=False)
    order = results[0]["order"]
    # warm-up (1 step each), then rounds of 2 steps: minitp first, then torch first, then minitp first
    who = [name for name, _ in order]
    assert who == ["minitp", "torch"] + ["minitp"] * 2 + ["torch"] * 4 + ["minitp"] * 4 + ["torch"] * 2
    assert [i for name, i in order if name == "torch"] == list(range(7))  # each side walks its own batches
    assert all(len(r["times"]["minitp"]) == 3 and len(r["times"]["minitp"][0]) == 2 for r in results)
    assert results[0]["param_diff"] == 0.0
    apart = minitp.launch(_trivial, 2, 0.5, 1, 1, 0, echo=False)
    with pytest.raises(harness.Diverged):
        harness.summarize(_comparison(), list(apart), [0.0, 0.0, 0.0])
