"""The strategies ``minitp run`` knows: each one's runner, its options and what they allow.

A strategy is one entry (``register(Strategy(...))`` next to its runner in ``minitp.runs``); the
command line reads this registry, so ``minitp run fsdp --help`` lists the common options and FSDP's
own, and adding a strategy touches one place. Each ``Option`` also says which values it allows, and
the same check refuses a bad value whether it came from the command line (``--steps 0``) or from
Python (``run_ddp(steps=0)``), in the parent, before any process starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_STEPS = 10_000  # a checked run also trains the one-process reference and holds every batch
# The most experts a MoE layer may have (2**20; far past any published model, and past what this
# machine's memory holds, which the run's memory estimate says); also the largest capacity factor:
# experts/top_k or more drops nothing, so a larger one means nothing more and would overflow.
MAX_EXPERTS = 2**20


class OptionError(ValueError):
    """A value an option does not allow; says so with the runner's keyword or the command line's
    flag."""

    def __init__(self, name: str, value: Any, allowed: str, flag: str | None = None):
        self.name, self.value, self.allowed, self.flag = name, value, allowed, flag
        super().__init__(f"{name}={value!r} is not allowed: expected {allowed}")

    def as_flag(self) -> str:
        """The same message as the command line names it: ``--steps 0 is not allowed: ...``."""
        flag = self.flag or "--" + self.name.replace("_", "-")
        return f"{flag} {self.value} is not allowed: expected {self.allowed}"


@dataclass(frozen=True)
class Option:
    """One keyword of a runner, as the command line shows it and as it may be set."""

    name: str  # the runner's keyword, e.g. "bucket_mb"; the flag is --bucket-mb
    type: type  # int, float, str or bool
    default: Any
    help: str
    choices: tuple = ()
    low: float | None = None  # smallest allowed value (inclusive)
    above: float | None = None  # a bound the value must exceed (exclusive): above=0 is "> 0"
    high: float | None = None  # largest allowed value (inclusive)
    optional: bool = False  # None is allowed (meaning: the runner picks)
    negate: bool = False  # a bool that defaults to True, switched off by --no-NAME
    metavar: str | None = None
    spelled: str | None = None  # the flag's own spelling, when not the keyword's (--nprocs: nproc)

    @property
    def flag(self) -> str:
        return ("--no-" if self.negate else "--") + (self.spelled or self.name.replace("_", "-"))

    def allowed(self) -> str:
        """What the option accepts, in words."""
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        kind = {int: "an integer", float: "a finite number", str: "a text",
                bool: "true or false"}[self.type]
        if self.low is not None and self.high is not None:
            return f"{kind} from {_number(self.low)} to {_number(self.high)}"
        if self.above is not None and self.high is not None:
            return f"{kind} > {_number(self.above)} and at most {_number(self.high)}"
        if self.low is not None:
            return f"{kind} >= {_number(self.low)}"
        if self.above is not None:
            return f"{kind} > {_number(self.above)}"
        if self.high is not None:
            return f"{kind} <= {_number(self.high)}"
        return kind

    def check(self, value: Any) -> None:
        """Refuse a value this option does not allow: one line naming it, the value and what is
        allowed."""
        if value is None and (self.optional or self.type is str):
            return
        bad = OptionError(self.name, value, self.allowed(), self.flag)
        if self.choices:
            if value not in self.choices:
                raise bad
            return
        if self.type is bool:
            if not isinstance(value, bool):
                raise bad
            return
        if self.type is str:
            if not isinstance(value, str) or not value:
                raise bad
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if self.type is int and not float(value).is_integer():
            raise bad
        if not math.isfinite(value):
            raise bad
        if self.low is not None and value < self.low:
            raise bad
        if self.above is not None and value <= self.above:
            raise bad
        if self.high is not None and value > self.high:
            raise bad


def _number(x: float) -> str:
    """A bound as people write it: 1048576, not 1.04858e+06; 0.5 as 0.5."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


# Every runner takes these; the strategy's own options come after them.
COMMON = (
    # --nprocs, not --nproc: torchrun reads any prefix of its own options, even after -m, and
    # "--nproc" is one of --nproc-per-node's (under torchrun the world is WORLD_SIZE's)
    Option("nproc", int, 4, "number of processes (ranks)", low=1, spelled="nprocs"),
    Option("steps", int, 4, "training steps", low=1, high=MAX_STEPS),
    Option("model", str, "tiny", "model preset", choices=("tiny", "small")),
    Option("batch_size", int, 8, "global batch size (sequences)", low=1),
    Option("seq_len", int, 16, "tokens per sequence (at most the model's max_seq_len)", low=1),
    Option("lr", float, 3e-3, "AdamW learning rate", above=0),
    Option("seed", int, 0, "seed of the model and the data", low=0),
    Option("backend", str, "gloo", "torch.distributed backend", choices=("gloo", "nccl")),
    Option("timeout", float, 300.0, "seconds before the run is ended", above=0),
)


@dataclass(frozen=True)
class Strategy:
    """A strategy ``minitp run NAME`` trains: its runner and the options it takes beyond
    ``COMMON``."""

    name: str
    runner: Callable[..., Any]  # returns a minitp.runs.report.Report
    summary: str  # one line for ``minitp run --help``
    options: tuple[Option, ...] = ()
    common: tuple[Option, ...] = field(default=COMMON)

    @property
    def doc(self) -> str:
        return (self.runner.__doc__ or self.summary).strip()

    def all_options(self) -> tuple[Option, ...]:
        return self.common + self.options

    def check(self, values: dict[str, Any]) -> None:
        """Check every option that ``values`` sets."""
        for option in self.all_options():
            if option.name in values:
                option.check(values[option.name])


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    if strategy.name in STRATEGIES and STRATEGIES[strategy.name].runner is not strategy.runner:
        raise ValueError(f"strategy {strategy.name!r} is registered twice")
    STRATEGIES[strategy.name] = strategy
    return strategy


def check_options(name: str, values: dict[str, Any]) -> None:
    """Called first thing by each runner with its ``locals()``: refuse bad values in the parent."""
    STRATEGIES[name].check(values)
