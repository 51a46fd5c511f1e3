"""Start N local ranks, wait for them, and bring back what happened: the parent's side of
``launch``.

The function and its arguments are shipped by value (cloudpickle) to processes forked on Linux
(spawned where torch sees a GPU, or when asked). Each rank writes its result, stdout and stderr to
files in the run's temporary folder (``worker.run_rank``); the parent polls them until every rank
has finished, one has failed (``RankError``: a rank that died is the cause over the survivors'
errors), or time is up (``LaunchTimeout``: where each rank waits, from ``stuck``). Whatever the
exit, no rank and no folder is left behind, a SIGTERM to the parent included.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import threading
import time
import warnings

import cloudpickle

from minitp.launcher import guard
from minitp.launcher import progress as _progress
from minitp.launcher.results import LaunchError, LaunchTimeout, RankError, Results
from minitp.launcher.stuck import call_line, dump_stacks, likely_mistake
from minitp.launcher.worker import run_rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_GRACE_S = 0.5  # after a rank raises, how long to watch for a rank that died (the likelier cause)


def run_local(fn, nprocs: int, args: tuple, *, backend: str, timeout: float,
              start_method: str | None, echo: bool, keep_sigterm: bool) -> Results:
    """Run ``fn(*args)`` on ``nprocs`` new processes of this machine (arguments checked by
    ``launch``)."""
    import multiprocessing as mp

    method = start_method or default_start_method()
    ctx = mp.get_context(method)
    if method == "fork":
        guard.warm_optimizer_imports(fn, args)
    payload = cloudpickle.dumps((fn, args))
    guard.remove_stale_workdirs()
    workdir = guard.make_workdir()
    t0 = time.perf_counter()
    procs = []
    restore_sigterm = (lambda: None) if keep_sigterm else _clean_up_on_sigterm(procs, workdir)
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns on forking a threaded process (a Jupyter kernel always is). The
            # hazard is a child using a lock or thread pool the parent held; each rank starts by
            # forcing one torch thread and touches nothing of the parent's threads.
            warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks",
                                    category=DeprecationWarning)
            port = _free_port()  # named as torchrun names it; the group meets in a file store
            for rank in range(nprocs):
                p = ctx.Process(target=run_rank,
                                args=(rank, nprocs, payload, backend, workdir, timeout, port),
                                name=f"minitp-rank{rank}", daemon=True)
                p.start()
                procs.append(p)
        with _progress.Line(workdir, nprocs) as line:  # shown only when MINITP_PROGRESS=1
            results = _wait(procs, workdir, timeout, t0, line)
        outputs, errors = _read_outputs(workdir, nprocs)
        if echo:
            _relay(outputs, errors)
        values = [r["value"] for r in results]
        traces = [r["trace"] for r in results]
        return Results(values, traces, outputs, errors, time.perf_counter() - t0)
    except LaunchError:
        outputs, errors = _read_outputs(workdir, nprocs)
        if echo:
            _relay(outputs, errors)
        raise
    finally:
        _stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)
        restore_sigterm()


def default_start_method() -> str:
    """fork on Linux (a rank starts in a fraction of a second), except where torch sees a GPU: a
    forked child can neither start CUDA nor run a backward once the parent has run one (autograd's
    device threads), so there each rank starts afresh (spawn)."""
    import torch

    return "fork" if sys.platform.startswith("linux") and not torch.cuda.is_available() else "spawn"


# -- waiting: every rank's result, or the first failure, or the timeout ----------------------------
def _wait(procs, workdir: str, timeout: float, t0: float, line=None) -> list[dict]:
    """Poll until every rank has finished, one has failed, or time is up."""
    n = len(procs)
    results: dict[int, dict] = {}
    raised: dict[int, tuple[float, str]] = {}  # rank -> (when it raised, its traceback)
    died: dict[int, tuple[float, int]] = {}  # rank -> (when the parent noticed, exit code)
    first_failure = None
    while True:
        for rank, p in enumerate(procs):
            if rank in results or rank in raised or rank in died:
                continue
            path = os.path.join(workdir, f"rank{rank}.result")
            exitcode = p.exitcode  # read before the file: a rank writes its result, then exits
            if os.path.exists(path):
                with open(path, "rb") as f:
                    result = cloudpickle.load(f)
                guard.note_rank_imports(result.get("imported_dynamo", False))
                if result["status"] == "ok":
                    results[rank] = result
                else:
                    raised[rank] = (result["time"], result["traceback"])
            elif exitcode is not None:  # died without writing a result
                died[rank] = (time.time(), exitcode)
        if raised or died:
            # A dead rank is noticed late (after its peers' "connection closed" errors), so a
            # death is the cause whenever there is one; after a raise, wait briefly for a death.
            first_failure = first_failure or time.perf_counter()
            settled = len(results) + len(raised) + len(died) == n
            if died or settled or time.perf_counter() - first_failure > _GRACE_S:
                _stop(procs)
                raise _rank_error(workdir, n, raised, died)
        if len(results) == n:
            for p in procs:
                p.join(timeout=5)
            return [results[r] for r in range(n)]
        if time.perf_counter() - t0 > timeout:
            stacks, calls = dump_stacks(procs, workdir, set(range(n)) - set(results))
            _stop(procs)
            returned = sorted(r for r in stacks
                              if os.path.exists(os.path.join(workdir, f"rank{r}.returned")))
            inside = sorted(set(stacks) - set(returned))
            calls = {r: calls.get(r, {}) for r in inside}
            lines = [call_line(r, calls[r]) for r in inside]
            likely = likely_mistake(calls, returned)
            where = "\n\n".join(f"rank {r} was here:\n{stacks[r]}" for r in inside)
            back = (f"  ranks {', '.join(map(str, returned))}: returned, waiting for the others"
                    if returned else "")
            raise LaunchTimeout(
                f"launch timed out after {timeout:g} s: ranks {inside} of {n} were still inside "
                "the function"
                + (f"; ranks {returned} had returned from it and were waiting for them at the end"
                   if returned else "")
                + ":\n" + "\n".join(lines) + "\n"
                + (likely or "A rank waiting in a collective that another rank never joined (or "
                   "joined with another shape) is the usual cause.") + f"\n\n{where}",
                stacks, calls,
                "\n".join([*lines, *([back] if back else []), *([likely] if likely else [])]))
        if line is not None:
            line.update(len(results))
        time.sleep(0.01)


def _rank_error(workdir: str, n: int, raised: dict, died: dict) -> RankError:
    """The cause: the first rank to die without a result, else the first to raise (ties: lowest
    rank)."""
    def last_line(tb: str) -> str:
        return tb.strip().splitlines()[-1] if tb.strip() else "failed"

    if died:
        rank = min(died, key=lambda r: (died[r][0], r))
        headline = _death_note(rank, died[rank][1])
        err = _tail(os.path.join(workdir, f"rank{rank}.err"), 10**6)
        # faulthandler's stack, innermost call first: keep its head
        crash = err.rfind("Fatal Python error")
        err = err[crash:crash + 3000] if crash >= 0 else err[-3000:]
        tb = f"{headline}\n{err}"
        body = f"What rank {rank} printed to stderr last:\n{err or '(nothing)'}"
    else:
        rank = min(raised, key=lambda r: (raised[r][0], r))
        tb = raised[rank][1]
        headline = f"rank {rank} of {n} failed: {last_line(tb)}"
        body = f"Traceback from rank {rank}:\n{tb}"
    after = [f"rank {r}: {last_line(raised[r][1])}" if r in raised else _death_note(r, died[r][1])
             for r in sorted((set(raised) | set(died)) - {rank})]
    also = f"\n(then, likely because it left: {'; '.join(after)})" if after else ""
    return RankError(f"{headline}{also}\n\n{body}", rank, tb)


_SIGNAL_HINTS = {
    "SIGKILL": "likely out of memory: the kernel's out-of-memory killer sends SIGKILL "
               "(as does kill -9)",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code",
    "SIGABRT": "native code called abort()",
    "SIGTERM": "ended from outside",
    "SIGINT": "interrupted",
}


def _death_note(rank: int, exitcode: int) -> str:
    """'rank 2 was killed by SIGKILL (signal 9), likely out of memory: ...' or '... died with exit
    code 3'."""
    if exitcode >= 0:
        return f"rank {rank} died with exit code {exitcode} before returning a result"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "an unknown signal"
    hint = _SIGNAL_HINTS.get(name)
    return f"rank {rank} was killed by {name} (signal {-exitcode}) before returning a result" + (
        f", {hint}" if hint else "")


