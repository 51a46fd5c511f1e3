"""How FSDP lays a model out, apart from how it runs: the model cut into **units**, each unit's
parameters side by side in one flat buffer padded to a multiple of the ranks, each rank's **shard**
of it, and the **pieces** of parameters a shard holds. Planning needs no process group, so the
planner, the cost model and the parent process can ask here too; ``minitp.fsdp`` runs it.

A piece (``LocalPiece``) names elements [start, stop) of one flattened parameter: that is how a
checkpoint stores what a rank holds, whatever the world size that cut it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from minitp import comm
from minitp.models import TransformerBlock

WrapPolicy = Callable[[str, nn.Module], bool]


def wrap_blocks(name: str, module: nn.Module) -> bool:
    """The default wrapping policy: every transformer block is a unit; the root keeps the rest."""
    return isinstance(module, TransformerBlock)


# -- planning the units (no process group needed, so it can be checked and costed anywhere) --------
@dataclass
class ParamSlot:
    """Where one of the model's parameters lives inside its unit's flat buffer."""

    name: str  # full name in the plain model, e.g. "layers.0.attention.wq.weight"
    owner: nn.Module  # the module whose attribute it is
    attr: str  # "weight"
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class UnitPlan:
    name: str  # "root" or the wrapped module's name, e.g. "layers.1"
    module: nn.Module
    slots: list[ParamSlot]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)


def plan_units(model: nn.Module, world_size: int, wrap: WrapPolicy = wrap_blocks) -> list[UnitPlan]:
    """Cut ``model`` into units: the root first (what no wrapped module claims), then each module
    the policy wraps, in the order the model registers them (which must be the order forward runs
    them, since prefetch follows it). A module inside a wrapped one belongs to the outer unit.

    Raises a ``ValueError`` for what would go wrong later: a wrapped module with no parameters, a
    unit with fewer elements than ranks (some rank would hold nothing but padding), a parameter
    shared by two modules, a dtype other than float32 (the master copy is fp32).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    counts: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        counts.setdefault(id(p), []).append(name)
    for names in counts.values():
        if len(names) > 1:
            raise ValueError(
                f"a parameter shared between {' and '.join(names)}: minitp.fsdp gives every "
                "parameter one place in one unit; untie the weights")
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise ValueError(
                f"unsupported dtype: {name} is {p.dtype}, expected torch.float32 (the sharded "
                "master weights are fp32; ask for bf16 compute with "
                "mixed_precision=torch.bfloat16)")

    wrapped: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(w + ".") for w, _ in wrapped):
            continue
        if wrap(name, module):
            wrapped.append((name, module))
    claimed: set[int] = set()
    plans = []
    for name, module in wrapped:
        params = list(module.named_parameters(prefix=name))
        if not params:
            raise ValueError(
                f"a unit with no parameters: {name} ({type(module).__name__}); the wrapping "
                "policy chose a module that holds nothing to shard")
        plans.append(UnitPlan(name, module, _slots(model, params)))
        claimed.update(id(p) for _, p in params)
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in claimed]
    if rest:
        plans.insert(0, UnitPlan("root", model, _slots(model, rest)))
    for plan in plans:
        if plan.numel < world_size:
            raise ValueError(
                f"unit {plan.name} has {plan.numel} elements, fewer than the {world_size} ranks: "
                f"ranks {plan.numel}..{world_size - 1} would hold nothing but padding; wrap it "
                "together with more parameters or use fewer ranks")
    return plans


