"""The checks of "hints in levels" that several chapters' tests share (``minitp.exercises.wrong``)."""

import pytest

from minitp.exercises import ExerciseError


def first_then_second(check, *args, expected: str, **kwargs) -> None:
    """``check(*args, **kwargs)`` fails twice: the first wrong try names the mistake, hides ``expected``
    and says how to see it; the second shows it. (A value under 4 characters, "5", may also occur in
    the question itself, so only longer ones are looked for in the first message.)"""
    with pytest.raises(ExerciseError) as first:
        check(*args, **kwargs)
    assert "Expected:" not in str(first.value) and "show_expected" in str(first.value)
    assert len(expected) < 4 or expected not in str(first.value)
    with pytest.raises(ExerciseError) as second:
        check(*args, **kwargs)
    assert f"Expected: {expected}" in str(second.value)