# -- no rank and no folder left behind -------------------------------------------------------------
def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _clean_up_on_sigterm(procs: list, workdir: str):
    """Until the returned function is called, SIGTERM to the parent first ends the ranks and removes
    ``workdir``, then does what it did before (by default: ends the parent, killed by SIGTERM)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set a signal handler
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        return lambda: None
    before = previous if previous is not None else signal.SIG_DFL  # None: set outside Python

    def on_sigterm(signum, frame):
        _stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, before)
        if callable(before):
            before(signum, frame)
            raise LaunchError("launch was stopped by SIGTERM; its ranks were ended")
        os.kill(os.getpid(), signal.SIGTERM)  # the default action, now that the handler is gone

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore():
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, before)
    return restore


# -- what the ranks printed ------------------------------------------------------------------------
def _tail(path: str, limit: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:]


def _read_outputs(workdir: str, n: int) -> tuple[list[str], list[str]]:
    outs = [_tail(os.path.join(workdir, f"rank{r}.out"), 10**7) for r in range(n)]
    errs = [_tail(os.path.join(workdir, f"rank{r}.err"), 10**7) for r in range(n)]
    return outs, errs


def _relay(outputs: list[str], errors: list[str]) -> None:
    """Print each rank's output in rank order, every line tagged with its rank."""
    for stream, texts in ((sys.stdout, outputs), (sys.stderr, errors)):
        for rank, text in enumerate(texts):
            for line in text.splitlines():
                print(f"[rank {rank}] {line}", file=stream)
        stream.flush()
