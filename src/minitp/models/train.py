"""Deterministic synthetic data, the optimizer, and the one-process run every strategy is checked
against (``train_one_process``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minitp.models.llama import TINY, ModelConfig, build_model, loss_fn


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4
    batch_size: int = 8  # global batch: split over the data-parallel ranks
    seq_len: int = 16
    lr: float = 3e-3
    seed: int = 0


def synthetic_batches(cfg: ModelConfig,
                      train: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``train.steps`` batches of (tokens, targets), each (batch_size, seq_len), from
    ``train.seed``.

    The tokens follow a fixed random Markov chain in which each token has four likely successors,
    so there is something to learn and the loss falls; nothing is downloaded. Every rank that calls
    this gets the same batches.
    """
    g = torch.Generator().manual_seed(train.seed + 1)
    V = cfg.vocab_size
    successors = torch.randint(0, V, (V, 4), generator=g)  # the likely next tokens of each token
    batches = []
    for _ in range(train.steps):
        seq = torch.empty(train.batch_size, train.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, V, (train.batch_size,), generator=g)
        for t in range(train.seq_len):
            pick = successors[seq[:, t], torch.randint(0, 4, (train.batch_size,), generator=g)]
            noise = torch.randint(0, V, (train.batch_size,), generator=g)
            seq[:, t + 1] = torch.where(torch.rand(train.batch_size, generator=g) < 0.1, noise,
                                        pick)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return batches


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW with LLaMA's settings (betas 0.9/0.95, eps 1e-5), the optimizer of every run in minitp
    (two fp32 moments per parameter: ZeRO's story).

    Why not PyTorch's default eps=1e-8: AdamW's first step moves each weight by about
    lr * g / (|g| + eps). For a gradient element that is nearly zero (|g| ~ 1e-9, common at a small
    init) that is +-lr with the sign of rounding noise, so any change in the order of a sum (which
    every parallel strategy makes) moves such weights by up to 2*lr and a correct strategy ends
    1e-4 from one process in fp32. With eps=1e-5 the same noise moves them by ~1e-7, and the
    comparison measures the strategy again rather than AdamW's sensitivity.
    """
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.01,
                             foreach=False)


def train_one_process(model: torch.nn.Module, batches, lr: float, loss=loss_fn, lr_at=None,
                      clip: float | None = None) -> tuple[list[float], list[float]]:
    """The one-process run every layout is checked against, and the only one: ``model`` trained on
    the whole of each (inputs, targets) batch by ``make_optimizer``'s AdamW. ``loss(output,
    targets)``; ``lr_at(step)``: the learning rate of each step (None: ``lr`` throughout);
    ``clip``: gradients clipped by their global norm (``torch.nn.utils.clip_grad_norm_``; 0: the
    norm measured, nothing scaled; None: not measured). Gradients are set to None before each step,
    so a parameter a step does not reach (a MoE's idle expert) keeps none and AdamW leaves it
    alone. Returns (losses, norms before clipping)."""
    optimizer = make_optimizer(model.parameters(), lr)
    losses, norms = [], []
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        value = loss(model(inputs), targets)
        value.backward()
        if clip is not None:
            max_norm = clip if clip > 0 else math.inf  # inf: the norm, measured, nothing scaled
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
        optimizer.step()
        losses.append(value.item())
    return losses, norms


def train_reference(cfg: ModelConfig = TINY, train: TrainConfig = TrainConfig()):
    """The tiny model trained on one process with the full synthetic batch. Returns (losses per
    step, trained model)."""
    model = build_model(cfg, seed=train.seed)
    losses, _ = train_one_process(model, synthetic_batches(cfg, train), train.lr)
    return losses, model
