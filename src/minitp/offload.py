"""Holding less on the device between forward and backward: activation offload and selective
activation checkpointing.

Between a block's forward and its backward, autograd keeps every tensor an operation saved to
compute its gradient (``minitp.measure.activations`` counts them). Full recomputation
(``minitp.measure.activations.run_recomputed``) keeps only the block's input and pays a whole
forward again. Two ways in between:

* **activation offload**: each saved tensor is copied out to the host's memory the moment autograd
  saves it, and copied back when backward asks for it. Nothing is computed twice; the price is the
  host link (PCIe), crossed twice per saved byte: out during forward, in during backward, which
  hides behind compute when the link is fast enough (``minitp.cost.offload.host_link_time``).
  PyTorch lets us stand between autograd and what it saves: ``saved_tensors_hooks(pack, unpack)``
  calls ``pack`` on every tensor it saves and keeps whatever ``pack`` returns (here a ticket, not
  the tensor); ``unpack`` turns the ticket back into the tensor in backward. As practice does,
  parameters and buffers are left alone (they are on the device anyway) and so are small tensors
  (``min_bytes``: a copy costs more than it frees).
* **selective activation checkpointing**: keep what is expensive to compute again (the matmul
  outputs, attention's kernel), recompute in backward what is cheap (norms, RoPE, SiLU, softmax,
  the elementwise products): a few FLOPs per element instead of a whole forward
  (``minitp.cost.offload.selective_block_tensors`` lists what it keeps). PyTorch's
  ``torch.utils.checkpoint`` runs a region so that backward recomputes it; its
  ``create_selective_checkpoint_contexts`` asks a *policy* about each operation in forward and
  caches the outputs of those the policy says to save, so the recomputation takes them from the
  cache instead of running them again.

Both run a block of ``minitp.models`` from the outside, as ``TransformerBlock(recompute=)`` takes:
``model(tokens, recompute=offload_blocks(store, model))`` or
``model(tokens, recompute=SelectiveCheckpoint(model))``. On a CPU the "host" is a second, counted
store in the same memory (``HostStore``): what moves, when, and how much each side holds is what the
lesson measures. On a GPU the same code copies to pinned host memory; practice also moves the copies
to a side stream so that they overlap the next kernels (torchtune's ``OffloadActivations``), which
this file leaves out.
"""

from __future__ import annotations

import functools
import itertools
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

aten = torch.ops.aten


# -- the host: a second memory, counted -----------------------------------------------------------
@dataclass(frozen=True)
class Move:
    """One crossing of the host link: "out" (device -> host, in forward) or "in" (back, in
    backward), of the storage ``key``, ``nbytes`` long, for ``label`` (the block), at ``at_s``
    seconds after the store was made; ``source``: the address of the device storage it came from
    (out) or went to (in)."""

    direction: str
    key: int
    nbytes: int
    label: str
    at_s: float
    source: int


