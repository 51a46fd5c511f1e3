"""What keeps ``minitp.launch`` safe: its arguments checked before any process starts, a cap on
processes from the memory each one costs, ranks that listen on loopback only, no temporary folder
left behind by a parent that was killed, and a watchdog for the timeout under torchrun.

It also reads minitp's environment variables, all through ``env_flag`` and ``env_int`` (one spelling
of "on" and "off", one error naming the variable and its value), and checks torchrun's (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) before a rank tries to join with them.
"""

from __future__ import annotations

import faulthandler
import functools
import math
import os
import re
import shutil
import socket
import sys
import sysconfig
import tempfile
import threading
import types

BACKENDS = ("gloo", "nccl")
# Resident memory of one forked rank that imported torch and joined a gloo group (psutil RSS, torch
# 2.13 CPU, Linux: 160-165 MiB; a spawned rank holds 145 MiB of its own). The default process cap.
RANK_MEMORY_BYTES = 160 * 2**20
MAX_PROCS_ENV = "MINITP_MAX_PROCS"
PROGRESS_ENV = "MINITP_PROGRESS"  # 1: show a live progress line (``minitp.launcher.progress``)
JOIN_TIMEOUT_ENV = "MINITP_JOIN_TIMEOUT"  # seconds a torchrun rank waits for the others to join
JOIN_TIMEOUT_S = 60  # its default: torchrun starts every rank at once, so the join takes seconds
# Set in every rank that launch started, to that rank's own pid: a value inherited by another
# process (a stale export in a shell, a program a rank started) names another pid and is ignored.
WORKER_ENV = "MINITP_WORKER"
WORKDIR = re.compile(r"minitp-(\d+)-")  # a launch's temporary folder: minitp-<parent pid>-<random>
WORKDIR_MARK = ".minitp-launch"  # written first into that folder: its parent's pid
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False,
              "no": False, "off": False, "": False}


# -- environment variables -------------------------------------------------------------------------
def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name``: 1/0, true/false, yes/no or on/off in any case
    (empty is off), ``default`` when unset. Anything else is a ValueError naming the variable and
    its value."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word not in FLAG_WORDS:
        raise ValueError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")
    return FLAG_WORDS[word]


def env_int(name: str, default: int | None = None, low: int = 1) -> int | None:
    """The integer environment variable ``name`` (decimal digits, at least ``low``), ``default``
    when unset. Anything else is a ValueError naming the variable and its value."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = _integer(raw)
    if value is None or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {raw!r}")
    return value


def _integer(text: str) -> int | None:
    """``text`` as a decimal integer (ASCII digits, an optional sign, spaces around), else None:
    int() alone takes '²' for a digit in isdigit() and fails on it, and reads other scripts'
    digits."""
    text = text.strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,18}", text):
        return None
    return int(text)


def in_launched_rank() -> bool:
    """True in a rank that ``launch`` started (it set MINITP_WORKER to its own pid)."""
    return os.environ.get(WORKER_ENV) == str(os.getpid())


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any env:// launcher), not by ``launch``."""
    return all(k in os.environ for k in TORCHRUN_ENV) and not in_launched_rank()


def check_environment() -> None:
    """Read every minitp variable that a launch reads later (in the parent as in the ranks), so that
    a bad value is refused here, before any process starts."""
    env_flag(PROGRESS_ENV)
    env_int(MAX_PROCS_ENV)
    env_int(JOIN_TIMEOUT_ENV)


_STALE = ("this process takes itself for a rank of torchrun because RANK, WORLD_SIZE and "
          "MASTER_ADDR are set; if torchrun did not start it, they are stale: unset them")


