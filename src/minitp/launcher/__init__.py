"""Run a function on N processes joined in one process group, and bring back what happened.

``launch(fn, 4, x)`` starts 4 processes, joins them in a process group (gloo on CPU, NCCL on
GPUs), calls ``fn(x)`` on each with a fresh trace recording, and returns the 4 return values in
rank order. The result list also carries each rank's trace (``results.traces``) and printed output
(``results.outputs``); the output is printed in the parent grouped by rank, in rank order, so a
notebook cell shows the same text every time.

Why the machinery:

* Every argument is checked in the parent before any process starts, the number of processes
  included: each rank costs about ``RANK_MEMORY_BYTES``, so more than the available memory holds is
  refused (``max_procs=`` or ``MINITP_MAX_PROCS`` lifts the cap).
* A function defined in a notebook cell or a script's ``__main__`` cannot be imported by a new
  process, so it is shipped by value with cloudpickle. On Linux the processes are forked (about
  1.5 s for 8 ranks, against 11-14 s to spawn 8 fresh interpreters that each import torch); each
  forces one torch thread first, since a forked child hangs in a thread pool its parent started.
* Ranks meet through a file in a fresh temporary folder (no port to pick, none to collide), opened
  as a ``FileStore`` by its path (no ``file://`` URL, which a folder named with ``?``, ``#`` or ``%``
  would cut short); the backend then connects them over the loopback interface only, so nothing
  listens on the network.
* A rank that raises ends the run at once: the parent kills every other rank and raises
  ``RankError`` carrying that rank's traceback. A rank that dies without a result (a signal, the
  out-of-memory killer) is the cause over the survivors' "connection closed" errors. A run past
  ``timeout`` is killed too, and ``LaunchTimeout`` names the ``minitp.comm`` call each unfinished rank
  waits in (its peer, label and shape), the likely mistake when the pattern is a known one, and each
  rank's stack. Each rank learns its call from its own frames when the parent asks (a thread waiting
  on a FIFO in the run's folder), so sending a message costs nothing more.
* No process or folder outlives the call: children are killed on any exit and die with their
  parent (Linux); a SIGTERM to the parent ends them and removes the folder first; a folder left
  by a parent killed outright (its pid is in the name) is removed by the next launch.
* Under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR set) nothing is started: every process runs
  ``fn`` itself and gets the same ``Results`` back, so worker code runs unchanged. The addresses
  are torchrun's (the user's choice); ``timeout`` still holds, enforced by a watchdog thread. The
  variables are checked before joining (a rank in range, integers, an address that resolves), and
  the join itself waits at most ``MINITP_JOIN_TIMEOUT`` seconds (60) for every rank: stale variables
  in a shell are named in seconds, not after the whole timeout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

import cloudpickle

from minitp import trace as _trace
from minitp.launcher import guard
from minitp.launcher import progress as _progress
from minitp.launcher.guard import BACKENDS, RANK_MEMORY_BYTES, check_launch, under_torchrun  # noqa: F401

_GRACE_S = 0.5  # after a rank raises, how long to watch for a rank that died (the likelier cause)


class LaunchError(RuntimeError):
    """A launched run did not finish."""


class RankError(LaunchError):
    """A rank raised (or died); ``rank`` and the remote ``traceback`` text say which and where."""

    def __init__(self, message: str, rank: int, remote_traceback: str):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class LaunchTimeout(LaunchError):
    """The run went past its timeout. ``stacks`` maps each unfinished rank to its Python stack, ``calls``
    each rank still inside the function to the call it waited in (``_in_flight``); ``summary`` says it
    in a few lines (one a rank, then the likely mistake when the pattern is a known one)."""

    def __init__(self, message: str, stacks: dict[int, str], calls: dict[int, dict] | None = None,
                 summary: str = ""):
        super().__init__(message)
        self.stacks = stacks
        self.calls = calls or {}
        self.summary = summary


class Results(list):
    """Per-rank return values in rank order, with each rank's trace and printed output."""

    def __init__(self, values, traces, outputs, errors, wall_s: float):
        super().__init__(values)
        self.traces: list[_trace.Trace] = traces
        self.outputs: list[str] = outputs  # what each rank printed to stdout
        self.errors: list[str] = errors  # what each rank printed to stderr
        self.wall_s = wall_s

    @property
    def events(self) -> list[_trace.Event]:
        """Every rank's events, merged and sorted, times starting at 0."""
        return _trace.merge(self.traces)

    def sent_bytes(self, label_prefix: str = "") -> list[float]:
        """Bytes each rank sent over the run (ring model; see ``minitp.cost``)."""
        return _trace.sent_bytes_per_rank(self.traces, label_prefix)