class HostStore:
    """The host's memory: ``put`` copies a storage's bytes into its own memory and hands back a key,
    ``take`` copies them back to the device and frees the host's copy (each key once).

    It counts every move (``moves``, ``bytes_out``, ``bytes_in``), what it holds now and at most
    (``host_bytes``, ``host_peak``), and the offloaded bytes back on the device whose tensors are
    still alive (``device_bytes``, ``device_peak``: during backward, how much of the activations is
    back at once)."""

    def __init__(self):
        self.host: dict[int, torch.Tensor] = {}  # key -> its bytes, in the host's memory
        self.moves: list[Move] = []
        self.bytes_out = self.bytes_in = 0
        self.host_bytes = self.host_peak = 0
        self.device_bytes = self.device_peak = 0
        self._next_key = 0
        self._start = time.perf_counter()

    def put(self, flat: torch.Tensor, label: str = "") -> int:
        """Copy ``flat`` (a storage's bytes, uint8) into the host's memory; its key."""
        # pinned memory on a GPU's host: the copy runs at the link's full rate
        host = torch.empty(flat.shape, dtype=torch.uint8, device="cpu", pin_memory=flat.is_cuda)
        host.copy_(flat)
        key, self._next_key = self._next_key, self._next_key + 1
        self.host[key] = host
        self.bytes_out += host.nbytes
        self.host_bytes += host.nbytes
        self.host_peak = max(self.host_peak, self.host_bytes)
        self._record("out", key, host.nbytes, label, flat.untyped_storage().data_ptr())
        return key

    def take(self, key: int, device: torch.device, label: str = "") -> torch.Tensor:
        """Copy ``key``'s bytes back to ``device`` (a new storage there); free the host's copy."""
        if key not in self.host:
            raise KeyError(f"storage {key} is not in the host store: never offloaded, or already "
                           "brought back (backward runs once per forward)")
        host = self.host.pop(key)
        flat = host.to(device, copy=True)  # (nbytes,) uint8, on the device
        self.bytes_in += host.nbytes
        self.host_bytes -= host.nbytes
        self.device_bytes += host.nbytes
        self.device_peak = max(self.device_peak, self.device_bytes)
        # counted back on the device until the last tensor on this storage dies
        weakref.finalize(flat.untyped_storage(), self._released, host.nbytes)
        self._record("in", key, host.nbytes, label, flat.untyped_storage().data_ptr())
        return flat

    def _released(self, nbytes: int) -> None:
        self.device_bytes -= nbytes

    def _record(self, direction: str, key: int, nbytes: int, label: str, source: int) -> None:
        at = time.perf_counter() - self._start
        self.moves.append(Move(direction, key, nbytes, label, at, source))


# -- the hooks: pack copies out, unpack brings back ------------------------------------------------
def storage_bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A whole storage as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def held_storages(module: nn.Module | None) -> set[int]:
    """The storages of ``module``'s parameters and buffers: on the device anyway, never moved."""
    if module is None:
        return set()
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


class _Offloaded:
    """One storage sent to the host: its key, a weak reference to the device storage it came from
    (to know a later tensor on the same storage from one on a new storage at a reused address), the
    tickets not yet unpacked, and the storage brought back while some are left."""

    def __init__(self, key: int, storage: torch.UntypedStorage):
        self.key = key
        self.source = weakref.ref(storage)
        self.pending = 0
        self.back: torch.Tensor | None = None


@dataclass(frozen=True)
class Ticket:
    """What autograd keeps in place of an offloaded tensor: which storage, and the tensor's view of
    it (dtype, shape, stride, offset) to rebuild it exactly."""

    stored: _Offloaded
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    device: torch.device


class Offloaded:
    """While active, every tensor autograd saves goes to ``store`` (see the module's docstring).

    A storage is sent once however many saved tensors share it (a tensor saved by two operations,
    a view of one already saved): counted as ``minitp.measure.activations`` counts saved bytes. It
    comes back once, when backward first asks for one of its tensors, and the host's copy is freed.
    keep: the module whose parameters and buffers stay; min_bytes: storages smaller than this stay
    too (``kept_bytes`` counts what stayed, each storage once, parameters and buffers left out)."""

    def __init__(self, store: HostStore, keep: nn.Module | None = None, min_bytes: int = 0,
                 label: str = ""):
        self.store, self.min_bytes, self.label = store, min_bytes, label
        self.held = held_storages(keep)
        self.sent: dict[int, _Offloaded] = {}  # device data_ptr -> what went out from it
        # data_ptr -> nbytes of what stayed (alive while autograd holds it: no address is reused)
        self.kept: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.held:  # a parameter or buffer: on the device anyway
            return t
        if storage.nbytes() < self.min_bytes:  # too small to be worth a copy: stays
            self.kept[ptr] = storage.nbytes()
            return t
        stored = self.sent.get(ptr)
        if stored is None or stored.source() is not storage:  # a storage not sent yet
            with torch.no_grad():
                key = self.store.put(storage_bytes_view(storage), self.label)
            stored = _Offloaded(key, storage)
            self.sent[ptr] = stored
        stored.pending += 1
        return Ticket(stored, t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device)

    def unpack(self, ticket) -> torch.Tensor:
        if isinstance(ticket, torch.Tensor):  # stayed on the device
            return ticket
        stored = ticket.stored
        if stored.back is None:  # the first of its tensors backward asks for: bring it back
            stored.back = self.store.take(stored.key, ticket.device, self.label)
        stored.pending -= 1
        back = stored.back
        if stored.pending == 0:  # the last: the tensors handed out hold the storage from now on
            stored.back = None
        out = torch.empty(0, dtype=ticket.dtype, device=back.device)
        return out.set_(back.untyped_storage(), ticket.offset, ticket.shape, ticket.stride)

    def __enter__(self) -> Offloaded:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def offloaded(store: HostStore, keep: nn.Module | None = None, min_bytes: int = 0,
              label: str = "") -> Offloaded:
    """``with offloaded(store, keep=model, min_bytes=1024): loss = ...``: every saved tensor of
    the forward inside, but ``model``'s parameters and buffers and storages under ``min_bytes``,
    goes to ``store`` and comes back in backward (which may run outside the ``with``)."""
    return Offloaded(store, keep, min_bytes, label)


