"""Under ``torchrun``, a launch runs in place: this process is one rank of torchrun's world, so
nothing is started. It joins torchrun's process group (checking that every rank came within
``guard.join_timeout``), runs the function under a trace recording, and hands every rank the same
``Results`` (all ranks' values and traces, gathered), so worker code runs unchanged. Nobody above us
enforces the run's timeout, so a watchdog thread does.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from minitp import trace as _trace
from minitp.launcher import guard
from minitp.launcher.results import LaunchError, Results
from minitp.launcher.stuck import call_line, in_flight


@dataclass
class _Ran:
    value: object
    trace: _trace.Trace


def _join(backend: str, rank: int, world: int, timeout: float) -> None:
    """Join torchrun's process group (env://: MASTER_ADDR, MASTER_PORT), every rank present within
    ``guard.join_timeout``; then the run's ``timeout`` holds for every collective. Torchrun's store
    outlives its restarts, so the ranks first agree on a generation of their own (``_generation``)
    and keep the group's keys under it: what a failed round left in the store is never read."""
    import torch.distributed as dist

    join = guard.join_timeout(timeout)
    env = os.environ
    where = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '?')}"
    deadline = time.monotonic() + join
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=join)))
        generation = _generation(store, rank, world, deadline)
    except Exception as e:
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LaunchError(
            f"rank {rank} of {world} could not join the process group at {where} within {join:g} s "
            f"(timeout={timeout:g} s; {guard.JOIN_TIMEOUT_ENV} sets the join's, "
            f"default {guard.JOIN_TIMEOUT_S} s): not all WORLD_SIZE={world} ranks came; "
            f"if torchrun did not start this process, RANK, WORLD_SIZE, MASTER_ADDR and "
            f"MASTER_PORT are stale: unset them ({said})") from e
    store.set_timeout(timedelta(seconds=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"{generation}/default_pg", store),
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def _generation(store, rank: int, world: int, deadline: float) -> str:
    """The key prefix every rank of this round derives alike, whichever agent restarted for which
    reason (an agent that lost a rank counts a restart in TORCHELASTIC_RESTART_COUNT, one that
    restarts for the other's new membership does not). Rank 0 draws the next generation from a
    counter in the store and opens it once every rank has checked in under it with a fresh nonce;
    a rank reads the counter, checks in, and takes the generation when the opening names its
    nonce: one left by a failed round never does."""
    nonce = uuid.uuid4().hex
    if rank == 0:
        generation = f"minitp/generation/{store.add('minitp/generation', 1)}"
        store.set(f"{generation}/rank0", nonce)
        keys = [f"{generation}/rank{r}" for r in range(world)]
        store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
        store.set(f"{generation}/open", json.dumps([store.get(k).decode() for k in keys]))
        return generation
    while True:
        drawn = store.add("minitp/generation", 0)  # 0: rank 0 has drawn none yet
        generation = f"minitp/generation/{drawn}"
        if drawn:
            store.set(f"{generation}/rank{rank}", nonce)
            if store.check([f"{generation}/open"]) or _opened_soon(store, generation):
                if nonce in json.loads(store.get(f"{generation}/open")):
                    return generation
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 opened no generation naming rank {rank}")
        time.sleep(0.05)


def _opened_soon(store, generation: str) -> bool:
    """Whether ``generation`` opens within a second (rank 0 is waiting for the others)."""
    try:
        store.wait([f"{generation}/open"], timedelta(seconds=1))
        return True
    except Exception:  # the store's timeout: not yet
        return False


def run_in_place(fn, args, backend: str, timeout: float) -> Results:
    """Run ``fn`` in this process, one rank of torchrun's world; nobody above us enforces the
    timeout, so a watchdog thread does."""
    import torch
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    t0 = time.perf_counter()
    main = threading.get_ident()
    watchdog = guard.start_watchdog(
        timeout, f"rank {rank} of {world}",
        where=lambda: call_line(rank, in_flight(sys._current_frames().get(main))))
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
