"""The ``minitp`` command line.

    minitp run ddp --nproc 4 [--steps K] [--bucket-mb X] [--json PATH]
    minitp run fsdp --nproc 4 [--zero 1|2|3] [--mixed-precision bf16] [--steps K] [--json PATH]
    minitp run tp --nproc 4 [--sequence-parallel] [--steps K] [--json PATH]
    minitp run swiglu --nproc 4 [--steps K] [--json PATH]      (the tensor-parallel MLP alone)
    minitp run pp --nproc 4 [--microbatches M] [--schedule gpipe|1f1b] [--steps K] [--json PATH]
    minitp run 3d --nproc 8 --dp 2 --tp 2 --pp 2 [--fsdp [--zero Z]] [--save-to DIR] [--resume-from DIR]
    minitp plan --model llama3-8b --gpus 64 --gpu-memory 80      (the layouts that fit; no run)

trains the tiny model with a strategy on N local processes, checks it against the one-process
reference, the traced bytes and the memory formulas, prints a short table and exits non-zero if
any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys

from minitp import runs
from minitp.launch import LaunchError
from minitp.models import get_config


def _write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _run(args: argparse.Namespace) -> int:
    max_seq_len = get_config(args.model).max_seq_len
    if not 1 <= args.seq_len <= max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} is outside 1..{max_seq_len}, the model's max_seq_len")
    common = dict(nproc=args.nproc, steps=args.steps, model=args.model, batch_size=args.batch_size,
                  seq_len=args.seq_len, seed=args.seed, backend=args.backend, timeout=args.timeout)
    if args.strategy == "ddp":
        report = runs.run_ddp(bucket_mb=args.bucket_mb, **common)
    elif args.strategy == "fsdp":
        report = runs.run_fsdp(zero=3 if args.zero is None else args.zero, mixed_precision=args.mixed_precision,
                               reshard_after_forward=not args.no_reshard_after_forward,
                               prefetch=not args.no_prefetch, checkpoint=args.checkpoint, **common)
    elif args.strategy == "tp":
        report = runs.run_tp(sequence_parallel=args.sequence_parallel, **common)
    elif args.strategy == "swiglu":
        report = runs.run_swiglu(**common)
    elif args.strategy == "pp":
        report = runs.run_pp(microbatches=args.microbatches or 8, schedule=args.schedule, **common)
    elif args.strategy == "3d":
        report = runs.run_3d(dp=args.dp, tp=args.tp, pp=args.pp, fsdp=args.fsdp, zero=args.zero,
                             microbatches=args.microbatches, schedule=args.schedule, resume_from=args.resume_from,
                             save_to=args.save_to, **common)
    else:  # argparse's choices keep this unreachable
        raise SystemExit(f"unknown strategy {args.strategy!r}")
    print(runs.format_report(report))
    if args.json:
        _write_json(report, args.json)
        print(f"report written to {args.json}")
    return 1 if runs.check(report) else 0


def _plan(args: argparse.Namespace) -> int:
    from minitp import plan
    from minitp.models import get_config

    cfg = get_config("tiny" if args.model == "custom" else args.model)
    sizes = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size")}
    cfg = cfg.with_(**{k: v for k, v in sizes.items() if v is not None})
    options = dict(flash_attention=not args.no_flash_attention, recompute=args.recompute)
    rows = plan.plan(cfg, args.gpus, args.gpu_memory, args.gpus_per_node, args.batch_size, args.seq_len,
                     "ddp" if args.ddp else "fsdp", args.zero, args.precision, include_unfit=args.all, **options)
    title = (f"minitp plan: {args.model} ({cfg.num_params() / 1e9:.2f} B parameters) on {args.gpus} GPUs of "
             f"{args.gpu_memory:g} GiB")
    if not any(r["fits"] for r in rows):  # say so, and show how far each layout is from fitting
        rows = plan.plan(cfg, args.gpus, args.gpu_memory, args.gpus_per_node, args.batch_size, args.seq_len,
                         "ddp" if args.ddp else "fsdp", args.zero, args.precision, include_unfit=True, **options)
        title += "\nno layout fits; every possible one, with what it would need:"
    print(plan.format_plan(rows, title))
    if args.json:
        _write_json({"model": args.model, "num_params": cfg.num_params(), "gpus": args.gpus,
                     "gpu_memory_gib": args.gpu_memory, "layouts": rows}, args.json)
    return 0 if any(r["fits"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minitp", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train with a strategy on N processes and check it")
    run.add_argument("strategy", choices=["ddp", "fsdp", "tp", "swiglu", "pp", "3d"])
    run.add_argument("--nproc", type=int, default=4, help="number of processes (ranks)")
    run.add_argument("--steps", type=int, default=4, help="training steps")
    run.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket size in MiB")
    run.add_argument("--zero", type=int, default=None, choices=[1, 2, 3],
                     help="FSDP: ZeRO stage (default 3; 3d: 3 without a pipeline, 1 with one)")
    run.add_argument("--mixed-precision", choices=["bf16"], default=None,
                     help="FSDP: bf16 compute and gathers, fp32 master shards and gradient sums")
    run.add_argument("--no-reshard-after-forward", action="store_true",
                     help="FSDP (ZeRO-3): keep gathered parameters from forward to backward")
    run.add_argument("--no-prefetch", action="store_true", help="FSDP: no early all-gather of the next unit")
    run.add_argument("--checkpoint", action="store_true", help="FSDP: activation checkpointing of the blocks")
    run.add_argument("--sequence-parallel", action="store_true",
                     help="TP: split the norms' positions over the ranks (reduce-scatter/all-gather)")
    run.add_argument("--microbatches", type=int, default=None,
                     help="PP: micro-batches per step (default 8; 3d: batch_size/dp)")
    run.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"], help="PP: pipeline schedule")
    run.add_argument("--model", default="tiny", choices=["tiny"], help="model preset")
    run.add_argument("--batch-size", type=int, default=8, help="global batch size")
    run.add_argument("--seq-len", type=int, default=16)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    run.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is ended")
    run.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    run.add_argument("--dp", type=int, default=2, help="3d: data-parallel replicas")
    run.add_argument("--tp", type=int, default=2, help="3d: tensor-parallel ranks per stage")
    run.add_argument("--pp", type=int, default=2, help="3d: pipeline stages")
    run.add_argument("--fsdp", action="store_true", help="3d: FSDP across replicas instead of DDP")
    run.add_argument("--save-to", metavar="DIR", help="3d: save a sharded checkpoint after the last step")
    run.add_argument("--resume-from", metavar="DIR", help="3d: start from a checkpoint (any layout)")
    run.set_defaults(func=_run)

    pl = sub.add_parser("plan", help="the dp x pp x tp layouts of N GPUs that fit a model (from minitp.cost)")
    pl.add_argument("--model", default="llama3-8b", help="preset: tiny, llama3-8b, llama3-70b, or 'custom'")
    pl.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    pl.add_argument("--gpu-memory", type=float, required=True, help="memory per GPU in GiB")
    pl.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per machine (tp stays inside one)")
    pl.add_argument("--batch-size", type=int, default=None, help="global batch in sequences (default: one per GPU)")
    pl.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    pl.add_argument("--ddp", action="store_true", help="DDP across replicas (default FSDP, ZeRO-3 or 1 with pp)")
    pl.add_argument("--zero", type=int, default=None, choices=[1, 2, 3])
    pl.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    pl.add_argument("--all", action="store_true", help="also list the layouts that do not fit")
    pl.add_argument("--recompute", action="store_true", help="full activation recomputation (keep block inputs)")
    pl.add_argument("--no-flash-attention", action="store_true", help="count the stored attention scores")
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "ffn-hidden", "vocab-size"):
        pl.add_argument(f"--{name}", type=int, default=None, help="override the preset's size")
    pl.add_argument("--json", metavar="PATH", help="also write the layouts as JSON")
    pl.set_defaults(func=_plan)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"minitp: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:  # a rank failed or hung: its message carries the rank's own traceback
        print(f"minitp: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
