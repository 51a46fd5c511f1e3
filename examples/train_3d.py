"""Train the tiny model on a dp × pp × tp mesh and check it against one process, on one machine or
many.

One machine, 8 local processes (minitp starts them):

    python examples/train_3d.py --nprocs 8 --dp 2 --tp 2 --pp 2

Two machines of 4 processes each (run on both, NODE_RANK 0 and 1; HOST is the first machine's
address):

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank NODE_RANK \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id minitp-3d \\
        examples/train_3d.py --dp 2 --tp 2 --pp 2

Under torchrun nothing is started: every process runs the same code (``minitp.launch`` runs in
place), the ranks are placed tp-fastest so each tensor-parallel pair stays inside one machine, and
the first rank prints the report. With ``--backend nccl`` each process computes on its own GPU,
``cuda:LOCAL_RANK`` (``minitp.launcher.device``): the model, the batches and every message go there.
"""

import argparse
import os
import sys

from minitp import runs
from minitp.grid import check_tp_within_node
from minitp.launcher import under_torchrun


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", dest="nproc", type=int, default=None,
                        help="local processes (default: torchrun's world)")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo: CPU; nccl: one GPU per process")
    parser.add_argument("--json", metavar="PATH", help="write the report (first rank only)")
    args = parser.parse_args()
    first = True
    if under_torchrun():
        nproc = int(os.environ["WORLD_SIZE"])
        check_tp_within_node(args.tp, int(os.environ.get("LOCAL_WORLD_SIZE", nproc)))
        first = int(os.environ["RANK"]) == 0
    else:
        nproc = args.nproc or args.dp * args.tp * args.pp
    report = runs.run_3d(nproc=nproc, dp=args.dp, tp=args.tp, pp=args.pp, fsdp=args.fsdp,
                         steps=args.steps, backend=args.backend)
    if first:
        print(runs.format_report(report))
        if args.json:
            report.to_json(args.json)
    return 1 if runs.check(report) else 0


if __name__ == "__main__":
    sys.exit(main())
