"""The ``minitp`` command line.

    minitp run ddp --nproc 4 [--steps K] [--bucket-mb X] [--json PATH]

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
    run.add_argument("strategy", choices=["ddp"])
    run.add_argument("--nproc", type=int, default=4, help="number of processes (ranks)")
    run.add_argument("--steps", type=int, default=4, help="training steps")
    run.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket size in MiB")
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
