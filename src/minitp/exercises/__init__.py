"""Checkers the notebook exercises call. Each runs the learner's answer (on several processes when
that is the point), compares it with minitp's own, and raises ``ExerciseError`` with a message that
says what is wrong and hints at why; it prints one line when the answer is right."""

from __future__ import annotations


class ExerciseError(AssertionError):
    """The answer is wrong or missing; the message says how."""


def not_implemented(exc: BaseException) -> bool:
    """True when the answer is still the learner's stub."""
    return isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc)


def passed(name: str, detail: str = "") -> None:
    print(f"[ok] {name}: correct" + (f" ({detail})" if detail else ""))
