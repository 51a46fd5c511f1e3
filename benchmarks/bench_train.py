"""``minitp train``'s step against PyTorch's DDP doing the same work: the byte model, the same batches of
the standard library's source, the same AdamW, warm-up/cosine learning rate and clipping, at dp = 2.

    python benchmarks/bench_train.py [--quick]

minitp's side is what ``minitp.trainer.train_step`` does on a ``Parallel3D`` (dp = 2, DDP), then the
loss's mean over the replicas, as ``minitp train`` runs every step, cut in two where the harness
times it: zero the gradients, forward and backward, clip, the loss's mean; then set the learning
rate and step the optimizer. PyTorch's side, cut at the same place: ``DistributedDataParallel``
with ``broadcast_buffers=False`` (minitp broadcasts no buffer: the RoPE tables are the same on every
rank), ``torch.nn.utils.clip_grad_norm_`` and the same mean of the loss; then the same learning
rate and AdamW step. minitp's clipping sends one more all-reduce (of one number: the norm over
every shard, which a layout with tp, pp or FSDP needs); PyTorch's DDP clips its replicated
gradients locally. Both keep one bucket (the model's 3.4 MB of gradients under the 25 MB cap) and
their gradients as views into it. The line's note gives the tokens of a step: over a side's
milliseconds, its tokens per second.
"""

from __future__ import annotations

import sys

import harness

BATCH, SEQ = 16, 128  # minitp train's defaults


def _worker(rounds: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from minitp import trainer
    from minitp.data import Sampler, load_corpus
    from minitp.mesh import Mesh
    from minitp.models import loss_fn
    from minitp.models.train import make_optimizer
    from minitp.parallel3d import Parallel3D

    s = trainer.Settings(dp=2, batch_size=BATCH, seq_len=SEQ, steps=warmup + rounds * steps + 1, warmup=2)
    sampler = Sampler(load_corpus().train, BATCH, SEQ, s.seed)
    rank = dist.get_rank()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)

    par = Parallel3D(trainer.build(s.config, s.seed), Mesh(2, 1, 1), lr=s.lr)

    def minitp_step(i: int) -> None:  # trainer.train_step up to the optimizer, then the loss's mean
        par.optimizer.zero_grad(set_to_none=True)
        loss = par.forward_backward(*sampler.batch(i))
        trainer.clip_grad_norm_(par, s.clip)
        trainer.world_mean(loss, par.device)

    def minitp_optimize(i: int) -> None:  # the rest of trainer.train_step
        for group in par.optimizer.param_groups:
            group["lr"] = trainer.lr_at(i, s)
        par.optimizer.step()

    model = trainer.build(s.config, s.seed)
    ddp = TorchDDP(model, broadcast_buffers=False, bucket_cap_mb=25, gradient_as_bucket_view=True)
    optimizer = make_optimizer(model.parameters(), s.lr)

    def torch_step(i: int) -> None:
        tokens, targets = sampler.batch(i)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(tokens[rows]), targets[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        trainer.world_mean(loss.item(), torch.device("cpu"))

    def torch_optimize(i: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = trainer.lr_at(i, s)
        optimizer.step()

    sides = {"minitp": harness.Side(minitp_step, lambda: dict(par.module.named_parameters()), minitp_optimize),
             "torch": harness.Side(torch_step, lambda: dict(model.named_parameters()), torch_optimize)}
    return harness.time_sides(sides, rounds, steps, warmup)


def comparisons(models: list[str]) -> list[harness.Comparison]:
    return [harness.Comparison("train/dp2", "byte", 2, _worker, (), tol=1e-4,
                               note=f"minitp train's step, batch {BATCH}x{SEQ} bytes; tokens/s = {BATCH * SEQ}/step",
                               timing={"rounds": 9, "steps": 5, "warmup": 3})]


if __name__ == "__main__":
    harness.main(["--only", "train", *sys.argv[1:]])
