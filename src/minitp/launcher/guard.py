"""What keeps ``minitp.launch`` safe: its arguments checked before any process starts, a cap on
processes from the memory each one costs, ranks that listen on loopback only, no temporary folder
left behind by a parent that was killed, and a watchdog for the timeout under torchrun.
"""

from __future__ import annotations

import faulthandler
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import threading

BACKENDS = ("gloo", "nccl")
# Resident memory of one forked rank that imported torch and joined a gloo group (psutil RSS, torch
# 2.13 CPU, Linux: 160-165 MiB; a spawned rank holds 145 MiB of its own). The default process cap.
RANK_MEMORY_BYTES = 160 * 2**20
MAX_PROCS_ENV = "MINITP_MAX_PROCS"
WORKER_ENV = "MINITP_WORKER"  # set in every rank that launch started
WORKDIR = re.compile(r"minitp-(\d+)-")  # a launch's temporary folder: minitp-<parent pid>-<random>


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any env:// launcher), not by ``launch``."""
    env = os.environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")) and WORKER_ENV not in env


def check_launch(nprocs: int | None, *, backend: str = "gloo", timeout: float = 120.0,
                 start_method: str | None = None, max_procs: int | None = None) -> None:
    """Raise ValueError, naming the argument, its value and what is allowed, for what ``launch`` refuses.

    Cheap and starts nothing: a command line can call it before building a model.
    """
    import multiprocessing as mp

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    methods = mp.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        raise ValueError(f"start_method must be None or one of {', '.join(methods)}, got {start_method!r}")
    if max_procs is not None and not _is_count(max_procs):
        raise ValueError(f"max_procs must be an integer >= 1 or None, got {max_procs!r}")
    if under_torchrun():  # torchrun chose the processes; nprocs may only repeat its world size
        world = int(os.environ["WORLD_SIZE"])
        if nprocs is not None and nprocs != world:
            raise ValueError(f"launch(nprocs={nprocs}) under torchrun, whose WORLD_SIZE is {world}; "
                             f"pass nprocs={world} or None")
        return
    if not _is_count(nprocs):
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    cap, why = process_cap(max_procs)
    if cap is not None and nprocs > cap:
        raise ValueError(f"nprocs={nprocs} is more than the cap of {cap} processes: {why}")
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < nprocs:
            raise ValueError(f"backend='nccl' needs one GPU per rank: nprocs={nprocs}, "
                             f"GPUs visible={torch.cuda.device_count()}")


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def process_cap(max_procs: int | None = None) -> tuple[int | None, str]:
    """The most local processes allowed, and why: ``max_procs``, else ``MINITP_MAX_PROCS``, else what
    the available memory holds at ``RANK_MEMORY_BYTES`` a rank (None when memory cannot be read)."""
    if max_procs is not None:
        return max_procs, f"max_procs={max_procs} was passed to launch; pass a larger one to run more"
    raw = os.environ.get(MAX_PROCS_ENV)
    if raw is not None:
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError(f"{MAX_PROCS_ENV} must be an integer >= 1, got {raw!r}")
        return int(raw), f"{MAX_PROCS_ENV}={raw.strip()} is set; set it higher to run more"
    available = available_memory()
    if available is None:
        return None, "the available memory could not be read"
    cap = max(1, available // RANK_MEMORY_BYTES)
    return cap, (f"each rank holds about {RANK_MEMORY_BYTES / 2**20:.0f} MiB (torch imported, a process group "
                 f"joined) and {available / 2**30:.1f} GiB of memory is available, so more would run out of "
                 f"memory; to go past it anyway pass max_procs=N to launch or set {MAX_PROCS_ENV}=N")


def available_memory() -> int | None:
    """Bytes the machine can still give without swapping (Linux's MemAvailable), or None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def listen_on_loopback() -> None:
    """Make gloo (and NCCL's bootstrap) in this process bind to the loopback interface. Left alone,
    gloo binds to the address the hostname resolves to, which may be the machine's network address."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
        os.environ["NCCL_SOCKET_IFNAME"] = loopback


def remove_stale_workdirs() -> list[str]:
    """Remove this user's ``minitp-<pid>-*`` temporary folders whose parent process is gone (it was
    killed before it could clean up); return their paths."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return []
    removed = []
    for name in names:
        match = WORKDIR.match(name)
        if not match or _pid_alive(int(match[1])):
            continue
        path = os.path.join(tmp, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or not os.path.isdir(path):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's live process, or a number we cannot judge: leave the folder
    return True


def start_watchdog(timeout: float, who: str):
    """End this process (exit status 124, as timeout(1) does) with every thread's stack once
    ``timeout`` seconds pass; return the function that calls it off. Under torchrun nothing above
    the process enforces minitp's timeout, so it does it itself."""
    stream = sys.__stderr__ or sys.stderr

    def fire():
        stream.write(f"\nminitp.launch: {who} ran past timeout={timeout:g} s; ending this process. "
                     "Where each thread was (the first is this watchdog; innermost call first):\n")
        stream.flush()
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()
        os._exit(124)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(timeout + 10, exit=True, file=stream)  # if fire() never gets the GIL

    def cancel():
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
    return cancel


def warm_optimizer_imports() -> None:
    """Import what a rank's first optimizer imports (``torch._dynamo``, ~1.5 s of CPU) once in the
    parent before forking, so that the ranks inherit it instead of each paying it: 8 ranks on 2 cores
    would otherwise spend seconds importing before their first step."""
    if "torch._dynamo" not in sys.modules:
        import importlib

        importlib.import_module("torch._dynamo")
