"""Checkers the notebook exercises call. Each runs the learner's answer (on several processes when
that is the point), compares it with minitp's own, and raises ``ExerciseError`` with a message that
says what is wrong and hints at why; it prints one line when the answer is right."""

from __future__ import annotations

from minitp.launch import LaunchTimeout, RankError, launch

HANG_HINT = "Every rank must join every collective (the same ones, in the same order)."


class ExerciseError(AssertionError):
    """The answer is wrong or missing; the message says how."""


def not_implemented(exc: BaseException) -> bool:
    """True when the answer is still the learner's stub."""
    return isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc)


def passed(name: str, detail: str = "") -> None:
    print(f"[ok] {name}: correct" + (f" ({detail})" if detail else ""))


def run_answer(worker, nprocs: int, args: tuple, name: str, timeout: float = 30.0, hint: str = "",
               hang_hint: str = HANG_HINT):
    """Launch ``worker(*args)`` on ``nprocs`` ranks for a checker. A stub, a crash or a hang becomes
    one ``ExerciseError`` that says which: "not done yet", the failing rank's error and traceback
    (with ``hint`` after it), or which ranks never finished (with ``hang_hint``)."""
    try:
        return launch(worker, nprocs, *args, timeout=timeout, echo=False)
    except RankError as err:
        if not_implemented(err):
            raise ExerciseError(f"{name}: not done yet (the function still raises NotImplementedError). "
                                "Replace the stub with your answer and run the check again.") from None
        last = err.remote_traceback.strip().splitlines()[-1] if err.remote_traceback.strip() else str(err)
        raise ExerciseError(f"{name}: on {nprocs} ranks, rank {err.rank} raised {last}"
                            + (f"\n{hint}" if hint else "") + f"\n\nIts traceback:\n{err.remote_traceback}") from None
    except LaunchTimeout as err:
        stuck = ", ".join(f"rank {r}" for r in sorted(err.stacks))
        raise ExerciseError(f"{name}: the run on {nprocs} ranks hung ({stuck} never finished) and was stopped "
                            f"after {timeout:g} s. {hang_hint}") from None
