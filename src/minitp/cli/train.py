"""``minitp train`` (real text on any layout), ``minitp sample`` (what its model writes) and
``minitp export`` (its checkpoint as one file)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from minitp.cli.common import check_output_file
from minitp.layout import AXES
from minitp.runs.context_parallel import ATTENTION
from minitp.runs.registry import Option


def train(args: argparse.Namespace) -> int:
    from minitp import trainer
    from minitp.runs import training

    if args.resume and args.out is None:
        raise ValueError("--resume needs --out DIR: the folder whose checkpoint to continue from")
    # train makes --out, nothing else
    check_output_file("--trace-out", args.trace_out, made_folder=args.out)
    s = trainer.Settings(
        model=args.model, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
        cp_attention=args.attention, data_parallel="fsdp" if args.fsdp else "ddp", zero=args.zero,
        schedule=args.schedule, microbatches=args.microbatches, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup=args.warmup if args.warmup is not None else min(30, args.steps // 10),
        clip=args.clip, eval_every=args.eval_every, eval_batches=args.eval_batches,
        save_every=args.save_every, out=args.out, resume=args.resume, overwrite=args.overwrite,
        seed=args.seed, corpus=args.corpus, max_files=args.max_files, kill_at=args.kill_at,
        profile=args.profile)
    dims = s.dims  # what composes with what, checked as it is made
    if args.layout == "auto" and set(dims.on) - {"ep"}:
        raise ValueError("--layout auto picks dp, tp and pp itself: give it --nprocs N, without "
                         "--dp/--tp/--pp/--cp")
    if args.layout is None and args.nproc is not None and args.nproc != dims.world:
        raise ValueError(f"--nprocs {args.nproc} but dp x tp x pp x cp = {args.dp} x {args.tp} x "
                         f"{args.pp} x {args.cp} = {dims.world} processes: give the layout's "
                         f"product, or --layout auto --nprocs {args.nproc}")
    if args.layout == "auto":
        s, rows = training.auto_layout(s, args.nproc or 2)
        print("minitp train --layout auto: the time model's step on this machine (minitp "
              "calibrate), fastest first")
        for r in rows:
            print(f"  dp {r['dp']} pp {r['pp']} tp {r['tp']}" + (f" (m={r['microbatches']})"
                                                                 if r["pp"] > 1 else "")
                  + f": {r['step_s'] * 1e3:.0f} ms")
    results = training.train(s, max_restarts=args.max_restarts, backend=args.backend)
    from minitp.launcher import under_torchrun

    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    losses = next((r["losses"] for r in results if r["losses"]), [])
    done = results[0]["start"] + len(losses)
    said = f"last loss {losses[-1]:.3f} nats/byte" if losses else "no step left to run"
    print(f"minitp train: at step {done} of {args.steps}, {said}"
          + (f"; log, figure and checkpoint in {args.out}" if args.out else ""))
    timed = training.measured_and_predicted(s, results)
    if timed:
        print(f"minitp train: {timed}")
    if args.trace_out:
        from minitp.viz.chrome_trace import write_chrome_trace

        coords = [dict(zip(AXES, r["coords"])) for r in results]
        write_chrome_trace(args.trace_out, results.traces, coords=coords)
        print(f"the last step's trace written to {args.trace_out}"
              + (" (with its operators: torch.profiler)" if args.profile else ""))
    if args.profile:
        from minitp.measure.operators import format_shares, shares

        print("where the last step's time went (torch.profiler's operators, minitp's messages; "
              "the profiler adds a few µs to each operator):")
        print(format_shares([shares(t.events) for t in results.traces]))
    if results[0]["stopped"]:
        signum = next((r["signal"] for r in results if r.get("signal")), signal.SIGINT)
        by = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        saved = (f"the checkpoint holds step {done}: add --resume to go on" if args.out
                 else "nothing saved (no --out)")
        print(f"minitp train: stopped by {by}; {saved}", file=sys.stderr)
        # 130 for SIGINT, 143 for SIGTERM, as a shell reports a process they ended
        return 128 + signum
    return 0


def train_options():
    from minitp.pp_schedules import RUNNER_SCHEDULES
    from minitp.trainer import PRESETS

    return (
        Option("model", str, "byte", "byte-level model preset", choices=tuple(PRESETS)),
        *(Option(dim, int, 1, help, low=1) for dim, help in (
            ("dp", "data-parallel replicas"), ("tp", "tensor-parallel ranks"),
            ("pp", "pipeline stages"), ("cp",
                                        "context-parallel ranks per replica (ring attention)"),
            ("ep", "expert-parallel ranks (--model byte-moe)"))),
        ATTENTION,
        Option("layout", str, None, "auto: the planner picks dp, tp and pp for --nprocs processes",
               choices=("auto",)),
        Option("nproc", int, None,
               "processes: dp x tp x pp x cp, or what --layout auto splits (default 2)", low=1,
               optional=True, spelled="nprocs"),
        Option("fsdp", bool, False, "FSDP across replicas (default DDP)"),
        Option("zero", int, None, "ZeRO stage with --fsdp", choices=(None, 1, 2, 3)),
        Option("schedule", str, "1f1b", "pipeline schedule", choices=RUNNER_SCHEDULES),
        Option("microbatches", int, 1, "micro-batches per step (pipeline)", low=1),
        Option("steps", int, 300, "optimizer steps", low=1),
        Option("batch_size", int, 16, "global batch, in sequences", low=1),
        Option("seq_len", int, 128, "bytes per sequence", low=1),
        Option("lr", float, 3e-3, "peak learning rate", above=0),
        Option("warmup", int, None, "warm-up steps (default: a tenth of the steps, at most 30)",
               low=0, optional=True),
        Option("clip", float, 1.0, "largest global gradient norm (0: no clipping)", low=0),
        Option("eval_every", int, 100, "validation loss every N steps (0: only at the end)", low=0),
        Option("eval_batches", int, 2, "batches of the validation loss", low=1),
        Option("save_every", int, 100,
               "checkpoint every N steps (0: only at the end and on Ctrl-C)", low=0),
        Option("out", str, None, "folder for log.jsonl, loss.png and checkpoint/", metavar="DIR"),
        Option("resume", bool, False,
               "continue from the checkpoint in --out, on this layout, when there is one"),
        Option("overwrite", bool, False,
               "start again in an --out that holds a run: its log, figure and checkpoint "
               "are replaced (without it, or --resume, such an --out is refused)"),
        Option("max_restarts", int, 0,
               "relaunch from the last checkpoint when a rank dies, up to N times", low=0),
        Option("seed", int, 0, "model and batch seed", low=0),
        Option("corpus", str, None,
               "a folder of .py files or a .tar.gz of them (default: this Python's standard "
               "library)", metavar="PATH"),
        Option("max_files", int, None, "only the first N files of the corpus (quick tries)", low=1,
               optional=True),
        Option("backend", str, "gloo", "gloo: CPU processes; nccl: one GPU per process",
               choices=("gloo", "nccl")),
        Option("kill_at", int, None, "the last rank dies at step N, once (to watch a restart)",
               low=0, optional=True),
        Option("profile", bool, False,
               "profile the last step (torch.profiler): print where its time went (matmul, "
               "attention, elementwise, optimizer, communication, Python); with --trace-out its "
               "operators go into the trace, nested under its spans"),
    )


def sample(args: argparse.Namespace) -> int:
    from minitp.runs import sampling

    if args.checkpoint is None:
        raise ValueError("--checkpoint DIR is required: the checkpoint folder of a minitp train "
                         "run (OUT/checkpoint)")
    model = sampling.load_for_sampling(args.checkpoint)
    print(sampling.sample(model, args.prompt, args.tokens, args.temperature, args.seed))
    return 0


SAMPLE_OPTIONS = (
    Option("checkpoint", str, None, "a minitp train checkpoint folder (DIR/checkpoint)",
           metavar="DIR"),
    Option("prompt", str, "def ", "the text to continue"),
    Option("tokens", int, 200, "bytes to write", low=1),
    Option("temperature", float, 0.8, "sampling temperature (0: the most likely byte)", low=0),
    Option("seed", int, 0, "sampling seed", low=0),
)


def export(args: argparse.Namespace) -> int:
    from minitp.runs import exporting

    if args.checkpoint is None or args.out is None:
        raise ValueError("--checkpoint DIR and --out FILE are required: minitp export --checkpoint "
                         "runs/a/checkpoint --out model.safetensors")
    exporting.check_out(args.out, args.overwrite)
    done = exporting.export(args.checkpoint, args.out)
    print(f"minitp export: step {done['step']}, {done['tensors']} tensors, "
          f"{done['bytes'] / 2**20:.1f} MiB written to {args.out} (safetensors; "
          "minitp.runs.exporting.load_exported gives the plain model)")
    return 0


EXPORT_OPTIONS = (
    Option("checkpoint", str, None, "a minitp train checkpoint folder (DIR/checkpoint)",
           metavar="DIR"),
    Option("out", str, None, "the file to write, e.g. model.safetensors", metavar="FILE"),
    Option("overwrite", bool, False, "replace --out if it exists"),
)
