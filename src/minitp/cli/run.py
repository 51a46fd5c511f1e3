"""``minitp run STRATEGY``: a strategy trained on N processes and checked three ways."""

from __future__ import annotations

import argparse
import os

from minitp.cli.common import check_output_file, first_rank
from minitp.runs.registry import STRATEGIES, Strategy


def run(args: argparse.Namespace) -> int:
    from minitp.launcher import under_torchrun

    strategy: Strategy = STRATEGIES[args.strategy]
    values = {o.name: getattr(args, o.name) for o in strategy.all_options()}
    if under_torchrun() and "nproc" in values:  # the world is torchrun's, each rank runs this
        values["nproc"] = int(os.environ["WORLD_SIZE"])
    if first_rank():
        check_output_file("--json", args.json)
        check_output_file("--trace-out", args.trace_out)
    if getattr(args, "impl", "minitp") == "torch":
        from minitp.runs.pytorch import run_torch

        if args.trace_out:
            raise ValueError("--trace-out draws minitp's trace; --impl torch counts PyTorch's "
                             "calls without one: leave one of them out")
        report = run_torch(args.strategy, **values)
    else:
        report = strategy.runner(**values)
    if not first_rank():  # every rank holds the whole report; the first one prints and writes it
        return 1 if report.check() else 0
    print(report.format())
    if args.json:
        report.to_json(args.json)
        print(f"report written to {args.json}")
    if args.trace_out:
        from minitp.viz.chrome_trace import report_coords, write_chrome_trace

        write_chrome_trace(args.trace_out, report.traces, coords=report_coords(report))
        print(f"trace written to {args.trace_out} (drag it onto ui.perfetto.dev, or Load it in "
              "chrome://tracing)")
    return 1 if report.check() else 0
