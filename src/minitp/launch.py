"""Run a function on N processes joined in one process group, and bring back what happened.

``launch(fn, 4, x)`` starts 4 processes, joins them in a process group (gloo on CPU, NCCL on
GPUs), calls ``fn(x)`` on each with a fresh trace recording, and returns the 4 return values in
rank order. The result list also carries each rank's trace (``results.traces``) and printed output
(``results.outputs``); the output is printed in the parent grouped by rank, in rank order, so a
notebook cell shows the same text every time.

Why the machinery:

* A function defined in a notebook cell or a script's ``__main__`` cannot be imported by a new
  process, so it is shipped by value with cloudpickle. On Linux the processes are forked (about
  1.5 s for 8 ranks, against 11-14 s to spawn 8 fresh interpreters that each import torch); each
  forces one torch thread first, since a forked child hangs in a thread pool its parent started.
* Ranks meet through a file in a fresh temporary folder (no port to pick, none to collide); the
  backend then connects them over 127.0.0.1.
* A rank that raises ends the run at once: the parent kills every other rank and raises
  ``RankError`` carrying that rank's traceback. A run past ``timeout`` is killed too, and
  ``LaunchTimeout`` shows where each unfinished rank was stuck. No process outlives the call:
  children are killed on any exit, and on Linux die with their parent.
* Under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR set) nothing is started: every process runs
  ``fn`` itself and gets the same ``Results`` back, so worker code runs unchanged.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

import cloudpickle

from minitp import trace as _trace

BACKENDS = ("gloo", "nccl")
_WORKER_ENV = "MINITP_WORKER"


class LaunchError(RuntimeError):
    """A launched run did not finish."""


class RankError(LaunchError):
    """A rank raised (or died); ``rank`` and the remote ``traceback`` text say which and where."""

    def __init__(self, message: str, rank: int, remote_traceback: str):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class LaunchTimeout(LaunchError):
    """The run went past its timeout; ``stacks`` maps each unfinished rank to where it was."""

    def __init__(self, message: str, stacks: dict[int, str]):
        super().__init__(message)
        self.stacks = stacks


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


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any env:// launcher), not by ``launch``."""
    env = os.environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")) and _WORKER_ENV not in env


def device():
    """The device this rank computes on: ``cuda:LOCAL_RANK`` under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch(fn, nprocs: int | None, *args, backend: str = "gloo", timeout: float = 120.0,
           start_method: str | None = None, echo: bool = True) -> Results:
    """Run ``fn(*args)`` on ``nprocs`` processes in one process group; return per-rank results.

    backend: "gloo" (CPU) or "nccl" (one GPU per rank, ``cuda:LOCAL_RANK``).
    timeout: seconds for the whole run, start-up included.
    start_method: "fork" (the default on Linux), "spawn" or "forkserver".
    echo: print each rank's output (grouped by rank, in rank order) when the run ends.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if under_torchrun():
        return _launch_in_place(fn, nprocs, args, backend)
    if _WORKER_ENV in os.environ:
        raise LaunchError("launch() was called inside a launched rank; launch from the parent process")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < nprocs:
            raise ValueError(f"backend='nccl' needs one GPU per rank: nprocs={nprocs}, "
                             f"GPUs visible={torch.cuda.device_count()}")
    import multiprocessing as mp

    method = start_method or ("fork" if sys.platform.startswith("linux") else "spawn")
    ctx = mp.get_context(method)
    payload = cloudpickle.dumps((fn, args))
    workdir = tempfile.mkdtemp(prefix="minitp-")
    t0 = time.perf_counter()
    procs = []
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
        results = _wait(procs, workdir, timeout, t0)
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


