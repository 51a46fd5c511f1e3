"""The one-process runs every strategy is held to, and how far apart two sets of parameters are.

* ``full_batch``: the whole model trained on one process with the whole global batch, the oracle
  of every fp32 run (``minitp.models.train.train_one_process`` does the training, here and for
  ``swiglu``).
* ``microbatched``: one process with the global batch cut into as many slices as there are
  data-parallel ranks, for bf16 runs, whose recipe rounds the averaged gradient.
* ``swiglu``: the plain SwiGLU MLP alone, the oracle of the tensor-parallel MLP run.
"""

from __future__ import annotations

import torch

from minitp.models import build_model, loss_fn
from minitp.models.train import (
    TrainConfig,
    make_optimizer,
    synthetic_batches,
    train_one_process,
    train_reference,
)


def max_abs_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts over the reference's keys."""
    missing = set(reference) - set(state)
    if missing:
        raise KeyError(f"parameters missing from the run's state: {sorted(missing)[:5]}")
    return max((state[k].float() - reference[k].float()).abs().max().item() for k in reference)


def full_batch(cfg, train: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole model trained on one process with the whole batch: (losses, final parameters)."""
    losses, model = train_reference(cfg, train)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def microbatched(cfg, train: TrainConfig, micro_batches: int,
                                 mixed_precision: torch.dtype | None = None,
                                 reverse_sum: bool = False) -> dict[str, torch.Tensor]:
    """One process, no sharding, the global batch cut into ``micro_batches`` slices whose gradients
    are averaged in fp32: the same arithmetic as data parallel over that many ranks, so the only
    difference left is the order of the sum. With ``mixed_precision=torch.bfloat16`` it is the
    recipe of ``minitp.fsdp``: a bf16 copy of the fp32 master weights computes, the averaged
    gradient is rounded to bf16, AdamW steps the fp32 master. Returns the final fp32 parameters.

    Used for bf16, whose recipe rounds the averaged gradient: the full-batch run has no such step.
    (fp32 runs are held to the full-batch run itself; ``make_optimizer`` says why AdamW's eps
    matters for that.) ``reverse_sum`` adds the micro-batches' gradients in the opposite order: how
    far that moves the result is the run's own sensitivity to the order of a sum.
    """
    master = build_model(cfg, seed=train.seed)
    work = build_model(cfg, seed=train.seed)
    dtype = mixed_precision or torch.float32
    for p in work.parameters():  # parameters only: the rotary tables stay fp32, as under FSDP
        p.data = p.data.to(dtype)
    optimizer = make_optimizer(master.parameters(), train.lr)
    for tokens, targets in synthetic_batches(cfg, train):
        total = [torch.zeros_like(p) for p in master.parameters()]
        slices = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)))
        for x, y in slices[::-1] if reverse_sum else slices:
            grads = torch.autograd.grad(loss_fn(work(x), y), list(work.parameters()))
            for t, g in zip(total, grads):
                t += g.float() / micro_batches
        for p, t in zip(master.parameters(), total):
            p.grad = t.to(dtype).float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w, p in zip(work.parameters(), master.parameters()):
                w.copy_(p)
    return {k: v.detach() for k, v in master.state_dict().items()}


def swiglu_batches(cfg, train: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) pairs, each (B, S, D), from ``train.seed``. The input requires a gradient, as
    the activation of an earlier layer would, so backward sends its gradient (f's all-reduce)."""
    g = torch.Generator().manual_seed(train.seed + 1)
    shape = (train.batch_size, train.seq_len, cfg.dim)
    return [(torch.randn(shape, generator=g).requires_grad_(), torch.randn(shape, generator=g))
            for _ in range(train.steps)]


def swiglu(cfg, train: TrainConfig) -> tuple[list[float], dict]:
    """The plain SwiGLU MLP (the model's first block's) trained on one process: (losses, state)."""
    mlp = build_model(cfg, seed=train.seed).layers[0].feed_forward
    losses, _ = train_one_process(mlp, swiglu_batches(cfg, train), train.lr,
                                  loss=torch.nn.functional.mse_loss)
    return losses, {k: v.detach() for k, v in mlp.state_dict().items()}
