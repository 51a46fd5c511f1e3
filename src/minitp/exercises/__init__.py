"""Checkers the notebook exercises call. Each runs the learner's answer (on several processes when
that is the point), compares it with minitp's own, and raises ``ExerciseError`` with a message that
says what is wrong and hints at why; it prints one line when the answer is right.

In a notebook an ``ExerciseError`` shows as its message alone (``_render_traceback_``): no frame of
the checker's own code. A rank's failure keeps only the frames of the learner's code
(``learner_frames``). How learner copies and the website treat the cells that call a checker:
``minitp.exercises.student``.

Hints come in levels (``wrong``): a first wrong try of a check names the mistake and hints at why;
the expected value (the number, the table, the group) shows from the second wrong try of the same
check on, or at once after ``show_expected(name)``. So an answer cannot be found by pasting back
what a check printed.
"""

from __future__ import annotations

import dis
import os
import re
import traceback

from minitp.launcher import LaunchTimeout, RankError, launch

HANG_HINT = "Every rank must join every collective (the same ones, in the same order)."
LONGEST = 400  # characters of a rank's error line shown
NOT_DONE = "not done yet (the function still raises NotImplementedError)."

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../minitp
_MACHINERY = (os.path.join(_PACKAGE, "exercises") + os.sep, os.path.join(_PACKAGE, "launch"))
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line \d+, in ')
_COMM = os.path.join(_PACKAGE, "comm.py")
# comm refused its arguments (``comm._check``)
_REFUSED = re.compile(r"^(TypeError|ValueError): comm\.\w+: ")


_WRONG_TRIES: dict[str, int] = {}  # check name -> wrong tries so far, in this kernel
_SHOWN: set[str] = set()  # check names whose expected value the learner asked to see


class ExerciseError(AssertionError):
    """The answer is wrong or missing; the message says how."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for it: the message, not the checker's frames that raised it."""
        lines = str(self).splitlines() or [""]
        return [f"\x1b[1;31mExerciseError\x1b[0m: {lines[0]}", *lines[1:]]


def not_implemented(exc: BaseException) -> bool:
    """True when the answer is still the learner's stub."""
    return isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc)


def show_expected(name: str) -> None:
    """From now on, a wrong answer to the check ``name`` (as its messages begin: ``"split the
    batch"``) shows the expected value at once, not only from the second wrong try on."""
    _SHOWN.add(name)
    print(f"{name}: a wrong answer now shows the expected value too.")


def reset_tries() -> None:
    """Forget every wrong try and every ``show_expected``: a fresh kernel's state (for tests)."""
    _WRONG_TRIES.clear()
    _SHOWN.clear()


def wrong(name: str, mistake: str, expected: str = "") -> ExerciseError:
    """The error for a wrong answer to the check ``name``, to raise. ``mistake`` says what is wrong
    and hints at why; ``expected`` (the expected value, as text) is added from the second wrong try
    of this check on, or after ``show_expected(name)``. A first try with something to show says how
    to see it."""
    _WRONG_TRIES[name] = tries = _WRONG_TRIES.get(name, 0) + 1
    message = mistake if mistake.startswith(name) else f"{name}: {mistake}"
    if expected and (tries >= 2 or name in _SHOWN):
        message += f"\nExpected: {expected}"
    elif expected:
        message += (f"\n(Try again: a second wrong try shows the expected value, "
                    f"or call minitp.exercises.show_expected({name!r}) to see it now.)")
    return ExerciseError(message)


def _names_used(code) -> tuple[set[str], set[str]]:
    """(global names, attribute names) that ``code`` and the functions defined in it load; a name
    imported inside them (``from minitp.pp import one_f_one_b``) counts as an attribute of its
    module."""
    globals_, attributes = set(), set()
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            globals_.add(instruction.argval)
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM"):  # m.f, or f from m
            attributes.add(instruction.argval)
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            inner = _names_used(const)
            globals_ |= inner[0]
            attributes |= inner[1]
    return globals_, attributes


def bound_names(fn) -> dict:
    """What the names ``fn``'s code uses are bound to: its module's globals, and the cells it closes
    over."""
    code, bound = getattr(fn, "__code__", None), dict(getattr(fn, "__globals__", {}))
    for var, cell in zip(code.co_freevars if code is not None else (),
                         getattr(fn, "__closure__", None) or ()):
        try:
            bound[var] = cell.cell_contents
        except ValueError:  # pragma: no cover - a cell not filled yet
            pass
    return bound


def refuse_own(name: str, fn, *own) -> None:
    """Refuse an answer that is one of minitp's own functions ``own``, or whose code calls one (by
    its name as an attribute, ``pp.one_f_one_b``, imported inside the answer, or as a global bound
    to it): the exercise is to write it.
    Read from the answer's code, before it runs; nothing is replaced."""
    code = getattr(fn, "__code__", None)
    globals_, attributes = _names_used(code) if code is not None else (set(), set())
    bound = bound_names(fn)
    # the names the answer closes over
    globals_ |= set(code.co_freevars if code is not None else ())
    for solution in own:
        where = f"{solution.__module__}.{solution.__qualname__}"
        if fn is solution:
            raise ExerciseError(
                f"{name}: that is {where}, minitp's own answer: the exercise is to write it. "
                "Replace the stub with your own code.")
        called = solution.__name__ in attributes or (
            solution.__name__ in globals_ and bound.get(solution.__name__) is solution)
        if called:
            raise ExerciseError(
                f"{name}: your code calls {where}, minitp's own answer: the exercise is to write "
                "it.")


