"""The device mesh of 3D parallelism: the world's ranks laid out on a (dp, pp, tp) grid.

Every rank has three coordinates. Ranks that differ only in ``tp`` hold slices of the same layers
(tensor parallel); ranks that differ only in ``pp`` hold consecutive stages of one replica
(pipeline parallel); ranks that differ only in ``dp`` hold the same part of the model and read
different slices of the batch (data parallel). So each rank belongs to three process groups:

    rank = (dp_rank · pp + pp_rank) · tp + tp_rank          tp varies fastest, dp slowest

Why this order: tensor parallel talks the most (several all-reduces of the activations in every
layer, forward and backward), so its ranks are neighbours: with ``torchrun --nproc-per-node``
a multiple of tp, each tensor-parallel group sits inside one machine on its fast links. Pipeline
neighbours exchange one activation per micro-batch; data parallel syncs gradients once a step and
can span machines.

    dp=2, pp=2, tp=2 (8 ranks)        tp groups {0,1} {2,3} {4,5} {6,7}
      replica 0: stage 0 = [0 1]      pp groups {0,2} {1,3} {4,6} {5,7}
                 stage 1 = [2 3]      dp groups {0,4} {1,5} {2,6} {3,7}
      replica 1: stage 0 = [4 5]
                 stage 1 = [6 7]

``torch.distributed.new_group`` must be called by every rank of the world, for every group, in
the same order (even for groups the rank is not in), so ``Mesh`` builds all of them, in a fixed
order, and keeps the three it belongs to. The layout arithmetic needs no process group and is
usable anywhere (the planner, the parent process, tests).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from minitp import tp as _tp
from minitp import trace as _trace
from minitp.ddp import DistributedDataParallel, split_batch
from minitp.fsdp import FullyShardedDataParallel
from minitp.memory import held_bytes
from minitp.models import loss_fn, make_optimizer
from minitp.pp import Pipeline

DIMS = ("dp", "pp", "tp")  # slowest to fastest


def check_layout(dp: int, pp: int, tp: int, world_size: int) -> None:
    """Refuse a layout whose sizes are not positive integers or whose product is not the world."""
    for name, size in zip(DIMS, (dp, pp, tp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
    if dp * pp * tp != world_size:
        raise ValueError(f"dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} but the world has {world_size} ranks")


@dataclass(frozen=True)
class Coordinates:
    """Where a rank sits on the mesh."""

    dp: int
    pp: int
    tp: int


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
    {"tp": [[0, 1], [2, 3], ...], "pp": [...], "dp": [...]}."""
    check_layout(dp, pp, tp, dp * pp * tp)
    return {
        "tp": [[rank_of(d, p, t, pp, tp) for t in range(tp)] for d in range(dp) for p in range(pp)],
        "pp": [[rank_of(d, p, t, pp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "dp": [[rank_of(d, p, t, pp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)],
    }


class Mesh:
    """This rank's place on a (dp, pp, tp) mesh over the whole world, and its three process groups.

    Call it on every rank at once, after the world's process group exists (``minitp.launch`` or
    torchrun set it up): it creates every group of every dimension, collectively.

        mesh = Mesh(dp=2, pp=2, tp=2)
        mesh.tp_group, mesh.pp_group, mesh.dp_group   # pass these to tp / pp / ddp / fsdp
        mesh.coords                                   # Coordinates(dp=1, pp=0, tp=1) on rank 5
    """

    def __init__(self, dp: int, pp: int, tp: int):
        world = dist.get_world_size()
        check_layout(dp, pp, tp, world)
        self.dp, self.pp, self.tp = dp, pp, tp
        self.world_size, self.rank = world, dist.get_rank()
        self.coords = coordinates(self.rank, dp, pp, tp)
        self.group_ranks: dict[str, list[int]] = {}
        groups = {}
        for dim, lists in group_lists(dp, pp, tp).items():  # the same order on every rank
            for ranks in lists:
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    groups[dim], self.group_ranks[dim] = group, ranks
        self.tp_group, self.pp_group, self.dp_group = groups["tp"], groups["pp"], groups["dp"]

    @property
    def shape(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    def group(self, dim: str) -> dist.ProcessGroup:
        """The group of dimension ``dim`` ("dp", "pp" or "tp") this rank is in."""
        if dim not in DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; expected one of {', '.join(DIMS)}")
        return getattr(self, f"{dim}_group")

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return rank_of(dp_rank, pp_rank, tp_rank, self.pp, self.tp)

    def __repr__(self) -> str:
        c = self.coords
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}; rank {self.rank} at "
                f"dp={c.dp} pp={c.pp} tp={c.tp})")


def check_tp_within_node(tp: int, procs_per_node: int) -> None:
    """Refuse a tensor-parallel group that would straddle machines: with ranks placed tp-fastest,
    each group stays on one machine exactly when ``procs_per_node`` is a multiple of tp."""
    if procs_per_node % tp:
        raise ValueError(f"tp={tp} does not divide the {procs_per_node} processes per node: a tensor-parallel "
                         f"group would span two machines; use --nproc-per-node a multiple of {tp}")


# -- the three strategies composed ------------------------------------------------------------------------
class Parallel3D:
    """A plain model trained on a mesh, each strategy applied from outside by the earlier chapters' code:

    1. ``tp.parallelize`` over the tp group: every matrix split, the logits sharded over the vocabulary
       (trained with ``tp.vocab_parallel_cross_entropy``);
    2. ``pp.Pipeline`` over the pp group: this rank keeps its stage's blocks (already tp-split) and runs
       the schedule over ``microbatches`` micro-batches of its share of the batch;
    3. ``ddp.DistributedDataParallel`` or ``fsdp.FullyShardedDataParallel`` over the dp group, on what
       this rank holds. Replicas of a tp slice hold the same tensor, so averaging over dp is all they
       need; the replicated norm weights need no tp message (without sequence parallel every tp rank
       computes the same full gradient for them).

    With pp > 1 each micro-batch runs its own backward, so data parallel waits: gradients accumulate
    under ``no_sync`` and are averaged once after the schedule (FSDP: ZeRO-1 only, see ``fsdp.no_sync``).
    A dimension of size 1 is left out (no wrapper, no message).
    """

    def __init__(self, model, mesh: Mesh, data_parallel: str = "ddp", zero: int | None = None,
                 microbatches: int = 1, schedule: str = "1f1b", lr: float = 3e-3, bucket_mb: float = 25.0):
        if data_parallel not in ("ddp", "fsdp"):
            raise ValueError(f"data_parallel must be 'ddp' or 'fsdp', got {data_parallel!r}")
        self.zero = check_zero(data_parallel, zero, mesh.pp)
        self.mesh, self.data_parallel = mesh, data_parallel
        self.loss = loss_fn
        if mesh.tp > 1:
            _tp.parallelize(model, mesh.tp_group)  # logits (B, S, V/tp)
            self.loss = lambda logits, targets: _tp.vocab_parallel_cross_entropy(logits, targets, mesh.tp_group)
        self.pipeline = None
        module = model
        if mesh.pp > 1:
            self.pipeline = Pipeline(model, mesh.pp_group, schedule, microbatches, loss=self.loss)
            module = self.pipeline.module  # this stage's pieces, under the plain model's names
        self.module = module  # what this rank holds
        # which dim of each parameter tp split (None: replicated), read before FSDP takes the parameters
        self.split_dims = split_dims(module)
        self.ddp = self.fsdp = None
        self.step_model = module
        if mesh.dp > 1 and data_parallel == "ddp":
            self.ddp = self.step_model = DistributedDataParallel(module, mesh.dp_group, bucket_mb=bucket_mb)
        elif mesh.dp > 1:
            self.fsdp = self.step_model = FullyShardedDataParallel(module, mesh.dp_group, zero=self.zero)
            if self.pipeline is not None:  # the pipeline runs the FSDP-wrapped stage
                for attr in ("is_first", "is_last", "dim"):
                    setattr(self.fsdp, attr, getattr(module, attr))
                self.pipeline.module = self.fsdp
        params = self.fsdp.parameters() if self.fsdp else module.parameters()
        self.optimizer = make_optimizer(params, lr)
        if self.fsdp:
            self.fsdp.attach(self.optimizer)

    def forward_backward(self, tokens, targets) -> float | None:
        """Forward and backward of one global batch (B, S), the same on every rank; gradients end
        averaged over dp. Returns the loss of this replica's share (None off the last stage)."""
        if self.mesh.dp > 1:  # this replica's rows: (B, S) → (B/dp, S)
            tokens, targets = split_batch(tokens, self.mesh.dp_group), split_batch(targets, self.mesh.dp_group)
        if self.pipeline is None:
            with _trace.span("forward"):
                loss = self.loss(self.step_model(tokens), targets)
            with _trace.span("backward"):
                loss.backward()
            return loss.item()
        wrapper = self.ddp or self.fsdp
        with wrapper.no_sync() if wrapper else nullcontext():
            record = self.pipeline.forward_backward(tokens, targets)
        if self.ddp:
            self.ddp.all_reduce_gradients()
        elif self.fsdp:
            self.fsdp.reduce_gradients()
        return record.loss

    def train_step(self, tokens, targets) -> float | None:
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.forward_backward(tokens, targets)
        with _trace.span("optimizer"):
            self.optimizer.step()
        return loss

    def held_bytes(self) -> dict[str, int]:
        return self.fsdp.held_bytes() if self.fsdp else held_bytes(self.module.parameters(), self.optimizer)

    def local_shards(self) -> dict:
        """{name: (tensor, tp split dim)}: this rank's tp slice of each parameter of its stage, whole
        over dp (FSDP gathers its shards: a collective, call it on every rank)."""
        if self.fsdp:
            state = self.fsdp.full_state_dict()
        else:
            state = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        return {name: (state[name], self.split_dims[name]) for name in self.split_dims}


def check_zero(data_parallel: str, zero: int | None, pp: int) -> int | None:
    """FSDP's ZeRO stage for a layout: 3 by default, 1 with a pipeline (its micro-batches' gradients
    must add up whole before they are sharded), and 2 or 3 with a pipeline refused."""
    if data_parallel != "fsdp":
        return None
    if zero is None:
        return 1 if pp > 1 else 3
    if zero not in (1, 2, 3):
        raise ValueError(f"zero must be 1, 2 or 3, got {zero!r}")
    if pp > 1 and zero != 1:
        raise ValueError(f"FSDP with pp={pp} needs zero=1, got zero={zero}: each micro-batch runs its own "
                         f"backward, and ZeRO-2/3 shard the gradient during it (as DeepSpeed, minitp pairs "
                         f"pipeline parallelism with ZeRO-1 only)")
    return zero


def split_dims(module: nn.Module) -> dict[str, int | None]:
    """{parameter name: the dim tensor parallel split it along, or None where it is replicated}."""
    return {f"{m}.{n}" if m else n: getattr(sub, "split_dims", {}).get(n)
            for m, sub in module.named_modules() for n, _ in sub.named_parameters(recurse=False)}


def unshard_3d(shards: list[list[dict]]) -> dict:
    """Whole tensors from one replica's ``Parallel3D.local_shards``: ``shards[stage][tp_rank]``. The
    tp slices are concatenated along their split dim, the stages' names put together. No message."""
    full = {}
    for stage in shards:
        full.update(_tp.unshard(stage, 0))
    return full
