"""Checkers for chapter 12, memory and precision: FP8 casts and matmuls, activation offload,
selective activation checkpointing and the host link's time.

* ``check_quantize(fn)``: ``fn(x, dtype)`` returns ``(x_fp8, scale)``, per-tensor current scaling:
  ``scale = max representable / amax(x)`` (scale 1 when amax is 0 or not finite), ``x · scale``
  clamped to ±max and cast to ``dtype`` (e4m3fn or e5m2); bytes and scale against
  ``minitp.fp8.quantize`` on tensors of ~1, ~1e-5, with an outlier, of zeros and with an inf (an
  overflow upstream: there the clamp is what keeps e5m2 from holding inf).
* ``check_float8_linear(fn)``: ``fn(x, weight)`` returns ``x @ weightᵀ`` computed from e4m3 copies
  of both, current scales, the product divided by ``s_x · s_w``; against ``minitp.fp8``'s.
* ``check_offload_hooks(fn)``: ``fn(store, model)`` returns ``(pack, unpack)`` for
  ``torch.autograd.graph.saved_tensors_hooks``: pack sends each saved tensor that is not a
  parameter or buffer of ``model`` to the ``HostStore`` (``store.put`` of its bytes, uint8),
  unpack brings it back (``store.take``). The tiny model's step under them: gradients equal the
  plain step's; no parameter moved; each saved tensor's bytes out once and in once (either each
  save its own copy, or each storage once as ``minitp.offload.Offloaded`` sends it).
* ``check_selective_policy(fn)``: ``fn(ctx, op, *args, **kwargs)`` returns a ``CheckpointPolicy``;
  each block of the tiny model (attention written out and fused) runs under it
  (``minitp.offload.SelectiveCheckpoint``): gradients equal the plain step's, backward runs no
  matmul beyond the plain backward's, each block keeps ``cost.tiny_selective_block_bytes``.
* ``check_offload_exposed(fn)``: ``fn(bytes_per_direction, bytes_per_s, forward_s, backward_s)``
  returns the seconds of the host link a step leaves exposed, as
  ``minitp.cost.offload.host_link_time`` counts them.
* ``check_problem(n, answer)``: the worked problems, on LLaMA-3 at scale.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from minitp import cost, fp8, offload
from minitp.exercises import ExerciseError, call_answer, passed, problems, refuse_own, wrong
from minitp.exercises.problems import Problem
from minitp.models import LLAMA3_8B, LLAMA3_70B, TINY, build_model, loss_fn

GIB = 2**30
B, S = 2, 16  # the tiny model's batch in exercises 3 and 4
_NAMES = {fp8.E4M3: "e4m3", fp8.E5M2: "e5m2"}


# -- exercise 1: the cast --------------------------------------------------------------------------
def _quantize_cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(12)
    outlier = torch.randn(64, 32, generator=g)
    outlier[5, 7] = 300.0
    overflowed = torch.randn(64, 32, generator=g)
    overflowed[9, 3] = math.inf
    return [("values ~N(0, 1)", torch.randn(64, 32, generator=g)),
            ("tiny values ~1e-5 (a gradient)", torch.randn(64, 32, generator=g) * 1e-5),
            ("values ~N(0, 1) with one outlier of 300", outlier),
            ("all zeros", torch.zeros(16, 8)),
            ("an inf among values ~N(0, 1) (an overflow upstream)", overflowed)]


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same_codes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Byte for byte, or one code apart (the neighbouring FP8 value: a tie rounded the other way by
    a scale computed in another precision) in at most 1 % of the elements."""
    diff = (_codes(got).int() - _codes(want).int()).abs()
    return bool((diff <= 1).all()) and int((diff > 0).sum()) <= 0.01 * diff.numel()


