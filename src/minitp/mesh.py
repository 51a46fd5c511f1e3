"""The device mesh: the world's ranks on a (dp, pp, tp) grid, the dp axis split further by context
and expert parallel. Every process group of every dimension is made here, and only here.

Every rank has three coordinates. Ranks that differ only in ``tp`` hold slices of the same layers
(tensor parallel); ranks that differ only in ``pp`` hold consecutive stages of one replica
(pipeline parallel); ranks that differ only in ``dp`` hold the same part of the model and average
their gradients (data parallel). So each rank belongs to three process groups:

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

The two other dimensions split a dp group (the ranks that average gradients together):

* cp: each run of cp consecutive ranks of a dp group is one context-parallel group: one replica's
  sequences, cut along the positions. The dp axis then holds dp/cp replicas × cp.
* ep: each run of ep consecutive ranks of a dp group shares one set of experts (an ep group); the
  ranks at the same place in every run hold the same experts (an expert-dp group, named "dp").
* dp_shard (HSDP, ``minitp.hsdp``): each run of dp_shard consecutive ranks of a dp group is one
  shard group ("dp_shard", FSDP inside); the ranks at the same place in every run are a replicate
  group ("dp_replicate", the all-reduce of their gradient shard). The dp axis then holds
  dp/dp_shard replicas × dp_shard shards, shard varying fastest.

    dp=4 as 2 × 2, pp=1, tp=2       dp groups        {0,2,4,6} {1,3,5,7}
                                    dp_shard groups  {0,2} {4,6} {1,3} {5,7}
                                    dp_replicate     {0,4} {2,6} {1,5} {3,7}

``torch.distributed.new_group`` must be called by every rank of the world, for every group, in
the same order (even for groups the rank is not in), so ``Mesh`` builds all of them, in a fixed
order, and keeps the ones it belongs to. The arithmetic needs no process group and lives in
``minitp.grid`` (with ``ParallelDims``, what composes with what); the trainer that composes
the strategies on a mesh is ``minitp.parallel3d.Parallel3D``.
"""

from __future__ import annotations

import torch.distributed as dist

from minitp import comm
from minitp.grid import check_layout, coordinates, group_lists, rank_of
from minitp.layout import AXES, DIMS, DP_HALVES, check_divisible


def make_groups(dim: str, lists: list[list[int]]):
    """Create every group of ``lists`` (collective: all ranks, same order), name each ``dim``;
    return (the one this rank is in, its ranks), or (None, None). The one place groups are made:
    the mesh's dimensions, and HSDP's two halves of data parallel (``minitp.hsdp``)."""
    mine, members = None, None
    for ranks in lists:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            comm.name_group(group, dim)  # its messages are recorded with Event.dim == dim
            mine, members = group, ranks
    return mine, members


class Mesh:
    """This rank's place on a (dp, pp, tp) mesh over the whole world, and its process groups.

    Call it on every rank at once, after the world's process group exists (``minitp.launch`` or
    torchrun set it up): it creates every group of every dimension, collectively.

        mesh = Mesh(dp=2, pp=2, tp=2)
        mesh.tp_group, mesh.pp_group, mesh.dp_group   # pass these to tp / pp / ddp / fsdp
        mesh.coords                                   # Coordinates(dp=1, pp=0, tp=1) on rank 5

    cp, ep: split each dp group (of ``dp`` ranks) into context-parallel groups of cp ranks
    (``cp_group``) or expert groups of ep ranks (``ep_group``, with ``expert_dp_group``); None when
    1.
    dp_shard: HSDP's shard groups of dp_shard ranks (``dp_shard_group``) and its replicate groups
    of dp/dp_shard ranks (``dp_replicate_group``), both cut from each dp group; None: not made.
    """

    def __init__(self, dp: int, pp: int, tp: int, cp: int = 1, ep: int = 1,
                 dp_shard: int | None = None):
        world = dist.get_world_size()
        check_layout(dp, pp, tp, world)
        check_divisible("the mesh's dp", dp, "cp", cp, ": it holds dp·cp ranks")
        check_divisible("dp", dp, "ep", ep, ": the experts are split over ep of the dp ranks")
        if dp_shard is not None:
            check_divisible("dp", dp, "dp_shard", dp_shard,
                            ": HSDP splits the dp ranks into replicas of dp_shard ranks each")
        self.dp, self.pp, self.tp, self.cp, self.ep = dp, pp, tp, cp, ep
        self.dp_shard = dp_shard
        self.world_size, self.rank = world, dist.get_rank()
        self.coords = coordinates(self.rank, dp, pp, tp)
        self.group_ranks: dict[str, list[int]] = {}
        self.cp_group = self.ep_group = self.expert_dp_group = None
        self.dp_shard_group = self.dp_replicate_group = None
        lists = group_lists(dp, pp, tp)
        # tp, pp, dp (the fastest axis first): the same order on every rank
        groups = {dim: self._make(dim, lists[dim]) for dim in reversed(AXES)}
        self.tp_group, self.pp_group, self.dp_group = groups["tp"], groups["pp"], groups["dp"]
        if cp > 1:
            self.cp_group = self._make("cp", [ranks[i:i + cp] for ranks in lists["dp"]
                                              for i in range(0, dp, cp)])
        if ep > 1:
            for ranks in lists["dp"]:  # per dp group: its ep runs, then its expert-dp groups
                self.ep_group = self._make("ep", [ranks[i:i + ep]
                                                  for i in range(0, dp, ep)]) or self.ep_group
                expert_dp = self._make("dp", [ranks[j::ep] for j in range(ep)], key="expert_dp")
                self.expert_dp_group = expert_dp or self.expert_dp_group
        if dp_shard is not None:
            shard, replicate = DP_HALVES
            # every dp group's shard groups (consecutive runs), then its replicate groups (strides)
            self.dp_shard_group = self._make(shard, [ranks[i:i + dp_shard] for ranks in lists["dp"]
                                                     for i in range(0, dp, dp_shard)])
            self.dp_replicate_group = self._make(replicate, [ranks[j::dp_shard]
                                                             for ranks in lists["dp"]
                                                             for j in range(dp_shard)])

    def _make(self, dim: str, lists: list[list[int]], key: str | None = None):
        """``make_groups``, keeping the members of the one this rank is in."""
        mine, ranks = make_groups(dim, lists)
        if mine is not None:
            self.group_ranks[key or dim] = ranks
        return mine

    @property
    def shape(self) -> dict[str, int]:
        """The grid's three axes (what a checkpoint records; cp and ep split the dp axis)."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The group of dimension ``dim`` (one of ``minitp.layout.DIMS``) this rank is in."""
        if dim not in DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; expected one of {', '.join(DIMS)}")
        return {"dp": self.dp_group, "pp": self.pp_group, "tp": self.tp_group, "cp": self.cp_group,
                "ep": self.ep_group}[dim]

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return rank_of(dp_rank, pp_rank, tp_rank, self.pp, self.tp)

    def __repr__(self) -> str:
        c = self.coords
        extra = "".join(f", {d}={getattr(self, d)}" for d in ("cp", "ep") if getattr(self, d) > 1)
        extra += f", dp_shard={self.dp_shard}" if self.dp_shard is not None else ""
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}{extra}; rank {self.rank} at "
                f"dp={c.dp} pp={c.pp} tp={c.tp})")
