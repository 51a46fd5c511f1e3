"""Chapter 08's worked problems: the answers are the numbers the solutions work out by hand, each known
slip is named, and the numbers the solutions state are the checkers' own."""

import json
import math
from pathlib import Path

import pytest
from hint_levels import first_then_second as _first_then_second

from minitp.exercises import ExerciseError, ch08

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "08_expert_parallel.ipynb"


def test_the_problems_answers_are_the_chapters_numbers_by_hand():
    from minitp import cost

    h = cost.H100
    # 1: Mixtral's layer, ep = 8 over InfiniBand: 2·(7/8)·k·T·D·2 bytes at 50 GB/s against k·T·6·D·Fe FLOPs
    transfer = 2 * 7 / 8 * 2 * 4096 * 4096 * 2 / 50e9
    compute = 2 * 4096 * 6 * 4096 * 14336 / (989e12 * 0.6)
    assert ch08.PROBLEMS[1].want() == pytest.approx(transfer / compute) == pytest.approx(0.4829, abs=1e-4)
    assert h.inter.bytes_per_s == 50e9 and h.flops_per_s == 989e12 and h.efficiency == 0.6
    # the crossover width: transfer = compute at Fe = 6,923
    assert 14336 * ch08.PROBLEMS[1].want() == pytest.approx(6923, abs=1)
    # 2: 7168 FP8 bytes to each node of its experts but its own: 8·(1 - C(224,8)/C(256,8))·7/8 nodes
    nodes = 8 * (1 - math.comb(224, 8) / math.comb(256, 8))
    assert ch08.PROBLEMS[2].want() == pytest.approx(7168 * nodes * 7 / 8) == pytest.approx(33208, abs=1)
    assert nodes == pytest.approx(5.29, abs=0.01)
    by_hand = 7168 * 8 * (1 - (7 / 8) ** 8) * 7 / 8  # experts drawn with replacement: within 5 %
    assert abs(by_hand / ch08.PROBLEMS[2].want() - 1) < 0.05
    # 3: C = 1.25·4096·2/8 = 1280 per expert: tokens 0..1279 keep both, the rest none
    assert ch08.PROBLEMS[3].want() == 1 - 1280 / 4096 == 0.6875


@pytest.mark.parametrize("number, factor, message", [
    (1, 0.5, "the dispatch alone"),
    (1, 8 / 7, r"\(ep-1\)/ep"),
    (1, 1 / 9, "NVLink's 450 GB/s"),
    (1, 3.0, "6·D·Fe FLOPs"),
    (1, 1 / 0.6, "60 % of the peak"),
    (1, 2 / 3, "forward and backward together"),
    (2, 56448 / 33208.057, "one row per assignment"),
    (2, 8 / 7, "own node is not crossed"),
    (2, 2.0, "FP8"),
    (2, 22761.157 / 33208.057, "the limit of 4 nodes"),
    (3, 0.3125 / 0.6875, "the share that keeps its experts"),
    (3, (1 - 640 / 4096) / 0.6875, "each token makes k assignments"),
    (3, 0.75 / 0.6875, "the capacity factor"),
])
def test_each_problems_slip_is_named(number, factor, message):
    want = ch08.PROBLEMS[number].want()
    with pytest.raises(ExerciseError, match=message):
        ch08.check_problem(number, lambda: want * factor)


def test_a_problem_shows_its_expected_value_only_from_the_second_try():
    _first_then_second(ch08.check_problem, 2, lambda: 1.0, expected="33,208 bytes")




def _prose() -> str:
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    return " ".join("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())


def test_the_solutions_state_the_checkers_numbers():
    from minitp import cost

    text, h = _prose(), cost.H100
    sent = cost.moe_all_to_all_bytes(4096, 4096, 2, 8, 2, 2, backward=False)
    transfer = (sent["dispatch"] + sent["combine"]) / h.inter.bytes_per_s
    compute = cost.compute_time(2 * 4096 * 2 * 3 * 4096 * 14336, h)
    assert f"{(sent['dispatch'] + sent['combine']) / 1e6:.0f} MB, {transfer * 1e3:.2f} ms at" in text
    assert f"{2 * 4096 * 6 * 4096 * 14336 / 1e12:.1f} \\times 10^{{12}}$ FLOPs, {compute * 1e3:.2f} ms" in text
    assert f"about **{ch08.PROBLEMS[1].want():.2f}**" in text
    assert f"$F_e \\approx$ {round(14336 * ch08.PROBLEMS[1].want(), -2):,.0f}" in text
    nodes = cost.expected_nodes_per_token(256, 8, 8)
    limited = cost.expected_nodes_per_token(256, 8, 8, 4) * 7 / 8
    per_assignment = 8 * 63 / 64 * 7168
    assert f"reaches {nodes:.2f} nodes, {nodes * 7 / 8:.2f} of them not its own" in text
    assert f"= **{ch08.PROBLEMS[2].want():,.0f} bytes**" in text
    assert f"would be $7.875 \\times 7168$ = {per_assignment:,.0f}" in text
    assert f"saves {per_assignment / ch08.PROBLEMS[2].want():.1f} times" in text
    assert f"(section 4: {limited:.2f} others) saves another {nodes * 7 / 8 / limited:.2f} times, to " \
           f"{ch08._dispatch_bytes_per_token(4):,.0f} bytes" in text
    assert f"neither: **{ch08.PROBLEMS[3].want():.4f}**" in text and "= 1280. Both experts" in text
