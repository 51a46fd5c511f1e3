"""The first launch of 8 ranks from a fresh process, timed (not a comparison: PyTorch has no launcher
that runs a function from a notebook).

Each measurement is a fresh Python that imports torch and minitp, then times ``minitp.launch`` of a
function on 8 ranks twice: the first launch, and a second one (warm). Two functions: one that does
nothing, and one that takes an optimizer step (its ranks need ``torch._dynamo``, which the parent
imports before forking: ``minitp.launcher.guard.warm_optimizer_imports``).

    python benchmarks/bench_launch.py [--repeats 5]

prints the median and range of each, with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
import minitp

def nothing():
    return 1

def one_step():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    torch.optim.AdamW([p], lr=0.1).step()
    return 1

fn = nothing if sys.argv[1] == "nothing" else one_step
t0 = time.perf_counter()
minitp.launch(fn, 8, echo=False, start_method="fork")
t1 = time.perf_counter()
minitp.launch(fn, 8, echo=False, start_method="fork")
print(json.dumps({"first": t1 - t0, "second": time.perf_counter() - t1}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"load before: {os.getloadavg()[0]:.2f}")
    for kind in ("nothing", "one_step"):
        runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True,
                                          check=True).stdout) for _ in range(args.repeats)]
        for which in ("first", "second"):
            times = [r[which] for r in runs]
            print(f"{kind:>9} {which:>6} launch of 8 ranks: median {statistics.median(times):.2f} s "
                  f"(range {min(times):.2f}-{max(times):.2f}, {args.repeats} fresh processes)")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