def check_quantize(fn) -> None:
    """``fn(x, dtype)`` -> (x_fp8, scale): current per-tensor scaling and the cast."""
    name = "quantize"
    refuse_own(name, fn, fp8.quantize, fp8.Scaling.cast, fp8.Scaling)
    for what, x in _quantize_cases():
        for dtype in fp8.FORMATS:
            fmt, limit = _NAMES[dtype], fp8.max_representable(dtype)
            where = f"{what}, {fmt}"
            want, want_scale = fp8.quantize(x, dtype)
            given = x.clone()
            got = call_answer(name, fn, given, dtype)
            if not torch.equal(given.nan_to_num(), x.nan_to_num()):
                raise wrong(name, f"{where}: your function changed x; scale a copy "
                            "(x.float() * scale makes one).")
            if not (isinstance(got, (tuple, list)) and len(got) == 2
                    and isinstance(got[0], torch.Tensor)):
                raise ExerciseError(f"{name}: return a pair (x_fp8, scale), got {got!r:.200}")
            x_fp8, scale = got
            if x_fp8.dtype == torch.float32:
                raise wrong(name, f"{where}: you returned fp32 values, 4 bytes each: return the "
                            f"FP8 tensor itself, x_fp8.dtype == torch.{str(dtype)[6:]} (1 byte "
                            "each); the scale travels beside it.")
            if x_fp8.dtype != dtype:
                raise wrong(name, f"{where}: wrong dtype, {x_fp8.dtype} where {dtype} was asked "
                            "for: cast to the dtype you are given.")
            if tuple(x_fp8.shape) != tuple(x.shape):
                raise wrong(name, f"{where}: x_fp8 has shape {tuple(x_fp8.shape)}; x has "
                            f"{tuple(x.shape)}: one byte per element, in place of each.")
            try:
                scale = float(scale)
            except (TypeError, ValueError, RuntimeError):
                raise ExerciseError(f"{name}: the scale must be one number (a float or a 0-d "
                                    f"tensor), got {scale!r:.200}") from None
            values = x_fp8.float()
            if torch.isinf(values).any():
                raise wrong(name, f"{where}: x_fp8 holds inf: no clamp. e5m2 has an infinity, "
                            f"and torch's cast turns a value past ±{limit:g} into it; clamp "
                            f"x · scale to [-{limit:g}, {limit:g}] before the cast (saturate).")
            ratio = scale / float(want_scale)
            if not math.isclose(ratio, 1.0, rel_tol=1e-6):
                if math.isclose(scale * float(want_scale), 1.0, rel_tol=1e-5):
                    raise wrong(name, f"{where}: your scale {scale:.6g} is the inverse, amax / "
                                f"max: the scale multiplies x up to the format's largest value, "
                                f"max / amax.", f"{float(want_scale):.6g}")
                if scale == 1.0:
                    raise _unscaled(name, where, dtype, x)
                special = ("amax is 0: nothing to scale, scale 1" if x.abs().max() == 0
                           else "amax is inf: no finite scale fits, scale 1 (the inf saturates)"
                           if not torch.isfinite(x).all() else f"max / amax = {limit:g} / amax")
                raise wrong(name, f"{where}: your scale is {scale:.6g}; {special}.",
                            f"{float(want_scale):.6g}")
            if not _same_codes(x_fp8, want):
                if _same_codes(x_fp8, fp8.quantize(x, dtype, torch.tensor(1.0))[0]):
                    raise _unscaled(name, where, dtype, x)
                raise wrong(name, f"{where}: the scale is right but the bytes differ: cast "
                            "(x · scale), clamped to ±max, to the dtype.")
    passed(name, "5 tensors in e4m3 and e5m2: bytes and scales equal minitp.fp8.quantize's")


def _unscaled(name: str, where: str, dtype, x) -> ExerciseError:
    tiny = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-5
    lost = float((tiny.to(dtype).float() == 0).float().mean())
    return wrong(name, f"{where}: no scaling: you cast x as it is. A tensor's values rarely sit in "
                 f"the format's range: cast unscaled, {lost:.0%} of values ~1e-5 flush to zero in "
                 f"{_NAMES[dtype]}. Multiply by scale = max / amax first.")


# -- exercise 2: the forward matmul of a Float8Linear ----------------------------------------------
def _linear_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(13)
    outlier = torch.randn(24, 32, generator=g)
    outlier[3, 4] = 40.0
    return [("x ~N(0, 1), weight ~N(0, 0.02)", torch.randn(24, 32, generator=g),
             torch.randn(48, 32, generator=g) * 0.02),
            ("x with an outlier of 40", outlier, torch.randn(48, 32, generator=g) * 0.02),
            ("x ~1e-4, weight ~N(0, 1)", torch.randn(16, 64, generator=g) * 1e-4,
             torch.randn(8, 64, generator=g))]


