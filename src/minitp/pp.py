"""Pipeline parallelism from scratch: every rank holds a few consecutive blocks of the model (a
*stage*), and activations flow forward, gradients backward, from rank to rank.

Stage s of p holds blocks ``stage_blocks(n_layers, p)[s]``; the first also holds the token
embedding, the last the final norm, the output layer and the loss. One stage alone would leave the
others waiting for its whole batch, so the global batch is cut into ``m`` *micro-batches*: while
stage 1 computes micro-batch 0, stage 0 already computes micro-batch 1. What is left of the waiting
is the *bubble*: with equal stage times it is (p-1)/(m+p-1) of the step, on every rank.

A **schedule** is data (``minitp.pp_schedules``, re-exported here): for each rank, the list of
actions it runs in order, ``Action("F", i, chunk)`` (forward of micro-batch i), ``Action("B", i,
chunk)`` (its backward) and, for zero-bubble, ``Action("W", i, chunk)`` (its weight gradient).
GPipe, 1F1B, interleaved 1F1B (v chunks per rank: rank r holds pieces r, r+p, ... of the p·v),
ZB-H1, ZB-V and DualPipeV (two chunks in a V: rank r holds pieces r and 2p-1-r) are pure functions
of (p, m[, v]); ``simulate`` plays any of them with fixed times.

``Pipeline.forward_backward`` runs a rank's table with one small loop. Each message goes through
``minitp.comm``: a forward sends the piece's output (b, S, D) to the rank of the next piece
(``pp/forward/mb3``), a backward sends the gradient of the piece's input to the rank of the previous
one (``pp/backward/mb3``; with chunks the labels add ``/piece5``, the sender's piece); the events
carry the same as fields (``Event.phase``, ``microbatch``, ``chunk``: the sender's). Between two
pieces of one rank (the V's turn, pieces p-1 and p on rank p-1) the tensor is handed over as is.
Sends are ``isend`` (waited on at the end of the step); receives are ``irecv``, all posted as the
step starts (or ``recv_ahead`` actions ahead) and waited on when the action needs them. Every rank
knows every rank's table, so it posts its receives from a neighbour in the order that neighbour
sends them: messages between two ranks are matched first to first, however forwards, backwards and
chunks interleave. A rank only ever waits for what its next action needs, so a table that
``simulate`` plays to the end cannot deadlock. Blocking sends could: in 1F1B's steady state rank s
sends an activation to s+1 while s+1 sends a gradient to s. Posting receives early matters on gloo:
a message whose receive is already posted is written at once by the sender; otherwise gloo's
background thread hands it over later (+0.2 ms a message at 2 ranks here).

Zero-bubble's B and W: ``WeightGradients`` gives every ``nn.Linear`` of the stage a backward that
returns the input gradient g·W at once and leaves (x, g) aside; the W action computes gᵀx from them.

The loss is the mean over the whole global batch: each micro-batch's mean loss / m. Gradients add
up over the micro-batches in ``.grad`` (autograd accumulates), so after the step they are the full
batch's gradient, as on one process.

Reading order, the textbook core first: PipelineStage (the pieces a rank holds;
``minitp.layout.stage_blocks`` says which), StageSpec (what the loop knows of a stage), Pipeline and
its receives (GPipe and 1F1B need nothing more). The extras after: StagePieces (interleaving's
chunks of a rank), WeightDeferringLinear and WeightGradients (zero-bubble's B/W split).
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
from minitp.pp_schedules import (
    SCHEDULES,
    Action,
    Schedule,
    Timeline,
    bubble_fraction,
    chunks_of,
    feeds,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    needs,
    one_f_one_b,
    peak_in_flight,
    replay,
    schedule_entry,
    simulate,
    splits_weight_gradient,
    zero_bubble_h1,
)

__all__ = ["SCHEDULES", "Action", "Pipeline", "PipelineStage", "Schedule", "StagePieces",
           "StageSpec", "StepRecord", "Timeline", "WeightGradients",
           "bubble_fraction", "chunks_of", "gpipe", "interleaved_1f1b", "make_schedule", "needs",
           "one_f_one_b", "peak_in_flight", "replay", "simulate", "split_microbatches",
           "splits_weight_gradient", "stage_blocks", "zero_bubble_h1"]


class PipelineStage(nn.Module):
    """The pieces of a plain ``Transformer`` that stage ``stage`` of ``num_stages`` holds, under the
    plain model's names (``layers.2.attention.wq.weight``), so its state dict is a slice of the
    plain model's. The modules are shared with ``model``, not copied, and the rest of the model is
    not kept: a rank holds its stage only."""

    run_blocks = Transformer.run_blocks  # the model's own loop, over the blocks this stage holds

    def __init__(self, model: Transformer, stage: int, num_stages: int, context=None):
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
        # context parallel (``minitp.cp.Context``: ``size``, ``positions(n)``, ``attend``): this
        # rank holds S of the cp·S positions of each sequence, RoPE rotates them by theirs,
        # attention is the ring
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # first stage: tokens (b, S); any other: the previous stage's output (b, S, D)
        h = self.tok_embeddings(x) if self.is_first else x  # (b, S, D)
        if self.context is None:
            h = self.run_blocks(h)
        else:
            pos = self.context.positions(x.shape[1]).to(h.device)
            h = self.run_blocks(h, seq_len=x.shape[1] * self.context.size, positions=pos,
                                attend=self.context.attend)
        # last: logits (b, S, V); else (b, S, D)
        return self.output(self.norm(h)) if self.is_last else h


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
    # one micro-batch forward: (b, S) tokens or (b, S, D) -> (b, S, D); on the last stage -> (b, S,
    # V)
    forward: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)
    dim: int  # D of the (b, S, D) messages
    dtype: torch.dtype  # of the activations sent forward and of the gradients sent back
    device: torch.device  # where the stage computes and its messages land

    @classmethod
    def of(cls, module: PipelineStage, forward: Callable[[torch.Tensor],
                                                         torch.Tensor] | None = None) -> StageSpec:
        """Describe ``module``'s stage: dtype and device from its parameters (read them before a
        wrapper such as FSDP takes the parameters over), D from the model's config."""
        param = next(module.parameters(), None)
        if param is None:
            raise ValueError(
                f"stage {module.stage} holds no parameter to read a dtype and device from; "
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


# -- running a schedule ---------------------------------------------------------------------------
class StepRecord(NamedTuple):
    """What one ``forward_backward`` did on one rank."""

    loss: float | None  # the global batch's mean loss (last stage only)
    timeline: Timeline  # each action's compute start and end (time.perf_counter)
    peak_in_flight: int  # the most (micro-batch, chunk) activation sets held at once


class Pipeline:
    """This rank's stage of a pipeline over ``group`` (the world when None), and the loop that runs
    a schedule on it. The stage is the rank's place in the group; messages go to the neighbours'
    global ranks.

    model: the plain ``Transformer`` (this rank cuts its pieces out of it), or a ``StageSpec``
        already made, whose ``forward`` may run through a wrapper (``Parallel3D``; one chunk only).
    schedule: "gpipe", "1f1b", "interleaved" (with ``virtual_stages`` v >= 2 chunks per rank),
        "zb" (ZB-H1: the backward cut into B and W), or "zbv" / "dualpipev" (two chunks in a V).
    recv_ahead: how many actions past the current one have their receives posted; None (the
        default): the whole step's, as it starts. A receive buffer is (b, S, D), small beside the
        activations a micro-batch keeps for backward, but the whole step holds 2·v·m of them.
    context: context parallel inside each piece (``PipelineStage(context=)``), plain model only.

    The table of every rank is known to every rank (it is data), so a receiver posts its receives
    from a neighbour in the order that neighbour sends: messages between two ranks are matched in
    order, whatever the interleaving of forwards and backwards, chunks and micro-batches.
    """

    def __init__(self, model: nn.Module | StageSpec, group=None, schedule: str = "1f1b",
                 microbatches: int = 4,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _loss_fn,
                 recv_ahead: int | None = None, virtual_stages: int = 1, context=None):
        comm.name_group(group, "pp", unless_named=True)  # its messages' Event.dim
        self.ranks = comm.group_ranks(group)
        p, self.stage = len(self.ranks), comm.group_rank(group)
        self.num_stages = p
        self.table = make_schedule(schedule, p, microbatches, virtual_stages)  # all ranks' actions
        self.place = schedule_entry(schedule).placement  # which piece each (rank, chunk) holds
        v = max(map(chunks_of, self.table))  # virtual_stages, or the V schedules' 2
        if virtual_stages > 1 and p == 1:
            raise ValueError("interleaving needs at least 2 ranks in the pipeline group, got 1")
        if isinstance(model, StageSpec):
            if v != 1:
                raise ValueError(f"a StageSpec describes one chunk; schedule {schedule!r} runs {v} "
                                 "chunks per rank and needs the plain model")
            if (model.index, model.num_stages) != (self.stage, p):
                raise ValueError(
                    f"the stage given is stage {model.index} of {model.num_stages}, but this rank "
                    f"is stage {self.stage} of the {p} ranks of its pipeline group")
            self.chunks = [model]
        else:  # chunk c is piece c·p + rank of the p·v pieces (V: rank, then 2p-1-rank)
            self.chunks = [StageSpec.of(PipelineStage(model, self.place.piece(p, self.stage, c),
                                                      p * v, context)) for c in range(v)]
        self.module = self.chunks[0].module if v == 1 else StagePieces(
            [c.module for c in self.chunks])
        self.schedule_name, self.microbatches, self.virtual_stages = schedule, microbatches, v
        self.actions = self.table[self.stage]
        self.weights = WeightGradients(
            self.module) if splits_weight_gradient(self.actions) else None
        self.group, self.loss, self.recv_ahead = group, loss, recv_ahead

    # the label of the message a piece's action sends
    def _label(self, kind: str, microbatch: int, piece: int) -> str:
        direction = "forward" if kind == "F" else "backward"
        return f"pp/{direction}/mb{microbatch}" + (f"/piece{piece}" if self.virtual_stages > 1
                                                   else "")

    def _tags(self, kind: str, microbatch: int, piece: int) -> dict:
        """The fields of that message's events (``trace.tagged``): phase, micro-batch, the sender's
        chunk."""
        return {"phase": "forward" if kind == "F" else "backward", "microbatch": microbatch,
                "chunk": self.place.holder(self.num_stages, piece)[1]}

    def _hand_over(self, a: Action, piece: int, tensor: torch.Tensor, receives: _Receives,
                   sends: list) -> None:
        """Pass what F (B) of ``piece`` made to the next (previous) piece: a message to its rank,
        or, where that piece is this rank's own (the V's turn), the tensor itself, no message."""
        rank, chunk = feeds(a, self.stage, self.num_stages, self.virtual_stages, self.place)
        if rank == self.stage:
            receives.local[a.kind, chunk, a.microbatch] = tensor
            return
        with _trace.tagged(**self._tags(a.kind, a.microbatch, piece)):
            sends.append((comm.isend(tensor, self.ranks[rank], self.group,
                                     label=self._label(a.kind, a.microbatch, piece)), tensor))

    @property
    def spec(self) -> StageSpec:
        """This rank's stage description; with virtual stages it holds several (``chunks``)."""
        if self.virtual_stages != 1:
            raise AttributeError(
                f"this rank holds {self.virtual_stages} chunks: read Pipeline.chunks")
        return self.chunks[0]

    def parameters(self):
        return self.module.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepRecord:
        """Run this rank's schedule over the micro-batches of one global batch; gradients are
        added into ``.grad`` (zero them before, step the optimizer after). Every rank passes the
        same (B, S) tokens and targets: the first piece reads the tokens, the last the targets."""
        m, p, v = self.microbatches, self.num_stages, self.virtual_stages
        last_piece = p * v - 1
        device = self.chunks[0].device
        tokens, targets = tokens.to(device), targets.to(device)
        xs, ys = split_microbatches(tokens, m), split_microbatches(targets, m)
        b, S = xs[0].shape  # micro-batch (b, S), b = B/m
        receives = _Receives(self, b, S)
        # (chunk, mb) -> what the chunk's forward read
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        # (chunk, mb) -> its output (the loss, last piece)
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        held: set[tuple[int, int]] = set()  # activations kept for a backward (and a W) still to run
        sends, timeline, peak, total = [], [], 0, 0.0
        tr = _trace.current()
        for j, a in enumerate(self.actions):
            i, c = a.microbatch, a.chunk
            chunk, piece = self.chunks[c], self.place.piece(p, self.stage, c)
            receives.post_ahead(j)
            if a.kind == "F":
                # (b, S) or (b, S, D)
                x = xs[i] if piece == 0 else receives.take(j).requires_grad_()
                if self.weights is not None:
                    self.weights.key = (c, i)
                start = time.perf_counter()
                y = chunk.forward(x)
                if piece == last_piece:
                    y = self.loss(y, ys[i]) / m  # this micro-batch's share of the global mean
                    total += y.item()
                end = time.perf_counter()
                inputs[c, i], outputs[c, i] = x, y
                held.add((c, i))
                if piece < last_piece:  # y.detach(): kept alive until the send is waited on
                    self._hand_over(a, piece, y.detach(), receives, sends)
                peak = max(peak, len(held))
            elif a.kind == "B":
                x, y = inputs.pop((c, i)), outputs.pop((c, i))
                # (b, S, D): d loss / d our output
                grad = None if piece == last_piece else receives.take(j)
                start = time.perf_counter()
                # x.grad, and .grad of the weights unless W is apart
                torch.autograd.backward(y, grad)
                end = time.perf_counter()
                if piece > 0:
                    self._hand_over(a, piece, x.grad, receives, sends)
                if self.weights is None:
                    held.discard((c, i))
            else:  # W: the linear layers' weight gradients, from the inputs and gradients B left
                start = time.perf_counter()
                self.weights.run((c, i))
                end = time.perf_counter()
                held.discard((c, i))
            timeline.append((a, start, end))
            if tr is not None:
                op = {"F": "forward", "B": "backward", "W": "weight"}[a.kind]
                tr.add(_trace.Event(tr.rank, "compute", op,
                                    tr.label(f"mb{i}" + (f"/chunk{c}" if v > 1 else "")), start,
                                    end, phase=op, microbatch=i, chunk=c))
        for handle, _ in sends:
            handle.wait()
        # the last piece is on rank p-1 (V: rank 0)
        has_loss = self.place.holder(p, last_piece)[0] == self.stage
        return StepRecord(total if has_loss else None, timeline, peak)


class _Receives:
    """The messages this rank's actions wait for, received with ``irecv`` posted ahead of need so
    that a neighbour's send finds its buffer ready and lands while this rank still computes.

    From each neighbour, receives are posted in the order the neighbour sends (its table says
    it): messages between two ranks are matched first to first."""

    def __init__(self, pipe: Pipeline, b: int, S: int):
        p, v, me = pipe.num_stages, pipe.virtual_stages, pipe.stage
        self.pipe, self.shape = pipe, (b, S)
        # per sending stage: the (kind, chunk, mb) of our actions its sends feed, in its order
        self.streams: dict[int, list[tuple[str, int, int]]] = {}
        for q, actions in enumerate(pipe.table):
            for a in actions:
                to = feeds(a, q, p, v, pipe.place)  # the (rank, chunk) its output goes to
                if q != me and to is not None and to[0] == me:
                    self.streams.setdefault(q, []).append((a.kind, to[1], a.microbatch))
        # (kind, chunk, mb) -> what a piece of this rank handed to another of its pieces (V)
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.where = {key: (q, n) for q, keys in self.streams.items() for n, key in enumerate(keys)}
        self.next_post = dict.fromkeys(self.streams, 0)  # per stream: how many are posted
        self.looked = 0  # actions before this one have had their receives posted
        self.posted: dict[tuple[str, int, int], tuple[comm.Handle, torch.Tensor]] = {}

    def _key(self, j: int) -> tuple[str, int, int] | None:
        a = self.pipe.actions[j]
        key = (a.kind, a.chunk, a.microbatch)
        return key if key in self.where else None

    def _post_through(self, key: tuple[str, int, int]) -> None:
        q, n = self.where[key]
        pipe, stream = self.pipe, self.streams[q]
        while self.next_post[q] <= n:
            kind, chunk, mb = stream[self.next_post[q]]
            sender_piece = pipe.place.piece(pipe.num_stages, pipe.stage, chunk) + (
                1 if kind == "B" else -1)
            buffer = pipe.chunks[chunk].boundary_buffer(*self.shape)  # (b, S, D)
            with _trace.tagged(**pipe._tags(kind, mb, sender_piece)):
                handle = comm.irecv(buffer, pipe.ranks[q], pipe.group,
                                    label=pipe._label(kind, mb, sender_piece))
            self.posted[kind, chunk, mb] = (handle, buffer)
            self.next_post[q] += 1

    def post_ahead(self, j: int) -> None:
        """Post the receives of actions j .. j + recv_ahead (and, in order, all before them)."""
        ahead, n = self.pipe.recv_ahead, len(self.pipe.actions)
        stop = n if ahead is None else min(j + 1 + ahead, n)
        for k in range(max(j, self.looked), stop):
            key = self._key(k)
            if key is not None:
                self._post_through(key)
        self.looked = max(self.looked, stop)

    def take(self, j: int) -> torch.Tensor:
        a = self.pipe.actions[j]
        if (a.kind, a.chunk, a.microbatch) in self.local:  # from a piece of this rank
            return self.local.pop((a.kind, a.chunk, a.microbatch))
        key = self._key(j)
        self._post_through(key)
        handle, buffer = self.posted.pop(key)
        handle.wait()
        return buffer


# -- extras: interleaving's pieces, zero-bubble's weight gradients ---------------------------------
class StagePieces(nn.Module):
    """The chunks a rank holds under interleaving (pieces r, r+p, ...), as one module with the plain
    model's names, so the rank's state dict is still a slice of the plain model's."""

    def __init__(self, chunks: list[PipelineStage]):
        super().__init__()
        self.tok_embeddings = next((c.tok_embeddings for c in chunks if c.is_first), None)
        self.layers = nn.ModuleDict({k: v for c in chunks for k, v in c.layers.items()})
        self.norm = next((c.norm for c in chunks if c.is_last), None)
        self.output = next((c.output for c in chunks if c.is_last), None)


# -- the weight gradient apart (zero-bubble's W) ---------------------------------------------------
class _LinearDeferringWeight(torch.autograd.Function):
    """y = x Wᵀ whose backward gives the input gradient g W at once and leaves (x, g) with
    ``stash`` for the weight gradient gᵀ x, computed later by ``WeightGradients.run``."""

    @staticmethod
    def forward(ctx, x, weight, stash, key):
        ctx.save_for_backward(x, weight)
        ctx.stash, ctx.key = stash, key
        return x @ weight.t()  # (..., in) -> (..., out)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.stash.pending.setdefault(ctx.key, []).append((x, grad, weight))  # kept until W
        return grad @ weight, None, None, None  # (..., out) -> (..., in)


class WeightDeferringLinear(nn.Module):
    """A bias-free linear layer whose weight gradient waits for zero-bubble's W
    (``WeightGradients``)."""

    def __init__(self, weight: nn.Parameter, weights: WeightGradients):
        super().__init__()
        self.weight, self.weights = weight, weights
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights.linear(self, x)


class WeightGradients:
    """Splits the backward of every ``nn.Linear`` of ``module`` (zero-bubble's B and W): B computes
    the input gradient and the small weights (norms, embedding); the linear layers' weight
    gradients wait, with their saved inputs and output gradients, until ``run(key)`` (the W).
    Each linear is replaced, in its parent, by a ``WeightDeferringLinear`` holding the same weight
    under the same name, as tensor parallel replaces layers: the rank owns its stage."""

    def __init__(self, module: nn.Module):
        # (chunk, micro-batch) -> [(x, grad, weight)]
        self.pending: dict[tuple[int, int], list] = {}
        self.key: tuple[int, int] | None = None  # the (chunk, micro-batch) whose forward runs now
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:  # not subclasses with their own forward
                    if child.bias is not None:
                        raise ValueError(
                            "zero-bubble's weight split handles linear layers without bias only")
                    parent.add_module(name, WeightDeferringLinear(child.weight, self))

    def linear(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not linear.weight.is_leaf:  # e.g. a view into FSDP's gathered flat parameter
            raise ValueError("zero-bubble's W writes .grad of each linear weight, which must be a "
                             "parameter of its own (a leaf tensor); this one is a view (FSDP?): "
                             "use DDP, or another schedule")
        return _LinearDeferringWeight.apply(x, linear.weight, self, self.key)

    @torch.no_grad()  # .grad may be a view into a data-parallel bucket: add into it in place
    def run(self, key: tuple[int, int]) -> None:
        for x, grad, weight in self.pending.pop(key, []):
            dw = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])  # (out, in)
            if weight.grad is None:
                weight.grad = dw
            else:
                weight.grad.add_(dw)
