"""Every message minitp sends, traced.

Thin wrappers over ``torch.distributed``: each call checks its arguments (a non-tensor, a peer
outside the group, mixed dtypes: one sentence, before any message), does the collective and appends
an ``Event`` (op, group, bytes, times, label, ...) to the trace recording on this process
(``minitp.trace``), so a strategy that sends something unexpected shows up. Ranks given (``src``,
``dst``) are global, as in ``torch.distributed``; ``group=None`` is the world. An event records the
mesh dimension its group was named with (``name_group``): byte tables and figures split the traffic
by it, never by label.

Messages whose backward is a message (Megatron's f and g, the sequence-parallel pair, the autograd
all-to-all) are built on these in ``minitp.regions``; the payload model is
``trace.collective_sent_bytes``.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from minitp import trace as _trace

ReduceOp = dist.ReduceOp

# Facts about a process group, keyed by the group object held weakly: a group made later (the next
# launch forked from this process, a new world under torchrun) never inherits them, even at one
# address.
_group_ranks_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_group_dims: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _resolve(group):
    """The group object ``group`` stands for (the world when None), or None where there is none to
    key on (no world yet; ``new_group``'s marker on ranks outside the group)."""
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
    is named once (another name: a ``ValueError``; with ``unless_named`` the first stays); the world
    takes the latest (DDP, then FSDP, may run on it). On a rank outside ``group`` nothing happens.
    """
    key = _resolve(group)
    if key is None:
        return
    had = _group_dims.get(key)
    if had is None or had == dim or key is dist.group.WORLD:
        _group_dims[key] = dim
    elif not unless_named:
        raise ValueError(f"process group {group_ranks(key)} is already named {had!r}; it cannot "
                         f"also be named {dim!r}")


def group_dim(group: dist.ProcessGroup | None = None) -> str:
    """The mesh dimension ``group`` (the world when None) was named with, or "" if none was."""
    key = _resolve(group)
    return "" if key is None else _group_dims.get(key, "")


def group_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group)


class Handle:
    """What an ``async_op=True`` call returns: ``wait()`` finishes the op and stamps its end time
    (when ``wait`` returned: an upper bound on when the op finished)."""

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


def _record(op: str, tensor: torch.Tensor, nbytes: int, group, label: str, peer: int | None = None,
            src: int | None = None, kept_bytes: int | None = None) -> _trace.Event | None:
    """Append the event of a call starting now to the trace recording, if any (``position``: a
    broadcast's place along the chain from ``src``)."""
    tr = _trace.current()
    if tr is None:
        return None
    start, ranks = time.perf_counter(), group_ranks(group)
    position = 0 if src is None else (ranks.index(dist.get_rank()) - ranks.index(src)) % len(ranks)
    event = _trace.Event(
        rank=dist.get_rank(), kind="comm", op=op, label=tr.label(label), start=start, end=start,
        group=ranks, dim=group_dim(group), peer=peer, shape=tuple(tensor.shape),
        dtype=str(tensor.dtype).replace("torch.", ""), bytes=nbytes,
        sent_bytes=_trace.collective_sent_bytes(op, nbytes, len(ranks), position, kept_bytes),
        **tr.tags(),
    )
    return tr.add(event)


def _finish(work, event, async_op: bool):
    if async_op:
        return Handle(work, event)
    if event is not None:
        event.end = time.perf_counter()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check(call: str, group=None, peer: tuple[str, int] | None = None, **tensors) -> None:
    """Refuse, before any message, what would fail deep inside torch or wait forever."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            got = ("None (a gradient that was never computed?)" if t is None
                   else f"{type(t).__name__} {t!r:.40}")
            raise TypeError(f"comm.{call}: {name} must be a torch.Tensor, got {got}")
    if len({t.dtype for t in tensors.values()}) > 1:
        raise TypeError(f"comm.{call}: " + " but ".join(f"{k} is {t.dtype}"
                                                        for k, t in tensors.items())
                        + "; they must have the same dtype")
    if peer and peer[1] not in group_ranks(group):
        raise ValueError(
            f"comm.{call}: {peer[0]}={peer[1]!r} is not a rank of the group; expected one of "
            f"{group_ranks(group)} (global ranks)")


# -- collectives ----------------------------------------------------------------------------------
# torch < 2.13: *_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM, label: str = "",
               async_op: bool = False):
    """Reduce ``tensor`` over the group, in place; every rank ends with the result."""
    _check("all_reduce", tensor=tensor)
    event = _record("all_reduce", tensor, _nbytes(tensor), group, label)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, label: str = "",
               async_op: bool = False):
    """Concatenate every rank's ``input`` along dim 0 into ``output`` (n * input rows)."""
    _check("all_gather", output=output, input=input)
    n = group_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"comm.all_gather: output has {output.numel()} elements, expected "
                         f"{n} ranks x {input.numel()} = {n * input.numel()}")
    event = _record("all_gather", output, _nbytes(output), group, label)
    work = _all_gather(output, input, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, op=ReduceOp.SUM,
                   label: str = "", async_op: bool = False):
    """Reduce ``input`` (n * output rows) over the group; rank i keeps the i-th slice."""
    _check("reduce_scatter", output=output, input=input)
    n = group_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"comm.reduce_scatter: input has {input.numel()} elements, expected "
                         f"{n} ranks x {output.numel()} = {n * output.numel()}")
    event = _record("reduce_scatter", input, _nbytes(input), group, label)
    work = _reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, label: str = "", async_op: bool = False):
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place."""
    _check("broadcast", group, ("src", src), tensor=tensor)
    event = _record("broadcast", tensor, _nbytes(tensor), group, label, src=src)
    work = dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    return _finish(work, event, async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor,
               output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None, group=None, label: str = "",
               async_op: bool = False):
    """Rank i's j-th chunk of ``input`` (rows along dim 0) lands as the i-th chunk of rank j's
    ``output``. Chunks are equal (rows / n) unless the split sizes say how many rows go to (input)
    and come from (output) each rank of the group, in group order; a size may be 0. Traced as the
    logical buffer ``input``; the bytes sent leave out the chunk addressed to this rank itself."""
    _check("all_to_all", output=output, input=input)
    n, me = group_size(group), group_rank(group)
    for name, t, sizes in (("input", input, input_split_sizes), ("output", output,
                                                                 output_split_sizes)):
        if sizes is None:
            if t.shape[0] % n:
                raise ValueError(
                    f"comm.all_to_all: {name} has {t.shape[0]} rows, not divisible by the group's "
                    f"{n} ranks; pass {name}_split_sizes for uneven chunks")
        elif len(sizes) != n or sum(sizes) != t.shape[0] or min(sizes) < 0:
            raise ValueError(
                f"comm.all_to_all: {name}_split_sizes {list(sizes)} should be {n} sizes >= 0 "
                f"(one per rank of the group) adding up to the {t.shape[0]} rows of {name}")
    row_bytes = _nbytes(input) // max(1, input.shape[0]) if input.dim() else 0
    kept_rows = input.shape[0] // n if input_split_sizes is None else input_split_sizes[me]
    event = _record("all_to_all", input, _nbytes(input), group, label,
                    kept_bytes=kept_rows * row_bytes)
    work = dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group,
                                  async_op=async_op)
    return _finish(work, event, async_op)


def send(tensor: torch.Tensor, dst: int, group=None, label: str = "") -> None:
    """Send ``tensor`` to global rank ``dst`` (blocks until it is handed over)."""
    _check("send", group, ("dst", dst), tensor=tensor)
    event = _record("send", tensor, _nbytes(tensor), group, label, peer=dst)
    dist.send(tensor, dst=dst, group=group)
    _finish(None, event, False)


def recv(tensor: torch.Tensor, src: int, group=None, label: str = "") -> None:
    """Receive into ``tensor`` from global rank ``src``."""
    _check("recv", group, ("src", src), tensor=tensor)
    event = _record("recv", tensor, _nbytes(tensor), group, label, peer=src)
    dist.recv(tensor, src=src, group=group)
    _finish(None, event, False)


def isend(tensor: torch.Tensor, dst: int, group=None, label: str = "") -> Handle:
    _check("isend", group, ("dst", dst), tensor=tensor)
    event = _record("send", tensor, _nbytes(tensor), group, label, peer=dst)
    return Handle(dist.isend(tensor, dst=dst, group=group), event)


def irecv(tensor: torch.Tensor, src: int, group=None, label: str = "") -> Handle:
    _check("irecv", group, ("src", src), tensor=tensor)
    event = _record("recv", tensor, _nbytes(tensor), group, label, peer=src)
    return Handle(dist.irecv(tensor, src=src, group=group), event)


def barrier(group=None) -> None:
    """Wait for every rank of the group (sends no payload; not traced)."""
    dist.barrier(group=group)


def device() -> torch.device:
    """The device this rank computes and sends from: ``cuda:<current>`` under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