def _float8_forward(x, weight, dtype=fp8.E4M3) -> tuple[torch.Tensor, float, float]:
    x_fp8, x_scale = fp8.quantize(x, dtype)
    w_fp8, w_scale = fp8.quantize(weight, dtype)
    y = fp8.float8_matmul(x_fp8, x_scale, w_fp8.t(), w_scale)
    return y, float(x_scale), float(w_scale)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-6) -> bool:
    return bool((got - want).norm() <= rel * want.norm())


def check_float8_linear(fn) -> None:
    """``fn(x, weight)`` -> y = x @ weightᵀ from e4m3 copies of both, current scales."""
    name = "float8 linear"
    refuse_own(name, fn, fp8.float8_matmul, fp8.Float8Linear, fp8._Float8Matmul)
    for where, x, weight in _linear_cases():
        want, s_x, s_w = _float8_forward(x, weight)
        got = call_answer(name, fn, x.clone(), weight.clone())
        if not isinstance(got, torch.Tensor):
            raise ExerciseError(f"{name}: return the output tensor y, got {got!r:.200}")
        if tuple(got.shape) != tuple(want.shape):
            raise wrong(name, f"{where}: y has shape {tuple(got.shape)}; x {tuple(x.shape)} @ "
                        f"weightᵀ {tuple(weight.t().shape)} is {tuple(want.shape)}.")
        got = got.detach().float()
        if _close(got, want):
            continue
        if _close(got, x @ weight.t(), 1e-6):
            raise wrong(name, f"{where}: y is exactly the fp32 product: you did not cast. Cast x "
                        "and the weight to e4m3 (each with its scale) and multiply the FP8 "
                        "copies.")
        if _close(got, want * s_x * s_w, 1e-5):
            raise wrong(name, f"{where}: y is s_x · s_w = {s_x * s_w:.4g} times too large: you "
                        "forgot to unscale. (s_x·X)(s_w·W)ᵀ / (s_x·s_w) = X Wᵀ: divide the "
                        "product by both scales.")
        for one, other in ((s_x, "s_x"), (s_w, "s_w")):
            if _close(got, want * one, 1e-5):
                raise wrong(name, f"{where}: y is {other} = {one:.4g} times too large: divide "
                            "by both scales, s_x · s_w.")
        if _close(got, _float8_forward(x, weight, fp8.E5M2)[0]):
            raise wrong(name, f"{where}: y is what e5m2 copies give: use e4m3 for forward. "
                        "Activations and weights need e4m3's precision (3 mantissa bits); e5m2's "
                        "range is for the gradients of backward.")
        error = float((got - want).norm() / want.norm())
        raise wrong(name, f"{where}: y is off by {error:.2g} of its size from the e4m3 "
                    "reference: cast x and the weight to e4m3 with current scales, multiply, "
                    "divide by s_x · s_w.")
    passed(name, "3 cases equal minitp.fp8's e4m3 forward (quantize, float8_matmul) to 2e-6")


# -- exercise 3: offload with saved-tensor hooks ---------------------------------------------------
def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, TINY.vocab_size, (B, S + 1),
                           generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _plain_step(cfg=TINY) -> dict[str, torch.Tensor]:
    model = build_model(cfg)
    x, y = _batch()
    loss_fn(model(x), y).backward()
    return _grads(model)


def _saved_bytes(model) -> tuple[int, int]:
    """(each save's own bytes, each storage once) of what the model's step saves, parameters and
    buffers left out: what an offload moves copying every saved tensor, or every storage once."""
    held = offload.held_storages(model)
    each, storages = [0], {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in held:
            each[0] += t.numel() * t.element_size()
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t  # kept alive by autograd: no address is reused in this forward

    x, y = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(x), y)
    return each[0], sum(storages.values())


