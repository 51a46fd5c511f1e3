"""Every message minitp sends, traced.

Thin wrappers over ``torch.distributed``: each call does the collective and appends an ``Event``
(op, group, bytes, times, label, ...) to the trace recording on this process (``minitp.trace``).
Tracing is how the library sends messages: a strategy that sends something unexpected shows up.

Ranks given to these functions (``src``, ``dst``) are global ranks, as in ``torch.distributed``.
``group=None`` means the whole world. Each event also records the mesh dimension its group was
named with (``name_group``): byte tables and figures split the traffic by it, never by label.

Messages whose backward is a message (Megatron's f and g, the sequence-parallel pair, the
autograd all-to-all) are built on these in ``minitp.regions``. The payload model (``sent_bytes``)
is ``minitp.trace.collective_sent_bytes``.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

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

    ``Mesh`` names each group it creates; a strategy names the group it is given with
    ``unless_named=True`` (a mesh's "dp" group stays "dp" under FSDP). A group other than the world
    is named once (another name: a ``ValueError``, or with ``unless_named`` the first name stays);
    the world takes the latest name (DDP, then FSDP, may run on it in turn). A name lives as long
    as its group object; on a rank outside ``group`` (``new_group``'s marker) nothing happens.
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
        sent_bytes=_trace.collective_sent_bytes(op, nbytes, len(ranks), position, kept_bytes), **tr.tags(),
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
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13: *_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    work = _all_gather(output, input, group=group, async_op=async_op)
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
    work = _reduce_scatter(output, input, op=op, group=group, async_op=async_op)
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


def device() -> torch.device:
    """The device this rank computes and sends from: ``cuda:<current>`` under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
