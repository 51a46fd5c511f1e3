"""Worked problems (``minitp.exercises.problems``): each chapter's answers come from minitp.cost, a right
estimate passes within 5 %, a wrong one is told too high or too low, a known slip by name, and the
expected value shows only from the second wrong try."""

import importlib
import pkgutil

import pytest

import minitp.exercises
from minitp import cost
from minitp.exercises import ExerciseError, ch00, ch01, ch02, ch03, ch05
from minitp.models import LLAMA3_8B

# every chapter module that holds worked problems (chNN.py with a PROBLEMS table)
CHAPTERS = {name: module for name in sorted(m.name for m in pkgutil.iter_modules(minitp.exercises.__path__))
            if name[:2] == "ch" and name[2:].isdigit()
            and hasattr(module := importlib.import_module(f"minitp.exercises.{name}"), "PROBLEMS")}


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_every_problem_has_three_or_more_and_passes_with_minitp_costs_answer(chapter, capsys):
    module = CHAPTERS[chapter]
    assert len(module.PROBLEMS) >= 3
    for number, problem in module.PROBLEMS.items():
        module.check_problem(number, lambda p=problem: p.want() * (1 + p.rel * 0.6))  # inside the tolerance
        assert f"[ok] {problem.name}" in capsys.readouterr().out


def test_the_chapters_with_problems_are_found():
    assert {"ch00", "ch01", "ch02", "ch03", "ch05"} <= set(CHAPTERS)


def test_the_answers_are_the_chapters_numbers_by_hand():
    h = cost.H100
    assert ch00.PROBLEMS[1].want() == pytest.approx(8 * 5e-6 * 450e9 / 1e6)  # 18 MB
    assert ch00.PROBLEMS[2].want() == pytest.approx(63 * 10e-6 + 63 / 64 * 2 * LLAMA3_8B.num_params() / 50e9)
    assert ch00.PROBLEMS[3].want() == pytest.approx(2 * 1023 * 10e-3)  # ms
    assert h.intra.bytes_per_s == 450e9 and h.inter.bytes_per_s == 50e9
    assert ch03.block_params(LLAMA3_8B) == 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # 218 M
    sent = 4 * 2 * 7 / 8 * 8192 * 4096 * 2 / 450e9  # 4 all-reduces of one bf16 activation
    compute = 8192 * (6 * 218_103_808 + 12 * 4096 * 8192) / 8 / (989e12 * 0.6)
    assert ch03.PROBLEMS[1].want() == pytest.approx(sent / compute) == pytest.approx(0.3535, abs=1e-4)
    assert ch03.PROBLEMS[3].want() == 218_103_808 / 8192
    rate = 989e12 * 0.6
    assert ch01.PROBLEMS[1].want() == pytest.approx(2 * 7 / 8 * 2 / 450e9 * rate / 4)  # Ψ cancels: 1,154
    assert ch01.PROBLEMS[2].want() == pytest.approx(2 * 63 / 64 * 2 / 50e9 * rate / 4)  # 11,683
    assert ch02.PROBLEMS[1].want() == pytest.approx(3 * 63 / 64 * 2 / 50e9 * rate / 6) == ch01.PROBLEMS[2].want()
    assert ch02.PROBLEMS[3].want() == 18 and ch05.PROBLEMS[1].want() == 133 and ch05.PROBLEMS[2].want() == 34


def test_a_wrong_estimate_names_its_slip_and_shows_the_expected_value_only_the_second_time():
    half = ch00.PROBLEMS[2].want() * 2  # the all-reduce's time
    with pytest.raises(ExerciseError) as first:
        ch00.check_problem(2, lambda: half)
    assert "too high: that is the all-reduce" in str(first.value) and "Expected" not in str(first.value)
    assert f"{ch00.PROBLEMS[2].want():.4g}" not in str(first.value)
    with pytest.raises(ExerciseError, match=r"Expected: 0\.3168 s"):
        ch00.check_problem(2, lambda: half)
    with pytest.raises(ExerciseError, match="off by 8: bits for bytes"):
        ch00.check_problem(1, lambda: ch00.PROBLEMS[1].want() * 8)
    with pytest.raises(ExerciseError, match="too low; check each factor"):
        ch00.check_problem(3, lambda: 1.0)


def test_a_problem_refuses_a_non_number_a_stub_and_an_unknown_number():
    with pytest.raises(ExerciseError, match="must be a finite number, in MB; got '18'"):
        ch00.check_problem(1, lambda: "18")
    with pytest.raises(ExerciseError, match="not done yet"):
        ch00.check_problem(1, lambda: (_ for _ in ()).throw(NotImplementedError()))
    with pytest.raises(ExerciseError, match=r"there is no problem 9 here; the problems are \[1, 2, 3\]"):
        ch00.check_problem(9, lambda: 1.0)
