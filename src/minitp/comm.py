"""Every message minitp sends, traced.

Thin wrappers over ``torch.distributed``: each call does the collective and appends an ``Event``
(op, group ranks, shape, dtype, bytes, start/end time, label) to the trace recording on this
process (``minitp.trace``). Tracing is not bolted on: it is how the library sends messages, so a
strategy that sends something unexpected shows up in its byte count.

Ranks given to these functions (``src``, ``dst``) are global ranks, as in ``torch.distributed``.
``group=None`` means the whole world. Each event also records the mesh dimension its group was
named with (``name_group``): byte tables and figures split the traffic by it, never by label.

The second half holds the autograd-aware operators of tensor parallelism (Megatron-LM's f and g):
a message in forward paired with its transpose in backward, so gradients come out right without
hooks.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from minitp import cost
from minitp import trace as _trace

ReduceOp = dist.ReduceOp

# Facts about a process group, keyed by the group object itself and held weakly: when a destroyed
# group is collected its entries go with it, so a group made later (the next launch forked from the
# same process, a new world under torchrun) never inherits them, even at the same address.
_group_ranks_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_group_dims: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _resolve(group):
    """The group object ``group`` stands for (the world when None), or None where there is none to
    key on: no world yet, or the marker ``new_group`` returns to ranks outside the group."""
    group = dist.group.WORLD if group is None else group
    return group if isinstance(group, dist.ProcessGroup) else None


def group_ranks(group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
    """The global ranks of ``group`` (the world when None), in group order."""
    key = _resolve(group)
    if key is None:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if key not in _group_ranks_cache:
        _group_ranks_cache[key] = tuple(dist.get_process_group_ranks(key))
    return _group_ranks_cache[key]


def name_group(group: dist.ProcessGroup | None, dim: str, *, unless_named: bool = False) -> None:
    """Say which mesh dimension ("dp", "fsdp", "tp", "pp", ...) ``group`` (the world when None)
    carries: every message sent through it is recorded with ``Event.dim == dim``.

    ``Mesh`` names each group it creates; each strategy wrapper names the group it is given with
    ``unless_named=True``, so a mesh's "dp" group stays "dp" when FSDP runs on it, and a group
    handed to DDP alone becomes "dp". The rule:

    * a group other than the world is named once: the same name again does nothing; another name
      is a ``ValueError`` naming both, or with ``unless_named`` leaves the first name in place;
    * the world takes the latest name: one process may run several strategies on the whole world
      in turn (DDP, then FSDP), and each names it for its own messages.

    A name lives as long as its group object: a group made after another is destroyed starts
    unnamed. Calling it on a rank outside ``group`` (``new_group``'s marker) does nothing.
    """
    key = _resolve(group)
    if key is None:
        return
    had = _group_dims.get(key)
    if had is None or had == dim or key is dist.group.WORLD:
        _group_dims[key] = dim
    elif not unless_named:
        raise ValueError(f"process group {group_ranks(key)} is already named {had!r}; "
                         f"it cannot also be named {dim!r}")


def group_dim(group: dist.ProcessGroup | None = None) -> str:
    """The mesh dimension ``group`` (the world when None) was named with, or "" if none was."""
    key = _resolve(group)
    return "" if key is None else _group_dims.get(key, "")


def group_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group)


class Handle:
    """What an ``async_op=True`` call returns: ``wait()`` finishes the op and stamps its end time.

    The recorded end is when ``wait`` returned, an upper bound on when the op finished.
    """

    def __init__(self, work, event: _trace.Event | None):
        self.work = work
        self.event = event

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.event is not None:
                self.event.end = time.perf_counter()

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def _record(op: str, tensor: torch.Tensor, nbytes: int, group, label: str, start: float,
            peer: int | None = None, src: int | None = None,
            kept_bytes: int | None = None) -> _trace.Event | None:
    tr = _trace.current()
    if tr is None:
        return None
    ranks = group_ranks(group)
    position = 0
    if src is not None:  # place along the broadcast chain that starts at src
        position = (ranks.index(dist.get_rank()) - ranks.index(src)) % len(ranks)
    event = _trace.Event(
        rank=dist.get_rank(), kind="comm", op=op, label=tr.label(label), start=start, end=start,
        group=ranks, dim=group_dim(group), peer=peer, shape=tuple(tensor.shape),
        dtype=str(tensor.dtype).replace("torch.", ""), bytes=nbytes,
        sent_bytes=cost.collective_sent_bytes(op, nbytes, len(ranks), position, kept_bytes),
    )
    return tr.add(event)


def _finish(work, event, async_op: bool):
    if async_op:
        return Handle(work, event)
    if event is not None:
        event.end = time.perf_counter()
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- collectives ----------------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM, label: str = "", async_op: bool = False):
    """Reduce ``tensor`` over the group, in place; every rank ends with the result."""
    start = time.perf_counter()
    event = _record("all_reduce", tensor, _nbytes(tensor), group, label, start)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, label: str = "",
               async_op: bool = False):
    """Concatenate every rank's ``input`` along dim 0 into ``output`` (n * input rows)."""
    n = group_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"{n} ranks x {input.numel()} = {n * input.numel()}")
    start = time.perf_counter()
    event = _record("all_gather", output, _nbytes(output), group, label, start)
    work = dist.all_gather_single(output, input, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, op=ReduceOp.SUM,
                   label: str = "", async_op: bool = False):
    """Reduce ``input`` (n * output rows) over the group; rank i keeps the i-th slice."""
    n = group_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                         f"{n} ranks x {output.numel()} = {n * output.numel()}")
    start = time.perf_counter()
    event = _record("reduce_scatter", input, _nbytes(input), group, label, start)
    work = dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, label: str = "", async_op: bool = False):
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place."""
    start = time.perf_counter()
    event = _record("broadcast", tensor, _nbytes(tensor), group, label, start, src=src)
    work = dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None, group=None, label: str = "",
               async_op: bool = False):
    """Rank i's j-th chunk of ``input`` (rows along dim 0) lands as the i-th chunk of rank j's
    ``output``. Chunks are equal (rows / n) unless the split sizes say how many rows go to (input)
    and come from (output) each rank of the group, in group order; a size may be 0.

    Traced as the logical buffer ``input`` (this rank's rows for everybody); the bytes it sends
    leave out the chunk addressed to itself, which never leaves the rank.
    """
    n, me = group_size(group), group_rank(group)
    for name, t, sizes in (("input", input, input_split_sizes), ("output", output, output_split_sizes)):
        if sizes is None:
            if t.shape[0] % n:
                raise ValueError(f"all_to_all: {name} has {t.shape[0]} rows, not divisible by the group's "
                                 f"{n} ranks; pass {name}_split_sizes for uneven chunks")
        elif len(sizes) != n or sum(sizes) != t.shape[0] or min(sizes) < 0:
            raise ValueError(f"all_to_all: {name}_split_sizes {list(sizes)} should be {n} sizes >= 0 "
                             f"(one per rank of the group) adding up to the {t.shape[0]} rows of {name}")
    row_bytes = _nbytes(input) // max(1, input.shape[0]) if input.dim() else 0
    kept_rows = input.shape[0] // n if input_split_sizes is None else input_split_sizes[me]
    start = time.perf_counter()
    event = _record("all_to_all", input, _nbytes(input), group, label, start, kept_bytes=kept_rows * row_bytes)
    work = dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def send(tensor: torch.Tensor, dst: int, group=None, label: str = "") -> None:
    """Send ``tensor`` to global rank ``dst`` (blocks until it is handed over)."""
    start = time.perf_counter()
    event = _record("send", tensor, _nbytes(tensor), group, label, start, peer=dst)
    dist.send(tensor, dst=dst, group=group)
    _finish(None, event, False)


def recv(tensor: torch.Tensor, src: int, group=None, label: str = "") -> None:
    """Receive into ``tensor`` from global rank ``src``."""
    start = time.perf_counter()
    event = _record("recv", tensor, _nbytes(tensor), group, label, start, peer=src)
    dist.recv(tensor, src=src, group=group)
    _finish(None, event, False)


def isend(tensor: torch.Tensor, dst: int, group=None, label: str = "") -> Handle:
    start = time.perf_counter()
    event = _record("send", tensor, _nbytes(tensor), group, label, start, peer=dst)
    return Handle(dist.isend(tensor, dst=dst, group=group), event)


def irecv(tensor: torch.Tensor, src: int, group=None, label: str = "") -> Handle:
    start = time.perf_counter()
    event = _record("recv", tensor, _nbytes(tensor), group, label, start, peer=src)
    return Handle(dist.irecv(tensor, src=src, group=group), event)


def barrier(group=None) -> None:
    """Wait for every rank of the group (sends no payload; not traced)."""
    dist.barrier(group=group)


# -- autograd-aware operators of tensor parallelism -------------------------------------------------
def _split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = group_size(group), group_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    return x.chunk(n, dim=dim)[r].contiguous()


def _gather_along(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    n = group_size(group)
    x = x.contiguous()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    all_gather(out.view(-1), x.view(-1), group=group, label=label)
    return torch.cat(out.unbind(0), dim=dim)


class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, group=ctx.group, label=ctx.label + "/f.backward")
        return grad, None, None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, label):
        x = x.contiguous().clone()
        all_reduce(x, group=group, label=label + "/g.forward")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather along ``dim`` forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim = group, dim
        return _gather_along(x, dim, group, label + "/gather.forward")

    @staticmethod
    def backward(ctx, grad):
        return _split_along(grad, ctx.dim, ctx.group), None, None, None


class _SplitToParallel(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim, ctx.label = group, dim, label
        return _split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, ctx.dim, ctx.group, ctx.label + "/split.backward"), None, None, None


def copy_to_parallel(x: torch.Tensor, group=None, label: str = "tp") -> torch.Tensor:
    """Megatron's f: enters a parallel region. Forward: identity. Backward: all-reduce."""
    return _CopyToParallel.apply(x, group, label)


def reduce_from_parallel(x: torch.Tensor, group=None, label: str = "tp") -> torch.Tensor:
    """Megatron's g: leaves a parallel region by summing partial results. Backward: identity."""
    return _ReduceFromParallel.apply(x, group, label)


def gather_from_parallel(x: torch.Tensor, group=None, dim: int = -1, label: str = "tp") -> torch.Tensor:
    """All-gather shards along ``dim`` (forward); backward keeps this rank's slice of the gradient."""
    return _GatherFromParallel.apply(x, group, dim, label)


def split_to_parallel(x: torch.Tensor, group=None, dim: int = -1, label: str = "tp") -> torch.Tensor:
    """Keep this rank's slice along ``dim`` (forward); backward all-gathers the gradient."""
    return _SplitToParallel.apply(x, group, dim, label)


# Sequence parallel: between tensor-parallel regions the activations are split along the sequence
# instead of copied, so g's all-reduce becomes a reduce-scatter and f's identity an all-gather.
def _reduce_scatter_along(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    chunks = torch.stack(x.chunk(n, dim=dim))  # (n, *chunk): rank i keeps the sum of row i
    out = torch.empty_like(chunks[0])
    reduce_scatter(out.view(-1), chunks.view(-1), group=group, label=label)
    return out


class _GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather along ``dim`` forward, reduce-scatter of the gradient backward.

    Backward is a reduce-scatter, not a split: every rank feeds the gathered tensor to its own slice
    of a column-parallel layer, so each holds a partial gradient for every position, and the
    gradient of this rank's positions is the sum of those partials.
    """

    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim, ctx.label = group, dim, label
        return _gather_along(x, dim, group, label + "/sequence_gather.forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along(grad.contiguous(), ctx.dim, ctx.group,
                                     ctx.label + "/sequence_gather.backward"), None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward (sum the partial results, keep this rank's positions),
    all-gather of the gradient backward (every position's gradient reaches every partial)."""

    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim, ctx.label = group, dim, label
        return _reduce_scatter_along(x.contiguous(), dim, group, label + "/sequence_scatter.forward")

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, ctx.dim, ctx.group, ctx.label + "/sequence_scatter.backward"), None, None, None


def gather_from_sequence_parallel(x: torch.Tensor, group=None, dim: int = 1, label: str = "tp") -> torch.Tensor:
    """Sequence parallel's f: all-gather the positions along ``dim``; backward reduce-scatters."""
    return _GatherFromSequenceParallel.apply(x, group, dim, label)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None, dim: int = 1, label: str = "tp") -> torch.Tensor:
    """Sequence parallel's g: sum partial results and keep this rank's positions along ``dim``;
    backward all-gathers the gradient."""
    return _ReduceScatterToSequenceParallel.apply(x, group, dim, label)
