"""Pipeline parallelism from scratch: every rank holds a few consecutive blocks of the model (a
*stage*), and activations flow forward, gradients backward, from rank to rank.

Stage s of p holds blocks ``stage_blocks(n_layers, p)[s]``; the first also holds the token
embedding, the last the final norm, the output layer and the loss. One stage alone would leave the
others waiting for its whole batch, so the global batch is cut into ``m`` *micro-batches*: while
stage 1 computes micro-batch 0, stage 0 already computes micro-batch 1. What is left of the waiting
is the *bubble*: with equal stage times it is (p-1)/(m+p-1) of the step, on every rank.

A **schedule** is data: for each stage, the list of actions it runs in order, ``Action("F", i)``
(forward of micro-batch i) or ``Action("B", i)`` (its backward). Two pure functions make them:

* ``gpipe``: all forwards, then all backwards (GPipe). Every stage holds the activations of all m
  micro-batches at the end of the forwards.
* ``one_f_one_b``: stage s runs p-s-1 warm-up forwards, then alternates one forward, one backward,
  then drains the remaining backwards (PipeDream-flush / Megatron's 1F1B). The same bubble, but a
  stage holds at most p-s micro-batches in flight, whatever m is.

``simulate`` plays a schedule with fixed forward and backward times (no processes), which is how the
tests show a schedule cannot deadlock and what its ideal bubble is; ``Pipeline.forward_backward``
runs it for real with one small loop. Each message goes through ``minitp.comm``: a forward sends
the stage's output (b, S, D) to the next rank (``pp/forward/mb3``), a backward sends the gradient
of the stage's input to the previous one (``pp/backward/mb3``). Sends are ``isend`` (waited on at
the end of the step); receives are ``irecv`` posted a couple of actions ahead (``recv_ahead``) and
waited on when the action needs them. A rank only ever waits for what its schedule needs next, and
both sides of a boundary order its messages alike (micro-batches in the same order), so no two
ranks can wait for each other. Blocking sends would deadlock 1F1B: in the steady state rank s sends
an activation to s+1 while s+1 sends a gradient to s. Posting receives early matters on gloo: a
message whose receive is already posted is written at once by the sender; otherwise gloo's
background thread hands it over later, which on a busy two-core machine took up to ~5 ms.

The loss is the mean over the whole global batch: each micro-batch's mean loss / m. Gradients add
up over the micro-batches in ``.grad`` (autograd accumulates), so after the step they are the full
batch's gradient, as on one process.

Top to bottom: PipelineStage (the pieces a rank holds; ``minitp.layout.stage_blocks`` says which),
StageSpec (what the loop knows of a stage), the schedules, simulate, bubble_fraction, Pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn

from minitp import comm
from minitp import trace as _trace
from minitp.layout import stage_blocks
from minitp.models import Transformer
from minitp.models import loss_fn as _loss_fn


class PipelineStage(nn.Module):
    """The pieces of a plain ``Transformer`` that stage ``stage`` of ``num_stages`` holds, under the
    plain model's names (``layers.2.attention.wq.weight``), so its state dict is a slice of the
    plain model's. The modules are shared with ``model``, not copied, and the rest of the model is
    not kept: a rank holds its stage only."""

    run_blocks = Transformer.run_blocks  # the model's own loop, over the blocks this stage holds

    def __init__(self, model: Transformer, stage: int, num_stages: int):
        super().__init__()
        blocks = stage_blocks(len(model.layers), num_stages)[stage]
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.config = model.config
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in blocks})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # first stage: tokens (b, S); any other: the previous stage's output (b, S, D)
        h = self.tok_embeddings(x) if self.is_first else x  # (b, S, D)
        h = self.run_blocks(h)
        return self.output(self.norm(h)) if self.is_last else h  # last: logits (b, S, V); else (b, S, D)


@dataclass(frozen=True)
class StageSpec:
    """What the loop of ``Pipeline`` knows of this rank's stage, said explicitly: its place, the
    pieces it holds, the call that runs one micro-batch forward, and what crosses its boundaries.

    ``forward`` is the pieces themselves or whatever wraps them (``Parallel3D`` passes its FSDP or
    DDP wrapper): the loop only calls it, so a wrapper needs to know nothing of pipelines.

    Why the receiver works its buffers out instead of being told: a receive is posted before its
    message arrives, so its shape, dtype and device must be known in advance. Both messages of a
    boundary are (b, S, D), the activation going forward and its gradient coming back; b and S come
    from the batch every rank is given, D from the model's config, and all stages of one model
    compute in one dtype (``dtype``: their parameters', or a wrapper's compute dtype), each on its
    own device. A header sent ahead (shape, dtype) would say the same in one more message per
    boundary, which the traces and ``minitp.cost`` would then have to count.
    """

    index: int
    num_stages: int
    # the pieces: embedding on the first stage, its blocks, norm + output on the last
    module: nn.Module = field(repr=False)
    # one micro-batch forward: (b, S) tokens or (b, S, D) -> (b, S, D); on the last stage -> (b, S, V)
    forward: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)
    dim: int  # D of the (b, S, D) messages
    dtype: torch.dtype  # of the activations sent forward and of the gradients sent back
    device: torch.device  # where the stage computes and its messages land

    @classmethod
    def of(cls, module: PipelineStage, forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StageSpec:
        """Describe ``module``'s stage: dtype and device from its parameters (read them before a
        wrapper such as FSDP takes the parameters over), D from the model's config."""
        param = next(module.parameters(), None)
        if param is None:
            raise ValueError(f"stage {module.stage} holds no parameter to read a dtype and device from; "
                             "describe the stage before wrapping it")
        return cls(module.stage, module.num_stages, module, forward or module, module.config.dim,
                   param.dtype, param.device)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def boundary_buffer(self, b: int, S: int) -> torch.Tensor:
        """An empty (b, S, D) tensor for one message across a boundary of this stage."""
        return torch.empty((b, S, self.dim), dtype=self.dtype, device=self.device)