def _slots(model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> list[ParamSlot]:
    slots, offset = [], 0
    for name, p in named:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        slots.append(ParamSlot(name, owner, attr, p.shape, offset))
        offset += p.numel()
    return slots


def unit_numels(model: nn.Module, world_size: int, wrap: WrapPolicy = wrap_blocks) -> list[int]:
    """Elements of each unit (root first), unpadded: what ``minitp.cost.fsdp_*`` take."""
    return [plan.numel for plan in plan_units(model, world_size, wrap)]


# -- a unit at run time ----------------------------------------------------------------------------
@dataclass
class Unit:
    """One flat-sharded group of parameters and everything this rank keeps for it.

    Between steps (P = padded elements, P/n per shard, c = compute dtype: fp32, or bf16 in mixed
    precision):
      ZeRO-1: full (P, c) + grad_full (P, c) + master/moments (P/n)
      ZeRO-2: full (P, c) + grad_shard (P/n, c) + master/moments (P/n)
      ZeRO-3: shard (P/n, c) + grad_shard (P/n, c) + master/moments (P/n)   (full's storage freed)
    In fp32 the master *is* the parameter shard (a view into ``full`` for ZeRO-1/2); in mixed
    precision it is a separate fp32 shard, counted with the optimizer state as in the ZeRO paper.
    """

    name: str
    plan: UnitPlan
    padded: int  # P: elements, rounded up to a multiple of n
    full: torch.Tensor  # (P,) leaf; the parameters are views into it; storage freed when resharded
    shard: torch.Tensor  # (P/n,) this rank's slice, compute dtype: the all-gather's input
    master: nn.Parameter  # (P/n,) fp32: what the optimizer steps
    grad_full: torch.Tensor | None = None  # ZeRO-1 only: (P,) the kept full gradient
    grad_shard: torch.Tensor | None = None  # (P/n,) the averaged gradient of this rank's shard
    gathered: bool = False  # does ``full`` hold the parameters right now?
    gather: comm.Handle | None = field(default=None, repr=False)  # a prefetch in flight
    reducing: tuple | None = field(default=None, repr=False)  # (handle, output, input) in flight
    reduced: bool = False  # has this backward reduced its gradient yet?
    used: list[bool] = field(default_factory=list)  # per slot: did this rank's backward reach it?
    # parts of the shard no rank used: AdamW leaves them
    untouched: list[range] = field(default_factory=list)

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()

    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()


# -- pieces of parameters: what a shard holds, by parameter ----------------------------------------
@dataclass
class LocalPiece:
    """Elements [start, stop) of parameter ``name`` flattened, with the optimizer's per-element
    state for the same elements: ``tensors`` holds "param" and, once the optimizer has stepped, each
    of its per-element tensors ("exp_avg", "exp_avg_sq" for AdamW), all (stop - start,)."""

    name: str  # the plain model's name, e.g. "layers.0.attention.wq.weight"
    # the whole parameter as the wrapped module holds it (a tp slice under tp)
    shape: tuple[int, ...]
    start: int
    stop: int
    tensors: dict[str, torch.Tensor]
    step: int | None = None  # the optimizer's step count for it; None: it has not stepped yet


def per_element_state(state: dict, numel: int) -> dict[str, torch.Tensor]:
    """The optimizer state tensors with one value per element of a (numel,) parameter (AdamW's
    moments), leaving out scalars such as its step."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1
            and v.numel() == numel}


def shard_pieces(unit: Unit, mine: range, state: dict) -> list[LocalPiece]:
    """The pieces shard ``mine`` of ``unit`` holds (the padding is no parameter's), copied to the
    CPU: the fp32 master values and the per-element optimizer ``state`` of the shard."""
    flats = {"param": unit.master.detach(), **per_element_state(state, len(mine))}
    step = int(state["step"]) if "step" in state else None
    pieces = []
    for slot in unit.plan.slots:
        lo, hi = max(slot.offset, mine.start), min(slot.offset + slot.numel, mine.stop)
        if lo < hi:  # unit coordinates -> the shard's and the parameter's
            tensors = {k: f[lo - mine.start:hi - mine.start].detach().clone().cpu()
                       for k, f in flats.items()}
            pieces.append(LocalPiece(slot.name, tuple(slot.shape), lo - slot.offset,
                                     hi - slot.offset, tensors, step))
    return pieces


def assemble(unit: Unit, pieces: dict[str, list[LocalPiece]], kind: str,
             span: range) -> torch.Tensor:
    """Elements ``span`` of ``unit``'s flat buffer of ``kind`` ("param" or a state), fp32 on the
    CPU, put together from ``pieces`` ({name: pieces}); the padding is zero. Raises a ValueError
    naming the parameter whose elements in ``span`` no piece covers."""
    out = torch.zeros(len(span), dtype=torch.float32)
    covered = torch.zeros(len(span), dtype=torch.bool)
    for slot in unit.plan.slots:
        lo, hi = max(slot.offset, span.start), min(slot.offset + slot.numel, span.stop)
        if lo >= hi:
            continue
        for piece in pieces.get(slot.name, ()):
            if tuple(piece.shape) != tuple(slot.shape):
                raise ValueError(
                    f"a piece of {slot.name} says its shape is {list(piece.shape)}, the "
                    f"model's is {list(slot.shape)}")
            a, b = max(lo, slot.offset + piece.start), min(hi, slot.offset + piece.stop)
            if a < b and kind in piece.tensors:
                start = slot.offset + piece.start
                out[a - span.start:b - span.start] = (
                    piece.tensors[kind].reshape(-1)[a - start:b - start])
                covered[a - span.start:b - span.start] = True
        if not covered[lo - span.start:hi - span.start].all():
            raise ValueError(f"the pieces of {slot.name} do not cover its {kind} elements "
                             f"[{lo - slot.offset}, {hi - slot.offset}), which this rank holds")
    return out


def pieces_by_name(pieces: list[LocalPiece], names: list[str]) -> dict[str, list[LocalPiece]]:
    """{name: its pieces}; refuses a piece of a parameter not in ``names``."""
    out: dict[str, list[LocalPiece]] = defaultdict(list)
    for piece in pieces:
        out[piece.name].append(piece)
    unknown = sorted(set(out) - set(names))
    if unknown:
        raise ValueError(f"pieces of {', '.join(unknown)}, which this model does not have")
    return out


def assemble_state(unit: Unit, pieces: dict[str, list[LocalPiece]],
                   mine: range) -> dict[str, torch.Tensor]:
    """The optimizer state of shard ``mine`` of ``unit`` from the pieces that carry one ({} when
    none does): its step, which every piece of the unit must share, and each per-element tensor."""
    given = [p for slot in unit.plan.slots for p in pieces.get(slot.name, ())]
    kinds, steps = sorted({k for p in given
                           for k in p.tensors} - {"param"}), {p.step for p in given}
    if not kinds:
        return {}
    if len(steps) != 1 or None in steps:
        raise ValueError(f"the pieces of unit {unit.name} carry optimizer state at steps "
                         f"{sorted(steps, key=str)}; one step per unit expected (AdamW keeps one "
                         "per shard)")
    return {"step": torch.tensor(float(steps.pop())), **{k: assemble(unit, pieces, k, mine)
                                                         for k in kinds}}


# -- a parameter no rank used: its part of the shard is put back after the optimizer's step --------
def keep_untouched(unit: Unit, state: dict) -> list[tuple[range, torch.Tensor,
                                                          dict[str, torch.Tensor]]]:
    """Copies of the values and per-element state of the parts in ``unit.untouched``."""
    moments = per_element_state(state, unit.shard_numel)
    return [(part, unit.master.detach()[part.start:part.stop].clone(),
             {k: v[part.start:part.stop].clone() for k, v in moments.items()})
             for part in unit.untouched]


def put_back(unit: Unit, kept: list[tuple[range, torch.Tensor, dict]], state: dict) -> None:
    """Undo a step on the parts ``kept``: values and state as they were (a state the step created
    started at zero), so the optimizer has not moved them."""
    for part, values, moments in kept:
        unit.master.detach()[part.start:part.stop] = values
        for k, v in per_element_state(state, unit.shard_numel).items():
            v[part.start:part.stop] = moments[k] if k in moments else 0.0
    unit.untouched = []
