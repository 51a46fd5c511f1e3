"""minitp's FSDP against PyTorch's ``fully_shard`` (FSDP2): the same model, seed and data, alternating
in one run on the same ranks.

    python benchmarks/bench_fsdp.py [--models tiny,small] [--quick]

Both wrap each transformer block as a unit and the root around them, on a CPU device mesh over
gloo. ZeRO-3 frees a block's gathered parameters after its forward and gathers them again for
backward, as ``fully_shard(reshard_after_forward=True)`` does; ZeRO-2 keeps them from forward to
backward, as ``reshard_after_forward=False`` does (the same messages: one all-gather of the
parameters and one reduce-scatter of the gradients per step).

Both prefetch: minitp starts the next unit's all-gather before this unit computes (forward) and the
previous one's in backward; ``fully_shard`` is told to do the same (``prefetch_like_minitp``).

What each side does, and where the harness times it: the step is forward and backward with their
all-gathers and reduce-scatters; then AdamW steps this rank's quarter of the parameters. minitp's
optimizer steps one flat fp32 shard per unit (a handful of tensors); ``fully_shard``'s steps every
parameter as a sharded DTensor, one dispatch through DTensor per parameter, which costs far more
than the arithmetic on a small model: the optimizer's own column shows how much. One message moves
between the phases in ZeRO-2: minitp all-gathers the updated shards right after its optimizer step
(timed with it), where ``fully_shard(reshard_after_forward=False)`` all-gathers them at the start of
the next forward (timed with the step); the whole step holds both on both sides.
"""

from __future__ import annotations

import sys

import harness

ZERO = {"zero3": (3, True), "zero2": (2, False)}  # minitp's zero, fully_shard's reshard_after_forward


def _worker(model_name: str, variant: str, rounds: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from minitp.ddp import split_batch
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.models import build_model, get_config, loss_fn
    from minitp.models.train import make_optimizer, synthetic_batches

    zero, reshard = ZERO[variant]
    steps_in_all = warmup + rounds * steps
    cfg, train = get_config(model_name), harness.train_config(model_name, steps_in_all, harness.rows_for(model_name))
    batches = [(split_batch(x), split_batch(y)) for x, y in synthetic_batches(cfg, train)]

    ours = FullyShardedDataParallel(build_model(cfg, seed=train.seed), zero=zero, reshard_after_forward=reshard)
    ours_opt = ours.attach(make_optimizer(ours.parameters(), train.lr))
    theirs = build_model(cfg, seed=train.seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in theirs.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(theirs, mesh=mesh, reshard_after_forward=reshard)
    prefetch_like_minitp(theirs)
    theirs_opt = make_optimizer(theirs.parameters(), train.lr)

    def stepper(model, optimizer):
        def step(i):
            optimizer.zero_grad()
            loss_fn(model(batches[i][0]), batches[i][1]).backward()
        return step

    sides = {"minitp": harness.Side(stepper(ours, ours_opt), ours.full_state_dict, lambda i: ours_opt.step()),
             "torch": harness.Side(stepper(theirs, theirs_opt),
                                   lambda: {k: p.full_tensor() for k, p in theirs.named_parameters()},
                                   lambda i: theirs_opt.step())}
    return harness.time_sides(sides, rounds, steps, warmup)


def prefetch_like_minitp(model) -> None:
    """Have ``fully_shard`` start the next block's all-gather as minitp's prefetch does: in forward
    from the root and from each block to the next, in backward from each block to the one before.
    (On CPU its default issues a block's all-gather only when that block starts, so nothing would
    overlap in forward.)"""
    blocks = list(model.layers)
    model.set_modules_to_forward_prefetch(blocks[:1])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
        block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0):i])


def comparisons(models: list[str]) -> list[harness.Comparison]:
    return [harness.Comparison(f"fsdp/{variant}", model, 4, _worker, (model, variant),
                               note=f"vs fully_shard(reshard_after_forward={reshard})")
            for model in models for variant, (_, reshard) in ZERO.items()]


if __name__ == "__main__":
    harness.main(["--only", "fsdp", *sys.argv[1:]])
