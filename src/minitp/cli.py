"""The ``minitp`` command line.

    minitp run ddp --nproc 4 [--steps K] [--bucket-mb X] [--json PATH]
    minitp run fsdp --nproc 4 [--zero 1|2|3] [--mixed-precision bf16] [--steps K] [--json PATH]
    minitp run tp --nproc 4 [--sequence-parallel] [--steps K] [--json PATH]
    minitp run swiglu --nproc 4 [--steps K] [--json PATH]      (the tensor-parallel MLP alone)
    minitp run pp --nproc 4 [--microbatches M] [--schedule gpipe|1f1b] [--steps K] [--json PATH]

trains the tiny model with a strategy on N local processes, checks it against the one-process
reference, the traced bytes and the memory formulas, prints a short table and exits non-zero if
any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys

from minitp import runs


def _write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _run(args: argparse.Namespace) -> int:
    common = dict(nproc=args.nproc, steps=args.steps, model=args.model, batch_size=args.batch_size,
                  seq_len=args.seq_len, seed=args.seed, backend=args.backend, timeout=args.timeout)
    if args.strategy == "ddp":
        report = runs.run_ddp(bucket_mb=args.bucket_mb, **common)
    elif args.strategy == "fsdp":
        report = runs.run_fsdp(zero=args.zero, mixed_precision=args.mixed_precision,
                               reshard_after_forward=not args.no_reshard_after_forward,
                               prefetch=not args.no_prefetch, checkpoint=args.checkpoint, **common)
    elif args.strategy == "tp":
        report = runs.run_tp(sequence_parallel=args.sequence_parallel, **common)
    elif args.strategy == "swiglu":
        report = runs.run_swiglu(**common)
    elif args.strategy == "pp":
        report = runs.run_pp(microbatches=args.microbatches, schedule=args.schedule, **common)
    else:  # argparse's choices keep this unreachable
        raise SystemExit(f"unknown strategy {args.strategy!r}")
    print(runs.format_report(report))
    if args.json:
        _write_json(report, args.json)
        print(f"report written to {args.json}")
    return 1 if runs.check(report) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minitp", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train with a strategy on N processes and check it")
    run.add_argument("strategy", choices=["ddp", "fsdp", "tp", "swiglu", "pp"])
    run.add_argument("--nproc", type=int, default=4, help="number of processes (ranks)")
    run.add_argument("--steps", type=int, default=4, help="training steps")
    run.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket size in MiB")
    run.add_argument("--zero", type=int, default=3, choices=[1, 2, 3], help="FSDP: ZeRO stage")
    run.add_argument("--mixed-precision", choices=["bf16"], default=None,
                     help="FSDP: bf16 compute and gathers, fp32 master shards and gradient sums")
    run.add_argument("--no-reshard-after-forward", action="store_true",
                     help="FSDP (ZeRO-3): keep gathered parameters from forward to backward")
    run.add_argument("--no-prefetch", action="store_true", help="FSDP: no early all-gather of the next unit")
    run.add_argument("--checkpoint", action="store_true", help="FSDP: activation checkpointing of the blocks")
    run.add_argument("--sequence-parallel", action="store_true",
                     help="TP: split the norms' positions over the ranks (reduce-scatter/all-gather)")
    run.add_argument("--microbatches", type=int, default=8, help="PP: micro-batches per step")
    run.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"], help="PP: pipeline schedule")
    run.add_argument("--model", default="tiny", choices=["tiny"], help="model preset")
    run.add_argument("--batch-size", type=int, default=8, help="global batch size")
    run.add_argument("--seq-len", type=int, default=16)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    run.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is ended")
    run.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    run.set_defaults(func=_run)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"minitp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