class OffloadBlocks:
    """How each block runs with its saved tensors offloaded, as ``TransformerBlock(recompute=)``
    takes it: ``model(tokens, recompute=offload_blocks(store, model))``. The moves carry the block's
    name (``layers.i``); what each block kept on the device is in ``kept_bytes``, by name."""

    def __init__(self, store: HostStore, model: nn.Module, min_bytes: int = 0):
        self.store, self.model, self.min_bytes = store, model, min_bytes
        self.names = {block: f"layers.{name}" for name, block in model.layers.named_children()}
        self.kept_bytes: dict[str, int] = {}

    def __call__(self, forward, *args):
        name = self.names.get(getattr(forward, "__self__", None), "block")
        with offloaded(self.store, self.model, self.min_bytes, name) as hooks:
            out = forward(*args)
        self.kept_bytes[name] = hooks.kept_bytes
        return out


def offload_blocks(store: HostStore, model: nn.Module, min_bytes: int = 0) -> OffloadBlocks:
    """The ``recompute=`` of a model whose blocks offload what they save (``OffloadBlocks``)."""
    return OffloadBlocks(store, model, min_bytes)


def offload_problems(store: HostStore, model: nn.Module | None = None,
                     expected_bytes: int | None = None) -> list[str]:
    """What is wrong with an offloaded step, read from the store after its backward (empty: all
    right): a storage that went out and never came back or came back twice; a parameter or buffer
    of ``model`` moved (held on the device anyway: the link crossed for nothing); bytes out that are
    not ``expected_bytes``; blocks brought back in an order other than the reverse of forward's."""
    found = []
    outs = [m for m in store.moves if m.direction == "out"]
    ins = [m for m in store.moves if m.direction == "in"]
    back = Counter(m.key for m in ins)
    never = [m.key for m in outs if back[m.key] == 0]
    if never:
        found.append(f"{len(never)} storages went out and never came back (keys {never[:5]})")
    twice = sorted(k for k, n in back.items() if n > 1)
    if twice:
        found.append(f"storages came back more than once (keys {twice[:5]})")
    if model is not None:
        held = held_storages(model)
        moved = [m for m in outs if m.source in held]
        if moved:
            found.append(f"{len(moved)} parameters or buffers were offloaded "
                         f"({sum(m.nbytes for m in moved)} bytes): they are on the device anyway")
    if expected_bytes is not None and store.bytes_out != expected_bytes:
        found.append(f"{store.bytes_out} bytes went out, expected {expected_bytes}")
    # each block's storages in one run, the blocks in forward's order reversed
    order_out = [label for label, _ in itertools.groupby(m.label for m in outs)]
    order_in = [label for label, _ in itertools.groupby(m.label for m in ins)]
    if order_in != order_out[::-1]:
        found.append(f"blocks came back in the order {order_in}, expected {order_out[::-1]}")
    return found


