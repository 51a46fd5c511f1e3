"""minitp's DDP against ``torch.nn.parallel.DistributedDataParallel``: the same model, seed, data and
bucket size, alternating in one run on the same ranks.

    python benchmarks/bench_ddp.py [--models tiny,small] [--quick]

What both sides do each step: forward and backward of a quarter of the batch, the gradients summed
over the 4 ranks in buckets during backward (timed as the step); then the same AdamW step on the
whole, replicated parameters, with no message (timed apart). Neither sends anything in forward:
PyTorch's DDP runs with ``broadcast_buffers=False``, since minitp broadcasts no buffer (the model's
only buffers, the RoPE tables, are computed alike on every rank); by default PyTorch would
broadcast them before every forward.

Two bucket caps per model: a quarter of the gradient bytes (several buckets, so the all-reduce of
one overlaps the backward of the layers before it: what buckets are for) and twice the gradient
bytes (one bucket, sent after the whole backward). PyTorch gets the cap for every bucket, its
first included, and keeps its gradients as bucket views, as minitp does; minitp gets the size that
makes its buckets PyTorch's (``_same_buckets_as_torch``), so both send the same all-reduces.

One more row, ``noise/ddp``, runs PyTorch's DDP on both sides (small model, 2 ranks): the same work
twice, timed as every row is. Its median and interquartile range are how far apart two equal
contenders land on this machine in one run (on the 2-core VM where this was written, four runs:
medians 0.98-1.00, IQRs within 0.91-1.07), the yardstick for reading a DDP row's ratio.
"""

from __future__ import annotations

import sys

import harness

BUCKETS = {"several-buckets": 0.25, "one-bucket": 2.0}  # bucket size / gradient bytes


def _worker(model_name: str, buckets: str, rounds: int, steps: int, warmup: int,
            implementations: tuple[str, str] = harness.SIDES) -> dict:
    """Each side's DDP (``implementations``: what the minitp and torch columns run; the noise row
    runs PyTorch's on both)."""
    from minitp.ddp import DistributedDataParallel, split_batch
    from minitp.models import build_model, get_config, loss_fn
    from minitp.models.train import make_optimizer, synthetic_batches

    steps_in_all = warmup + rounds * steps
    cfg, train = get_config(model_name), harness.train_config(model_name, steps_in_all, harness.rows_for(model_name))
    batches = [(split_batch(x), split_batch(y)) for x, y in synthetic_batches(cfg, train)]
    cap = int(BUCKETS[buckets] * cfg.num_params() * 4)
    minitp_mb = _same_buckets_as_torch(build_model(cfg, seed=train.seed), cap) / 2**20
    sides = {}
    for name, implementation in zip(harness.SIDES, implementations):
        model = build_model(cfg, seed=train.seed)
        if implementation == "minitp":
            wrapped = DistributedDataParallel(model, bucket_mb=minitp_mb)
        else:
            wrapped = torch_ddp(model, cap)
        optimizer = make_optimizer(model.parameters(), train.lr)

        def step(i, wrapped=wrapped, optimizer=optimizer):
            optimizer.zero_grad()
            loss_fn(wrapped(batches[i][0]), batches[i][1]).backward()

        def optimize(i, optimizer=optimizer):
            optimizer.step()

        sides[name] = harness.Side(step, model.state_dict, optimize)
    return harness.time_sides(sides, rounds, steps, warmup)


def torch_ddp(model, cap: int):
    """PyTorch's side: buckets capped at ``cap`` bytes, gradients kept as views into them (as
    minitp keeps them), and no broadcast of buffers before each forward (minitp sends none)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=cap / 2**20, gradient_as_bucket_view=True,
                                   broadcast_buffers=False)


def _same_buckets_as_torch(model, cap: int) -> int:
    """The bucket size that gives minitp the buckets PyTorch makes under ``cap``: PyTorch closes a
    bucket once it reaches the cap (so it may pass it), minitp before it would pass it, so at the
    same cap minitp would send one more, smaller all-reduce. Capped at PyTorch's largest bucket,
    minitp's buckets are PyTorch's, parameter for parameter (checked on both models)."""
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad][::-1]  # backward order
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [cap], [False] * len(params))
    return max(sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets)


def _torch_twice(model_name: str, buckets: str, rounds: int, steps: int, warmup: int) -> dict:
    return _worker(model_name, buckets, rounds, steps, warmup, ("torch", "torch"))


def comparisons(models: list[str]) -> list[harness.Comparison]:
    """4 ranks on every model; the small model also on 2 (4 ranks on 2 cores wait for a core). Last,
    on the small model at 2 ranks, the harness's own noise: PyTorch's DDP on both sides, the same
    work twice, whose ratio would be 1.00 on a machine that did not drift (a minitp row within its
    spread is at par)."""
    rows = [harness.Comparison(f"ddp/{buckets}", model, ranks, _worker, (model, buckets),
                               note=f"bucket = {fraction:g} x gradient bytes")
            for model in models for ranks in ((2, 4) if model == "small" else (4,))
            for buckets, fraction in BUCKETS.items()]
    if "small" in models:
        rows.append(harness.Comparison("noise/ddp", "small", 2, _torch_twice, ("small", "one-bucket"),
                                       note="PyTorch's DDP on both sides: the harness's own noise"))
    return rows


if __name__ == "__main__":
    harness.main(["--only", "ddp", *sys.argv[1:]])
