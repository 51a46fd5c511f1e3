"""The ``minitp`` command line.

    minitp run ddp --nprocs 4 [--steps K] [--bucket-mb X] [--json PATH]
    minitp run fsdp --nprocs 4 [--zero 1|2|3] [--mixed-precision bf16] [--steps K] [--json PATH]
    minitp run tp --nprocs 4 [--sequence-parallel] [--steps K] [--json PATH]
    minitp run swiglu --nprocs 4 [--steps K] [--json PATH]      (the tensor-parallel MLP alone)
    minitp run pp --nprocs 4 [--microbatches M] [--schedule gpipe|1f1b|interleaved|zb]
        [--virtual-stages V] [--steps K] [--json PATH]
    minitp run 3d --dp 2 --tp 2 --pp 2 [--fsdp [--zero Z]] [--save-to DIR] [--resume-from DIR]
    minitp plan --model llama3-8b --gpus 64 --gpu-memory 80      (the layouts that fit; no run)
        [--sequence-parallel] [--recompute | --selective-recompute] [--device h100|a100]
        [--cp C [--cp-attention ring|ulysses|allgather]] [--activations llama|llama-regather|gpt3]
    minitp plan --model mixtral-8x7b --gpus 64 --gpu-memory 80 --ep 8
                                                  (a MoE: experts over ep GPUs)
    minitp calibrate                              (this machine, for predicted step times)
    minitp train --dp 2 --tp 2 --steps 300 --out runs/a [--resume] [--max-restarts N]
                                                  (real text, any layout)
    minitp sample --checkpoint runs/a/checkpoint --prompt "def "  (text the trained model writes)
    minitp export --checkpoint runs/a/checkpoint --out model.safetensors  (one file, whole tensors)

trains the tiny model with a strategy on N local processes, checks it against the one-process
reference, the traced bytes and the memory formulas, prints a short table and exits non-zero if
any check fails. The strategies and their options come from ``minitp.runs.registry``: ``minitp run X
--help`` lists X's. Every value is checked before any process starts; a bad one ends the command
with one line naming it and what is allowed, and exit code 2.
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import signal
import sys
from dataclasses import replace

from minitp import runs  # noqa: F401  (registers every strategy)
from minitp.launcher import LaunchError, RankError
from minitp.layout import AXES
from minitp.plan import MAX_GPUS
from minitp.runs.context_parallel import ATTENTION
from minitp.runs.registry import STRATEGIES, Option, OptionError, Strategy


def _check_output_file(flag: str, path: str | None, made_folder: str | None = None) -> None:
    """Refuse a report path that cannot be written, before anything runs.

    made_folder: a folder the command makes itself before it writes the file (``minitp train``'s
    ``--out``, checked and made before any process starts): a file straight inside it may name it
    while it does not exist yet. Any other missing folder is refused.
    """
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; expected a file name to write the JSON into")
    if made_folder is not None and parent == os.path.abspath(
        made_folder) and not os.path.lexists(parent):
        # made (and checked for writing) with the rest of the output, before any process starts
        return
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path} is not writable")


# what a rank may raise that is the input's or the disk's fault, not the code's: said in the rank's
# own one line
OS_ERRORS = {name for name, kind in vars(builtins).items() if isinstance(kind, type)
             and issubclass(kind, OSError)}


def _rank_one_line(error: LaunchError) -> tuple[str, int] | None:
    """A rank's ``CheckpointError`` (a checkpoint refused: exit 2, as in the parent) or ``OSError``
    (a file it could not read or write, a full disk: exit 1) as one line, naming the rank; None for
    anything else, whose traceback the learner needs."""
    kind, message = error.raised if isinstance(error, RankError) else ("", "")
    if message and kind == "minitp.checkpoint.CheckpointError":
        return f"rank {error.rank}: {message}", 2
    if message and kind in OS_ERRORS:
        return f"rank {error.rank}: {message}", 1
    return None


def _write_json(data: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _add_option(parser: argparse.ArgumentParser, option: Option) -> None:
    if option.type is bool:
        action = "store_false" if option.negate else "store_true"
        parser.add_argument(option.flag, dest=option.name, action=action, help=option.help)
        return
    choices = [c for c in option.choices if c is not None] or None
    default = "" if option.default is None else f" (default {option.default})"
    parser.add_argument(option.flag, dest=option.name, type=option.type, default=option.default,
                        choices=choices, metavar=option.metavar, help=option.help + default)


def _first_rank() -> bool:
    """Whether this process speaks for the run: always, but under torchrun only global rank 0."""
    from minitp.launcher import under_torchrun

    return not under_torchrun() or os.environ["RANK"] == "0"


def _run(args: argparse.Namespace) -> int:
    from minitp.launcher import under_torchrun

    strategy: Strategy = STRATEGIES[args.strategy]
    values = {o.name: getattr(args, o.name) for o in strategy.all_options()}
    if under_torchrun() and "nproc" in values:  # the world is torchrun's, each rank runs this
        values["nproc"] = int(os.environ["WORLD_SIZE"])
    if _first_rank():
        _check_output_file("--json", args.json)
        _check_output_file("--trace-out", args.trace_out)
    report = strategy.runner(**values)
    if not _first_rank():  # every rank holds the whole report; the first one prints and writes it
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


def _plan(args: argparse.Namespace) -> int:
    from minitp import plan
    from minitp.models import get_config
    from minitp.models.moe import MOE_PRESETS

    if args.gpus is not None and args.gpus > MAX_GPUS:  # the planner answers at once up to it
        raise OptionError("gpus", args.gpus, f"an integer from 1 to {MAX_GPUS}", "--gpus")
    for flag, value in (("--gpus", args.gpus), ("--gpu-memory", args.gpu_memory)):
        if value is None:
            raise ValueError(
                f"{flag} is required: minitp plan --model llama3-8b --gpus 64 --gpu-memory 80")
    _check_output_file("--json", args.json)

    cfg = MOE_PRESETS.get(args.model) or get_config("tiny" if args.model == "custom"
                                                    else args.model)
    sizes = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                                           "vocab_size")}
    cfg = cfg.with_(**{k: v for k, v in sizes.items() if v is not None})
    if args.recompute and args.selective_recompute:
        raise ValueError(
            "--recompute (full) and --selective-recompute exclude each other: choose one")
    from minitp.cost import DEVICES, active_params

    recompute = "full" if args.recompute else "selective" if args.selective_recompute else "none"
    options = dict(flash_attention=args.flash_attention, recompute=recompute,
                   sequence_parallel=args.sequence_parallel, device=DEVICES[args.device],
                   cp=args.cp, ep=args.ep, activations=args.activations,
                   cp_attention=args.cp_attention)
    rows = plan.plan(cfg, args.gpus, args.gpu_memory, args.gpus_per_node, args.batch_size,
                     args.seq_len, "ddp" if args.ddp else "fsdp", args.zero, args.precision,
                     include_unfit=args.all, **options)
    active = f", {active_params(cfg) / 1e9:.2f} B active" if hasattr(cfg, "n_experts") else ""
    title = (f"minitp plan: {args.model} ({cfg.num_params() / 1e9:.2f} B parameters{active}) on "
             f"{args.gpus} GPUs of {args.gpu_memory:g} GiB"
             + (f", sequences split over cp = {args.cp} ({args.cp_attention} attention)"
                if args.cp > 1 else "")
             + (f", experts split over ep = {args.ep}" if args.ep > 1 else ""))
    if not any(r["fits"] for r in rows):  # say so, and show how far each layout is from fitting
        refused = []
        rows = plan.plan(cfg, args.gpus, args.gpu_memory, args.gpus_per_node, args.batch_size,
                         args.seq_len, "ddp" if args.ddp else "fsdp", args.zero, args.precision,
                         include_unfit=True, refused=refused, **options)
        if not rows:  # none is possible at all: say why, in one line
            raise ValueError(plan.why_no_layout(refused, args.gpus, args.batch_size, args.cp,
                                                args.ep))
        title += "\nno layout fits; every possible one, with what it would need:"
    print(plan.format_plan(rows, title))
    if args.json:
        _write_json({"model": args.model, "num_params": cfg.num_params(),
                     "active_params": active_params(cfg), "gpus": args.gpus,
                     "gpu_memory_gib": args.gpu_memory, "layouts": rows}, args.json)
    return 0 if any(r["fits"] for r in rows) else 1


# `minitp plan`'s options, checked like a strategy's (it runs nothing, so no COMMON ones)
PLAN_OPTIONS = (
    Option("model", str, "llama3-8b", "preset, or 'custom' with the sizes below",
           choices=("tiny", "llama3-8b", "llama3-70b", "mixtral-8x7b", "custom")),
    Option("gpus", int, None, f"number of GPUs (at most {MAX_GPUS})", low=1, optional=True),
    Option("gpu_memory", float, None, "memory per GPU in GiB", above=0, optional=True),
    Option("gpus_per_node", int, 8, "GPUs per machine (tp stays inside one)", low=1),
    Option("batch_size", int, None, "global batch in sequences (default: one per GPU)", low=1,
           optional=True),
    Option("seq_len", int, None, "tokens per sequence (default: the model's max_seq_len)", low=1,
           optional=True),
    Option("ddp", bool, False, "DDP across replicas (default FSDP, ZeRO-3 or 1 with pp)"),
    Option("zero", int, None, "ZeRO stage", choices=(None, 1, 2, 3)),
    Option("precision", str, "bf16", "bytes per parameter and activation",
           choices=("bf16", "fp32")),
    Option("all", bool, False, "also list the layouts that do not fit"),
    Option("recompute", bool, False, "full activation recomputation (keep block inputs)"),
    Option("selective_recompute", bool, False,
           "recompute attention's scores only (Korthikanti et al.)"),
    Option("sequence_parallel", bool, False,
           "split the norms' activations over tp (reduce-scatter/all-gather)"),
    Option("device", str, "h100", "whose FLOP/s and links time the step", choices=("h100", "a100")),
    Option("cp", int, 1, "context parallel: each sequence split over cp GPUs (ring attention); "
           "the layouts are those of gpus/cp", low=1),
    replace(ATTENTION, name="cp_attention"),
    Option("ep", int, 1,
           "expert parallel (a MoE model, e.g. mixtral-8x7b): its experts split over ep of the "
           "data-parallel GPUs; ep divides n_experts and dp·cp", low=1),
    Option("flash_attention", bool, True, "count the stored attention scores", negate=True),
    Option("activations", str, "llama",
           "how a block's activations are counted: minitp's LLaMA block, the same with the "
           "linears' inputs gathered again in backward (Megatron-LM), or GPT-3's (Korthikanti et "
           "al.)",
           choices=("llama", "llama-regather", "gpt3")),
    *(Option(name, int, None, "override the preset's size", low=1, optional=True)
      for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size")),
)


def _calibrate(args: argparse.Namespace) -> int:
    from minitp.measure import calibrate
    from minitp.runs import measuring

    _check_output_file("--json", args.json)
    if not args.dry_run:  # where it will be stored, before seconds of measuring
        calibrate.check_store()
    cal = measuring.calibrate()
    print(calibrate.format_calibration(cal))
    if not args.dry_run:
        print(f"stored in {calibrate.save(cal)}")
    if args.json:
        _write_json(cal, args.json)
    return 0


# `minitp calibrate`'s options (it measures this machine for the time model)
CALIBRATE_OPTIONS = (
    Option("dry_run", bool, False, "measure and print, store nothing"),
)


def _train(args: argparse.Namespace) -> int:
    from minitp import trainer
    from minitp.runs import training

    if args.resume and args.out is None:
        raise ValueError("--resume needs --out DIR: the folder whose checkpoint to continue from")
    # train makes --out, nothing else
    _check_output_file("--trace-out", args.trace_out, made_folder=args.out)
    s = trainer.Settings(
        model=args.model, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
        cp_attention=args.attention, data_parallel="fsdp" if args.fsdp else "ddp", zero=args.zero,
        schedule=args.schedule, microbatches=args.microbatches, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup=args.warmup if args.warmup is not None else min(30, args.steps // 10),
        clip=args.clip, eval_every=args.eval_every, eval_batches=args.eval_batches,
        save_every=args.save_every, out=args.out, resume=args.resume, overwrite=args.overwrite,
        seed=args.seed, corpus=args.corpus, max_files=args.max_files, kill_at=args.kill_at)
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
    if args.trace_out:
        from minitp.viz.chrome_trace import write_chrome_trace

        coords = [dict(zip(AXES, r["coords"])) for r in results]
        write_chrome_trace(args.trace_out, results.traces, coords=coords)
        print(f"the last step's trace written to {args.trace_out}")
    if results[0]["stopped"]:
        signum = next((r["signal"] for r in results if r.get("signal")), signal.SIGINT)
        by = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        saved = (f"the checkpoint holds step {done}: add --resume to go on" if args.out
                 else "nothing saved (no --out)")
        print(f"minitp train: stopped by {by}; {saved}", file=sys.stderr)
        # 130 for SIGINT, 143 for SIGTERM, as a shell reports a process they ended
        return 128 + signum
    return 0


def _train_options():
    from minitp.pp_schedules import SCHEDULES
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
        Option("schedule", str, "1f1b", "pipeline schedule", choices=tuple(SCHEDULES)),
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
    )


def _sample(args: argparse.Namespace) -> int:
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


def _export(args: argparse.Namespace) -> int:
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


class _Usage(Exception):
    """A command line argparse cannot read, as its one line: ``minitp run 3d: error: argument --dp:
    ...``."""


DESCRIPTION = """\
minitp: data, fully sharded, tensor, pipeline, context and expert parallelism,
built from scratch on torch.distributed, run on N processes and checked against
one process, PyTorch and the formulas."""
# the docstring's examples, as a terminal shows them
EXAMPLES = "examples:\n" + __doc__.split("\n\n")[1].strip("\n")


def _version() -> str:
    import platform

    import torch

    from minitp import __version__

    return f"minitp {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


class _Parser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands'), whose error is one line without the usage block
    above it (``--help`` shows that): ``minitp run 3d: error: argument --dp: invalid int value:
    'x'``."""

    def error(self, message: str):
        raise _Usage(f"{self.prog}: error: {message}")