class _WatchedStore(offload.HostStore):
    """The learner's store: a HostStore that notes the keys put and taken, in order."""

    def __init__(self):
        super().__init__()
        self.puts: list[int] = []
        self.takes: list[int] = []

    def put(self, flat, label=""):
        key = super().put(flat, label)
        self.puts.append(key)
        return key

    def take(self, key, device, label=""):
        self.takes.append(key)
        return super().take(key, device, label)


@dataclasses.dataclass
class _Saved:
    value: torch.Tensor  # a copy of what was saved, to compare with what unpack returns
    storage: int  # its storage's address when saved
    held: bool  # a parameter's or buffer's


class _Watch:
    """Hooks around the learner's: each save numbered, its copy kept, the keys its pack put and the
    keys each unpack took noted; mistakes noted, not raised (raised inside backward they would come
    out as autograd's)."""

    def __init__(self, pack, unpack, store: _WatchedStore, model):
        self.learner_pack, self.learner_unpack, self.store = pack, unpack, store
        self.held = offload.held_storages(model)
        self.saved: list[_Saved] = []
        self.owner: dict[int, int] = {}  # key -> the save whose pack put it
        self.moved_params = 0  # bytes of parameters and buffers sent
        self.wrong_key: tuple[int, int] | None = None  # (save unpacked, save whose key it took)
        self.wrong_value: int | None = None  # a save whose unpack returned something else

    def pack(self, t):
        i, first = len(self.saved), len(self.store.puts)
        ticket = self.learner_pack(t)
        ptr = t.untyped_storage().data_ptr()
        self.saved.append(_Saved(t.detach().clone(), ptr, ptr in self.held))
        for key in self.store.puts[first:]:
            self.owner[key] = i
            if ptr in self.held:
                self.moved_params += self.store.host[key].nbytes if key in self.store.host else 0
        return i, ticket

    def unpack(self, packed):
        i, ticket = packed
        first = len(self.store.takes)
        try:
            out = self.learner_unpack(ticket)
        finally:
            for key in self.store.takes[first:]:
                j = self.owner.get(key, i)
                if self.saved[j].storage != self.saved[i].storage and self.wrong_key is None:
                    self.wrong_key = (i, j)
        want = self.saved[i].value
        if not (isinstance(out, torch.Tensor) and out.shape == want.shape
                and out.dtype == want.dtype and torch.equal(out, want)):
            if self.wrong_value is None:
                self.wrong_value = i
        return out


def _describe(t: torch.Tensor) -> str:
    return f"a {tuple(t.shape)} {str(t.dtype)[6:]} tensor"


def _offloaded_step(fn, store: _WatchedStore, model) -> tuple[_Watch, BaseException | None]:
    """The model's step under the learner's hooks; the learner's exception, if one came."""
    pack, unpack = call_answer("offload hooks", fn, store, model)
    watch = _Watch(pack, unpack, store, model)
    x, y = _batch()
    try:
        with torch.autograd.graph.saved_tensors_hooks(watch.pack, watch.unpack):
            loss = loss_fn(model(x), y)
        loss.backward()
    except Exception as error:  # the learner's, told after the named mistakes
        return watch, error
    return watch, None


def _raise(error: BaseException):
    raise error


