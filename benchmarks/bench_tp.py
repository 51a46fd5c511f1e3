"""minitp tensor parallel against PyTorch's (DTensor ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``): the SwiGLU MLP and a whole transformer block, same weights and shapes,
alternating in one run on the same ranks, so both see the same machine load.

    python benchmarks/bench_tp.py [--nproc 4] [--rounds 10] [--steps 3] [--json PATH]

A step is forward and backward of one (B, S, D) batch. Prints the median step time of each and the
ratio minitp / PyTorch (below 1: minitp is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import minitp
from minitp import tp
from minitp.models import TINY, build_model

# Larger than the tiny model, as in bench_ddp, so that a step is compute and communication.
BENCH_MODEL = TINY.with_(vocab_size=512, dim=256, n_layers=1, n_heads=8, ffn_hidden=688, max_seq_len=64)
PLAN = {"attention.wq": "col", "attention.wk": "col", "attention.wv": "col", "attention.wo": "row",
        "feed_forward.w1": "col", "feed_forward.w3": "col", "feed_forward.w2": "row"}


def _dtensor(block, mesh, mlp_only: bool):
    """The block (or its MLP) under PyTorch's tensor parallel, the same plan as minitp's."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    if mlp_only:
        plan = {k.split(".", 1)[1]: styles[v]() for k, v in PLAN.items() if k.startswith("feed_forward")}
        return parallelize_module(block.feed_forward, mesh, plan)
    parallelize_module(block, mesh, {k: styles[v]() for k, v in PLAN.items()})
    for linear in (block.attention.wq, block.attention.wk, block.attention.wv):
        linear.out_features //= mesh.size()  # the plain forward reads its local head count off these
    return block


def _bench(rounds: int, steps: int, batch_size: int, seq_len: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(BENCH_MODEL)
    cos, sin = model.rope_cos[:seq_len], model.rope_sin[:seq_len]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, seq_len, BENCH_MODEL.dim, generator=g).requires_grad_()
    contenders = {}
    for piece in ("mlp", "block"):
        minitp_block = build_model(BENCH_MODEL).layers[0]
        if piece == "mlp":
            contenders[("minitp", piece)] = tp.ParallelFeedForward(minitp_block.feed_forward, None)
        else:
            contenders[("minitp", piece)] = tp.parallelize(build_model(BENCH_MODEL), None).layers[0]
        contenders[("torch", piece)] = _dtensor(build_model(BENCH_MODEL).layers[0], mesh, piece == "mlp")

    def step(key):
        module = contenders[key]
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = module(x) if key[1] == "mlp" else module(x, cos, sin)
        y.pow(2).mean().backward()

    times = {f"{who}/{piece}": [] for who, piece in contenders}
    for key in contenders:  # warm-up: first steps allocate
        step(key)
    for r in range(rounds):
        for piece in ("mlp", "block"):
            order = ("minitp", "torch") if r % 2 == 0 else ("torch", "minitp")
            for who in order:
                for _ in range(steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    step((who, piece))
                    times[f"{who}/{piece}"].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    results = minitp.launch(_bench, args.nproc, args.rounds, args.steps, args.batch_size, args.seq_len,
                            timeout=1800, echo=False)
    # A step ends for everyone at its last collective, so take the slowest rank's time per step.
    per_step = {k: [max(r[k][i] for r in results) for i in range(len(results[0][k]))] for k in results[0]}
    med = {k: statistics.median(v) for k, v in per_step.items()}
    ratio = {piece: med[f"minitp/{piece}"] / med[f"torch/{piece}"] for piece in ("mlp", "block")}
    cfg = BENCH_MODEL
    print(f"TP benchmark: {args.nproc} ranks (gloo, CPU, 1 thread per rank), x ({args.batch_size}, {args.seq_len}, "
          f"{cfg.dim}), {cfg.n_heads} heads, MLP hidden {cfg.ffn_hidden}, forward + backward, "
          f"{len(per_step['minitp/mlp'])} steps each, alternating")
    for piece in ("mlp", "block"):
        ours, theirs = med[f"minitp/{piece}"], med[f"torch/{piece}"]
        print(f"  {piece:<5}  minitp {ours * 1e3:8.2f} ms   DTensor {theirs * 1e3:8.2f} ms   "
              f"ratio minitp / PyTorch = {ratio[piece]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nproc": args.nproc, "median_s": med, "ratio": ratio, "step_s": per_step}, f, indent=2)


if __name__ == "__main__":
    main()
