"""The mesh's arithmetic: rank <-> coordinates, the groups of each dimension, the layouts a world
allows, and what composes with what. Pure integers, no process group: ``minitp.mesh.Mesh`` builds
its groups from it; the planner and the parent process (before any worker starts) check layouts with
it. The per-strategy arithmetic (stages, tp splits, shards, buckets, cp chunks) is
``minitp.layout``.
"""

from __future__ import annotations

from dataclasses import dataclass

from minitp.layout import AXES, check_divisible, check_positive, check_stages, tp_split_sizes


# -- the mesh: rank = (dp_rank · pp + pp_rank) · tp + tp_rank, tp fastest, dp slowest --------------
@dataclass(frozen=True)
class Coordinates:
    """Where a rank sits on the mesh."""

    dp: int
    pp: int
    tp: int


def check_layout(dp: int, pp: int, tp: int, world_size: int) -> None:
    """Refuse a layout whose sizes are not positive integers or whose product is not the world."""
    for name, size in zip(AXES, (dp, pp, tp)):
        check_positive(name, size)
    if dp * pp * tp != world_size:
        raise ValueError(
            f"dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} but the world has {world_size} ranks")


def layouts(world_size: int) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) whose product is ``world_size``, by tp then pp, smallest first."""
    out = []
    for tp in range(1, world_size + 1):
        if world_size % tp:
            continue
        for pp in range(1, world_size // tp + 1):
            if (world_size // tp) % pp == 0:
                out.append((world_size // (tp * pp), pp, tp))
    return out


def rank_of(dp_rank: int, pp_rank: int, tp_rank: int, pp: int, tp: int) -> int:
    """The global rank at mesh position (dp_rank, pp_rank, tp_rank)."""
    return (dp_rank * pp + pp_rank) * tp + tp_rank


def coordinates(rank: int, dp: int, pp: int, tp: int) -> Coordinates:
    """The mesh position of global ``rank``: the inverse of ``rank_of``."""
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} is not in a mesh of dp*pp*tp = {dp * pp * tp} ranks")
    return Coordinates(rank // (pp * tp), rank // tp % pp, rank % tp)


def group_lists(dp: int, pp: int, tp: int) -> dict[str, list[list[int]]]:
    """Every group of each dimension, as lists of global ranks, in the order ``Mesh`` creates them:
    {"tp": [[0, 1], [2, 3], ...], "pp": [...], "dp": [...]}. A group holds the other two coordinates
    fixed and runs its own through its range."""
    check_layout(dp, pp, tp, dp * pp * tp)
    return {
        "tp": [[rank_of(d, p, t, pp, tp) for t in range(tp)] for d in range(dp) for p in range(pp)],
        "pp": [[rank_of(d, p, t, pp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "dp": [[rank_of(d, p, t, pp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)],
    }


def check_tp_within_node(tp: int, procs_per_node: int) -> None:
    """Refuse a tensor-parallel group that would straddle machines: with ranks placed tp-fastest,
    each group stays on one machine exactly when ``procs_per_node`` is a multiple of tp."""
    if procs_per_node % tp:
        raise ValueError(
            f"tp={tp} does not divide the {procs_per_node} processes per node: a tensor-parallel "
            f"group would span two machines; use --nproc-per-node a multiple of {tp}")


def check_zero(data_parallel: str, zero: int | None, pp: int) -> int | None:
    """FSDP's ZeRO stage for a layout: 3 by default, 1 with a pipeline (its micro-batches' gradients
    must add up whole before they are sharded), and 2 or 3 with a pipeline refused. None for DDP."""
    if data_parallel != "fsdp":
        return None
    if zero is None:
        return 1 if pp > 1 else 3
    if zero not in (1, 2, 3):
        raise ValueError(f"zero must be 1, 2 or 3, got {zero!r}")
    if pp > 1 and zero != 1:
        raise ValueError(
            f"FSDP with pp={pp} needs zero=1, got zero={zero}: each micro-batch runs its own "
            f"backward, and ZeRO-2/3 shard the gradient during it (as DeepSpeed, minitp pairs "
            f"pipeline parallelism with ZeRO-1 only)")
    return zero


def check_composition(dp: int, pp: int, tp: int, cp: int = 1, ep: int = 1,
                      data_parallel: str = "ddp", schedule: str = "1f1b",
                      virtual_stages: int = 1) -> None:
    """What composes with what on a mesh, the only copy of these rules (the runner checks them in
    the parent, ``Parallel3D`` on every rank). dp: the replicas (cp and ep split them further)."""
    if data_parallel not in ("ddp", "fsdp"):
        raise ValueError(f"data_parallel must be 'ddp' or 'fsdp', got {data_parallel!r}")
    fsdp = data_parallel == "fsdp"
    if ep > 1:
        if tp > 1 or cp > 1 or fsdp or (pp > 1 and schedule == "interleaved"):
            raise ValueError(
                f"ep={ep} composes with dp (DDP) and pp: tp must be 1, without --cp, --fsdp or the "
                f"interleaved schedule (got tp={tp}, cp={cp}, fsdp={fsdp}, schedule={schedule!r})")
        check_divisible("dp", dp, "ep", ep, ": each run of ep dp ranks shares one set of experts")
    if virtual_stages > 1:
        if schedule != "interleaved":
            raise ValueError(f"virtual_stages={virtual_stages} is for schedule='interleaved', "
                             f"got schedule={schedule!r}")
        if pp == 1 or fsdp:
            raise ValueError(
                f"schedule='interleaved' needs pp > 1 and DDP (got pp={pp}, fsdp={fsdp})")
    elif schedule == "interleaved":
        raise ValueError("schedule='interleaved' needs virtual_stages >= 2 chunks per rank, got 1")
    if fsdp and pp > 1 and schedule == "zb":
        raise ValueError("schedule='zb' with fsdp: FSDP's gathered weights are views, and "
                         "zero-bubble's W needs each linear weight as a parameter of its own; use "
                         "DDP (no --fsdp) or another schedule")


def check_3d_layout(cfg, dp: int, pp: int, tp: int, world_size: int | None = None) -> None:
    """Refuse a layout the model cannot take, naming the numbers (mesh product, tp splits, pp
    stages). ``cfg``: a ``ModelConfig``; ``world_size`` None checks the sizes alone (the
    planner)."""
    if world_size is None:
        for name, size in zip(AXES, (dp, pp, tp)):
            check_positive(name, size)
    else:
        check_layout(dp, pp, tp, world_size)
    for what, size in tp_split_sizes(cfg):
        if size % tp:
            raise ValueError(f"tp={tp} does not divide {what}={size}")
    check_stages(cfg.n_layers, pp)