def check_offload_hooks(fn) -> None:
    """``fn(store, model)`` -> (pack, unpack): every saved activation out to ``store`` in forward,
    back in backward; the parameters and buffers stay (a saved view of one, as a linear's
    ``weight.t()``, counts as one: compare storages).

    The whole tiny model's step (B = 2, S = 16) runs under them. Bytes out must be either each
    save's own bytes (954,116: the simple answer, one copy per save, though autograd saves some
    tensors twice or as views of one another) or each storage once (699,028, the blocks'
    4 · 164,352 and the embedding's, the final norm's, the head's and the loss's: what
    ``minitp.offload.Offloaded`` sends, ``SavedTensors``' count)."""
    name = "offload hooks"
    refuse_own(name, fn, offload.Offloaded, offload.offloaded, offload.offload_blocks)
    model, store = build_model(TINY), _WatchedStore()
    per_save, per_storage = _saved_bytes(build_model(TINY))
    watch, error = _offloaded_step(fn, store, model)
    if watch.moved_params:
        raise wrong(name, f"pack sent the model's parameters to the host ({watch.moved_params:,} "
                    "bytes): they stay on the device anyway, so the link carries them for "
                    "nothing. Return a parameter or buffer as it is; it is often saved as a view "
                    "(a linear's weight.t()), so compare storages: t.untyped_storage().data_ptr() "
                    "against the parameters'.")
    if error is None and store.bytes_out == 0:
        raise wrong(name, "nothing went to the store: you moved nothing. pack must send each "
                    "saved tensor that is not a parameter (store.put of its bytes, "
                    "t.detach().contiguous().view(-1).view(torch.uint8)) and return the key.")
    if watch.wrong_key is not None:
        i, j = watch.wrong_key
        raise wrong(name, f"unpack of {_describe(watch.saved[i].value)} took the key of "
                    f"{_describe(watch.saved[j].value)}, another saved tensor: a stack? Backward "
                    "does not ask for the saved tensors in the reverse order of forward (an "
                    "operation's backward reads its own in its own order): put each key in the "
                    "ticket pack returns, and take that one.")
    if error is not None:
        call_answer(name, _raise, error)
    if watch.wrong_value is not None:
        want = watch.saved[watch.wrong_value].value
        raise wrong(name, f"unpack returned something else than the {_describe(want)} pack was "
                    "given: rebuild it from its bytes with its dtype and shape (.view(dtype)"
                    ".view(shape)).")
    plain, got = _plain_step(), _grads(model)
    diffs = {n: (got[n] - plain[n]).abs().max().item() if n in got else math.inf for n in plain}
    worst = max(diffs, key=diffs.get)
    if diffs[worst] > 1e-6:
        raise wrong(name, f"the gradient of {worst} differs from the plain step's by "
                    f"{diffs[worst]:.2g}: backward must get back exactly what forward saved.")
    left = sorted(store.host)
    if left:
        raise wrong(name, f"{len(left)} tensors went out and never came back (keys {left[:5]}): "
                    "unpack takes each one back from the store.")
    if store.bytes_out not in (per_save, per_storage):
        side = "more" if store.bytes_out > per_save else "less"
        raise wrong(name, f"{store.bytes_out:,} bytes went out, {side} than the saved tensors': "
                    "send each saved tensor's bytes, once each time autograd saves it.",
                    f"{per_save:,} bytes (each save's own; {per_storage:,} if each storage is "
                    "sent once)")
    found = offload.offload_problems(store, model)
    if found:
        raise wrong(name, "; ".join(found))
    how = "each save's own copy" if store.bytes_out == per_save else "each storage once"
    passed(name, f"gradients equal the plain step's; {store.bytes_out:,} bytes out and "
                 f"{store.bytes_in:,} back ({how}), no parameter moved")


# -- exercise 4: the policy of selective checkpointing ---------------------------------------------
def _selective_step(cfg, policy) -> tuple[dict, dict, list[int]]:
    """(gradients, the saved-op counts of backward, the bytes each block kept) of one step of the
    tiny model whose blocks run under ``policy`` (None: plain)."""
    model = build_model(cfg)
    x, y = _batch()
    run = offload.SelectiveCheckpoint(model, policy=policy) if policy is not None else None
    loss = loss_fn(model(x, recompute=run), y)
    with offload.counting_ops() as ops:
        loss.backward()
    counts = {str(op): n for op, n in ops.counts.items() if op in offload.SAVED_OPS}
    return _grads(model), counts, run.kept_bytes if run is not None else []