def device():
    """The device this rank computes on: ``cuda:LOCAL_RANK`` under NCCL, else the CPU (``minitp.comm.device``)."""
    from minitp.comm import device as comm_device

    return comm_device()


def launch(fn, nprocs: int | None, *args, backend: str = "gloo", timeout: float = 120.0,
           start_method: str | None = None, echo: bool = True, max_procs: int | None = None,
           keep_sigterm: bool = False) -> Results:
    """Run ``fn(*args)`` on ``nprocs`` processes in one process group; return per-rank results.

    backend: "gloo" (CPU) or "nccl" (one GPU per rank, ``cuda:LOCAL_RANK``).
    timeout: seconds for the whole run, start-up included (under torchrun too).
    start_method: "fork" (the default on Linux without a GPU), "spawn" (the default elsewhere) or "forkserver".
    echo: print each rank's output (grouped by rank, in rank order) when the run ends.
    max_procs: the most processes allowed (default: ``MINITP_MAX_PROCS``, else what memory holds).
    keep_sigterm: SIGTERM to the parent is the caller's (a trainer passes it on to its ranks, which
    save and leave); by default it ends the ranks at once and removes the run's folder.
    """
    if not callable(fn):
        raise ValueError(f"fn must be a callable to run on every rank, got {type(fn).__name__} {fn!r:.80}")
    if not isinstance(echo, bool):
        raise ValueError(f"echo must be True or False, got {echo!r}")
    check_launch(nprocs, backend=backend, timeout=timeout, start_method=start_method, max_procs=max_procs)
    if under_torchrun():
        return _launch_in_place(fn, args, backend, timeout)
    if guard.in_launched_rank():  # MINITP_WORKER names this very process (a stale value names another)
        raise LaunchError("launch() was called inside a launched rank; launch from the parent process")
    import multiprocessing as mp

    method = start_method or _default_start_method()
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
            warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
            for rank in range(nprocs):
                p = ctx.Process(target=_worker, args=(rank, nprocs, payload, backend, workdir, timeout),
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


def _default_start_method() -> str:
    """fork on Linux (a rank starts in a fraction of a second), except where torch sees a GPU: a forked
    child can neither start CUDA nor run a backward once the parent has run one (autograd's device
    threads), so there each rank starts afresh (spawn)."""
    import torch

    return "fork" if sys.platform.startswith("linux") and not torch.cuda.is_available() else "spawn"


# -- parent side -----------------------------------------------------------------------------------

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
            stacks, calls = _dump_stacks(procs, workdir, set(range(n)) - set(results))
            _stop(procs)
            returned = sorted(r for r in stacks if os.path.exists(os.path.join(workdir, f"rank{r}.returned")))
            inside = sorted(set(stacks) - set(returned))
            calls = {r: calls.get(r, {}) for r in inside}
            lines = [_call_line(r, calls[r]) for r in inside]
            likely = _likely_mistake(calls, returned)
            where = "\n\n".join(f"rank {r} was here:\n{stacks[r]}" for r in inside)
            back = f"  ranks {', '.join(map(str, returned))}: returned, waiting for the others" if returned else ""
            raise LaunchTimeout(
                f"launch timed out after {timeout:g} s: ranks {inside} of {n} were still inside the function"
                + (f"; ranks {returned} had returned from it and were waiting for them at the end" if returned
                   else "")
                + ":\n" + "\n".join(lines) + "\n"
                + (likely or "A rank waiting in a collective that another rank never joined (or joined with "
                   "another shape) is the usual cause.") + f"\n\n{where}",
                stacks, calls, "\n".join([*lines, *([back] if back else []), *([likely] if likely else [])]))
        if line is not None:
            line.update(len(results))
        time.sleep(0.01)


def _rank_error(workdir: str, n: int, raised: dict, died: dict) -> RankError:
    """The cause: the first rank to die without a result, else the first to raise (ties: lowest rank)."""
    def last_line(tb: str) -> str:
        return tb.strip().splitlines()[-1] if tb.strip() else "failed"

    if died:
        rank = min(died, key=lambda r: (died[r][0], r))
        headline = _death_note(rank, died[rank][1])
        err = _tail(os.path.join(workdir, f"rank{rank}.err"), 10**6)
        crash = err.rfind("Fatal Python error")  # faulthandler's stack, innermost call first: keep its head
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
    "SIGKILL": "likely out of memory: the kernel's out-of-memory killer sends SIGKILL (as does kill -9)",
    "SIGSEGV": "a crash in native code", "SIGBUS": "a crash in native code",
    "SIGABRT": "native code called abort()", "SIGTERM": "ended from outside", "SIGINT": "interrupted",
}


