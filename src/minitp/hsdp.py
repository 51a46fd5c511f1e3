"""Hybrid sharded data parallel (HSDP): FSDP inside a group of ranks, plain data parallel across
the groups.

The data-parallel ranks stand on an R × S grid: R **replicas** of the model, each sharded ZeRO-3
style over its own S ranks. Rank ``r·S + s`` is shard ``s`` of replica ``r``, and belongs to two
groups:

* its **shard group**, the S ranks of its replica: FSDP's group. Every unit's parameters are
  all-gathered in it (in forward, and again in backward if resharded) and every unit's gradient is
  reduce-scattered in it, exactly as ``minitp.fsdp`` does on S ranks;
* its **replicate group**, the R ranks that hold the same shard ``s`` in every replica: after the
  reduce-scatter, each rank all-reduces its gradient shard there, so every replica ends the step
  with the same averaged gradient, and its optimizer takes the same step on the same shard.

::

    R=2, S=2 (4 ranks)     shard groups      {0,1} {2,3}   all-gather, reduce-scatter
      replica 0: [0 1]     replicate groups  {0,2} {1,3}   all-reduce of the gradient shard
      replica 1: [2 3]

Why: ZeRO-3 over all N = R·S ranks sends every unit's parameters twice and its gradient once per
step across all N, so every message pays the slowest link of the job (between machines). HSDP
keeps the gathers and reduce-scatters inside a shard group (one machine's fast links, when S ranks
fit on it: shard is the fastest-varying coordinate, as tp is in ``minitp.mesh``); the only message
that crosses groups is the all-reduce of a gradient shard, 1/S of the gradient. The price is
memory: a rank holds 1/S of the model, gradients and optimizer state, not 1/N. S = N is FSDP;
S = 1 is DDP (each unit all-reduced whole).

What each rank sends in a step (``minitp.cost.hsdp_step_bytes``), with P_u a unit's padded size:

    shard group      what FSDP sends on S ranks: Σ_u (S-1)/S · P_u · (g_u·b_param + b_reduce)
    replicate group  one all-reduce of each unit's shard:  Σ_u 2(R-1)/R · P_u/S · b_reduce

The averaging: FSDP divides each rank's gradient by S before the reduce-scatter (the mean over the
shard group); here that mean is divided by R and summed over the replicate group: the mean over
all R·S ranks, the gradient of the whole batch. Both sums run in fp32 (bf16 mixed precision
included), so a parameter no rank used still arrives as -0.0 (see ``minitp.ddp``).

This is PyTorch's ``fully_shard`` on a 2-D DeviceMesh ("replicate", "shard") and torchtitan's
``data_parallel_replicate_degree`` × ``data_parallel_shard_degree``. The messages go through groups
named "dp_shard" and "dp_replicate" (``Event.dim``), so a trace splits the traffic by them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minitp import comm
from minitp import trace as _trace
from minitp.fsdp import FullyShardedDataParallel
from minitp.fsdp_units import Unit
from minitp.layout import DP_HALVES, check_positive
from minitp.mesh import make_groups

SHARD, REPLICATE = DP_HALVES  # the two groups' names in a trace (Event.dim)


def check_hsdp(replicate: int, shard: int, world_size: int) -> None:
    """Refuse a grid that is not the world: ``shard`` must divide it and ``replicate × shard`` be
    it. Pure arithmetic: the parent asks before any process starts."""
    check_positive("replicate", replicate)
    check_positive("shard", shard)
    if world_size % shard:
        raise ValueError(f"shard={shard} does not divide the world's {world_size} ranks: HSDP "
                         f"needs replicate × shard = {world_size}")
    if replicate * shard != world_size:
        raise ValueError(f"replicate={replicate} × shard={shard} = {replicate * shard} ranks, "
                         f"expected the world's {world_size} (replicate={world_size // shard})")


def hsdp_group_ranks(replicate: int, shard: int) -> dict[str, list[list[int]]]:
    """The ranks of every group, in the order they are made: {SHARD: R lists of S consecutive
    ranks, REPLICATE: S lists of R ranks, one per position in a shard group}."""
    check_positive("replicate", replicate)
    check_positive("shard", shard)
    world = replicate * shard
    shard_groups = [list(range(r * shard, (r + 1) * shard)) for r in range(replicate)]
    replicate_groups = [list(range(s, world, shard)) for s in range(shard)]
    return {SHARD: shard_groups, REPLICATE: replicate_groups}


def hsdp_groups(replicate: int, shard: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Make the shard and replicate groups of an R × S grid over the world; return this rank's
    (shard_group, replicate_group). Collective: every rank calls ``new_group`` for every group, in
    the same order (as ``minitp.mesh.Mesh`` does), and keeps the two it belongs to."""
    check_hsdp(replicate, shard, dist.get_world_size())
    mine = {dim: make_groups(dim, lists)[0]  # named: its messages' Event.dim
            for dim, lists in hsdp_group_ranks(replicate, shard).items()}
    return mine[SHARD], mine[REPLICATE]


class HybridShardedDataParallel(FullyShardedDataParallel):
    """FSDP over ``shard_group`` (every option of ``FullyShardedDataParallel`` applies, ZeRO-3 by
    default), plus one all-reduce of each unit's gradient shard over ``replicate_group``.

    module: the plain model, built the same way (same seed) on every rank.
    shard_group, replicate_group: this rank's two groups (``hsdp_groups`` makes them).

    Use it as FSDP: ``optimizer = hsdp.attach(torch.optim.AdamW(hsdp.parameters(), ...))``; each
    rank's optimizer steps its 1/S shard, the same shard on every replica.
    """

    def __init__(self, module: nn.Module, shard_group: dist.ProcessGroup,
                 replicate_group: dist.ProcessGroup, **fsdp_options):
        # named before FSDP names its group "fsdp" (unless named, so hsdp_groups' names stay)
        comm.name_group(shard_group, SHARD, unless_named=True)
        comm.name_group(replicate_group, REPLICATE, unless_named=True)
        super().__init__(module, shard_group, **fsdp_options)
        self.replicate_group = replicate_group
        self.replicas = comm.group_size(replicate_group)  # R

    @torch.no_grad()
    def _reduce_across_replicas(self, unit: Unit, out: torch.Tensor) -> None:
        """``out``: (P/S,) fp32, this rank's shard of the unit's gradient, already the mean over
        its shard group. Divided by R and summed over the replicate group, in place: the mean over
        all R·S ranks, identical on every replica."""
        out.div_(self.replicas)
        with _trace.tagged(unit=unit.name, phase="backward"):
            comm.all_reduce(out, group=self.replicate_group,
                            label=f"hsdp/{unit.name}/all_reduce.replicate")
