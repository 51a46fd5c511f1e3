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
    minitp grade student/project.py [--only dp,tp,pp,3-D,reshard,restart]  (the final project)

trains the tiny model with a strategy on N local processes, checks it against the one-process
reference, the traced bytes and the memory formulas, prints a short table and exits non-zero if
any check fails. The strategies and their options come from ``minitp.runs.registry``: ``minitp run X
--help`` lists X's. Every value is checked before any process starts; a bad one ends the command
with one line naming it and what is allowed, and exit code 2.
"""

from __future__ import annotations

import argparse
import builtins
import os
import signal
import sys

from minitp import runs  # noqa: F401  (registers every strategy)
from minitp.cli import grade, plan, train
from minitp.cli import run as run_command
from minitp.launcher import LaunchError, RankError
from minitp.runs.pytorch import STRATEGIES as TORCH_STRATEGIES
from minitp.runs.registry import STRATEGIES, Option, OptionError

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


def _add_option(parser: argparse.ArgumentParser, option: Option) -> None:
    if option.type is bool:
        action = "store_false" if option.negate else "store_true"
        parser.add_argument(option.flag, dest=option.name, action=action, help=option.help)
        return
    choices = [c for c in option.choices if c is not None] or None
    default = "" if option.default is None else f" (default {option.default})"
    parser.add_argument(option.flag, dest=option.name, type=option.type, default=option.default,
                        choices=choices, metavar=option.metavar, help=option.help + default)


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
        if strategy.name in TORCH_STRATEGIES:
            one.add_argument("--impl", choices=("minitp", "torch"), default="minitp",
                             help="torch: also run PyTorch's own implementation of the same layout "
                             "(DDP, fully_shard, parallelize_module, pipelining, a DeviceMesh) and "
                             "report it beside minitp's")
        one.add_argument("--json", metavar="PATH", help="also write the report as JSON")
        one.add_argument("--trace-out", metavar="FILE",
                         help="also write every rank's compute spans and messages "
                         "as a Chrome trace (open it in ui.perfetto.dev or chrome://tracing)")
        one.set_defaults(func=run_command.run, options=strategy.all_options())

    pl = sub.add_parser(
        "plan", help="the dp x pp x tp layouts of N GPUs that fit a model (from minitp.cost); "
                                     "--cp splits sequences, --ep a MoE's experts")
    for option in plan.PLAN_OPTIONS:
        _add_option(pl, option)
    pl.add_argument("--json", metavar="PATH", help="also write the layouts as JSON")
    pl.set_defaults(func=plan.plan_command, options=plan.PLAN_OPTIONS)

    cal = sub.add_parser(
        "calibrate", help="measure this machine (matmul FLOP/s, gloo α and β) for the time model")
    for option in plan.CALIBRATE_OPTIONS:
        _add_option(cal, option)
    cal.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    cal.set_defaults(func=plan.calibrate_command, options=plan.CALIBRATE_OPTIONS)

    train_options = train.train_options()
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
    tr.set_defaults(func=train.train, options=train_options)

    sa = sub.add_parser("sample", help="text a trained model writes (minitp train's checkpoint)")
    for option in train.SAMPLE_OPTIONS:
        _add_option(sa, option)
    sa.set_defaults(func=train.sample, options=train.SAMPLE_OPTIONS)

    ex = sub.add_parser("export", help="a minitp train checkpoint (any layout) as one safetensors "
                                       "file a plain model loads")
    for option in train.EXPORT_OPTIONS:
        _add_option(ex, option)
    ex.set_defaults(func=train.export, options=train.EXPORT_OPTIONS)

    grade.add_parser(sub)

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
    except BrokenPipeError:  # the reader left (``minitp plan ... | head``): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
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