def split_microbatches(x: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """(B, ...) -> m tensors (B/m, ...). Refuses a batch that does not divide evenly: unequal
    micro-batches would weigh their mean losses unequally, and the gradient would not be the full
    batch's."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if x.shape[0] % microbatches:
        raise ValueError(f"batch_size={x.shape[0]} is not divisible by microbatches={microbatches}")
    return list(x.chunk(microbatches))


# -- schedules ------------------------------------------------------------------------------------
class Action(NamedTuple):
    kind: str  # "F" forward or "B" backward
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _check(num_stages: int, microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def gpipe(num_stages: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards, on every stage. Backwards run in reverse order (the last
    micro-batch's activations are the freshest); the gradient sum is the same either way."""
    _check(num_stages, microbatches)
    m = microbatches
    stage = [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]
    return [list(stage) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B: stage s runs min(p-s-1, m) warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards. Micro-batches in increasing order everywhere."""
    _check(num_stages, microbatches)
    p, m = num_stages, microbatches
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: the forward of i+warmup, the backward of i
            actions += [Action("F", i + warmup), Action("B", i)]
        actions += [Action("B", i) for i in range(m - warmup, m)]
        out.append(actions)
    return out


SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, num_stages: int, microbatches: int) -> list[list[Action]]:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_stages, microbatches)


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward has run and backward has not, along one stage's
    actions: how many micro-batches' activations the stage holds at once."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


Timeline = list[tuple[Action, float, float]]  # one stage's (action, start, end), in order


def simulate(schedule: list[list[Action]], forward_time: float = 1.0, backward_time: float = 2.0) -> list[Timeline]:
    """Play a schedule with fixed compute times and free messages: each stage runs its actions in
    order, each as soon as its input is there (F of stage s after F of s-1; B of s after B of s+1,
    or after its own F on the last stage). Raises if the schedule deadlocks."""
    p = len(schedule)
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end time
    timelines: list[Timeline] = [[] for _ in range(p)]
    position, free = [0] * p, [0.0] * p
    while any(position[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                a = schedule[s][position[s]]
                if a.kind == "F":
                    need = ("F", s - 1, a.microbatch) if s > 0 else None
                else:
                    need = ("B", s + 1, a.microbatch) if s < p - 1 else ("F", s, a.microbatch)
                if need is not None and need not in done:
                    break
                start = max(free[s], done[need] if need else 0.0)
                free[s] = start + (forward_time if a.kind == "F" else backward_time)
                done[(a.kind, s, a.microbatch)] = free[s]
                timelines[s].append((a, start, free[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: schedule[s][position[s]] for s in range(p) if position[s] < len(schedule[s])}
            raise ValueError(f"the schedule deadlocks: each stage waits for another, next actions {waiting}")
    return timelines


def bubble_fraction(timelines: list[Timeline]) -> list[float]:
    """Idle share of the step, per stage: 1 - busy / T, where busy is the stage's time in forward
    and backward compute, and T the step's span over all stages, from the first action's start on
    any stage to the last action's end on any stage (ranks on one machine share one clock).

    Why it compares with (p-1)/(m+p-1): with equal stages, forward time F and backward time B, the
    step lasts (m+p-1)(F+B) and every stage computes m(F+B), under GPipe and 1F1B alike (B = 2F
    changes neither; ``simulate`` shows it). Measured, the idle share also holds what the formula
    leaves out: message latency, the loop's own overhead, and unequal stages (the last one adds the
    output layer and the loss). The mean over stages is the share of all ranks' time lost.
    """
    start = min(t[0][1] for t in timelines if t)
    end = max(t[-1][2] for t in timelines if t)
    return [1.0 - sum(e - s for _, s, e in t) / (end - start) for t in timelines]


# -- running a schedule ---------------------------------------------------------------------------
class StepRecord(NamedTuple):
    """What one ``forward_backward`` did on one rank."""

    loss: float | None  # the global batch's mean loss (last stage only)
    timeline: Timeline  # each action's compute start and end (time.perf_counter)
    peak_in_flight: int  # the most micro-batches whose activations were held at once


class Pipeline:
    """This rank's stage of a pipeline over ``group`` (the world when None), and the loop that runs
    a schedule on it. The stage is the rank's place in the group; messages go to the neighbours'
    global ranks.

    model: the plain ``Transformer`` (this rank cuts its ``PipelineStage`` out of it), or a
        ``StageSpec`` already made, whose ``forward`` may run through a wrapper (``Parallel3D``).
    recv_ahead: how many actions past the current one have their receives posted (a receive
        buffer is (b, S, D), small beside the activations a micro-batch keeps for backward).
    """

    def __init__(self, model: nn.Module | StageSpec, group=None, schedule: str = "1f1b", microbatches: int = 4,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _loss_fn, recv_ahead: int = 2):
        comm.name_group(group, "pp", unless_named=True)  # its messages' Event.dim
        ranks = comm.group_ranks(group)
        self.num_stages, self.stage = len(ranks), comm.group_rank(group)
        if isinstance(model, StageSpec):
            if (model.index, model.num_stages) != (self.stage, self.num_stages):
                raise ValueError(f"the stage given is stage {model.index} of {model.num_stages}, but this rank "
                                 f"is stage {self.stage} of the {self.num_stages} ranks of its pipeline group")
            self.spec = model
        else:
            self.spec = StageSpec.of(PipelineStage(model, self.stage, self.num_stages))
        self.module = self.spec.module  # the pieces this rank holds
        self.schedule_name, self.microbatches = schedule, microbatches
        self.actions = make_schedule(schedule, self.num_stages, microbatches)[self.stage]
        self.group, self.loss, self.recv_ahead = group, loss, recv_ahead
        self.prev_rank = ranks[self.stage - 1] if self.stage > 0 else None
        self.next_rank = ranks[self.stage + 1] if self.stage < self.num_stages - 1 else None

    def parameters(self):
        return self.module.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepRecord:
        """Run this stage's schedule over the micro-batches of one global batch; gradients are
        added into ``.grad`` (zero them before, step the optimizer after). Every rank passes the
        same (B, S) tokens and targets: the first stage reads the tokens, the last the targets."""
        m, stage = self.microbatches, self.spec
        tokens, targets = tokens.to(stage.device), targets.to(stage.device)
        xs, ys = split_microbatches(tokens, m), split_microbatches(targets, m)
        b, S = xs[0].shape  # micro-batch (b, S), b = B/m
        receives = self._receives(b, S)
        inputs: dict[int, torch.Tensor] = {}  # micro-batch -> what this stage's forward read
        outputs: dict[int, torch.Tensor] = {}  # micro-batch -> its output (the loss on the last stage)
        sends, timeline, peak, total = [], [], 0, 0.0
        tr = _trace.current()
        for j, a in enumerate(self.actions):
            i = a.microbatch
            for k in range(j, min(j + 1 + self.recv_ahead, len(self.actions))):
                receives.post(k)
            if a.kind == "F":
                x = xs[i] if stage.is_first else receives.take(j).requires_grad_()  # (b, S) or (b, S, D)
                start = time.perf_counter()
                y = stage.forward(x)
                if stage.is_last:
                    y = self.loss(y, ys[i]) / m  # this micro-batch's share of the global mean
                    total += y.item()
                end = time.perf_counter()
                inputs[i], outputs[i] = x, y
                if not stage.is_last:
                    out = y.detach()  # kept alive until the send is waited on
                    sends.append((comm.isend(out, self.next_rank, self.group, label=f"pp/forward/mb{i}"), out))
                peak = max(peak, len(outputs))
            else:
                x, y = inputs.pop(i), outputs.pop(i)
                grad = None if stage.is_last else receives.take(j)  # (b, S, D): d loss / d our output
                start = time.perf_counter()
                torch.autograd.backward(y, grad)  # adds into every parameter's .grad
                end = time.perf_counter()
                if not stage.is_first:
                    sends.append((comm.isend(x.grad, self.prev_rank, self.group, label=f"pp/backward/mb{i}"),
                                  x.grad))
            timeline.append((a, start, end))
            if tr is not None:
                tr.add(_trace.Event(tr.rank, "compute", "forward" if a.kind == "F" else "backward",
                                    tr.label(f"mb{i}"), start, end))
        for handle, _ in sends:
            handle.wait()
        return StepRecord(total if stage.is_last else None, timeline, peak)

    def _receives(self, b: int, S: int) -> _Receives:
        """The messages this stage's actions wait for: action j's, if any, from the neighbour."""
        wanted = {}
        for j, a in enumerate(self.actions):
            if a.kind == "F" and not self.spec.is_first:
                wanted[j] = (self.prev_rank, f"pp/forward/mb{a.microbatch}")
            elif a.kind == "B" and not self.spec.is_last:
                wanted[j] = (self.next_rank, f"pp/backward/mb{a.microbatch}")
        return _Receives(wanted, lambda: self.spec.boundary_buffer(b, S), self.group)


class _Receives:
    """Receives posted ahead of need (``irecv``), so that a neighbour's send finds its buffer ready
    and lands while this rank still computes; ``take`` waits for one and hands its tensor over.
    ``new_buffer`` makes an empty tensor of the message's shape, dtype and device."""

    def __init__(self, wanted: dict[int, tuple[int, str]], new_buffer: Callable[[], torch.Tensor], group):
        self.wanted, self.new_buffer, self.group = wanted, new_buffer, group
        self.posted: dict[int, tuple[comm.Handle, torch.Tensor]] = {}

    def post(self, j: int) -> None:
        if j in self.wanted and j not in self.posted:
            src, label = self.wanted[j]
            buffer = self.new_buffer()  # (b, S, D)
            self.posted[j] = (comm.irecv(buffer, src, self.group, label=label), buffer)

    def take(self, j: int) -> torch.Tensor:
        self.post(j)
        handle, buffer = self.posted.pop(j)
        handle.wait()
        return buffer