def check_selective_policy(fn) -> None:
    """``fn(ctx, op, *args, **kwargs)`` -> a CheckpointPolicy: keep the matmuls' and attention's
    outputs, recompute the rest."""
    name = "selective policy"
    refuse_own(name, fn, offload.keep_matmuls)
    fused = TINY.with_(fused_attention=True)
    for cfg, where in ((TINY, "attention written out"), (fused, "fused attention")):
        plain, plain_ops, _ = _selective_step(cfg, None)
        got, ops, kept = call_answer(name, _selective_step, cfg, fn)
        diffs = {n: (got[n] - plain[n]).abs().max().item() if n in got else math.inf
                 for n in plain}
        worst = max(diffs, key=diffs.get)
        if diffs[worst] > 1e-6:
            raise wrong(name, f"{where}: the gradient of {worst} differs from the plain step's "
                        f"by {diffs[worst]:.2g}: return a CheckpointPolicy for every op.")
        again = {op: n - plain_ops.get(op, 0) for op, n in ops.items() if n > plain_ops.get(op, 0)}
        # the linears' and attention's both: the blocks' forward again (as far as backward needs:
        # the recomputation stops once it has made every tensor the block's backward reads)
        if "aten.mm.default" in again and len(again) > 1:
            raise wrong(name, f"{where}: backward ran {sum(again.values())} matmuls more than a "
                        "plain backward: the blocks' forward again, as far as their backward "
                        "reads it. You recompute everything; MUST_SAVE the outputs of the "
                        "matmuls (aten.mm) and of attention's ops, PREFER_RECOMPUTE the cheap "
                        "rest.")
        if again:
            ops_named = ", ".join(f"{op} ×{n}" for op, n in sorted(again.items()))
            what = ("attention's ops" if "aten.mm.default" not in again
                    else "the linears' matmuls")
            raise wrong(name, f"{where}: backward ran {ops_named} again: {what} were recomputed. "
                        "Save every matmul's output (aten.mm, aten.bmm: q·kᵀ and the weighted "
                        "sum) and the fused attention kernel's "
                        "(aten._scaled_dot_product_flash_attention_for_cpu on a CPU).")
        want = cost.tiny_selective_block_bytes(cfg, B, S)
        none = cost.tiny_block_activation_bytes(cfg, B, S)
        if kept != [want] * cfg.n_layers:
            block = max(kept) if kept else 0
            if block > want:
                raise wrong(name, f"{where}: each block keeps up to {block:,} bytes, more than "
                            f"its input and matmul outputs ({want:,}; no checkpointing keeps "
                            f"{none:,}): you save everything, even outputs that are cheap to "
                            "compute again (norms, SiLU, softmax, products): PREFER_RECOMPUTE "
                            "them.", f"{want:,} bytes per block")
            raise wrong(name, f"{where}: each block keeps {kept} bytes: save the outputs of the "
                        "matmuls and attention's ops, nothing else.", f"{want:,} bytes per block")
    passed(name, "written-out and fused attention: gradients equal the plain step's, no matmul "
                 "run again in backward, each block keeps its input and its matmuls' outputs")


# -- exercise 5: the host link against compute -----------------------------------------------------
def _link_exposed(nbytes: float, bytes_per_s: float, forward_s: float) -> float:
    """cost.offload.host_link_time's exposed seconds, on a device whose link runs at
    ``bytes_per_s``, for a step whose forward takes ``forward_s`` (backward twice that)."""
    device = dataclasses.replace(cost.H100, host_link=cost.Link("a link", 0.0, bytes_per_s))
    return cost.host_link_time(nbytes, device, 3 * forward_s)["exposed_s"]


