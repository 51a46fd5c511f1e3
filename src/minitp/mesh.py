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
order, and keeps the three it belongs to. The layout arithmetic needs no process group and lives
in ``minitp.layout`` (usable anywhere: the planner, the parent process, tests); the trainer that
composes the strategies on a mesh is ``minitp.parallel3d.Parallel3D``.
"""

from __future__ import annotations

import torch.distributed as dist

from minitp import comm
from minitp.layout import DIMS, check_layout, coordinates, group_lists, rank_of


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
                comm.name_group(group, dim)  # its messages are recorded with Event.dim == dim
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