def refuse_own_deep(name: str, fn, *own, depth: int = 3, _seen: set | None = None) -> None:
    """``refuse_own`` on ``fn`` and on what it uses that was written beside it (in the answer's own
    module: its helpers, the forward and backward of its autograd Functions, by global name or
    closed over), a few levels down: an answer that hands the work to its own helper that calls
    minitp's is refused too."""
    import torch

    seen = set() if _seen is None else _seen
    if id(fn) in seen or depth < 0:
        return
    seen.add(id(fn))
    refuse_own(name, fn, *own)
    code, home = getattr(fn, "__code__", None), getattr(fn, "__module__", None)
    if code is None:
        return
    bound = bound_names(fn)
    names = set(code.co_names) | set(code.co_freevars)
    names |= {n for c in code.co_consts if hasattr(c, "co_names") for n in c.co_names}
    for used in sorted(names):
        obj = bound.get(used)
        if obj is None or getattr(obj, "__module__", None) != home:
            continue
        if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
            for part in (obj.forward, obj.backward):
                refuse_own_deep(name, part, *own, depth=depth - 1, _seen=seen)
        elif callable(obj):
            refuse_own_deep(name, obj, *own, depth=depth - 1, _seen=seen)


def passed(name: str, detail: str = "") -> None:
    print(f"[ok] {name}: correct" + (f" ({detail})" if detail else ""))


def _is_machinery(path: str) -> bool:
    """A frame of the checkers, of launch, of the interpreter's own modules or of torch."""
    path = os.path.abspath(path) if not path.startswith("<") else path
    if path.startswith(_MACHINERY):
        return True
    return f"{os.sep}torch{os.sep}" in path or path.startswith(os.path.dirname(os.__file__)
                                                               + os.sep)


def learner_frames(remote_traceback: str) -> str:
    """A traceback's text with the checker's and launch's frames (and torch's, Python's) taken out.

    Frames of the learner's code (a notebook cell, a script) and of minitp's library stay; the frame
    where the error was raised stays whatever it is, unless ``minitp.comm`` refused the arguments it
    was given: then the learner's call is the last frame. Headers and the exception lines stay.
    """
    lines = remote_traceback.rstrip("\n").splitlines()
    blocks: list[tuple[str | None, list[str]]] = []  # (file of the frame or None, its lines)
    for line in lines:
        match = _FRAME.match(line)
        if match:
            blocks.append((match.group("file"), [line]))
        elif line.startswith("    ") and blocks and blocks[-1][0] is not None:
            blocks[-1][1].append(line)  # the frame's source line (and its ^^^ marks)
        else:
            blocks.append((None, [line]))
    refused = bool(lines) and _REFUSED.match(lines[-1]) is not None
    blocks = [(path, block) for path, block in blocks if not (refused and path
                                                              and os.path.abspath(path) == _COMM)]
    kept: list[str] = []
    for index, (path, block) in enumerate(blocks):
        innermost = path is not None and (index + 1 == len(blocks) or blocks[index + 1][0] is None)
        if path is None or innermost or not _is_machinery(path):
            kept.extend(block)
    return "\n".join(_shortened(line) for line in kept) + "\n"


def _shortened(line: str) -> str:
    return f"{line[:LONGEST]} … ({len(line):,} characters)" if len(line) > LONGEST else line


def call_answer(name: str, answer, *args, hint: str = "", **kwargs):
    """Call the learner's ``answer(*args, **kwargs)`` in this process for a checker. The stub
    becomes ``ExerciseError`` "not done yet"; any other error becomes ``ExerciseError`` naming it,
    with the frames of the learner's code only (and ``hint`` after it)."""
    try:
        return answer(*args, **kwargs)
    except NotImplementedError:
        raise ExerciseError(
            f"{name}: {NOT_DONE} Replace the stub with your answer and run the check again.") \
            from None
    except Exception as error:
        frames = traceback.format_exception(type(error), error, error.__traceback__)
        text = learner_frames("".join(frames))
        raise ExerciseError(f"{name}: your code raised {type(error).__name__}: {error}"
                            + (f"\n{hint}" if hint else "") + f"\n\nWhere:\n{text}") from None


def run_answer(worker, nprocs: int, args: tuple, name: str, timeout: float = 30.0, hint: str = "",
               hang_hint: str = HANG_HINT):
    """Launch ``worker(*args)`` on ``nprocs`` ranks for a checker. A stub, a crash or a hang becomes
    one ``ExerciseError`` that says which: "not done yet", the failing rank's error and the frames
    of the learner's code (with ``hint`` after it), or the call each stuck rank waits in
    (``hang_hint`` first)."""
    try:
        return launch(worker, nprocs, *args, timeout=timeout, echo=False)
    except RankError as err:
        if not_implemented(err):
            raise ExerciseError(f"{name}: {NOT_DONE} Replace the stub with your answer and run "
                                "the check again.") from None
        last = (err.remote_traceback.strip().splitlines()[-1] if err.remote_traceback.strip()
                else str(err))
        last = _shortened(last)  # DTensor's errors print every tensor's spec on one line
        raise ExerciseError(f"{name}: on {nprocs} ranks, rank {err.rank} raised {last}"
                            + (f"\n{hint}" if hint else "")
                            + f"\n\nRank {err.rank}'s traceback (your "
                              f"code):\n{learner_frames(err.remote_traceback)}") \
            from None
    # the summary: the call each stuck rank waits in, the likely mistake
    except LaunchTimeout as err:
        raise ExerciseError(
            f"{name}: the run on {nprocs} ranks hung and was stopped after {timeout:g} s."
            + (f" {hang_hint}" if hang_hint else "") + f"\n{err.summary}") from None


__all__ = ["ExerciseError", "HANG_HINT", "NOT_DONE", "bound_names", "call_answer", "learner_frames",
           "not_implemented", "passed", "refuse_own", "refuse_own_deep", "reset_tries",
           "run_answer", "show_expected", "wrong"]
