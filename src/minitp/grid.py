"""The mesh's arithmetic: rank <-> coordinates, the groups of each dimension, the layouts a world
allows, and what composes with what (``ParallelDims``). Pure integers, no process group:
``minitp.mesh.Mesh`` builds its groups from it; the planner and the parent process (before any
worker starts) check layouts with it. The per-strategy arithmetic (stages, tp splits, shards,
buckets, cp chunks) is ``minitp.layout``.
"""

from __future__ import annotations

from dataclasses import dataclass

from minitp.layout import (
    AXES,
    CP_ATTENTIONS,
    DIMS,
    check_divisible,
    check_positive,
    check_stages,
    tp_split_sizes,
)


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
    must add up whole before they are sharded), and 2 or 3 with a pipeline refused. None for DDP.
    HSDP ("hsdp") is FSDP inside each shard group: the same stages."""
    if data_parallel not in ("fsdp", "hsdp"):
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


# -- what composes with what: one object, checked when made ---------------------------------------
@dataclass(frozen=True)
class ParallelDims:
    """Which dimensions are on, how big, and what composes with what: the only copy of these rules.
    Made (and so checked) once in the parent process before any worker starts, by ``minitp train``'s
    ``Settings``, the 3D runner and the CLI, then again on every rank by ``Parallel3D``; each asks
    this object rather than a rule of its own. ``check_model`` adds what the model must allow.

    dp: the replicas, each a copy of the model that sees its rows of the batch; cp splits each
    replica's sequence and ep its experts, both inside the dp ranks (the mesh's dp axis holds
    dp·cp ranks, ``mesh_dp``). pp and tp are the mesh's other two axes. ``zero`` comes out
    resolved: FSDP's stage (3 by default, 1 with a pipeline), None under DDP.

    data_parallel "hsdp": the dp replicas split into dp/dp_shard replica groups of ``dp_shard``
    shards (``minitp.hsdp``: FSDP over each shard group, the gradient shards all-reduced across
    the replicas); with dp, pp and tp only (no cp, no ep).
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    data_parallel: str = "ddp"  # or "fsdp", "hsdp": what the replicas are
    zero: int | None = None
    schedule: str = "1f1b"  # the pipeline's (minitp.pp.SCHEDULES)
    virtual_stages: int = 1  # chunks per rank, for schedule "interleaved"
    cp_attention: str = "ring"  # how attention crosses the cp group (CP_ATTENTIONS)
    dp_shard: int | None = None  # HSDP's shard group: dp_shard of the dp replicas

    def __post_init__(self):
        for name in DIMS:
            check_positive(name, getattr(self, name))
        if self.data_parallel not in ("ddp", "fsdp", "hsdp"):
            raise ValueError(
                f"data_parallel must be 'ddp', 'fsdp' or 'hsdp', got {self.data_parallel!r}")
        check_cp_attention(self.cp_attention)
        dp, pp, tp, cp, ep = (getattr(self, name) for name in DIMS)
        self._check_hsdp()
        fsdp, schedule, v = self.sharded, self.schedule, self.virtual_stages
        if ep > 1:
            if tp > 1 or cp > 1 or fsdp or (pp > 1 and schedule == "interleaved"):
                raise ValueError(
                    f"ep={ep} composes with dp (DDP) and pp: tp must be 1, without --cp, --fsdp "
                    f"or the interleaved schedule (got tp={tp}, cp={cp}, fsdp={fsdp}, "
                    f"schedule={schedule!r})")
            check_divisible("dp", dp, "ep", ep,
                            ": each run of ep dp ranks shares one set of experts")
        if v > 1:
            if schedule != "interleaved":
                raise ValueError(f"virtual_stages={v} is for schedule='interleaved', "
                                 f"got schedule={schedule!r}")
            if pp == 1 or fsdp:
                raise ValueError(
                    f"schedule='interleaved' needs pp > 1 and DDP (got pp={pp}, fsdp={fsdp})")
        elif schedule == "interleaved":
            raise ValueError(
                "schedule='interleaved' needs virtual_stages >= 2 chunks per rank, got 1")
        if fsdp and pp > 1 and schedule == "zb":
            raise ValueError("schedule='zb' with fsdp: FSDP's gathered weights are views, and "
                             "zero-bubble's W needs each linear weight as a parameter of its own; "
                             "use DDP (no --fsdp) or another schedule")
        object.__setattr__(self, "zero", check_zero(self.data_parallel, self.zero, pp))

    def _check_hsdp(self) -> None:
        """dp_shard goes with data_parallel "hsdp" and divides dp; HSDP composes with pp and tp."""
        hsdp, shard = self.data_parallel == "hsdp", self.dp_shard
        if shard is not None and not hsdp:
            raise ValueError(f"dp_shard={shard} is HSDP's shard group; it needs data_parallel "
                             f"'hsdp', got {self.data_parallel!r}")
        if not hsdp:
            return
        if shard is None:
            raise ValueError("data_parallel 'hsdp' needs dp_shard, the ranks of a shard group")
        check_positive("dp_shard", shard)
        check_divisible("dp", self.dp, "dp_shard", shard,
                        f": HSDP makes dp/dp_shard replicas of dp_shard shards each "
                        f"(dp_shard one of {divisors(self.dp)})")
        if self.cp > 1 or self.ep > 1:
            raise ValueError(f"HSDP (dp_shard={shard}) composes with dp, pp and tp; got "
                             f"cp={self.cp}, ep={self.ep}")

    @property
    def fsdp(self) -> bool:
        return self.data_parallel == "fsdp"

    @property
    def sharded(self) -> bool:
        """FSDP over the dp axis or inside each of its shard groups (HSDP): the same rules."""
        return self.data_parallel in ("fsdp", "hsdp")

    @property
    def mesh_dp(self) -> int:
        """The mesh's dp axis: dp replicas of cp ranks each."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def on(self) -> tuple[str, ...]:
        """The dimensions of size > 1, in ``DIMS`` order: the ones that send messages."""
        return tuple(name for name in DIMS if getattr(self, name) > 1)

    @property
    def replicas(self) -> str | None:
        """What keeps the replicas equal: "expert_parallel" (it replaces DDP under ep), "ddp",
        "fsdp", "hsdp", or None when the mesh's dp axis has one rank."""
        if self.ep > 1:
            return "expert_parallel"
        return self.data_parallel if self.mesh_dp > 1 else None

    def check_model(self, cfg, world_size: int | None = None, seq_len: int | None = None) -> None:
        """Refuse what ``cfg`` (a ``ModelConfig`` or ``MoEConfig``) cannot take on these dimensions:
        the tp splits and pipeline stages (``check_3d_layout``, and the mesh's product against
        ``world_size`` when given), Ulysses' heads, a MoE's experts over ep (no expert split over
        tp, no auxiliary loss cut over cp), and ``seq_len`` over cp's 2·cp chunks when given."""
        check_3d_layout(cfg, self.mesh_dp, self.pp, self.tp, world_size)
        if self.virtual_stages > 1:
            check_stages(cfg.n_layers, self.pp * self.virtual_stages)
        if self.cp > 1 and self.cp_attention == "ulysses":
            check_ulysses_heads(cfg, self.cp, self.tp)
        if self.cp > 1 and seq_len is not None:
            check_divisible("seq_len", seq_len, "2*cp", 2 * self.cp,
                            ": load-balanced context parallel cuts the sequence into 2*cp equal "
                            "chunks")
        experts = getattr(cfg, "n_experts", None)
        if self.ep > 1 and experts is None:
            raise ValueError(f"ep={self.ep} needs a mixture of experts (a MoEConfig of "
                             f"minitp.models.moe; minitp train --model byte-moe), got "
                             f"{type(cfg).__name__}")
        if experts is not None and (self.tp > 1 or self.cp > 1):
            raise ValueError(f"a mixture of experts trains with tp = 1 and cp = 1 (got "
                             f"tp={self.tp}, cp={self.cp}): minitp splits no expert over tp, and "
                             "its load-balancing loss would be each cp rank's own positions', not "
                             "the sequence's; use dp, ep and pp")
        if experts is not None:
            check_divisible("n_experts", experts, "ep", self.ep, ": every rank holds E/ep experts")


def divisors(n: int) -> str:
    """``n``'s divisors in words: "1, 2, 4"."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_cp_attention(attention: str) -> str:
    """``attention`` if it is one of ``CP_ATTENTIONS``, else a ValueError naming them."""
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(CP_ATTENTIONS)}, got {attention!r}")
    return attention


def check_ulysses_heads(cfg, cp: int, tp: int = 1) -> None:
    """Ulysses gives each cp rank 1/cp of the heads a tp rank holds: cp must divide n_heads/tp and
    kv_heads/tp (ValueError naming the numbers otherwise)."""
    for name, heads in (("n_heads", cfg.n_heads), ("kv_heads", cfg.kv_heads)):
        if (heads // tp) % cp:
            per = f"{name}/tp = {heads}/{tp} = {heads // tp}" if tp > 1 else f"{name}={heads}"
            raise ValueError(
                f"Ulysses splits each tp rank's heads over cp: {per} is not divisible by cp={cp}")


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
