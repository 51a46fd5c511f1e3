"""Worked problems: an estimate a learner works out by hand from the hardware sheet
(``minitp.cost.H100``) and the chapter's formulas, checked against ``minitp.cost`` within a
tolerance.

A wrong estimate is told too high or too low; a known slip (a factor 2, bits for bytes, GB for GiB,
a chapter's own) is named when the ratio shows it; the expected value follows ``wrong``'s levels
(the second wrong try, or ``show_expected``). Each chapter's ``check_problem(n, answer)`` holds its
problems.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from minitp.exercises import ExerciseError, call_answer, passed, wrong

SLIPS = {8.0: "off by 8: bits for bytes?", 1 / 8: "off by 8: bytes for bits?",
         2**30 / 1e9: "off by 1.07: GiB where GB is meant?",
         1e9 / 2**30: "off by 1.07: GB where GiB is meant?",
         1e3: "off by 1000: check the unit asked for",
         1e-3: "off by 1000: check the unit asked for"}


@dataclass
class Problem:
    """One worked problem: ``want()`` computes the answer from ``minitp.cost``; ``unit`` is what the
    answer is in ("" for a ratio); ``slips`` maps a ratio answer/expected to the mistake it
    shows."""

    name: str
    want: Callable[[], float]
    unit: str
    slips: dict[float, str] = field(default_factory=dict)
    rel: float = 0.05


def _number(x: float, unit: str) -> str:
    text = f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"
    return f"{text} {unit}" if unit else text


def check_estimate(problem: Problem, answer) -> None:
    """Call the learner's ``answer()`` and compare its number with ``problem.want()``."""
    got, want = call_answer(problem.name, answer), problem.want()
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
        raise ExerciseError(f"{problem.name}: the answer must be a finite number"
                            + (f", in {problem.unit}" if problem.unit else "") + f"; got {got!r}")
    if abs(got - want) <= problem.rel * abs(want):
        passed(problem.name,
               f"{_number(got, problem.unit)}, within {problem.rel:.0%} of minitp.cost's "
                             f"{_number(want, problem.unit)}")
        return
    ratio = got / want if want else math.inf
    named = next((why for r, why in {**SLIPS, **problem.slips}.items()
                  if abs(ratio / r - 1) <= problem.rel), None)
    side = "too high" if got > want else "too low"
    raise wrong(problem.name, f"{_number(got, problem.unit)} is {side}"
                + (f": {named}" if named else "; check each factor against the hints"),
                _number(want, problem.unit))


def check_problem(problems: dict[int, Problem], number: int, answer) -> None:
    """``check_estimate`` for problem ``number`` of a chapter's ``problems``."""
    if number not in problems:
        raise ExerciseError(
            f"there is no problem {number!r} here; the problems are {sorted(problems)}")
    check_estimate(problems[number], answer)
