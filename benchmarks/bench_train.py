"""``minitp train``'s step against PyTorch's DDP doing the same work: the byte model, the same batches of
the standard library's source, the same AdamW, warm-up/cosine learning rate and clipping, at dp = 2;
then against a plain one-process loop on two threads (``_plain_worker``); then the dp = 2 step's
model FLOPs per core against one thread's matmul rate (``matmul_share``).

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


def _minitp_side(rounds: int, steps: int, warmup: int):
    """minitp's side, as ``minitp train`` runs every step at dp = 2, cut in two where the harness
    times it; with the run's settings and batches, for the other side to share."""
    from minitp import trainer
    from minitp.data import Sampler, load_corpus
    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D

    s = trainer.Settings(dp=2, batch_size=BATCH, seq_len=SEQ, steps=warmup + rounds * steps + 1, warmup=2)
    sampler = Sampler(load_corpus().train, BATCH, SEQ, s.seed)
    par = Parallel3D(trainer.build(s.config, s.seed), Mesh(2, 1, 1), lr=s.lr)

    def minitp_step(i: int) -> None:  # trainer.train_step up to the optimizer, then the loss's mean
        par.optimizer.zero_grad(set_to_none=True)
        loss = par.forward_backward(*sampler.batch(i))
        trainer.clip_grad_norm_(par, s.clip)
        trainer.world_mean(loss, par.device)

    # the rest of trainer.train_step
    return harness.Side(minitp_step, lambda: dict(par.module.named_parameters()),
                        _optimize(par.optimizer, s)), s, sampler


def _optimize(optimizer, s):
    """Step i's optimizer step, at the run's learning rate for step i (either side's)."""
    from minitp import trainer

    def optimize(i: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = trainer.lr_at(i, s)
        optimizer.step()
    return optimize


def _worker(rounds: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from minitp import trainer
    from minitp.models import loss_fn
    from minitp.models.train import make_optimizer

    minitp_side, s, sampler = _minitp_side(rounds, steps, warmup)
    rank = dist.get_rank()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)

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

    sides = {"minitp": minitp_side,
             "torch": harness.Side(torch_step, lambda: dict(model.named_parameters()), _optimize(optimizer, s))}
    return harness.time_sides(sides, rounds, steps, warmup)


def _plain_worker(rounds: int, steps: int, warmup: int) -> dict:
    """minitp's dp = 2 step (as ``_worker``) against the plain loop a learner would write first: one
    process training on the whole batch with two threads, the same model, batches, AdamW, schedule
    and clipping. The plain side runs on rank 0 while rank 1 waits in the harness's barrier (gloo's
    wait sleeps on its socket: the two threads have both cores)."""
    import torch
    import torch.distributed as dist

    from minitp import trainer
    from minitp.models import loss_fn
    from minitp.models.train import make_optimizer

    minitp_side, s, sampler = _minitp_side(rounds, steps, warmup)
    if dist.get_rank() != 0:  # nothing to do on the plain side; its parameters are rank 0's to compare
        return harness.time_sides({"minitp": minitp_side, "torch": harness.Side(None, minitp_side.params, None)},
                                  rounds, steps, warmup)
    model = trainer.build(s.config, s.seed)
    optimizer = make_optimizer(model.parameters(), s.lr)

    def with_two_threads(fn):
        def run(i: int) -> None:
            torch.set_num_threads(2)
            try:
                fn(i)
            finally:
                torch.set_num_threads(1)
        return run

    def plain_step(i: int) -> None:
        tokens, targets = sampler.batch(i)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        loss.item()

    plain = harness.Side(with_two_threads(plain_step), lambda: dict(model.named_parameters()),
                         with_two_threads(_optimize(optimizer, s)))
    return harness.time_sides({"minitp": minitp_side, "torch": plain}, rounds, steps, warmup)


def comparisons(models: list[str]) -> list[harness.Comparison]:
    timing = {"rounds": 9, "steps": 5, "warmup": 3}
    return [harness.Comparison("train/dp2", "byte", 2, _worker, (), tol=1e-4,
                               note=f"minitp train's step, batch {BATCH}x{SEQ} bytes; tokens/s = {BATCH * SEQ}/step",
                               timing=timing),
            harness.Comparison("train/plain", "byte", 2, _plain_worker, (), tol=1e-4,
                               note=f"minitp dp = 2 against one process with 2 threads (the torch column), "
                                    f"{BATCH}x{SEQ} bytes", timing=timing)]


def matmul_share(lines: list[dict]) -> str:
    """What the dp = 2 step does per core, in model FLOPs (6 per parameter per token, plus attention
    counted whole: ``cost.training_flops_per_token``), against one thread's matmul rate measured now,
    at 512^3 and at the model's largest matmul (its MLP's, tokens x D x F on one rank)."""
    from minitp.cost import training_flops_per_token
    from minitp.measure.calibrate import matmul_flops_per_s
    from minitp.trainer import BYTE

    line = next((x for x in lines if x["name"] == "train/dp2" and "minitp_ms" in x), None)
    if line is None:
        return "train/dp2 has no figures: no FLOP rate"
    per_core = training_flops_per_token(BYTE, SEQ) * BATCH * SEQ / (line["minitp_ms"] / 1e3) / 2
    rates = {shape: matmul_flops_per_s(*shape) for shape in [(512, 512, 512), (BATCH // 2 * SEQ, BYTE.dim, BYTE.ffn_hidden)]}
    return ("the dp = 2 step: " + f"{per_core / 1e9:.1f} GFLOP/s per core; " + "; ".join(
        f"one thread's matmul {m}x{k}x{n}: {rate / 1e9:.1f} GFLOP/s, the step {per_core / rate:.2f} of it"
        for (m, k, n), rate in rates.items()) + f" (load {harness.loadavg()})")


if __name__ == "__main__":
    lines = harness.main(["--only", "train", *sys.argv[1:]])
    print(matmul_share(lines))
