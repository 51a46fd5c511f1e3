"""What a launched rank does, from its first instruction to its exit: tie its life to the parent's,
send its output to its own files, be ready to say where it waits, join the group through the run's
rendezvous file, run the function under a trace recording, and leave its result for the parent in
one atomic file (``rank<r>.result``). Whatever happens, the rank exits through ``os._exit``: a
forked child never runs its parent's exit handlers.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import cloudpickle

from minitp import trace as _trace
from minitp.launcher import guard
from minitp.launcher import progress as _progress
from minitp.launcher.stuck import answer_where


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


def run_rank(rank: int, nprocs: int, payload: bytes, backend: str, workdir: str,
             timeout: float, master_port: int = 0) -> None:
    """Rank ``rank`` of ``nprocs``: run the ``(fn, args)`` the parent shipped in ``payload``; never
    returns. Its environment names what torchrun's would (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), so code written for torchrun reads
    them here too; the process group itself meets in a file of the run's folder."""
    _die_with_parent()
    _redirect_output(workdir, rank)
    answer_where(workdir, rank)
    stack_file = open(os.path.join(workdir, f"rank{rank}.stack"), "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    faulthandler.enable(file=sys.stderr)
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's clean-up handler
    os.environ.update({guard.WORKER_ENV: str(os.getpid()),
                       "RANK": str(rank),
                       "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(nprocs),
                       "LOCAL_WORLD_SIZE": str(nprocs),
                       "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(master_port),
                       "OMP_NUM_THREADS": "1",
                       _progress.DIR_ENV: workdir})
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
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=nprocs, timeout=timedelta(seconds=timeout))
        inherited = "torch._dynamo" in sys.modules
        with _trace.recording(rank) as tr:
            value = fn(*args)
        # the parent will warm it next time
        imported = not inherited and "torch._dynamo" in sys.modules
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
        data = cloudpickle.dumps({"status": "error", "value": None, "trace": None,
                                  "time": time.time(),
                                  "traceback": "the return value could not be pickled to send it "
                                               "back:\n" + traceback.format_exc()})
        status = "error"
    path = os.path.join(workdir, f"rank{rank}.result")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # the parent never reads half a result
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if status == "ok" else 1)