def _tell_torchrun(error: BaseException) -> None:
    """Under torchrun, leave this rank's error where its agent reads it (TORCHELASTIC_ERROR_FILE),
    so that its failure summary names it, as ``@record`` does for an uncaught one."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)


def main(argv: list[str] | None = None) -> int:
    """The command line; under torchrun inside torch's ``@record``, so that an error nothing here
    caught still reaches the agent's failure summary."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = _Parser(prog="minitp", description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train with a strategy on N processes and check it",
                         description="Train the tiny model with a strategy on N local processes "
                                     "and check it against one process, the traced bytes and the "
                                     "memory formulas.")
    strategies = run.add_subparsers(dest="strategy", required=True, metavar="STRATEGY",
                                    title="strategies (minitp run STRATEGY --help for its options)")
    for strategy in STRATEGIES.values():
        one = strategies.add_parser(strategy.name, help=strategy.summary,
                                    description=strategy.summary)
        for option in strategy.all_options():
            _add_option(one, option)
        one.add_argument("--json", metavar="PATH", help="also write the report as JSON")
        one.add_argument("--trace-out", metavar="FILE",
                         help="also write every rank's compute spans and messages "
                         "as a Chrome trace (open it in ui.perfetto.dev or chrome://tracing)")
        one.set_defaults(func=_run, options=strategy.all_options())

    pl = sub.add_parser(
        "plan", help="the dp x pp x tp layouts of N GPUs that fit a model (from minitp.cost); "
                                     "--cp splits sequences, --ep a MoE's experts")
    for option in PLAN_OPTIONS:
        _add_option(pl, option)
    pl.add_argument("--json", metavar="PATH", help="also write the layouts as JSON")
    pl.set_defaults(func=_plan, options=PLAN_OPTIONS)

    cal = sub.add_parser(
        "calibrate", help="measure this machine (matmul FLOP/s, gloo α and β) for the time model")
    for option in CALIBRATE_OPTIONS:
        _add_option(cal, option)
    cal.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    cal.set_defaults(func=_calibrate, options=CALIBRATE_OPTIONS)

    train_options = _train_options()
    tr = sub.add_parser(
        "train", help="train a byte-level model on the Python standard library's source, on any "
                                      "layout; checkpoints, resumes, restarts",
        description="Train a byte-level model on the Python standard library's own source, on "
                                    "dp x tp x pp x cp x ep local processes (or under torchrun).")
    for option in train_options:
        _add_option(tr, option)
    tr.add_argument("--trace-out", metavar="FILE",
                    help="also write the last step's compute spans and messages "
                    "as a Chrome trace (ui.perfetto.dev or chrome://tracing)")
    tr.set_defaults(func=_train, options=train_options)

    sa = sub.add_parser("sample", help="text a trained model writes (minitp train's checkpoint)")
    for option in SAMPLE_OPTIONS:
        _add_option(sa, option)
    sa.set_defaults(func=_sample, options=SAMPLE_OPTIONS)

    ex = sub.add_parser("export", help="a minitp train checkpoint (any layout) as one safetensors "
                                       "file a plain model loads")
    for option in EXPORT_OPTIONS:
        _add_option(ex, option)
    ex.set_defaults(func=_export, options=EXPORT_OPTIONS)

    try:
        args, unknown = parser.parse_known_args(argv)
        # said by the command they were given to: minitp run ddp: error: unrecognized arguments: ...
        if unknown:
            where = ["minitp", args.command] + ([args.strategy] if args.command == "run" else [])
            raise _Usage(f"{' '.join(where)}: error: unrecognized arguments: {' '.join(unknown)}")
    except _Usage as e:
        print(e, file=sys.stderr)
        return 2
    try:
        for option in args.options:  # every value, before anything runs
            option.check(getattr(args, option.name))
        return args.func(args)
    except OptionError as e:  # bad input: one clear line naming the flag, no traceback
        print(f"minitp: error: {e.as_flag()}", file=sys.stderr)
        _tell_torchrun(e)
        return 2
    except ValueError as e:
        print(f"minitp: error: {e}", file=sys.stderr)
        _tell_torchrun(e)
        return 2
    # a second Ctrl-C or SIGTERM while minitp train was saving: stopped at once
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"minitp: stopped at once ({signal.Signals(signum).name} again); the last checkpoint "
              "saved before stays", file=sys.stderr)
        return 128 + signum
    except LaunchError as e:  # a rank failed or hung: its message carries the rank's own traceback
        one_line = _rank_one_line(e)
        # ... unless what it raised says all in one line (the file, what was wrong)
        _tell_torchrun(e)
        if one_line is not None:
            print(f"minitp: error: {one_line[0]}", file=sys.stderr)
            return one_line[1]
        print(f"minitp: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
