"""minitp's FSDP (ZeRO-3) against PyTorch's ``fully_shard`` (FSDP2), same machine, same run.

Every rank builds the model twice from the same seed: once wrapped by ``minitp.fsdp``, once by
``fully_shard`` (each block, then the root, on a CPU device mesh over gloo). The two then take
training steps in turn (minitp, fully_shard, minitp, ...), so both see the same machine load. A
step's time is the slowest rank's (a step ends when every rank is done); the table gives the
median over the timed steps and the ratio minitp / fully_shard (below 1: minitp is faster). The
final parameters of the two are compared too, so the timed code is the code that trains right.

    python benchmarks/bench_fsdp.py --nproc 4 --steps 20 [--dim 256 --layers 4] [--mixed-precision bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from minitp.launch import launch
from minitp.models import TrainConfig, get_config


def _bench_worker(cfg, train: TrainConfig, warmup: int, mixed: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from minitp import comm
    from minitp.ddp import split_batch
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.models import build_model, loss_fn, make_optimizer, synthetic_batches

    dtype = torch.bfloat16 if mixed else None
    ours = FullyShardedDataParallel(build_model(cfg, seed=train.seed), zero=3, mixed_precision=dtype)
    ours_opt = ours.attach(make_optimizer(ours.parameters(), train.lr))
    theirs = build_model(cfg, seed=train.seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if mixed else None)
    for block in theirs.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)
    theirs_opt = make_optimizer(theirs.parameters(), train.lr)

    times = {"minitp": [], "fully_shard": []}
    for i, (tokens, targets) in enumerate(synthetic_batches(cfg, train)):
        x, y = split_batch(tokens), split_batch(targets)
        for name, model, opt in (("minitp", ours, ours_opt), ("fully_shard", theirs, theirs_opt)):
            comm.barrier()  # both start the step together on every rank
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    slowest = {}
    for name, values in times.items():  # per step, the slowest rank's time
        t = torch.tensor(values, dtype=torch.float64)
        comm.all_reduce(t, op=comm.ReduceOp.MAX, label="bench/times")
        slowest[name] = t.tolist()
    full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    mine = ours.full_state_dict()
    return {"step_s": slowest, "max_abs_param_diff": max((mine[k] - full[k]).abs().max().item() for k in full)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--dim", type=int, default=None, help="model width (default: the tiny model's 64)")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--mixed-precision", choices=["bf16"], default=None)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    cfg = get_config("tiny")
    if args.dim:
        cfg = cfg.with_(dim=args.dim, ffn_hidden=2 * args.dim)
    if args.layers:
        cfg = cfg.with_(n_layers=args.layers)
    train = TrainConfig(steps=args.warmup + args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    results = launch(_bench_worker, args.nproc, cfg, train, args.warmup, args.mixed_precision == "bf16",
                     echo=False, timeout=600)
    step_s = results[0]["step_s"]
    median = {name: statistics.median(v) for name, v in step_s.items()}
    report = {
        "nproc": args.nproc, "num_params": cfg.num_params(), "dim": cfg.dim, "layers": cfg.n_layers,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
        "mixed_precision": args.mixed_precision,
        "median_step_s": median, "ratio_minitp_over_fully_shard": median["minitp"] / median["fully_shard"],
        "max_abs_param_diff": max(r["max_abs_param_diff"] for r in results),
        "threads_per_rank": 1, "cpus": os.cpu_count(),
    }
    print(f"FSDP (ZeRO-3, {args.mixed_precision or 'fp32'}) on {args.nproc} ranks, gloo CPU, model "
          f"{cfg.num_params():,} parameters (dim {cfg.dim}, {cfg.n_layers} blocks), batch {args.batch_size}x"
          f"{args.seq_len}, {args.steps} timed steps each, alternating")
    for name in ("minitp", "fully_shard"):
        print(f"  {name:<12} median step {median[name] * 1e3:8.1f} ms")
    print(f"  ratio minitp / fully_shard = {report['ratio_minitp_over_fully_shard']:.2f}  "
          f"(final parameters differ by {report['max_abs_param_diff']:.1e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
