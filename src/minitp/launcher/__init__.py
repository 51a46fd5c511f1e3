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
  as a ``FileStore`` by its path (no ``file://`` URL, which a folder named with ``?``, ``#`` or
  ``%`` would cut short); the backend then connects them over the loopback interface only, so
  nothing listens on the network.
* A rank that raises ends the run at once: the parent kills every other rank and raises
  ``RankError`` carrying that rank's traceback. A rank that dies without a result (a signal, the
  out-of-memory killer) is the cause over the survivors' "connection closed" errors. A run past
  ``timeout`` is killed too, and ``LaunchTimeout`` names the ``minitp.comm`` call each unfinished
  rank waits in (its peer, label and shape), the likely mistake when the pattern is a known one, and
  each rank's stack. Each rank learns its call from its own frames when the parent asks (a thread
  waiting on a FIFO in the run's folder), so sending a message costs nothing more.
* No process or folder outlives the call: children are killed on any exit and die with their
  parent (Linux); a SIGTERM to the parent ends them and removes the folder first; a folder left
  by a parent killed outright (its pid is in the name) is removed by the next launch.
* Under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR set) nothing is started: every process runs
  ``fn`` itself and gets the same ``Results`` back, so worker code runs unchanged. The addresses
  are torchrun's (the user's choice); ``timeout`` still holds, enforced by a watchdog thread. The
  variables are checked before joining (a rank in range, integers, an address that resolves), and
  the join itself waits at most ``MINITP_JOIN_TIMEOUT`` seconds (60) for every rank: stale variables
  in a shell are named in seconds, not after the whole timeout.

The files, one job each: ``local`` starts and waits for the ranks of this machine, ``worker`` is
what each of them does, ``torchrun`` runs in place under torchrun, ``stuck`` says where a stuck rank
waits, ``results`` holds what a launch returns or raises, ``guard`` the checks made before anything
starts, ``progress`` the live progress line.
"""

from __future__ import annotations

from minitp.launcher import guard
from minitp.launcher.guard import BACKENDS, RANK_MEMORY_BYTES, check_launch, under_torchrun
from minitp.launcher.local import run_local
from minitp.launcher.results import LaunchError, LaunchTimeout, RankError, Results
from minitp.launcher.torchrun import run_in_place

__all__ = ["BACKENDS", "RANK_MEMORY_BYTES", "LaunchError", "LaunchTimeout", "RankError", "Results",
           "check_launch", "device", "launch", "under_torchrun"]


def device():
    """The device this rank computes on: ``cuda:LOCAL_RANK`` under NCCL, else the CPU
    (``minitp.comm.device``)."""
    from minitp.comm import device as comm_device

    return comm_device()


def launch(fn, nprocs: int | None, *args, backend: str = "gloo", timeout: float = 120.0,
           start_method: str | None = None, echo: bool = True, max_procs: int | None = None,
           keep_sigterm: bool = False) -> Results:
    """Run ``fn(*args)`` on ``nprocs`` processes in one process group; return per-rank results.

    backend: "gloo" (CPU) or "nccl" (one GPU per rank, ``cuda:LOCAL_RANK``).
    timeout: seconds for the whole run, start-up included (under torchrun too).
    start_method: "fork" (the default on Linux without a GPU), "spawn" (the default elsewhere) or
    "forkserver".
    echo: print each rank's output (grouped by rank, in rank order) when the run ends.
    max_procs: the most processes allowed (default: ``MINITP_MAX_PROCS``, else what memory holds).
    keep_sigterm: SIGTERM to the parent is the caller's (a trainer passes it on to its ranks, which
    save and leave); by default it ends the ranks at once and removes the run's folder.
    """
    if not callable(fn):
        raise ValueError(f"fn must be a callable to run on every rank, "
                         f"got {type(fn).__name__} {fn!r:.80}")
    if not isinstance(echo, bool):
        raise ValueError(f"echo must be True or False, got {echo!r}")
    check_launch(nprocs, backend=backend, timeout=timeout, start_method=start_method,
                 max_procs=max_procs)
    if under_torchrun():
        return run_in_place(fn, args, backend, timeout)
    # MINITP_WORKER names this very process (a stale value names another)
    if guard.in_launched_rank():
        raise LaunchError("launch() was called inside a launched rank; "
                          "launch from the parent process")
    return run_local(fn, nprocs, args, backend=backend, timeout=timeout,
                     start_method=start_method, echo=echo, keep_sigterm=keep_sigterm)
