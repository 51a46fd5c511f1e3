"""minitp DDP against torch.nn.parallel.DistributedDataParallel: same model, seed and data, same
bucket size, alternating in one run on the same ranks, so both see the same machine load.

    python benchmarks/bench_ddp.py [--nproc 4] [--rounds 12] [--steps 3] [--bucket-mb 25]

Prints the median step time of each and the ratio minitp / PyTorch (below 1: minitp is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import minitp
from minitp.ddp import DistributedDataParallel, split_batch
from minitp.models import TINY, TrainConfig, build_model, loss_fn, make_optimizer, synthetic_batches

# Larger than the tiny model so that a step is compute and communication, not Python overhead.
BENCH_MODEL = TINY.with_(vocab_size=512, dim=256, n_layers=4, n_heads=8, ffn_hidden=688, max_seq_len=64)


def _bench(rounds: int, steps: int, bucket_mb: float, batch_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    train = TrainConfig(steps=steps, batch_size=batch_size, seq_len=64)
    batches = [(split_batch(x), split_batch(y)) for x, y in synthetic_batches(BENCH_MODEL, train)]
    contenders = {}
    for name in ("minitp", "torch"):
        model = build_model(BENCH_MODEL, seed=0)
        if name == "minitp":
            wrapped = DistributedDataParallel(model, bucket_mb=bucket_mb)
        else:  # an explicit cap applies to PyTorch's first bucket too, so both send the same messages
            wrapped = TorchDDP(model, bucket_cap_mb=bucket_mb)
        contenders[name] = (model, wrapped, make_optimizer(model.parameters(), train.lr))
    times = {name: [] for name in contenders}

    def step(name, x, y):
        model, wrapped, optimizer = contenders[name]
        optimizer.zero_grad()
        loss_fn(wrapped(x), y).backward()
        optimizer.step()

    for name in contenders:  # warm-up: first steps allocate
        step(name, *batches[0])
    for r in range(rounds):
        order = ("minitp", "torch") if r % 2 == 0 else ("torch", "minitp")
        for name in order:
            for x, y in batches:
                dist.barrier()
                t0 = time.perf_counter()
                step(name, x, y)
                times[name].append(time.perf_counter() - t0)
    return {**times, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    results = minitp.launch(_bench, args.nproc, args.rounds, args.steps, args.bucket_mb, args.batch_size,
                            timeout=1800, echo=False)
    # A step ends for everyone at the last all-reduce, so take the slowest rank's time per step.
    per_step = {name: [max(r[name][i] for r in results) for i in range(len(results[0][name]))]
                for name in ("minitp", "torch")}
    med = {name: statistics.median(v) for name, v in per_step.items()}
    ratio = med["minitp"] / med["torch"]
    n_params = BENCH_MODEL.num_params()
    print(f"DDP benchmark: {args.nproc} ranks (gloo, CPU, {results[0]['threads']} thread per rank), "
          f"model {n_params:,} parameters, global batch {args.batch_size}x64, bucket {args.bucket_mb} MiB, "
          f"{len(per_step['minitp'])} steps each, alternating")
    print(f"  minitp DDP   median step {med['minitp'] * 1e3:8.1f} ms")
    print(f"  PyTorch DDP  median step {med['torch'] * 1e3:8.1f} ms")
    print(f"  ratio minitp / PyTorch = {ratio:.3f}  (target <= 1.05)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nproc": args.nproc, "num_params": n_params, "median_s": med, "ratio": ratio,
                       "step_s": per_step}, f, indent=2)


if __name__ == "__main__":
    main()