def _death_note(rank: int, exitcode: int) -> str:
    """'rank 2 was killed by SIGKILL (signal 9), likely out of memory: ...' or '... died with exit code 3'."""
    if exitcode >= 0:
        return f"rank {rank} died with exit code {exitcode} before returning a result"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "an unknown signal"
    hint = _SIGNAL_HINTS.get(name)
    return f"rank {rank} was killed by {name} (signal {-exitcode}) before returning a result" + (
        f", {hint}" if hint else "")


def _dump_stacks(procs, workdir: str, ranks: set[int]) -> tuple[dict[int, str], dict[int, dict]]:
    """Ask each unfinished rank to write its Python stack (faulthandler on SIGUSR1) and the comm call
    it is in (``_answer_where``); return both, by rank."""
    for rank in ranks:
        if procs[rank].is_alive() and hasattr(signal, "SIGUSR1"):
            try:
                os.kill(procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        try:  # opening the FIFO wakes the rank's thread; none listening (the rank is gone): no answer
            os.close(os.open(os.path.join(workdir, f"rank{rank}.ask"), os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    time.sleep(0.5)
    stacks, calls = {}, {}
    for r in ranks:  # faulthandler writes the innermost call first: keep the head
        text = _tail(os.path.join(workdir, f"rank{r}.stack"), 10**6)
        stacks[r] = text[:4000] or "(no stack written)"
        try:
            with open(os.path.join(workdir, f"rank{r}.call")) as f:
                calls[r] = json.load(f)
        except (OSError, ValueError):
            pass
    return stacks, calls


# -- where a stuck rank waits, and what that pattern usually means -------------------------------------
def _in_flight(frame) -> dict:
    """What the thread whose innermost frame is ``frame`` waits in, read from the frames themselves: the
    ``minitp.comm`` call (``call`` as written, ``op`` as traced, ``peer``, ``label``, ``group``, ``shape``,
    ``waited`` seconds), else ``where``: the innermost function outside torch, Python and the launcher."""
    comm = sys.modules.get("minitp.comm")
    f = frame
    while f is not None and (comm is None or f.f_code.co_filename != comm.__file__):
        f = f.f_back
    if f is None:
        skip = (f"{os.sep}torch{os.sep}", os.path.dirname(os.__file__) + os.sep, os.path.dirname(__file__))
        f = frame
        while f is not None and any(s in f.f_code.co_filename for s in skip):
            f = f.f_back
        f = f or frame
        return {} if f is None else {"where": f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:"
                                              f"{f.f_lineno})"}
    name, local = f.f_code.co_name, f.f_locals
    handle = local.get("self") if name in ("wait", "is_completed") else None
    event = getattr(handle, "event", None) if handle is not None else local.get("event")
    op = event.op if event is not None else {"isend": "send", "irecv": "recv"}.get(name, name)
    call = name
    if handle is not None:
        call = (f"i{op}(...).wait()" if op in ("send", "recv") else f"{op}(..., async_op=True).wait()") if event \
            else "wait()"
    if event is None:  # nothing was recording: what the call's own arguments say
        peer = local.get("dst", local.get("src")) if op in ("send", "recv") else None
        return {"call": call, "op": op, "peer": peer, "label": local.get("label", ""), "group": [], "shape": []}
    return {"call": call, "op": op, "peer": event.peer, "label": event.label, "group": list(event.group),
            "shape": list(event.shape), "waited": round(time.perf_counter() - event.start, 1)}


def _call_line(rank: int, c: dict) -> str:
    """One line for a stuck rank: '  rank 0: in irecv(...).wait() from rank 1, label "B0", shape (2, 8), for 7.6 s'."""
    if not c:
        return f"  rank {rank}: did not say where it was (see its stack)"
    if "where" in c:
        return f"  rank {rank}: not in a minitp.comm call, in {c['where']}"
    peer = {"send": f" to rank {c['peer']}", "recv": f" from rank {c['peer']}"}.get(
        c["op"], f" over ranks {tuple(c['group'])}" if c["group"] else "")
    label = f', label "{c["label"]}"' if c["label"] else ""
    shape = f", shape {tuple(c['shape'])}" if c["shape"] else ""
    waited = f", for {c['waited']:g} s" if "waited" in c else ""
    return f"  rank {rank}: in {c['call']}{peer}{label}{shape}{waited}"


def _likely_mistake(calls: dict[int, dict], returned: list[int]) -> str:
    """One sentence on the likely mistake when the stuck ranks' calls make a known pattern, else ""."""
    known = {r: c for r, c in calls.items() if c.get("op")}
    if not known or len(known) < len(calls):
        return ""
    if all(c["op"] == "recv" for c in known.values()):
        return "Every stuck rank waits to receive: a send is missing or goes the wrong way."
    for r, c in sorted(known.items()):
        if c["op"] != "send":
            continue
        peer, other = c["peer"], known.get(c["peer"])
        if other is None and peer in returned:
            return f"Rank {r}'s send to rank {peer} waits for a receive, but rank {peer} returned: a recv is missing."
        if other is not None and not (other["op"] == "recv" and other["peer"] == r):
            doing = f"{other['call']}" + (f" to rank {other['peer']}" if other["op"] == "send" else
                                          f" from rank {other['peer']}" if other["op"] == "recv" else "")
            return (f"Rank {r}'s send waits for rank {peer} to receive it, but rank {peer} is in {doing}: a blocking "
                    "send returns only once the other side receives, so post one side with isend (or receive "
                    "first on one side).")
    collective = {r: c for r, c in known.items() if c["op"] not in ("send", "recv")}
    if len(collective) == len(known):
        by_group: dict[tuple, list] = {}
        for c in collective.values():
            by_group.setdefault(tuple(c["group"]), []).append(c)
        for cs in by_group.values():
            if len({(c["op"], c["label"]) for c in cs}) > 1:
                return "The ranks call collectives in a different order: every rank of a group must make the same " \
                       "collectives, in the same order."
            if len({tuple(c["shape"]) for c in cs}) > 1:
                return (f"The ranks called {cs[0]['op']} with different shapes "
                        f"({', '.join(sorted({str(tuple(c['shape'])) for c in cs}))}): every rank passes the same.")
        if returned:
            ops = sorted({c["op"] for c in collective.values()})
            return (f"Ranks {', '.join(map(str, returned))} returned without joining {' / '.join(ops)}: every rank of "
                    "the group must call it.")
    return ""


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


# -- child side ------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _redirect_output(workdir: str, rank: int) -> None:
    """Send this rank's stdout and stderr (Python and C level) to its own files."""
    for fd, name in ((1, "out"), (2, "err")):
        f = open(os.path.join(workdir, f"rank{rank}.{name}"), "w")
        os.dup2(f.fileno(), fd)
        f.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _answer_where(workdir: str, rank: int) -> None:
    """Start a thread that, when the parent opens this rank's FIFO (at a timeout), writes the call the
    main thread waits in (``_in_flight``) to ``rank<r>.call``. Read from the frames then, it costs a
    message nothing; a rank blocked in a collective has released the GIL, so the thread runs."""
    if not hasattr(os, "mkfifo"):
        return
    fifo, main = os.path.join(workdir, f"rank{rank}.ask"), threading.main_thread().ident

    def answer():
        os.close(os.open(fifo, os.O_RDONLY))  # blocks until the parent opens it to write
        path = os.path.join(workdir, f"rank{rank}.call")
        try:
            call = _in_flight(sys._current_frames().get(main))
        except Exception:  # a courtesy: the stack still says where the rank was
            call = {}
        with open(path + ".tmp", "w") as f:
            json.dump(call, f)
        os.replace(path + ".tmp", path)

    try:
        os.mkfifo(fifo)
    except OSError:  # a folder that holds no FIFO: a timeout then shows the stacks alone
        return
    threading.Thread(target=answer, name="minitp-where", daemon=True).start()


def _worker(rank: int, nprocs: int, payload: bytes, backend: str, workdir: str, timeout: float) -> None:
    _die_with_parent()
    _redirect_output(workdir, rank)
    _answer_where(workdir, rank)
    stack_file = open(os.path.join(workdir, f"rank{rank}.stack"), "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    faulthandler.enable(file=sys.stderr)
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's clean-up handler
    os.environ.update({guard.WORKER_ENV: str(os.getpid()), "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(nprocs), "OMP_NUM_THREADS": "1", _progress.DIR_ENV: workdir})
    guard.listen_on_loopback()
    status, value, tb, tr, imported = "ok", None, "", None, False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args = cloudpickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported; a forked rank
        # inherited that import, so read the variable again as the parent has it now.
        dist.set_debug_level_from_env()
        # the rendezvous file by its path: any folder name works, and no two runs share a file
        store = dist.FileStore(os.path.join(workdir, "rendezvous"), nprocs)
        store.set_timeout(timedelta(seconds=timeout))
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=nprocs,
                                timeout=timedelta(seconds=timeout))
        inherited = "torch._dynamo" in sys.modules
        with _trace.recording(rank) as tr:
            value = fn(*args)
        imported = not inherited and "torch._dynamo" in sys.modules  # the parent will warm it next time
        open(os.path.join(workdir, f"rank{rank}.returned"), "w").close()  # for a timeout's message
        dist.barrier()  # no rank leaves while another may still be reading from it
        dist.destroy_process_group()
    except BaseException:
        status, tb = "error", traceback.format_exc()
    result = {"status": status, "value": value, "trace": tr, "traceback": tb, "time": time.time(),
              "imported_dynamo": imported}
    try:
        data = cloudpickle.dumps(result)
    except Exception:
        data = cloudpickle.dumps({"status": "error", "value": None, "trace": None, "time": time.time(),
                                  "traceback": "the return value could not be pickled to send it back:\n"
                                               + traceback.format_exc()})
        status = "error"
    path = os.path.join(workdir, f"rank{rank}.result")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # the parent never reads half a result
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if status == "ok" else 1)


# -- under torchrun --------------------------------------------------------------------------------
@dataclass
class _Ran:
    value: object
    trace: _trace.Trace


def _join(backend: str, rank: int, world: int, timeout: float) -> None:
    """Join torchrun's process group (env://: MASTER_ADDR, MASTER_PORT), every rank present within
    ``guard.join_timeout``; then the run's ``timeout`` holds for every collective. Under torchrun's own
    store (TORCHELASTIC_USE_AGENT_STORE) connecting waits for no one, so the ranks also check in."""
    import torch.distributed as dist

    join = guard.join_timeout(timeout)
    env = os.environ
    where = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '?')}"
    deadline = time.monotonic() + join
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=join)))
        attempt = f"minitp/join/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # a restarted group checks in anew
        store.set(f"{attempt}/{rank}", "1")
        left = max(deadline - time.monotonic(), 0.1)
        store.wait([f"{attempt}/{r}" for r in range(world)], timedelta(seconds=left))
    except Exception as e:
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LaunchError(
            f"rank {rank} of {world} could not join the process group at {where} within {join:g} s "
            f"(timeout={timeout:g} s; {guard.JOIN_TIMEOUT_ENV} sets the join's, default {guard.JOIN_TIMEOUT_S} s): "
            f"not all WORLD_SIZE={world} ranks came; if torchrun did not start this process, RANK, WORLD_SIZE, "
            f"MASTER_ADDR and MASTER_PORT are stale: unset them ({said})") from e
    store.set_timeout(timedelta(seconds=timeout))
    # the group's keys under this attempt's name: torchrun's store outlives a restart, and the addresses
    # the ranks of the failed attempt left in it must not be read by the new ones
    dist.init_process_group(backend, store=dist.PrefixStore(f"{attempt}/default_pg", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))


def _launch_in_place(fn, args, backend: str, timeout: float) -> Results:
    """Run ``fn`` in this process, one rank of torchrun's world; nobody above us enforces the timeout,
    so a watchdog thread does."""
    import torch
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    t0 = time.perf_counter()
    main = threading.get_ident()
    watchdog = guard.start_watchdog(timeout, f"rank {rank} of {world}",
                                    where=lambda: _call_line(rank, _in_flight(sys._current_frames().get(main))))
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        owns_group = not dist.is_initialized()
        if owns_group:
            _join(backend, rank, world, timeout)
        with _trace.recording(rank) as tr:
            value = fn(*args)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, _Ran(value, tr))
        if owns_group:  # a process group left to interpreter exit can abort the process
            dist.barrier()
            dist.destroy_process_group()
    finally:
        watchdog()
    return Results([r.value for r in everyone], [r.trace for r in everyone],
                   [""] * world, [""] * world, time.perf_counter() - t0)