# -- selective activation checkpointing -----------------------------------------------------------
# The operations whose outputs a block keeps: the matmuls (a linear layer is aten.mm on the (B·S, D)
# rows; written-out attention's q k^T and its weighted sum are aten.bmm) and attention's fused
# kernels (their output and log-sum-exp), whichever the device runs. The rest is recomputed.
MATMUL_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default,
                        aten.baddbmm.default})
ATTENTION_OPS = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # a CPU's
    aten._scaled_dot_product_flash_attention.default,  # a GPU's FlashAttention
    aten._scaled_dot_product_efficient_attention.default,  # memory-efficient attention
    aten._scaled_dot_product_cudnn_attention.default,  # cuDNN's
})
SAVED_OPS = MATMUL_OPS | ATTENTION_OPS


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The policy: keep the outputs of the matmuls and attention's kernels, recompute the rest.

    MUST_SAVE: cached in forward, taken from the cache when backward runs the region again;
    PREFER_RECOMPUTE: run again (the norms, RoPE, SiLU, softmax, products and sums; a view is free
    either way)."""
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def run_selective(forward, *args, policy=keep_matmuls):
    """Run ``forward(*args)`` so that backward recomputes it, but for the outputs ``policy`` keeps.
    ``preserve_rng_state=False``: the models have no dropout, and keeping the random generator's
    state would hold 5 KB more per block (as torchtitan also sets it)."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn,
                      preserve_rng_state=False)


class SelectiveCheckpoint:
    """How each block runs under selective checkpointing, as ``TransformerBlock(recompute=)`` takes
    it: ``model(tokens, recompute=SelectiveCheckpoint(model))``.

    It counts what each call keeps for backward (``kept_bytes``, one entry per block run): the
    storages of the outputs the policy keeps (the policy sees each one, ``ctx.op_output``), and the
    block's input, which the checkpoint holds to run the block again (parameters and buffers left
    out, each storage once, as ``minitp.measure.activations`` counts saved bytes)."""

    def __init__(self, model: nn.Module | None = None, policy=keep_matmuls):
        self.policy = policy
        self.held = held_storages(model)
        self.kept_bytes: list[int] = []
        self.kept_ops: Counter = Counter()  # op name -> outputs kept, over all calls
        self._storages: dict[int, int] = {}

    def _counting(self, ctx, op, *args, **kwargs):
        decision = self.policy(ctx, op, *args, **kwargs)
        if decision in (True, CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            self.kept_ops[str(op)] += 1
            outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
            self._count([o for o in outputs if isinstance(o, torch.Tensor)])
        return decision

    def _count(self, tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.held:
                self._storages[storage.data_ptr()] = storage.nbytes()

    def __call__(self, forward, *args):
        self._storages = {}
        self._count([a for a in args if isinstance(a, torch.Tensor)])  # the input, held to rerun
        out = run_selective(forward, *args, policy=self._counting)
        self.kept_bytes.append(sum(self._storages.values()))
        return out


# -- counting what backward computes again ---------------------------------------------------------
class CountOps(TorchDispatchMode):
    """Counts the operations that run while active, by name (``counts``), and the matmuls among
    them (``matmuls``: aten.mm, addmm, bmm, baddbmm, and attention's kernels). Around backward, the
    matmuls beyond a plain backward's are the ones recomputation ran again: none under selective
    checkpointing (taken from its cache), one forward's worth under full recomputation."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def matmuls(self) -> int:
        return sum(n for op, n in self.counts.items() if op in SAVED_OPS)


@contextmanager
def counting_ops():
    """``with counting_ops() as ops: loss.backward()``, then ``ops.matmuls``, ``ops.counts``."""
    with CountOps() as mode:
        yield mode