def check_torchrun(nprocs: int | None, backend: str = "gloo") -> int:
    """Check torchrun's variables before this process joins with them; return WORLD_SIZE. Each wrong
    one is a ValueError naming it, in seconds: joining with them would wait out the whole
    timeout."""
    env = os.environ
    world = _integer(env["WORLD_SIZE"])
    if world is None or world < 1:
        raise ValueError(
            f"WORLD_SIZE must be an integer >= 1, got {env['WORLD_SIZE']!r} ({_STALE})")
    if nprocs is not None and nprocs != world:
        raise ValueError(f"launch(nprocs={nprocs}) under torchrun, whose WORLD_SIZE is {world}; "
                         f"pass nprocs={world} or None")
    rank = _integer(env["RANK"])
    if rank is None:
        raise ValueError(
            f"RANK must be an integer from 0 to WORLD_SIZE-1 = {world - 1}, got {env['RANK']!r} "
            f"({_STALE})")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not a rank of WORLD_SIZE={world}: expected 0 to "
                         f"{world - 1} ({_STALE})")
    local = env.get("LOCAL_RANK")
    if local is not None:
        local_rank = _integer(local)
        if local_rank is None or local_rank < 0:
            raise ValueError(f"LOCAL_RANK must be an integer >= 0, got {local!r} ({_STALE})")
        if backend == "nccl":
            import torch

            if local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK={local_rank} but {torch.cuda.device_count()} GPUs are visible: "
                    f"backend='nccl' puts local rank r on cuda:r")
    env_int(JOIN_TIMEOUT_ENV)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        # the caller joined already, by its own means: the address is not ours to check
        return world
    port = env.get("MASTER_PORT")
    if port is None:
        raise ValueError(
            f"MASTER_PORT is not set: rank 0 listens on MASTER_ADDR:MASTER_PORT ({_STALE})")
    port_number = _integer(port)
    if port_number is None or not 1 <= port_number <= 65535:
        raise ValueError(f"MASTER_PORT must be a port number from 1 to 65535, got {port!r}")
    address = env["MASTER_ADDR"]
    try:
        socket.getaddrinfo(address, port_number, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as e:
        raise ValueError(
            f"MASTER_ADDR={address!r} does not resolve to an address ({e}); rank 0's host name "
            f"or IP address is expected") from None
    return world


def join_timeout(timeout: float) -> float:
    """Seconds a torchrun rank waits for the others to join: ``MINITP_JOIN_TIMEOUT`` (default 60),
    at most half the run's ``timeout``, so that a join that fails says so (naming the variables)
    before the watchdog ends the run."""
    return min(timeout / 2, env_int(JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S))


def check_launch(nprocs: int | None, *, backend: str = "gloo", timeout: float = 120.0,
                 start_method: str | None = None, max_procs: int | None = None) -> None:
    """Raise ValueError, naming the argument, its value and what is allowed, for what ``launch``
    refuses.

    Cheap and starts nothing: a command line can call it before building a model.
    """
    import multiprocessing as mp

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int,
                                                             float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    methods = mp.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        raise ValueError(
            f"start_method must be None or one of {', '.join(methods)}, got {start_method!r}")
    if max_procs is not None and not _is_count(max_procs):
        raise ValueError(f"max_procs must be an integer >= 1 or None, got {max_procs!r}")
    check_environment()
    if under_torchrun():  # torchrun chose the processes; nprocs may only repeat its world size
        check_torchrun(nprocs, backend)
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
    """The most local processes allowed, and why: ``max_procs``, else ``MINITP_MAX_PROCS``, else
    what the available memory holds at ``RANK_MEMORY_BYTES`` a rank (None when memory cannot be
    read)."""
    if max_procs is not None:
        return (max_procs,
                f"max_procs={max_procs} was passed to launch; pass a larger one to run more")
    cap = env_int(MAX_PROCS_ENV)
    if cap is not None:
        return cap, f"{MAX_PROCS_ENV}={cap} is set; set it higher to run more"
    available = available_memory()
    if available is None:
        return None, "the available memory could not be read"
    cap = max(1, available // RANK_MEMORY_BYTES)
    return cap, (f"each rank holds about {RANK_MEMORY_BYTES / 2**20:.0f} MiB (torch imported, a "
                 f"process group joined) and {available / 2**30:.1f} GiB of memory is available, "
                 "so more would run out of memory; to go past it anyway pass max_procs=N to launch "
                 f"or set {MAX_PROCS_ENV}=N")


def available_memory() -> int | None:
    """Bytes the machine can still give without swapping (Linux's MemAvailable), or None if
    unknown."""
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
    gloo binds to the address the hostname resolves to, which may be the machine's network
    address."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
        os.environ["NCCL_SOCKET_IFNAME"] = loopback


def make_workdir() -> str:
    """A launch's temporary folder, ``minitp-<pid>-<random>``, with its mark written first: the one
    proof ``remove_stale_workdirs`` accepts that a launch made it."""
    workdir = tempfile.mkdtemp(prefix=f"minitp-{os.getpid()}-")
    with open(os.path.join(workdir, WORKDIR_MARK), "w") as f:
        f.write(f"{os.getpid()}\n")
    return workdir


def _made_by_a_launch(path: str, pid: int) -> bool:
    """Whether ``path`` is a folder of this user holding a launch's mark naming ``pid``."""
    try:
        if not os.path.isdir(path) or os.path.islink(path) or os.lstat(path).st_uid != os.getuid():
            return False
        with open(os.path.join(path, WORKDIR_MARK)) as f:
            return f.read().strip() == str(pid)
    except (OSError, UnicodeDecodeError):
        return False


def remove_stale_workdirs() -> list[str]:
    """Remove the temporary folders of launches whose parent process is gone (it was killed before
    it could clean up); return their paths. Only a folder a launch made goes: named
    ``minitp-<pid>-*``, its pid gone, and holding the mark ``make_workdir`` wrote first. A learner's
    own ``minitp-2024-results`` matches the name, holds no mark, and stays."""
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
        if not _made_by_a_launch(path, int(match[1])):
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


def start_watchdog(timeout: float, who: str, where=None):
    """End this process (exit status 124, as timeout(1) does) with every thread's stack once
    ``timeout`` seconds pass; return the function that calls it off. Under torchrun nothing above
    the process enforces minitp's timeout, so it does it itself. ``where()``, if given, is a line
    saying what the process waits in, written first."""
    stream = sys.__stderr__ or sys.stderr

    def fire():
        stream.write(
            f"\nminitp.launch: {who} ran past timeout={timeout:g} s; ending this process.\n")
        if where is not None:
            try:
                stream.write(f"{where()}\n")
            except Exception as e:  # the line is a courtesy: the stacks below must still be written
                stream.write(f"(where it waits could not be read: {e!r})\n")
        stream.write("Where each thread was (the first is this watchdog; innermost call first):\n")
        stream.flush()
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()
        os._exit(124)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    # if fire() never gets the GIL
    faulthandler.dump_traceback_later(timeout + 10, exit=True, file=stream)

    def cancel():
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
    return cancel


# a rank of an earlier launch imported torch._dynamo itself: warm from now on
_optimizer_seen = False


def note_rank_imports(imported_dynamo: bool) -> None:
    """A rank reports whether it imported ``torch._dynamo`` (its first optimizer step does): the
    parent warms it before every later launch."""
    global _optimizer_seen
    _optimizer_seen = _optimizer_seen or imported_dynamo


def uses_optimizer(fn, args: tuple = (), depth: int = 6) -> bool:
    """Whether ``fn(*args)`` will step a ``torch.optim`` optimizer, as far as its code says: the
    names its code (and nested code) reads, followed through its globals, closures, modules, classes
    and partials up to ``depth`` calls away, reach ``torch.optim``. A call through an object's
    method is not followed; :func:`note_rank_imports` catches what this misses, after one launch."""
    seen: set[int] = set()
    todo = [(obj, 0) for obj in (fn, *args)]
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen or level > depth:
            continue
        seen.add(id(obj))
        module = obj.__name__ if isinstance(
            obj, types.ModuleType) else getattr(obj, "__module__", None) or ""
        if module.startswith("torch.optim"):
            return True
        if isinstance(obj, functools.partial):
            todo += [(part, level) for part in (obj.func, *obj.args, *obj.keywords.values())]
            continue
        if not _readable(module):
            continue
        if isinstance(obj, type):
            todo += [(getattr(v, "__func__", v), level + 1) for v in vars(obj).values()
                     if callable(v)
                     or isinstance(v, (staticmethod, classmethod))]
            continue
        obj = getattr(obj, "__func__", obj)  # a bound method
        code = getattr(obj, "__code__", None)
        if not isinstance(code, types.CodeType):
            continue
        names, codes = set(), [code]
        while codes:
            c = codes.pop()
            names.update(c.co_names)
            codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        found = [obj.__globals__[name] for name in names if name in getattr(obj, "__globals__", {})]
        found += [cell.cell_contents for cell in obj.__closure__ or () if _filled(cell)]
        for value in found:
            if isinstance(value, types.ModuleType) and (value.__name__ == "torch"
                                                        or _readable(value.__name__)):
                todo += [(getattr(value, name), level + 1) for name in names if name in vars(value)]
            todo.append((value, level + 1))
    return False


_INSTALLED = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib",
                                                           "platlib")})


def _readable(module: str) -> bool:
    """Code :func:`uses_optimizer` reads: minitp's, a notebook's or a script's; not torch's, the
    standard library's or another installed package's."""
    if module.startswith("minitp") or module in ("__main__", "builtins") or not module:
        return module != "builtins"
    path = getattr(sys.modules.get(module), "__file__", None) or ""
    return bool(path) and not path.startswith(_INSTALLED)


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty closure cell
        return False
    return True


def warm_optimizer_imports(fn=None, args: tuple = ()) -> None:
    """Import what a rank's first optimizer step imports (``torch._dynamo``, ~1.2 s of CPU) once in
    the parent before forking, so that the ranks inherit it instead of each paying it (8 ranks on 2
    cores would otherwise spend seconds importing before their first step): when ``fn`` will use an
    optimizer (:func:`uses_optimizer`), or when a rank of an earlier launch had to import it. A
    launch without an optimizer does not pay it."""
    if "torch._dynamo" in sys.modules:
        return
    if fn is None or _optimizer_seen or uses_optimizer(fn, args):
        import importlib

        importlib.import_module("torch._dynamo")
