"""Fully sharded data parallel (ZeRO-1, 2 and 3) from scratch.

Data parallel keeps a whole copy of the model, its gradients and its optimizer state on every rank:
16 bytes per parameter with Adam, whatever the number of ranks. ZeRO notices that each rank only
needs all of it for a moment, and splits it instead:

* The model is cut into **units** (by default every transformer block, plus the root that keeps
  what is left: embedding, final norm, head). A unit's parameters are laid side by side in one flat
  buffer, padded with zeros to a multiple of the world size ``n``, and rank ``r`` keeps the ``r``-th
  of ``n`` equal slices: its **shard**. The padding is never viewed as a parameter, gets a zero
  gradient, and so stays zero and never reaches a result.
* **ZeRO-3** keeps only shards between steps. Before a unit's forward its full parameters are
  all-gathered, used, and freed after (``reshard_after_forward``) or kept until backward. Backward
  gathers them again, and the unit's gradient is reduce-scattered: each rank keeps the summed
  gradient of its own shard only. The optimizer steps on shards.
* **ZeRO-2** keeps the full parameters on every rank but still reduce-scatters each unit's
  gradient during backward and frees the full gradient; after the step the updated shards are
  all-gathered back into the full parameters.
* **ZeRO-1** shards only the optimizer state: the full gradient is kept (it is what backward
  accumulates into), its own slice overwritten with the averaged gradient the optimizer reads.
  It sends what ZeRO-2 sends.

ZeRO-1 and 2 send exactly what DDP sends (a reduce-scatter plus an all-gather is an all-reduce);
ZeRO-3 sends 1.5 times that, for 1/n of the memory (``minitp.cost.fsdp_step_bytes`` has the bytes).

Also here: prefetch (the next unit's all-gather is started before this unit computes, so it
overlaps), bf16 mixed precision (the ZeRO paper's recipe: bf16 parameters and gradients, gathered
and computed in bf16, an fp32 master shard that the optimizer steps, gradients summed over ranks in
fp32), activation checkpointing of the wrapped blocks, gathering the full state dict, and the
pieces of parameters each rank holds (``local_pieces`` / ``load_local_pieces``: what a checkpoint
saves and loads). How the units and shards are laid out is in ``minitp.fsdp_units``.

**A parameter no rank used** (a branch the forward skipped) is left as one process leaves it (with
``zero_grad()``'s default: no gradient, so AdamW skips it), as far as a flat unit allows: its values
and AdamW moments are put back after the step, so weight decay does not move it. The ranks agree
on it as DDP's do, inside the reduce-scatter: a rank that did not use it sends -0.0 (see
``minitp.ddp``). What the flat layout does not allow: AdamW keeps one step count per shard, so the
unit's count advances. A parameter unused for some steps and used later gets the unit's bias
correction, where one process (or ``fully_shard``) counts its own steps.

The model stays plain: its parameters are replaced by views into the units' flat buffers, registered
on their modules as non-persistent buffers under the parameters' names before each forward, so its
own code runs unchanged.

Reading order, ZeRO-3 first: units and shards (``__init__``, ``_make_unit``; the layout is
``minitp.fsdp_units``), the views, gather and free (``_unshard``, ``_reshard``), forward and its
hooks, the reduce-scatter in backward (``_reduce_gradient``), ``finish_gradients`` (the
data-parallel protocol of ``minitp.replicas``), the optimizer step. The extras branch where they
apply and are named there: ZeRO-1/2 (``zero < 3``), bf16 (``self.mixed``), prefetch, recomputation
(``checkpoint``), a parameter no rank used (``unit.used``, -0.0); checking and saving come last.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from minitp import comm, fsdp_units
from minitp import trace as _trace
from minitp.fsdp_units import LocalPiece, Unit, UnitPlan, WrapPolicy, plan_units, wrap_blocks
from minitp.fsdp_units import unit_numels as unit_numels  # re-exported: fsdp.unit_numels
from minitp.layout import padded_numel, shard_range
from minitp.replicas import GradientSync, used_by_no_rank


class FullyShardedDataParallel(GradientSync, nn.Module):
    """Wrap a plain model so that each rank holds a shard of it (ZeRO stage ``zero``).

    module: the plain model, built the same way (same seed) on every rank; each rank keeps its
        slices and drops the rest, so nothing is sent at start-up.
    group: the data-parallel process group (None: the world).
    zero: 1 (optimizer state sharded), 2 (gradients too), 3 (parameters too).
    wrap: the wrapping policy, ``(name, module) -> bool``; the root unit keeps what it leaves.
    reshard_after_forward: ZeRO-3: free a unit's gathered parameters after its forward and gather
        them again for backward (less memory, one more all-gather). The root is never resharded:
        backward starts with it. (ZeRO-1/2 hold full parameters, so this and prefetch do nothing.)
    prefetch: start the next unit's all-gather before this unit computes.
    mixed_precision: None (fp32) or torch.bfloat16.
    checkpoint: activation checkpointing of the wrapped modules (recomputed in backward).

    Use ``optimizer = fsdp.attach(torch.optim.AdamW(fsdp.parameters(), ...))``: the optimizer sees
    only the fp32 shards, and its step hooks do what follows a step (copy the master into bf16,
    all-gather the updated shards for ZeRO-1/2).
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, *, zero: int = 3,
                 wrap: WrapPolicy = wrap_blocks, reshard_after_forward: bool = True,
                 prefetch: bool = True, mixed_precision: torch.dtype | None = None,
                 checkpoint: bool = False):
        super().__init__()
        if zero not in (1, 2, 3):
            raise ValueError(f"zero must be 1, 2 or 3, got {zero!r}")
        if mixed_precision not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"unsupported dtype: mixed_precision={mixed_precision}, expected None or "
                "torch.bfloat16 (float16 would need loss scaling, which minitp does not do)")
        self.module, self.group, self.zero = module, group, zero
        # its messages' Event.dim (a mesh's group keeps "dp")
        comm.name_group(group, "fsdp", unless_named=True)
        self.world_size, self.rank = comm.group_size(group), comm.group_rank(group)
        self.reshard_after_forward, self.prefetch, self.checkpoint = (reshard_after_forward,
                                                                      prefetch, checkpoint)
        self.compute_dtype = mixed_precision or torch.float32
        self.mixed = self.compute_dtype != torch.float32
        self.param_names = [name for name, _ in module.named_parameters()]
        self.units = [self._make_unit(plan) for plan in plan_units(module, self.world_size, wrap)]
        self.root = self.units[0] if self.units[0].name == "root" else None
        # Registered here, the shards are all that ``self.parameters()`` yields: the plain model's
        # parameters were removed from it.
        self.shards = nn.ParameterList([u.master for u in self.units])
        self.optimizer: torch.optim.Optimizer | None = None
        self.gathered_bytes = sum(u.full_bytes() for u in self.units if u.gathered)
        self.gathered_peak = self.gathered_bytes
        self._in_flight: Unit | None = None  # the unit whose reduce-scatter is still running
        self._kept: list = []  # during an optimizer step: (unit, part, values, moments) to put back
        for unit in self.units:
            unit.full.register_post_accumulate_grad_hook(
                functools.partial(self._reduce_gradient, unit))
            if unit is self.root:
                continue
            module_ = unit.plan.module
            module_.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            module_.register_forward_hook(functools.partial(self._after_forward, unit))

    @torch.no_grad()
    def _make_unit(self, plan: UnitPlan) -> Unit:
        n, r = self.world_size, self.rank
        # P, this rank's P/n
        padded, mine = padded_numel(plan.numel, n), shard_range(plan.numel, n, r)
        flat = torch.zeros(padded, dtype=torch.float32, device=_device_of(plan))  # (P,)
        for slot in plan.slots:
            flat[slot.offset:slot.offset + slot.numel] = getattr(slot.owner, slot.attr).reshape(-1)
            del slot.owner._parameters[slot.attr]  # the model holds a view in its place from now on
        if self.zero == 3:
            full = torch.empty(padded, dtype=self.compute_dtype, device=flat.device)
            master = nn.Parameter(flat[mine.start:mine.stop].clone())  # (P/n,) fp32
            shard = master.detach().to(self.compute_dtype) if self.mixed else master.detach()
        else:  # ZeRO-1/2: full parameters held; the shard is a view of this rank's slice of them
            full = flat.to(self.compute_dtype)
            shard = full[mine.start:mine.stop]
            master = nn.Parameter(flat[mine.start:mine.stop].clone() if self.mixed else shard)
        full.requires_grad_(True)
        unit = Unit(plan.name, plan, padded, full, shard, master, gathered=self.zero < 3,
                    used=[False] * len(plan.slots))
        self._set_views(unit)  # the attributes exist from now on; ZeRO-3's point at freed storage
        if self.zero == 3:
            full.untyped_storage().resize_(0)  # nothing gathered yet
        return unit

    # -- the parameters the model sees ------------------------------------------------------------
    def _set_views(self, unit: Unit) -> None:
        """Point the model's attributes at views of the unit's full buffer. Under grad mode the
        views come from one ``split``, so backward gathers every parameter's gradient into one
        full-size ``unit.full.grad`` (the padding's part zero), then calls ``_reduce_gradient``.
        A hook on each view notes that backward reached it: that parameter was used."""
        sizes = [slot.numel for slot in unit.plan.slots]
        pieces = unit.full.split([*sizes, unit.padded - sum(sizes)])
        for i, (slot, piece) in enumerate(zip(unit.plan.slots, pieces)):
            view = piece.view(slot.shape)
            if view.requires_grad:
                view.register_hook(functools.partial(_mark_used, unit.used, i))
            # in the parameter's place
            slot.owner.register_buffer(slot.attr, view, persistent=False)

    def _unshard(self, unit: Unit, phase: str, async_op: bool = False) -> None:
        """Make ``unit.full`` hold the parameters: all-gather every rank's shard into it."""
        if unit.gather is not None:  # prefetched: wait for it only when it is needed
            if not async_op:
                unit.gather.wait()
                unit.gather = None
            return
        if unit.gathered:
            return
        unit.full.untyped_storage().resize_(unit.full_bytes())
        self._count_gathered(unit.full_bytes())
        with _trace.tagged(unit=unit.name, phase=phase):  # Event.unit, Event.phase
            handle = comm.all_gather(unit.full.data, unit.shard, self.group, async_op=async_op,
                                     label=f"fsdp/{unit.name}/all_gather.{phase}")
        unit.gathered, unit.gather = True, handle

    def _reshard(self, unit: Unit) -> None:
        """ZeRO-3: free the gathered parameters (the views keep pointing at the empty storage)."""
        if self.zero < 3 or not unit.gathered:
            return
        if unit.gather is not None:
            unit.gather.wait()
            unit.gather = None
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False
        self._count_gathered(-unit.full_bytes())

    def _count_gathered(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def _next(self, unit: Unit, step: int) -> Unit | None:
        i = self.units.index(unit) + step
        return self.units[i] if 0 <= i < len(self.units) else None

    # -- forward --------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # each block recomputes in backward; the hooks stay outside (TransformerBlock.forward)
        if self.checkpoint:
            kwargs["recompute"] = functools.partial(_checkpoint, use_reentrant=False)
        if torch.is_grad_enabled() and self.optimizer is None:
            raise RuntimeError(
                "no optimizer attached: use optimizer = fsdp.attach(torch.optim.AdamW("
                "fsdp.parameters(), ...)) before training; its step hooks finish each step")
        if self.root is not None:
            self._unshard(self.root, "forward")
            self._set_views(self.root)
            self._prefetch(self.root, +1, "forward")
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and out.requires_grad:
            # finish_gradients when backward is over
            out.register_hook(lambda grad: self.queue_finish())
        else:  # no backward will come to free them
            for unit in self.units:
                self._reshard(unit)
        return out

    def _prefetch(self, unit: Unit, step: int, phase: str) -> None:
        nxt = self._next(unit, step)
        if self.prefetch and nxt is not None and nxt is not self.root:
            self._unshard(nxt, phase, async_op=True)

    def _before_forward(self, unit: Unit, module, args) -> None:
        self._unshard(unit, "forward")
        self._prefetch(unit, +1, "forward")
        self._set_views(unit)

    def _after_forward(self, unit: Unit, module, args, output) -> None:
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._reshard(unit)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._before_backward, unit))

    # -- backward -------------------------------------------------------------------------------
    def _before_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        """Called with the gradient of the unit's output, just before the unit's own backward."""
        self._unshard(unit, "backward")
        self._prefetch(unit, -1, "backward")

    @torch.no_grad()
    def _reduce_gradient(self, unit: Unit, full: torch.Tensor) -> None:
        """The unit's full gradient is complete: start its reduce-scatter (in fp32), keep at most
        one in flight (the previous one is finished first, so its buffers are freed), and free the
        gathered parameters (ZeRO-3)."""
        if not self.sync:  # no_sync: autograd keeps adding into full.grad
            return
        self.queue_finish()  # finish_gradients, once, when this whole backward pass is over
        self._start_reduce(unit)

    @torch.no_grad()
    def _start_reduce(self, unit: Unit) -> None:
        full = unit.full
        grad, full.grad = full.grad, None  # (P,) compute dtype: this rank's local gradient
        if self._in_flight is not None:
            self._finish_reduce(self._in_flight)
        # (P,) fp32: the sum over ranks is taken in fp32
        send = grad.float() if self.mixed else grad
        for slot, used in zip(unit.plan.slots, unit.used):
            if not used:  # -0.0: "this rank did not use it" (see the top)
                send[slot.offset:slot.offset + slot.numel] = -0.0
        send.div_(self.world_size)  # the mean over ranks = the gradient of the whole batch
        out = torch.empty(unit.shard_numel, dtype=torch.float32, device=send.device)  # (P/n,)
        with _trace.tagged(unit=unit.name, phase="backward"):
            handle = comm.reduce_scatter(out, send, self.group, async_op=True,
                                         label=f"fsdp/{unit.name}/reduce_scatter")
        unit.reducing, unit.reduced, self._in_flight = (handle, out, send), True, unit
        if self.zero == 1:
            unit.grad_full = grad  # kept whole; its own slice gets the averaged gradient
        self._reshard(unit)

    @torch.no_grad()
    def _finish_reduce(self, unit: Unit) -> None:
        handle, out, _ = unit.reducing
        handle.wait()
        self._reduce_across_replicas(unit, out)
        if self.zero == 1:
            s = unit.shard_numel
            unit.grad_shard = unit.grad_full[self.rank * s:(self.rank + 1) * s]
            unit.grad_shard.copy_(out)  # (rounded to bf16 in mixed precision)
        else:
            unit.grad_shard = out.to(self.compute_dtype)  # the fp32 buffer itself when fp32
        if not self.mixed:
            unit.master.grad = unit.grad_shard
        unit.reducing, self._in_flight = None, None
        # the parts of this shard whose parameter no rank used: the step must leave them alone
        mine, unit.untouched = self._shard_range(unit), []
        for slot, used in zip(unit.plan.slots, unit.used):
            lo = max(slot.offset, mine.start) - mine.start
            hi = min(slot.offset + slot.numel, mine.stop) - mine.start
            if not used and lo < hi and used_by_no_rank(out[lo:hi]):
                unit.untouched.append(range(lo, hi))
        unit.used[:] = [False] * len(unit.used)

    def _reduce_across_replicas(self, unit: Unit, out: torch.Tensor) -> None:
        """The seam of hybrid sharding: nothing here; ``minitp.hsdp`` averages ``out`` (this
        rank's reduced shard, fp32) over the replicas of the model."""

    def _shard_range(self, unit: Unit) -> range:
        return shard_range(unit.plan.numel, self.world_size, self.rank)

    # -- the end of backward, and gradient accumulation (a pipeline's micro-batches) ---------------
    @contextmanager
    def no_sync(self):
        """Backward passes inside add each unit's full gradient into ``unit.full.grad`` and send
        nothing; ``finish_gradients()`` then reduce-scatters the sum, once. ZeRO-1 only: ZeRO-2 and
        3 give up the full gradient during backward, and accumulating it is what they save
        (DeepSpeed allows only ZeRO-1 with pipeline parallelism, for the same reason)."""
        if self.zero != 1:
            raise ValueError("no_sync needs zero=1 (the full gradient kept through backward), got "
                             f"zero={self.zero}")
        with super().no_sync():
            yield

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Reduce-scatter every unit's gradient not yet sent (at the end of backward: the units no
        forward reached, which still join the collective with zeros; after backward passes under
        ``no_sync``: every unit's accumulated sum), wait for the last, free the gathered weights."""
        for unit in self.units:
            if not unit.reduced:
                if unit.full.grad is None:
                    unit.full.grad = torch.zeros(unit.padded, dtype=self.compute_dtype,
                                                 device=unit.shard.device)
                self._start_reduce(unit)
        if self._in_flight is not None:
            self._finish_reduce(self._in_flight)
        for unit in self.units:
            unit.reduced = False
            self._reshard(unit)

    # -- the optimizer step -----------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Hook into an optimizer built on ``self.parameters()`` (the fp32 shards); returns it."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if stepped != {id(u.master) for u in self.units}:
            raise ValueError(f"the optimizer steps {len(stepped)} tensors, expected exactly the "
                             f"{len(self.units)} shards of fsdp.parameters()")
        optimizer.register_step_pre_hook(lambda *_: self._before_step())
        optimizer.register_step_post_hook(lambda *_: self._after_step())
        self.optimizer = optimizer
        return optimizer

    @torch.no_grad()
    def _before_step(self) -> None:
        if self.mixed:  # the optimizer reads an fp32 gradient, only for the length of the step
            for unit in self.units:
                unit.master.grad = None if unit.grad_shard is None else unit.grad_shard.float()
        # what the step must not change: the parts of shards whose parameter no rank used
        self._kept = [fsdp_units.keep_untouched(u, self.optimizer.state.get(u.master, {}))
                      for u in self.units]

    @torch.no_grad()
    def _after_step(self) -> None:
        for unit, kept in zip(self.units, self._kept):
            fsdp_units.put_back(unit, kept, self.optimizer.state[unit.master])
        self._kept = []
        if self.mixed:
            for unit in self.units:
                unit.master.grad = None
                unit.shard.copy_(unit.master)  # fp32 master -> bf16 shard
        if self.zero < 3:  # every rank updated its slice only: gather the full parameters back
            handles = []
            for u in self.units:
                with _trace.tagged(unit=u.name, phase="step"):
                    handles.append(comm.all_gather(u.full.data, u.shard.clone(), self.group,
                                                   async_op=True,
                                                   label=f"fsdp/{u.name}/all_gather.step"))
            for handle in handles:
                handle.wait()

    def gradient_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of this rank's averaged gradient shard, parameter by parameter, padding left
        out: what a norm over every shard counts (``minitp.trainer.clip_grad_norm_``)."""
        pieces = []
        for unit in (u for u in self.units if u.grad_shard is not None):
            mine = self._shard_range(unit)
            for slot in unit.plan.slots:
                lo, hi = max(slot.offset, mine.start), min(slot.offset + slot.numel, mine.stop)
                if lo < hi:
                    pieces.append((slot.name, unit.grad_shard[lo - mine.start:hi - mine.start]))
        return pieces

    # -- checking and saving ----------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, in fp32, under its plain-model name (on every rank): the fp32
        master shards all-gathered, then cut at the parameter boundaries (padding dropped)."""
        out = {}
        for unit in self.units:
            flat = torch.empty(unit.padded, dtype=torch.float32, device=unit.master.device)  # (P,)
            with _trace.tagged(unit=unit.name, phase="state_dict"):
                comm.all_gather(flat, unit.master.detach(), self.group,
                                label=f"fsdp/{unit.name}/all_gather.state_dict")
            for slot in unit.plan.slots:
                out[slot.name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        return {name: out[name] for name in self.param_names}

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of every parameter wrapped, in the plain model's order."""
        shapes = {slot.name: tuple(slot.shape) for unit in self.units for slot in unit.plan.slots}
        return {name: shapes[name] for name in self.param_names}

    def local_pieces(self, optimizer: torch.optim.Optimizer | None = None) -> list[LocalPiece]:
        """What this rank holds of each parameter: the elements its shards cover (no padding), their
        fp32 values and the optimizer's per-element state, copied to the CPU. Sends nothing.
        ``optimizer``: the attached one by default."""
        optimizer = optimizer or self.optimizer
        pieces = []
        for unit in self.units:
            state = optimizer.state.get(unit.master, {}) if optimizer is not None else {}
            pieces += fsdp_units.shard_pieces(unit, self._shard_range(unit), state)
        return pieces

    @torch.no_grad()
    def load_local_pieces(self, pieces: list[LocalPiece],
                          optimizer: torch.optim.Optimizer | None = None) -> None:
        """Set what this rank holds from pieces of the parameters, cut any way (whole tensors, or
        the ``local_pieces`` of a run on another world size). They must cover this rank's shards;
        under ZeRO-1/2, which hold the full parameters, every parameter's values whole (so nothing
        is sent). Copies only: bit for bit. Pieces that carry optimizer state set it, at their
        step."""
        optimizer = optimizer or self.optimizer
        by_name = fsdp_units.pieces_by_name(pieces, self.param_names)
        for unit in self.units:
            mine, device = self._shard_range(unit), unit.master.device
            state = fsdp_units.assemble_state(unit, by_name, mine)  # {} when the pieces carry none
            if state and optimizer is None:
                raise ValueError(
                    "the pieces carry optimizer state, and no optimizer is attached to take it")
            # (P,): the full parameters, padding zero; the master shard is a view of them
            if self.zero < 3:
                flat = fsdp_units.assemble(unit, by_name, "param", range(unit.padded)).to(device)
                unit.full.copy_(flat)
                if self.mixed:
                    unit.master.copy_(flat[mine.start:mine.stop])
            else:
                unit.master.copy_(fsdp_units.assemble(unit, by_name, "param", mine).to(device))
                if self.mixed:
                    unit.shard.copy_(unit.master)
            if state:
                optimizer.state[unit.master] = {k: v if k == "step" else v.to(device)
                                                for k, v in state.items()}

    def held_bytes(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: bytes this rank holds, counted from the tensors (each
        storage once), in the ZeRO paper's split: in mixed precision the fp32 master shard is
        optimizer state. Compare with ``minitp.cost.fsdp_memory_per_rank``."""
        params = [u.full if self.zero < 3 else u.shard for u in self.units]
        grads = [u.grad_full if self.zero == 1 else u.grad_shard for u in self.units]
        grads += [u.master.grad for u in self.units]  # the same storage in fp32; None in mixed
        state = [u.master for u in self.units] if self.mixed else []
        if self.optimizer is not None:
            for s in self.optimizer.state.values():
                state.extend(v for v in s.values() if isinstance(v, torch.Tensor))
        return {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
                "optimizer": _storage_bytes(state)}

    def unit_numels(self) -> list[int]:
        return [u.plan.numel for u in self.units]


def _storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (a view shares its base's); None
    is skipped. How ``minitp.measure.memory`` counts what any model holds, from outside."""
    storages = (t.untyped_storage() for t in tensors if t is not None)
    return sum(nbytes for _, nbytes in {(s.data_ptr(), s.nbytes()) for s in storages})


def _mark_used(used: list[bool], i: int, grad: torch.Tensor) -> None:
    used[i] = True


def _device_of(plan: UnitPlan) -> torch.device:
    slot = plan.slots[0]
    return getattr(slot.owner, slot.attr).device
