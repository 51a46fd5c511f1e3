"""Deterministic synthetic data and the one-process reference every strategy is checked against."""

from __future__ import annotations

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


def train_reference(cfg: ModelConfig = TINY, train: TrainConfig = TrainConfig()):
    """Train on one process with the full batch. Returns (losses per step, trained model)."""
    model = build_model(cfg, seed=train.seed)
    optimizer = make_optimizer(model.parameters(), train.lr)
    losses = []
    for tokens, targets in synthetic_batches(cfg, train):
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model
