"""3D parallelism: a plain model trained on a (dp, pp, tp) mesh, each strategy applied from outside
by the earlier chapters' code, in the order that lets each one see what it needs:

1. ``tp.parallelize`` over the tp group splits every matrix of the whole model;
2. ``pp.PipelineStage`` keeps this rank's stage of it (already tp-split);
3. ``ddp.DistributedDataParallel`` or ``fsdp.FullyShardedDataParallel`` over the dp group wraps
   what this rank holds (or ``hsdp.HybridShardedDataParallel``: FSDP over the rank's shard group,
   the gradient shards all-reduced over its replicate group, both cut from the dp group);
4. ``pp.Pipeline`` runs the schedule, calling the wrapper through a ``pp.StageSpec``: the pipeline
   knows the stage from its description, the wrapper knows nothing of pipelines.

Every wrapper of step 3 (and expert parallel's, in its place) keeps the same data-parallel protocol
(``minitp.replicas``: ``no_sync()``, ``finish_gradients()``), so the trainer never asks which one it
holds. Also here: the inverse, whole tensors from every rank's tp slices (``unshard_3d``). The mesh
and every group are in ``minitp.mesh``; the arithmetic and what composes with what in
``minitp.grid`` (``ParallelDims``, asked once at the top of ``Parallel3D``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from minitp import comm
from minitp import cp as _cp
from minitp import ep as _ep
from minitp import tp as _tp
from minitp import trace as _trace
from minitp.ddp import DistributedDataParallel, split_batch
from minitp.fsdp import FullyShardedDataParallel
from minitp.grid import ParallelDims
from minitp.hsdp import HybridShardedDataParallel
from minitp.measure.memory import held_bytes
from minitp.mesh import Mesh
from minitp.models import Transformer, loss_fn
from minitp.models.moe import MoEConfig, aux_loss, moe_layers
from minitp.models.train import make_optimizer
from minitp.pp import Pipeline, PipelineStage, StageSpec


class Parallel3D:
    """A plain model trained on a mesh: tensor parallel over the tp group (the logits sharded over
    the vocabulary, trained with ``tp.vocab_parallel_cross_entropy``), this rank's pipeline stage
    over the pp group (``microbatches`` micro-batches of its share of the batch per step), data
    parallel over the dp group (DDP, FSDP, or HSDP on the mesh's ``dp_shard`` groups: data_parallel
    "hsdp") on what the rank holds. Replicas of a tp slice hold the
    same tensor, so averaging over dp is all they need; the replicated norm weights need no tp
    message (without sequence parallel every tp rank computes the same full gradient for them).

    With pp > 1 each micro-batch runs its own backward, so data parallel waits: gradients accumulate
    under ``no_sync`` and are averaged once after the schedule (FSDP: ZeRO-1 only, see
    ``fsdp.no_sync``). A dimension of size 1 is left out (no wrapper, no message).

    mesh.cp: context parallel inside each replica (the mesh's dp axis holds dp·cp ranks): each
        attention a ring over the cp group, RoPE at the rank's positions (``cp.Context``);
        ``cp_attention``: "ring", "ulysses" (all-to-alls of the tp rank's heads) or "allgather"
        (every rank gathers the keys and values of the whole sequence).
    schedule "interleaved": ``virtual_stages`` chunks per rank (pieces r, r+pp, ... of pp·v), DDP
    only. mesh.ep: expert parallel for a MoE model (``minitp.models.moe``): each run of ep
    consecutive dp ranks shares one set of experts (``Mesh.ep_group``); ``ep.ExpertParallel`` then
    averages the replicated gradients over dp and each expert's over its dp/ep copies, in place of
    DDP (tp = 1; with pp, each stage's MoE layers add coef/m of their auxiliary loss to the
    backward).

    device: where the model, the batches and the messages go; by default ``minitp.comm.device()``
    (``cuda:LOCAL_RANK`` under NCCL, else the CPU).

    Read by others: ``mesh``, ``data_parallel``, ``zero``, ``module`` (the pieces this rank holds,
    under the plain model's names), ``split_dims``, ``replicas`` (the data-parallel wrapper,
    whichever: ``ddp``, ``fsdp`` or ``expert_parallel``; None when not used), ``context`` (context
    parallel's), ``pipeline`` (None when pp = 1), ``optimizer``, ``device``, ``config`` and
    ``whole_shapes`` (the plain model's config and {name: shape} before any split: what a checkpoint
    checks), ``aux_loss_coef`` and ``aux_per_step`` (a MoE's auxiliary loss under a pipeline: see
    ``forward_backward``).
    """

    def __init__(self, model: Transformer, mesh: Mesh, data_parallel: str = "ddp",
                 zero: int | None = None, microbatches: int = 1, schedule: str = "1f1b",
                 lr: float = 3e-3, bucket_mb: float = 25.0,
                 device: torch.device | str | None = None, virtual_stages: int = 1,
                 cp_attention: str = "ring"):
        # which dimensions are on and whether they compose: asked of one object, checked as made
        self.dims = ParallelDims(mesh.dp // mesh.cp, mesh.pp, mesh.tp, mesh.cp, mesh.ep,
                                 data_parallel, zero, schedule, virtual_stages, cp_attention,
                                 mesh.dp_shard)
        self.dims.check_model(model.config)
        self.mesh, self.data_parallel, self.zero = mesh, data_parallel, self.dims.zero
        # what a checkpoint stores and checks: the plain model's config and its whole shapes
        self.config = model.config
        self.whole_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.device = torch.device(device) if device is not None else comm.device()
        model.to(self.device)
        moe = isinstance(model.config, MoEConfig)
        self.aux_loss_coef = model.config.aux_loss_coef if moe else 0.0

        # 1. tensor parallel: every matrix of the whole model split over the tp group
        if mesh.tp > 1:
            _tp.parallelize(model, mesh.tp_group)
        # 2. context parallel: every attention across the cp group (the ring, Ulysses' all-to-alls
        # or the all-gathers), RoPE at this rank's (B/dp, S/cp) tokens' positions
        self.context = _cp.Context(mesh.cp_group, attention=cp_attention) if mesh.cp > 1 else None
        # 3. pipeline parallel: this rank's stage (interleaved: its v chunks, and the pipeline that
        # runs them, since no wrapper stands between them)
        self.module, self.pipeline = self._stage(model, schedule, microbatches, virtual_stages)
        # 4. expert parallel: this rank keeps its experts of each MoE layer, over the ep group
        self.expert_parallel = None
        if mesh.ep > 1:
            self.expert_parallel = _ep.ExpertParallel(self.module, mesh.ep_group, mesh.dp_group,
                                                      mesh.expert_dp_group)
        # a MoE in a pipeline: each stage's layers add their part of the auxiliary loss themselves
        self.aux_per_step = 0.0  # this stage's share of the step's aux (without coef)
        self._aux_parts: list[torch.Tensor] = []  # its pieces, detached, read after the step
        if moe and mesh.pp > 1:
            for layer in moe_layers(self.module):
                layer.register_forward_hook(self._add_aux_loss(self.aux_loss_coef, microbatches))
        # read before FSDP takes the parameters: the dim tp split each one along (None: whole; its
        # own experts only, under ep), the stage's dtype and device
        self.split_dims = _tp.split_dims(self.module)
        stage = StageSpec.of(self.module) if mesh.pp > 1 and self.pipeline is None else None
        # 5. data parallel over the dp axis: DDP, FSDP or HSDP (expert parallel keeps its own)
        self.replicas = self._replicate(self.module, bucket_mb)
        self.step_model = self.module if self.replicas is None else self.replicas
        # 6. the pipeline (one chunk per rank) calls the wrapper, computing in its dtype
        if stage is not None:
            dtype = self.fsdp.compute_dtype if self.fsdp else stage.dtype
            stage = replace(stage, forward=self.step_model, dtype=dtype)
            self.pipeline = Pipeline(stage, mesh.pp_group, schedule, microbatches, loss=self.loss)
        params = self.fsdp.parameters() if self.fsdp else self.module.parameters()
        self.optimizer = make_optimizer(params, lr)
        if self.fsdp:
            self.fsdp.attach(self.optimizer)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of (B, S, V) logits (under tp (B, S, V/tp), the vocabulary split:
        ``tp.vocab_parallel_cross_entropy``); a MoE on one stage adds ``aux_loss_coef`` · aux."""
        if self.mesh.tp > 1:
            loss = _tp.vocab_parallel_cross_entropy(logits, targets, self.mesh.tp_group)
        else:
            loss = loss_fn(logits, targets)
        if self.aux_loss_coef and self.mesh.pp == 1:
            loss = loss + self.aux_loss_coef * aux_loss(self.module)
        return loss

    def _stage(self, model: Transformer, schedule: str, microbatches: int,
               virtual_stages: int) -> tuple[torch.nn.Module, Pipeline | None]:
        """What this rank holds of the (tp-split) model: all of it (pp = 1), its stage, or its v
        chunks under the interleaved schedule, whose pipeline is made here: DDP only keeps their
        gradient buckets (under no_sync during the schedule, averaged after it)."""
        if self.mesh.pp > 1 and schedule == "interleaved":
            pipeline = Pipeline(model, self.mesh.pp_group, schedule, microbatches, loss=self.loss,
                                virtual_stages=virtual_stages, context=self.context)
            return pipeline.module, pipeline
        if self.mesh.pp > 1:
            return PipelineStage(model, self.mesh.coords.pp, self.mesh.pp, self.context), None
        return model, None

    def _replicate(self, module: torch.nn.Module, bucket_mb: float):
        """The data-parallel wrapper ``ParallelDims.replicas`` names over the dp group (expert
        parallel's, made already), or None; also kept as ``ddp`` or ``fsdp`` (HSDP's too: FSDP
        inside each shard group, plus an all-reduce)."""
        mesh, kind = self.mesh, self.dims.replicas
        self.ddp = self.fsdp = None
        if kind == "expert_parallel":
            return self.expert_parallel
        if kind == "ddp":
            self.ddp = DistributedDataParallel(module, mesh.dp_group, bucket_mb=bucket_mb)
            return self.ddp
        if kind == "fsdp":
            self.fsdp = FullyShardedDataParallel(module, mesh.dp_group, zero=self.zero)
            return self.fsdp
        if kind == "hsdp":
            self.fsdp = HybridShardedDataParallel(module, mesh.dp_shard_group,
                                                  mesh.dp_replicate_group, zero=self.zero)
            return self.fsdp
        return None

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Forward and backward of one global batch (B, S), the same on every rank; gradients end
        averaged over dp. Returns the loss of this replica's share (None off the last stage). A
        MoE's loss is the cross-entropy plus ``aux_loss_coef`` · aux: all of it on one stage, but
        under a pipeline the cross-entropy only, each stage's part of aux left in ``aux_per_step``
        (adding them up takes a message over pp: ``trainer.world_mean`` does it, or the 3D run's
        parent)."""
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        # this replica's rows, this rank's positions: (B, S) → (B/dp, S/cp)
        if self.context is not None:
            tokens, targets = (_cp.replica_share(t, self.mesh) for t in (tokens, targets))
        elif self.mesh.dp > 1:  # this replica's rows: (B, S) → (B/dp, S)
            tokens = split_batch(tokens, self.mesh.dp_group)
            targets = split_batch(targets, self.mesh.dp_group)
        if self.pipeline is None:
            # context parallel: the ring and RoPE at this rank's positions (the pipeline's stages
            # know theirs)
            where = self.context.inputs(tokens) if self.context is not None else {}
            with _trace.span("forward"):
                loss = self.loss(self.step_model(tokens, **where), targets)
            with _trace.span("backward"):
                loss.backward()
            return loss.item()
        with self.replicas.no_sync() if self.replicas is not None else nullcontext():
            record = self.pipeline.forward_backward(tokens, targets)
        # one sync, not one per layer
        self.aux_per_step = float(sum(self._aux_parts)) if self._aux_parts else 0.0
        self._aux_parts.clear()
        if self.replicas is not None:  # DDP, FSDP or expert parallel: the same protocol
            self.replicas.finish_gradients()
        return record.loss

    def _add_aux_loss(self, coef: float, microbatches: int):
        """A forward hook on a MoE layer: its output carries coef/m times the layer's auxiliary loss
        into the backward (``_AuxLossGrad``), as one process's coef · aux of the whole batch
        would."""
        def hook(layer, args, out):
            self._aux_parts.append(layer.aux_loss.detach() / microbatches)
            return _AuxLossGrad.apply(out, layer.aux_loss, coef / microbatches)
        return hook

    def held_bytes(self) -> dict[str, int]:
        return self.fsdp.held_bytes() if self.fsdp else held_bytes(self.module.parameters(),
                                                                   self.optimizer)

    def local_shards(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """{name: (tensor, tp split dim)}: this rank's tp slice of each parameter of its stage,
        whole over dp, on the CPU (so it can travel back to the parent process). FSDP gathers its
        shards: a collective, call it on every rank."""
        if self.fsdp:
            state = self.fsdp.full_state_dict()
        else:
            state = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        return {name: (state[name].cpu(), self.split_dims[name]) for name in self.split_dims}


def unshard_3d(shards: list[list[dict]]) -> dict:
    """Whole tensors from one replica's ``Parallel3D.local_shards``: ``shards[stage][tp_rank]``. The
    tp slices are concatenated along their split dim, the stages' names put together. No message."""
    full = {}
    for stage in shards:
        full.update(_tp.unshard(stage, 0))
    return full


class _AuxLossGrad(torch.autograd.Function):
    """Identity on a layer's output whose backward also gives ``aux`` (a scalar that depends on the
    router) the gradient ``scale``: d(scale · aux)/d aux, added to the loss without reaching it."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.tensor(ctx.scale, dtype=torch.float32, device=grad.device), None

