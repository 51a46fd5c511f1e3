"""What a training step is, on any layout: what ``minitp train`` runs on each rank, step by step.

The pieces are the course's: the corpus and its sampler (``minitp.data``: bytes of the Python
standard library's own source, no download), the model (``minitp.models``), the layout
(``Parallel3D`` on a ``Mesh``), the checkpoint (``minitp.checkpoint``: sharded, loads into any
other layout). What this module adds is what a step needs, read top to bottom:

- **the settings** of a run (``Settings``), refused before any process starts when they cannot run;
- **the learning rate**: linear warm-up, then a cosine down to ``min_lr_ratio`` of the peak
  (``lr_at``);
- **gradient clipping by the global norm** across every shard (``clip_grad_norm_``): each element
  of the model counted once, wherever it lives (``counts_in_norm``, the ownership rule, read beside
  ``Parallel3D.split_dims``), then one all-reduce over the whole world (none under DDP alone);
- **the step** (``train_step``: the only one, every layout's) and **validation** (``evaluate``) on
  files the training never sees;
- **the same run on one process** (``reference``): what every layout is checked against.

Around the step, each rank's loop (``minitp.runs.train_rank``: checkpoints every ``save_every``
steps, resume onto any layout, Ctrl-C, ``out/log.jsonl`` written by ``minitp.runs.train_log``, the
progress bar) and the parent's work (``minitp.runs.training``: checks, ``out``, the launch,
restarts of a run whose rank died, ``out/loss.png`` by ``minitp.viz.train``) live in the runners'
wing; ``minitp.runs.sampling`` writes text with a trained checkpoint.

Every rank computes the whole global batch's sampling (cheap) and ``Parallel3D`` keeps its share,
so the run equals one process on the same batches (``reference``), clipping and schedule included.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from minitp import comm
from minitp import trace as _trace
from minitp.data import Sampler, check_seq_len, load_corpus
from minitp.grid import ParallelDims
from minitp.layout import DIMS
from minitp.models import BYTE, ModelConfig, Transformer, build_model, loss_fn
from minitp.models.moe import MoEConfig, aux_loss, build_moe_model, moe_config, moe_loss
from minitp.models.train import train_one_process
from minitp.parallel3d import Parallel3D

# byte-level models sized for a laptop run (vocabulary: the 256 byte values): ``minitp.models.BYTE``
PRESETS = {
    "byte": BYTE,  # 0.85 M parameters
    "byte-4m": BYTE.with_(dim=256, n_layers=6, ffn_hidden=704),  # 4.6 M
    # for --ep
    "byte-moe": moe_config(BYTE, n_experts=4, top_k=2, expert_hidden=192, capacity_factor=None),
}


@dataclass(frozen=True)
class Settings:
    model: str = "byte"
    dp: int = 1  # data-parallel replicas (each of cp ranks under context parallel)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cp_attention: str = "ring"  # with cp > 1: "ring", "ulysses" or "allgather" (minitp.cp.Context)
    data_parallel: str = "ddp"  # or "fsdp"
    zero: int | None = None
    schedule: str = "1f1b"
    microbatches: int = 1
    steps: int = 300
    batch_size: int = 16  # global, in sequences
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    clip: float = 1.0  # the largest global gradient norm; 0: no clipping
    eval_every: int = 100
    eval_batches: int = 2
    save_every: int = 100  # and at the end; 0: only at the end
    out: str | None = None  # log.jsonl, loss.png and checkpoint/; None: nothing written
    resume: bool = False  # from out/checkpoint when it holds one
    overwrite: bool = False  # start again in an ``out`` that holds a run (its files go)
    seed: int = 0
    corpus: str | None = None  # .py files: a folder or a .tar.gz (data.COURSE_CORPUS); None: stdlib
    max_files: int | None = None  # the first N files of the corpus only (tests)
    kill_at: int | None = None  # tests and chapter 09: the last rank dies at this step, once
    profile: bool = False  # the last step's CPU operators in its trace (minitp.measure.operators)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def config(self) -> ModelConfig:
        return PRESETS[self.model]

    @property
    def virtual_stages(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def dims(self) -> ParallelDims:
        """The dimensions and what composes with what, checked as it is made."""
        return ParallelDims(self.dp, self.pp, self.tp, self.cp, self.ep, self.data_parallel,
                            self.zero, self.schedule, self.virtual_stages, self.cp_attention)

    def check(self) -> None:
        """Refuse what cannot run, with one sentence, before any process starts."""
        if self.model not in PRESETS:
            raise ValueError(f"unknown model {self.model!r}; expected one of {', '.join(PRESETS)}")
        for name in (*DIMS, "steps", "batch_size", "seq_len", "microbatches", "eval_batches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        check_seq_len(self.seq_len, self.config.max_seq_len)
        if self.batch_size % (self.dp * self.microbatches):
            raise ValueError(f"batch_size={self.batch_size} must divide by dp·microbatches = "
                             f"{self.dp}·{self.microbatches}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup} must be from 0 to steps-1 = {self.steps - 1}")
        if self.clip < 0 or not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"expected clip >= 0, lr > 0 and 0 <= min_lr_ratio <= 1; got "
                             f"clip={self.clip}, lr={self.lr}, min_lr_ratio={self.min_lr_ratio}")
        if self.corpus is not None and not (
                os.path.isdir(self.corpus)
                or self.corpus.endswith((".tar.gz", ".tgz")) and os.path.isfile(self.corpus)):
            raise ValueError(f"corpus {self.corpus!r}: expected a folder of .py files or a .tar.gz "
                             "of them")
        if (self.resume or self.kill_at is not None or self.overwrite) and not self.out:
            raise ValueError("--resume, --overwrite and --kill-at need --out DIR (where the "
                             "checkpoint is)")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out, --overwrite starts it again: "
                             "give one")
        if self.zero is not None and self.data_parallel != "fsdp":
            raise ValueError(f"--zero {self.zero} sets FSDP's stage: add --fsdp (without it the "
                             "replicas are DDP's, which keep everything whole)")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be from 0 to 2**63 - 1 (a torch generator's seed), "
                             f"got {self.seed}")
        if not self.lr <= 10:  # AdamW's step is about lr per element: past 10 every weight is noise
            raise ValueError(f"lr={self.lr:g} is far above any learning rate that trains (AdamW "
                             f"moves each weight by about lr a step); expected at most 10")
        self.dims.check_model(self.config, seq_len=self.seq_len)


def lr_at(step: int, s: Settings) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from ``lr`` down to ``min_lr_ratio``·lr
    at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - 1 - s.warmup)
    cosine = 1 + math.cos(math.pi * min(1.0, progress))  # 2 → 0
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * cosine)


# -- the global gradient norm ----------------------------------------------------------------------
def counts_in_norm(par: Parallel3D, name: str) -> bool:
    """Whether this rank's gradient of parameter ``name`` counts in the global norm, so that over
    the world each element of the model is counted once (Megatron's
    ``param_is_not_tensor_parallel_duplicate``, with the replicas added): pipeline stages and tp
    slices hold different elements (all count), a replicated (norm) weight is the same on every tp
    rank (the first counts), FSDP shards are disjoint (all count; under HSDP those of the first
    replica, dp coordinates below dp_shard, the others holding the same), DDP replicas hold the same
    gradients after the average (the first replica counts; under context parallel the dp axis's
    dp·cp ranks), and under expert parallel the first ep ranks of the dp axis hold every expert
    between them (as a checkpoint writes them)."""
    coords = par.mesh.coords
    if par.split_dims[name] is None and coords.tp != 0:
        return False  # replicated over tp: tp rank 0 counts it
    if par.fsdp is not None:  # a shard of its own (HSDP: the first replica's)
        return par.mesh.dp_shard is None or coords.dp < par.mesh.dp_shard
    return coords.dp == 0 or (coords.dp < par.mesh.ep and ".experts." in name)


def owned_gradients(par: Parallel3D) -> list[torch.Tensor]:
    """The gradient elements this rank counts in the global norm (``counts_in_norm``)."""
    if par.fsdp is not None:
        return [g for name, g in par.fsdp.gradient_pieces() if counts_in_norm(par, name)]
    return [p.grad for name, p in par.module.named_parameters()
            if p.grad is not None and counts_in_norm(par, name)]


def all_gradients(par: Parallel3D) -> list[torch.Tensor]:
    """Every gradient the optimizer will read on this rank: what clipping scales."""
    if par.fsdp is not None:
        return [g for _, g in par.fsdp.gradient_pieces()]
    return [p.grad for p in par.module.parameters() if p.grad is not None]


def replicas_only(par: Parallel3D) -> bool:
    """Whether every rank holds the whole model and, after the average, the same gradients: data
    parallel by DDP alone (context parallel's ranks average theirs the same way)."""
    return par.fsdp is None and par.mesh.tp == 1 and par.mesh.pp == 1 and par.mesh.ep == 1


@torch.no_grad()
def clip_grad_norm_(par: Parallel3D, max_norm: float) -> float:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), ``norm`` the whole model's gradient
    norm (the 2-norm of every element, once): as ``torch.nn.utils.clip_grad_norm_`` on one process.
    One all-reduce of a number over the world; none where every rank holds the same whole gradients
    (``replicas_only``): each computes the norm itself. Returns the norm before clipping."""
    alike = replicas_only(par)
    grads = all_gradients(par) if alike else owned_gradients(par)
    squares = torch.zeros((), dtype=torch.float32, device=par.device)
    if grads:  # every tensor's norm in one operation over the list, as torch's own clipping does
        squares += torch.stack(torch._foreach_norm([g.float() for g in grads])).square().sum()
    if not alike:  # stages, slices, shards: disjoint pieces of one sum
        comm.all_reduce(squares, label="clip/norm")
    norm = squares.sqrt().item()
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        torch._foreach_mul_(grads if alike else all_gradients(par), coef)
    return norm


# -- the step --------------------------------------------------------------------------------------
class Step(NamedTuple):
    """What one step gives back on one rank."""
    loss: float | None  # this replica's loss (None off the last stage)
    aux: float  # what this rank's stage adds to that loss (a MoE under a pipeline; else 0)
    norm: float | None  # the global gradient norm before clipping (None: not measured)


def train_step(par: Parallel3D, tokens: torch.Tensor, targets: torch.Tensor,
               lr: float | None = None, clip: float | None = None) -> Step:
    """One optimizer step on the global batch (B, S), the same on every rank, on any layout: the
    one step minitp takes (``minitp train``'s ranks, the 3D runs, chapter 06). Forward and backward
    (gradients averaged over the replicas), clipping by the global norm (``clip``: the largest norm;
    0: the norm measured, nothing scaled; None: neither, and no message), AdamW's step (at ``lr``;
    None: the optimizer's own).

    The loss is one process's: a MoE's is the cross-entropy plus coef · aux, which one stage
    computes whole, but under a pipeline each stage holds its own layers' part of aux
    (``Parallel3D.aux_per_step``): ``Step.aux``, added up over the stages by ``world_mean``."""
    # None, as one process's zero_grad(): a parameter this step leaves unused (an expert no token
    # reached) keeps no gradient, so AdamW skips it rather than moving it by momentum and decay
    par.optimizer.zero_grad(set_to_none=True)
    loss = par.forward_backward(tokens, targets)
    norm = clip_grad_norm_(par, clip) if clip is not None else None
    if lr is not None:
        for group in par.optimizer.param_groups:
            group["lr"] = lr
    with _trace.span("optimizer"):
        par.optimizer.step()
    return Step(loss, par.aux_loss_coef * par.aux_per_step, norm)


def evaluate(par: Parallel3D, sampler: Sampler, batches: int) -> float:
    """The mean cross-entropy over ``batches`` validation batches, in nats per byte: how well the
    model predicts files it never trained on. A MoE's auxiliary (load-balancing) loss, which the
    training loss holds, is left out on every layout: it is a term of the objective, not of the
    prediction, and without it a MoE's validation compares with a dense model's. Each batch runs
    the step's own forward and backward (the layout's only path through a pipeline); the gradients
    are thrown away."""
    total = 0.0
    for i in range(batches):
        loss = par.forward_backward(*sampler.batch(i))
        par.optimizer.zero_grad(set_to_none=True)
        if loss is not None and par.pipeline is None:  # one stage: its loss also holds coef · aux
            loss -= par.aux_loss_coef * float(aux_loss(par.module))  # its layers' (0 without a MoE)
        total += world_mean(loss, par.device)[0]  # a pipeline's loss: the cross-entropy only
    return total / batches


def world_mean(loss: float | None, device, stop: bool = False,
               aux: float = 0.0) -> tuple[float, bool]:
    """The mean over the replicas of a loss only the last stage knows, and whether any rank asked to
    stop. ``aux``: what this rank's pipeline stage adds to its replica's loss (``Step.aux``). Each
    replica's last stage holds one loss and each of its stages adds its part, so the sum of every
    rank's ``aux`` over the number of losses is the mean over the replicas of their sums over the
    stages. ``stop``: this rank's wish to stop (Ctrl-C, ``minitp.runs.train_rank``)."""
    t = torch.tensor([loss or 0.0, loss is not None, stop, aux], dtype=torch.float64, device=device)
    dist.all_reduce(t)  # bookkeeping, not a message of the strategy: left out of the trace
    return ((t[0] + t[3]) / t[1]).item(), bool(t[2] > 0)


