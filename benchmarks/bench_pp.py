"""minitp's pipeline parallel against PyTorch's ``torch.distributed.pipelining``, same machine, same run.

Every rank builds its stage of the model twice from the same seed: once as ``minitp.pp.Pipeline``,
once as ``torch.distributed.pipelining.PipelineStage`` driven by ``ScheduleGPipe`` or
``Schedule1F1B`` (over the same blocks: the stage module is minitp's ``PipelineStage``, so both
compute the same thing and only the schedule runner differs). For each schedule the two take
training steps in turn (minitp, torch, minitp, ...), so both see the same machine load. A step's
time is the slowest rank's (a step ends when every rank is done); the table gives the median over
the timed steps and the ratio minitp / torch (below 1: minitp is faster). The final parameters of
the two are compared too, so the timed code is the code that trains right.

    python benchmarks/bench_pp.py --nproc 2 --microbatches 8 --steps 20 [--batch-size 32 --seq-len 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial

import torch

from minitp.launch import launch
from minitp.models import TrainConfig, get_config

SCHEDULES = ("gpipe", "1f1b")


def _torch_step(schedule, rank: int, world: int, tokens, targets) -> None:
    """One forward and backward of torch's schedule: the first stage feeds the tokens, the last the targets."""
    if rank == 0:
        schedule.step(tokens)
    elif rank == world - 1:
        schedule.step(target=targets)
    else:
        schedule.step()


def _bench_worker(cfg, train: TrainConfig, microbatches: int, warmup: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from minitp import comm
    from minitp.models import build_model, loss_fn, make_optimizer, synthetic_batches
    from minitp.pp import Pipeline, PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, torch_schedule in zip(SCHEDULES, (ScheduleGPipe, Schedule1F1B)):
        ours = Pipeline(build_model(cfg, seed=train.seed), None, name, microbatches)
        ours_opt = make_optimizer(ours.parameters(), train.lr)
        module = PipelineStage(build_model(cfg, seed=train.seed), rank, world)
        theirs = torch_schedule(TorchStage(module, rank, world, torch.device("cpu")), microbatches, loss_fn=loss_fn)
        theirs_opt = make_optimizer(module.parameters(), train.lr)

        times = {"minitp": [], "torch": []}
        runners = (("minitp", ours_opt, ours.forward_backward),
                   ("torch", theirs_opt, partial(_torch_step, theirs, rank, world)))
        for i, (tokens, targets) in enumerate(synthetic_batches(cfg, train)):
            for who, opt, step in runners:
                comm.barrier()  # both start the step together on every rank
                t0 = time.perf_counter()
                opt.zero_grad()
                step(tokens, targets)
                opt.step()
                if i >= warmup:
                    times[who].append(time.perf_counter() - t0)
        slowest = {}
        for who, values in times.items():  # per step, the slowest rank's time
            t = torch.tensor(values, dtype=torch.float64)
            comm.all_reduce(t, op=comm.ReduceOp.MAX, label="bench/times")
            slowest[who] = t.tolist()
        theirs_state = module.state_dict()
        diff = max((v - theirs_state[k]).abs().max().item() for k, v in ours.state_dict().items())
        out[name] = {"step_s": slowest, "max_abs_param_diff": diff}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="pipeline stages (2 on a 2-core machine)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--dim", type=int, default=None, help="model width (default: the tiny model's 64)")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    cfg = get_config("tiny")
    if args.dim:
        cfg = cfg.with_(dim=args.dim, ffn_hidden=2 * args.dim)
    if args.layers:
        cfg = cfg.with_(n_layers=args.layers)
    train = TrainConfig(steps=args.warmup + args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    results = launch(_bench_worker, args.nproc, cfg, train, args.microbatches, args.warmup, echo=False, timeout=600)
    report = {
        "nproc": args.nproc, "microbatches": args.microbatches, "num_params": cfg.num_params(), "dim": cfg.dim,
        "layers": cfg.n_layers, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
        "threads_per_rank": 1, "cpus": os.cpu_count(), "schedules": {},
    }
    print(f"pipeline parallel on {args.nproc} stages, {args.microbatches} micro-batches, gloo CPU, model "
          f"{cfg.num_params():,} parameters (dim {cfg.dim}, {cfg.n_layers} blocks), batch {args.batch_size}x"
          f"{args.seq_len}, {args.steps} timed steps each, alternating")
    for name in SCHEDULES:
        median = {who: statistics.median(v) for who, v in results[0][name]["step_s"].items()}
        diff = max(r[name]["max_abs_param_diff"] for r in results)
        ratio = median["minitp"] / median["torch"]
        report["schedules"][name] = {"median_step_s": median, "ratio_minitp_over_torch": ratio,
                                     "max_abs_param_diff": diff}
        print(f"  {name:<6} minitp {median['minitp'] * 1e3:7.1f} ms   torch.distributed.pipelining "
              f"{median['torch'] * 1e3:7.1f} ms   ratio {ratio:.2f}   (parameters differ by {diff:.1e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