def check_offload_exposed(fn) -> None:
    """``fn(bytes_per_direction, bytes_per_s, forward_s, backward_s)`` -> exposed seconds."""
    name = "offload exposed"
    refuse_own(name, fn, cost.host_link_time)
    cases = [("hidden", 40e9, 64e9, 1.0), ("longer than forward only", 100e9, 64e9, 1.0),
             ("longer than both", 138.5e9, 64e9, 0.25), ("exactly forward", 64e9, 64e9, 1.0),
             ("hidden, at another rate", 10e9, 32e9, 0.5)]
    for where, nbytes, rate, forward_s in cases:
        backward_s = 2 * forward_s
        want = _link_exposed(nbytes, rate, forward_s)
        got = call_answer(name, fn, nbytes, rate, forward_s, backward_s)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise ExerciseError(f"{name}: return the exposed seconds, one number; got "
                                f"{got!r:.200}") from None
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
            continue
        link_s = nbytes / rate
        case = (f"{where}: {nbytes / 1e9:g} GB each way at {rate / 1e9:g} GB/s "
                f"({link_s:.4g} s), forward {forward_s:g} s, backward {backward_s:g} s")
        if math.isclose(got, max(0.0, 2 * link_s - forward_s - backward_s), abs_tol=1e-12):
            raise wrong(name, f"{case}: {got:.4g} s sets both directions against the whole "
                        "step's compute. Each direction hides only behind its own phase: out "
                        "during forward, in during backward; what each exceeds of its phase is "
                        "exposed.", f"{want:.4g} s")
        for phase_s, phase in ((forward_s, "forward"), (backward_s, "backward")):
            if math.isclose(got, max(0.0, link_s - phase_s), abs_tol=1e-12):
                other = "in, during backward" if phase == "forward" else "out, during forward"
                raise wrong(name, f"{case}: {got:.4g} s counts one direction only, against "
                            f"{phase}: the bytes also cross {other}, at the same rate (PCIe is "
                            "full duplex, each way its own).", f"{want:.4g} s")
        raise wrong(name, f"{case}: {got:.4g} s. Each way takes bytes / rate; out exceeds "
                    "forward by max(0, out - forward), in exceeds backward by max(0, in - "
                    "backward); their sum is exposed.", f"{want:.4g} s")
    passed(name, "5 cases, equal to minitp.cost.offload.host_link_time's exposed seconds")


# -- worked problems -------------------------------------------------------------------------------
def _fp8_gather_gib() -> float:
    """LLaMA-3-70B under FSDP over 64 GPUs, its weights all-gathered in forward and in backward as
    e4m3 with current scaling (the parameters as one tensor: one amax all-reduce each time): GiB
    each GPU sends per step in those all-gathers."""
    return 2 * cost.float8_all_gather_bytes(LLAMA3_70B.num_params(), 64) / GIB


OFFLOAD_LAYOUT = dict(dp=8, pp=1, tp=8, batch_size=64, seq_len=8192)


def _offload_link_s() -> float:
    """LLaMA-3-8B at dp = 8, pp = 1, tp = 8, 64 sequences of 8192 (8 a replica), every block's
    saved activations offloaded: seconds the PCIe link of an H100 takes each way per step."""
    from minitp import plan

    row = plan.plan_layout(LLAMA3_8B, **OFFLOAD_LAYOUT, recompute="offload")
    return row["host"]["out"] / cost.H100.host_link.bytes_per_s


def _selective_stage(recompute: str) -> float:
    from minitp import plan

    row = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True,
                           recompute=recompute)
    return row["memory"]["activations"] / GIB


def _selective_op_gib() -> float:
    """LLaMA-3-70B at dp = 2, pp = 4, tp = 8 with sequence parallel, 64 sequences of 8192, 1F1B:
    GiB of activations on its fullest stage (the first) under op-level selective checkpointing."""
    return _selective_stage("selective-op")


PROBLEMS = {
    1: Problem("problem 1, GiB of FP8 all-gathers per step", _fp8_gather_gib, "GiB",
               {2.0: "that is bf16's 2 bytes per element: in FP8 each weight crosses as 1 byte",
                4.0: "that is fp32's 4 bytes per element: in FP8 each weight crosses as 1 byte",
                0.5: "one all-gather: FSDP gathers the weights twice per step, in forward and "
                     "again in backward"}),
    2: Problem("problem 2, seconds of PCIe each way", _offload_link_s, "s",
               {2.0: "both directions added: PCIe is full duplex, out and in each run at 64 GB/s "
                     "at once",
                0.5: "128 GB/s is both directions together: each way runs at 64 GB/s",
                8.0: "that is all 64 sequences: each of the dp = 8 replicas holds 8"}),
    3: Problem("problem 3, GiB of activations under selective-op", _selective_op_gib, "GiB",
               {_selective_stage("none") / _selective_stage("selective-op"):
                    "that is what recompute none keeps: selective-op keeps only each block's "
                    "input and its matmuls' outputs",
                0.25: "one micro-batch: the first stage of 1F1B holds pp = 4 in flight"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 12: ``answer()`` returns the estimate, in the unit asked."""
    problems.check_problem(PROBLEMS, number, answer)