# -- the model and the one-process run every layout is checked against ---------------------------
def build(cfg: ModelConfig, seed: int) -> Transformer:
    """The plain model of ``cfg`` (dense or a MoE), the same on every rank for one ``seed``."""
    if isinstance(cfg, MoEConfig):
        return build_moe_model(cfg, seed=seed)
    return build_model(cfg, seed=seed)


def reference(s: Settings,
              steps: int | None = None) -> tuple[list[float], list[float], Transformer]:
    """The first ``steps`` steps of ``s`` on one process with the whole batch: the same model,
    batches, schedule and clipping (``torch.nn.utils.clip_grad_norm_``), by the one-process loop
    every layout is checked against (``minitp.models.train.train_one_process``). Returns (losses,
    norms, model)."""
    model = build(s.config, s.seed)
    loss = moe_loss(model) if isinstance(s.config, MoEConfig) else loss_fn
    corpus = load_corpus(s.corpus, max_files=s.max_files)
    train = Sampler(corpus.train, s.batch_size, s.seq_len, s.seed)
    batches = (train.batch(step) for step in range(steps or s.steps))
    losses, norms = train_one_process(model, batches, s.lr, loss=loss,
                                      lr_at=lambda step: lr_at(step, s), clip=s.clip)
    return losses, norms, model
