"""minitp's tensor parallel against PyTorch's (DTensor ``parallelize_module``): a whole training step
of the whole model, the same weights, data and shards, alternating in one run on the same ranks.

    python benchmarks/bench_tp.py [--models tiny,small] [--quick]

Both split the embedding and the output layer over the vocabulary (the loss computed on vocabulary
shards: minitp's ``vocab_parallel_cross_entropy``, DTensor's ``loss_parallel``), attention over its
heads (wq, wk, wv column-parallel, wo row-parallel) and the MLP over its hidden units (w1, w3
column, w2 row). Two DTensor plans:

* **default-plan**: each column-parallel layer takes a replicated input on its own, so backward
  all-reduces the input gradient of every one of them: 3 in attention and 2 in the MLP.
* **same-messages**: ``PrepareModuleInput`` makes the input of attention and of the MLP one
  replicated DTensor that the column layers share, so backward sums their input gradients first and
  all-reduces once per module, as minitp (Megatron's f) does: the messages minitp sends.

What each side does, and where the harness times it: the step is forward and backward with their
all-reduces; then AdamW steps this rank's shards, with no message. minitp's parameters are plain
tensors (its shards); DTensor's are DTensors, and its optimizer step goes through DTensor's
dispatch once per parameter and operation, which on these models costs far more than the
arithmetic: the optimizer's own column shows how much, apart from the messages.
"""

from __future__ import annotations

import sys

import harness

PLANS = ("same-messages", "default-plan")


def _dtensor_plan(same_messages: bool) -> tuple[dict, dict]:
    """(the model-level plan, the plan of each block): ``minitp.runs.pytorch.tp_plan``, the one
    ``minitp run tp --impl torch`` runs; without its ``PrepareModuleInput`` for the default plan."""
    from minitp.runs.pytorch import tp_plan

    top, block = tp_plan()
    if not same_messages:
        block = {k: v for k, v in block.items() if k not in ("attention", "feed_forward")}
    return top, block


def _worker(model_name: str, plan: str, rounds: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from minitp import tp
    from minitp.models import build_model, get_config
    from minitp.models.train import make_optimizer, synthetic_batches

    steps_in_all = warmup + rounds * steps
    cfg, train = get_config(model_name), harness.train_config(model_name, steps_in_all, harness.rows_for(model_name))
    batches = synthetic_batches(cfg, train)
    tp_size = dist.get_world_size()

    ours = tp.parallelize(build_model(cfg, seed=train.seed), None)
    ours_opt = make_optimizer(ours.parameters(), train.lr)

    def minitp_step(i):
        tokens, targets = batches[i]
        ours_opt.zero_grad()
        tp.vocab_parallel_cross_entropy(ours(tokens), targets, None).backward()  # logits (B, S, V/tp)

    mesh = init_device_mesh("cpu", (tp_size,))
    theirs = build_model(cfg, seed=train.seed)
    top, block_plan = _dtensor_plan(plan == "same-messages")
    parallelize_module(theirs, mesh, top)
    for block in theirs.layers:
        parallelize_module(block, mesh, block_plan)
        for linear in (block.attention.wq, block.attention.wk, block.attention.wv):
            linear.out_features //= tp_size  # the plain forward reads its local head counts off these
    theirs_opt = make_optimizer(theirs.parameters(), train.lr)

    def torch_step(i):
        tokens, targets = batches[i]
        theirs_opt.zero_grad()
        with loss_parallel():
            F.cross_entropy(theirs(tokens).flatten(0, 1), targets.flatten()).backward()

    def local(model):  # this rank's shards, under the plain model's names
        return {k: p.to_local() if isinstance(p, DTensor) else p for k, p in model.named_parameters()}

    sides = {"minitp": harness.Side(minitp_step, lambda: local(ours), lambda i: ours_opt.step()),
             "torch": harness.Side(torch_step, lambda: local(theirs), lambda i: theirs_opt.step())}
    return harness.time_sides(sides, rounds, steps, warmup)


def comparisons(models: list[str]) -> list[harness.Comparison]:
    return [harness.Comparison(f"tp/{plan}", model, 4, _worker, (model, plan), note=f"vs DTensor, {plan}")
            for model in models for plan in PLANS]


if __name__ == "__main__":
    harness.main(["--only", "tp", *sys.argv[1:]])