# -- parent side -----------------------------------------------------------------------------------
def _wait(procs, workdir: str, timeout: float, t0: float) -> list[dict]:
    """Poll until every rank has finished, one has failed, or time is up."""
    n = len(procs)
    results: dict[int, dict] = {}
    while True:
        failures = []
        for rank, p in enumerate(procs):
            if rank in results:
                continue
            path = os.path.join(workdir, f"rank{rank}.result")
            exitcode = p.exitcode  # read before the file: a rank writes its result, then exits
            if os.path.exists(path):
                with open(path, "rb") as f:
                    result = cloudpickle.load(f)
                if result["status"] == "ok":
                    results[rank] = result
                else:
                    failures.append((result["time"], rank, result["traceback"]))
            elif exitcode is not None:  # died without writing a result
                failures.append((time.time(), rank, _death_note(exitcode, workdir, rank)))
        if failures:
            # The first rank to fail is the cause; the others usually fail because it left.
            _, rank, tb = min(failures)
            _stop(procs)
            first = tb.strip().splitlines()[-1] if tb.strip() else "failed"
            raise RankError(f"rank {rank} of {n} failed: {first}\n\n"
                            f"Traceback from rank {rank}:\n{tb}", rank, tb)
        if len(results) == n:
            for p in procs:
                p.join(timeout=5)
            return [results[r] for r in range(n)]
        if time.perf_counter() - t0 > timeout:
            stacks = _dump_stacks(procs, workdir, set(range(n)) - set(results))
            _stop(procs)
            returned = sorted(r for r in stacks if os.path.exists(os.path.join(workdir, f"rank{r}.returned")))
            inside = sorted(set(stacks) - set(returned))
            where = "\n\n".join(f"rank {r} was here:\n{stacks[r]}" for r in inside)
            raise LaunchTimeout(
                f"launch timed out after {timeout:g} s: ranks {inside} of {n} were still inside the function"
                + (f"; ranks {returned} had returned from it and were waiting for them at the end" if returned
                   else "")
                + ". A rank waiting in a collective that another rank never joined (or joined with another "
                  f"shape) is the usual cause.\n\n{where}", stacks)
        time.sleep(0.01)


def _death_note(exitcode: int, workdir: str, rank: int) -> str:
    if exitcode < 0:
        try:
            what = f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            what = f"signal {-exitcode}"
    else:
        what = f"exit code {exitcode}"
    err = _tail(os.path.join(workdir, f"rank{rank}.err"))
    return f"rank {rank} died with {what} before returning.\n{err}\nRankDied: {what}"


def _dump_stacks(procs, workdir: str, ranks: set[int]) -> dict[int, str]:
    """Ask each unfinished rank to write its Python stack (faulthandler on SIGUSR1)."""
    for rank in ranks:
        if procs[rank].is_alive() and hasattr(signal, "SIGUSR1"):
            try:
                os.kill(procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    stacks = {}
    for r in ranks:  # faulthandler writes the innermost call first: keep the head
        text = _tail(os.path.join(workdir, f"rank{r}.stack"), 10**6)
        stacks[r] = text[:4000] or "(no stack written)"
    return stacks


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


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


def _worker(rank: int, nprocs: int, payload: bytes, backend: str, workdir: str, timeout: float) -> None:
    _die_with_parent()
    _redirect_output(workdir, rank)
    stack_file = open(os.path.join(workdir, f"rank{rank}.stack"), "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    faulthandler.enable(file=sys.stderr)
    os.environ.update({_WORKER_ENV: "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(nprocs), "OMP_NUM_THREADS": "1"})
    status, value, tb, tr = "ok", None, "", None
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
        dist.init_process_group(backend, init_method=f"file://{os.path.join(workdir, 'rendezvous')}",
                                rank=rank, world_size=nprocs, timeout=timedelta(seconds=timeout))
        with _trace.recording(rank) as tr:
            value = fn(*args)
        open(os.path.join(workdir, f"rank{rank}.returned"), "w").close()  # for a timeout's message
        dist.barrier()  # no rank leaves while another may still be reading from it
        dist.destroy_process_group()
    except BaseException:
        status, tb = "error", traceback.format_exc()
    result = {"status": status, "value": value, "trace": tr, "traceback": tb, "time": time.time()}
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


def _launch_in_place(fn, nprocs, args, backend: str) -> Results:
    import torch
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if nprocs not in (None, world):
        raise ValueError(f"launch(nprocs={nprocs}) under torchrun, whose WORLD_SIZE is {world}; "
                         f"pass nprocs={world} or None")
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend)
    with _trace.recording(rank) as tr:
        value = fn(*args)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, _Ran(value, tr))
    if owns_group:  # a process group left to interpreter exit can abort the process
        dist.barrier()
        dist.destroy_process_group()
    return Results([r.value for r in everyone], [r.trace for r in everyone],
                   [""] * world, [""] * world, time.perf_counter() - t0)
