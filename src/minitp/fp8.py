"""FP8 training, simulated on the CPU: per-tensor scaling, current and delayed, a linear layer
whose three matmuls read 1-byte copies of their operands, and FSDP's all-gather of weights in
FP8.

**Two formats of one byte** (torch's ``float8_e4m3fn`` and ``float8_e5m2``, the OCP/NVIDIA ones):

======  ========  =======  ===============  ==================  =====================
format  mantissa  largest  smallest normal  smallest subnormal  rounding error (rel.)
======  ========  =======  ===============  ==================  =====================
e4m3fn  3 bits    448      2^-6             2^-9                ≤ 2^-4
e5m2    2 bits    57344    2^-14            2^-16               ≤ 2^-3
======  ========  =======  ===============  ==================  =====================

A value in the normal range is rounded to the nearest of 2^m steps per power of two: half a step
is 2^-(m+1) of it. Below the smallest normal the steps are fixed (2^-9 for e4m3): an error of
half that, whatever the value; below half the smallest subnormal a value becomes 0. e4m3 has
the precision, e5m2 the range (2^32 between its extremes, e4m3 2^18), which is why practice
(Micikevicius et al. 2022, Transformer Engine's "HYBRID" format) casts activations and weights
to e4m3 in forward and the gradient of the output to e5m2 in backward: gradients spread over more
powers of two.

**Per-tensor scaling.** One byte holds a value only between those extremes, and a tensor's values
rarely sit there: weights at init are ~0.02, gradients ~1e-5. So each tensor is multiplied by a
scale before the cast, ``s = max representable / amax`` (amax = max |x|; divided by 2^margin for
headroom), which puts its largest value at the format's largest, and divided by the same s after
the matmul: ``(s_a·A)(s_b·B) / (s_a·s_b) = A·B``. A value still past the largest (a stale scale,
below) is clamped to it: *saturated*. torch's own cast saturates in e4m3fn (it has no infinity) but
turns an e5m2 overflow into inf, so ``quantize`` clamps first, as Transformer Engine and torchao do.

**Current or delayed.** *Current* scaling (torchao's "dynamic") reads this tensor's amax and scales
by it: exact, but the amax is a pass over the tensor before the cast can start (a reduction on a
GPU, and an all-reduce when the tensor is sharded). *Delayed* scaling (Transformer Engine's
default) scales by the largest amax of the last N steps (``AmaxHistory``) and records this step's
amax while casting (on a GPU, inside the cast's own kernel), so the cast waits for no pass of its
own. It bets that the amax moves slowly: when it jumps, the values above the history's amax
saturate until the history catches up (``tests/test_fp8.py`` shows it); the first call, with no
history, scales by its own amax.

**The layer** (``Float8Linear``; Y = X Wᵀ + b, X of N rows): three matmuls, each reading FP8 copies:

    forward      Y  = (X₈ W₈ᵀ) / (s_x s_w)      X₈, W₈: e4m3
    backward     dX = (G₈ W₈) / (s_g s_w)       G₈ = dY in e5m2
                 dW = (G₈ᵀ X₈) / (s_g s_x)      the e4m3 copy of X, kept from forward: 1 byte each

The bias and its gradient stay in fp32 (a sum, not a matmul). Simulation: on a GPU with FP8 units
(H100 and later) each matmul reads the bytes and accumulates in fp32; here the bytes are turned back
into fp32 and multiplied in fp32 (``float8_matmul``), which computes the same products exactly (a
product of two FP8 values fits in fp32's mantissa) and sums them in fp32; only the order of that sum
differs. PyTorch's ``torch._scaled_mm`` (which runs on the CPU in torch 2.13, taking the inverse
scales) is the oracle the tests compare with. What this saves on a GPU (twice bf16's matmul rate,
half its bytes read, a 1-byte copy of X kept for backward) shows here only in bytes: a CPU has no
FP8 units, and the casts make the simulation slower than fp32.

**What stays in high precision** (``convert_to_float8``'s ``skip``): the output head (its logits go
through a softmax over the vocabulary, where a 2^-4 error on every logit moves the loss, and its
gradient is the loss's own signal, not yet averaged down), the embedding (a lookup, not a matmul),
the norms and attention's softmax: as torchao's and Transformer Engine's recipes do, only the
linears inside the blocks go FP8. The master weights and the optimizer stay fp32.

**FSDP's all-gather in FP8** (``all_gather_float8``). Under FSDP every weight is all-gathered before
its forward; the forward then casts it to e4m3 anyway. So cast the shard first and gather the bytes:
1 byte per element on the wire instead of bf16's 2 (fp32's 4), and what arrives is the e4m3 copy
the matmul reads, with one fp32 scale per weight. The scale must be the same on every rank (one
tensor, one scale): current scaling computes it from the whole weight's amax, one all-reduce (MAX)
of 4 bytes; delayed scaling has it from its history, with no message. This is torchao's float8
all-gather under ``fully_shard``, whose shards are each parameter's rows (torchao all-reduces
every weight's amax in one message after the optimizer step:
``precompute_float8_dynamic_scale_for_fsdp``).
Gloo does not carry float8 dtypes, so the bytes travel as uint8, the same bytes: the traced size is
the FP8 size. Bytes each rank sends for one weight of Ψ_w elements over n ranks
(``minitp.cost.float8_all_gather_bytes``): (n-1)/n · Ψ_w · 1, plus 2(n-1)/n · 4 for the amax.
``minitp.fsdp`` does not gather this way: its units lay a block's norms beside its linear weights
in one flat buffer, sent in one dtype, where FP8 would round the norms too.

Reading order: the formats, scaling and the casts (``quantize``, ``dequantize``); the history and
a tensor's ``Scaling``; the matmul; the autograd Function and ``Float8Linear``; the conversion of a
model; the all-gather.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from minitp import comm

E4M3 = torch.float8_e4m3fn  # forward: activations and weights (precision)
E5M2 = torch.float8_e5m2  # backward: the gradient of the output (range)
RECIPES = ("current", "delayed")
FORMATS = (E4M3, E5M2)


# -- formats and scales ----------------------------------------------------------------------------
def max_representable(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 ``dtype``: 448 (e4m3fn), 57344 (e5m2)."""
    _check_format(dtype)
    return torch.finfo(dtype).max


def relative_error_bound(dtype: torch.dtype) -> float:
    """Half a step of the mantissa, 2^-(m+1): the largest relative error of rounding a value in the
    normal range (2^-4 for e4m3's 3 bits, 2^-3 for e5m2's 2)."""
    mantissa_bits = {E4M3: 3, E5M2: 2}[_check_format(dtype)]
    return 2.0 ** -(mantissa_bits + 1)


def absolute_error_bound(dtype: torch.dtype) -> float:
    """Half the smallest subnormal: the largest absolute error of rounding a value below the
    smallest normal (2^-10 for e4m3, 2^-17 for e5m2), in the scaled units."""
    smallest_subnormal = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}[_check_format(dtype)]
    return smallest_subnormal / 2


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor: what a scale is computed from."""
    return x.detach().abs().max().float()


def scale_from_amax(peak: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """``max representable / amax / 2^margin`` (0-d fp32): the scale that puts the largest value at
    the format's largest (``margin`` powers of two below it, headroom for a growing amax). A tensor
    of zeros (or a non-finite amax) gets scale 1: nothing to scale."""
    peak = torch.as_tensor(peak, dtype=torch.float32)
    usable = torch.isfinite(peak) & (peak > 0)
    scale = max_representable(dtype) / torch.where(usable, peak, 1.0) / 2.0 ** margin
    return torch.where(usable, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, dtype: torch.dtype,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x · scale, clamped to the format's range and cast to ``dtype``, scale). ``scale`` None:
    current scaling, from x's own amax. The clamp is what saturates a value past the range: torch's
    cast alone turns e5m2's overflow into inf."""
    if scale is None:
        scale = scale_from_amax(amax(x), dtype)
    limit = max_representable(dtype)
    scaled = (x.float() * scale).clamp(-limit, limit)
    return scaled.to(dtype), scale


def dequantize(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values an FP8 tensor stands for: its bytes as numbers, divided by the scale."""
    return x_fp8.float() / scale


# -- the scale of one tensor, step after step ------------------------------------------------------
class AmaxHistory:
    """The amaxes of one tensor over its last ``length`` casts, newest first (Transformer Engine's
    ``amax_history``; torchao's delayed scaling keeps the same). Delayed scaling scales by their
    maximum: a scale known before the tensor is."""

    def __init__(self, length: int = 16):
        if length < 1:
            raise ValueError(f"an amax history needs length >= 1, got {length}")
        self.values = torch.zeros(length)  # (length,) fp32, newest at 0
        self.recorded = 0  # casts recorded so far

    def record(self, peak: torch.Tensor) -> None:
        self.values = torch.roll(self.values, 1)
        self.values[0] = peak
        self.recorded += 1

    def max(self) -> torch.Tensor:
        return self.values.max()

    def __len__(self) -> int:
        return min(self.recorded, len(self.values))


class Scaling:
    """How one tensor of a layer (its input, its weight, the gradient of its output) is cast to
    FP8, call after call: the ``recipe`` ("current" or "delayed"), the format, the margin and, for
    delayed scaling, the history. ``saturated``: how many values the last cast clamped."""

    def __init__(self, dtype: torch.dtype, recipe: str = "current", history: int = 16,
                 margin: int = 0):
        _check_format(dtype)
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {', '.join(RECIPES)}")
        self.dtype, self.recipe, self.margin = dtype, recipe, margin
        self.history = AmaxHistory(history) if recipe == "delayed" else None
        self.saturated = 0

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """The scale for casting x now. Current: x's amax. Delayed: the history's largest (x's own
        amax the first time, with no history yet)."""
        if self.history is None or len(self.history) == 0:
            return scale_from_amax(amax(x), self.dtype, self.margin)
        return scale_from_amax(self.history.max(), self.dtype, self.margin)

    def cast(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x in FP8, its scale); delayed scaling records x's amax for the casts to come."""
        scale = self.scale(x)
        peak = amax(x)
        # past the largest value (1.75·2^e in both formats) by less than half its step, 2^(e-m),
        # a value rounds to it anyway: only beyond that does the clamp change it
        limit = max_representable(self.dtype) * (1 + relative_error_bound(self.dtype) / 1.75)
        self.saturated = int((x.detach().abs().float() * scale > limit).sum())
        if self.history is not None:
            self.history.record(peak)
        return quantize(x, self.dtype, scale)


# -- the matmul ------------------------------------------------------------------------------------
def float8_matmul(a_fp8: torch.Tensor, a_scale: torch.Tensor, b_fp8: torch.Tensor,
                  b_scale: torch.Tensor) -> torch.Tensor:
    """A · B from FP8 copies: (a_fp8 @ b_fp8) / (a_scale · b_scale), computed in fp32 (an FP8 unit
    multiplies the bytes and accumulates in fp32, then applies the inverse scales once: the
    simulation does the same arithmetic). (M, K), (K, N) -> (M, N) fp32. ``torch._scaled_mm(a_fp8,
    b_fp8, 1/a_scale, 1/b_scale, out_dtype=torch.float32)`` computes the same on hardware that has
    it."""
    return (a_fp8.float() @ b_fp8.float()) / (a_scale * b_scale)


# -- the layer -------------------------------------------------------------------------------------
class _Float8Matmul(torch.autograd.Function):
    """Y = X Wᵀ + b with X, W in e4m3 forward; dX, dW from dY in e5m2 and the kept FP8 copies."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        x_rows = x.reshape(-1, x.shape[-1])  # (N, in): every leading dim is a row
        x_fp8, x_scale = layer.input_scaling.cast(x_rows)  # (N, in) e4m3
        w_fp8, w_scale = layer.weight_scaling.cast(weight)  # (out, in) e4m3
        y = float8_matmul(x_fp8, x_scale, w_fp8.t(), w_scale)  # (N, out) fp32
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x_fp8, x_scale, w_fp8, w_scale)  # 1 byte per element of X and W
        ctx.layer, ctx.x_shape, ctx.x_dtype = layer, x.shape, x.dtype
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x_fp8, x_scale, w_fp8, w_scale = ctx.saved_tensors
        g_rows = grad_y.reshape(-1, grad_y.shape[-1])  # (N, out)
        g_fp8, g_scale = ctx.layer.grad_scaling.cast(g_rows)  # (N, out) e5m2
        grad_x = float8_matmul(g_fp8, g_scale, w_fp8, w_scale)  # (N, out) @ (out, in)
        grad_w = float8_matmul(g_fp8.t(), g_scale, x_fp8, x_scale)  # (out, N) @ (N, in)
        grad_b = g_rows.float().sum(0) if ctx.has_bias else None  # (out,), in high precision
        return grad_x.reshape(ctx.x_shape).to(ctx.x_dtype), grad_w, grad_b, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose forward and backward matmuls read FP8 copies: input and weight in e4m3,
    the gradient of the output in ``grad_dtype`` (e5m2), each with its per-tensor scale.

    recipe: "current" (each cast scaled by its tensor's own amax) or "delayed" (by the largest of
        the last ``history`` amaxes of that tensor). margin: powers of two of headroom below the
        format's largest value.

    The parameters are an ordinary fp32 ``weight`` and ``bias``: the optimizer steps them as
    always, and each forward casts the weight anew.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: str = "current", history: int = 16, margin: int = 0,
                 grad_dtype: torch.dtype = E5M2, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.input_scaling = Scaling(E4M3, recipe, history, margin)
        self.weight_scaling = Scaling(E4M3, recipe, history, margin)
        self.grad_scaling = Scaling(grad_dtype, recipe, history, margin)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> Float8Linear:
        """A Float8Linear holding ``linear``'s own weight and bias (the same Parameters, not
        copies: an optimizer built before still steps them)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    device="meta", **options)
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Float8Matmul.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert_to_float8(model: nn.Module, recipe: str = "current",
                      skip: Iterable[str] = ("output",), **options) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a ``Float8Linear`` holding the same
    parameters, except those whose qualified name is in ``skip``: by default the output head of
    ``minitp.models``' Transformer (why: see the top of this file). ``options``: those of
    ``Float8Linear`` (history, margin, grad_dtype). Returns the model (torchao's
    ``convert_to_float8_training``)."""
    skip = set(skip)
    names = {name for name, _ in model.named_modules()}
    if skip - names:
        raise ValueError(f"skip names modules the model does not have: {sorted(skip - names)}")
    swaps = [(name, module) for name, module in model.named_modules()
             if type(module) is nn.Linear and name not in skip and name]  # "": model itself
    for name, linear in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent.add_module(child, Float8Linear.from_linear(linear, recipe=recipe, **options))
    return model


# -- FSDP's all-gather in FP8 ----------------------------------------------------------------------
def float8_scale_of_shards(shard: torch.Tensor, group=None, margin: int = 0,
                           label: str = "fp8/amax") -> torch.Tensor:
    """Current scaling of a sharded weight: the whole weight's amax, the largest of every rank's
    shard's (one all-reduce, MAX, of one fp32 number), as a scale every rank agrees on."""
    peak = amax(shard).reshape(1)  # (1,) fp32
    comm.all_reduce(peak, group, op=comm.ReduceOp.MAX, label=label)
    return scale_from_amax(peak[0], E4M3, margin)


def all_gather_float8(shard: torch.Tensor, group=None, scale: torch.Tensor | None = None,
                      label: str = "fp8/all_gather") -> tuple[torch.Tensor, torch.Tensor]:
    """Gather a weight sharded by rows as e4m3 bytes: (the whole weight in e4m3, its scale).

    shard: (rows/n, ...) this rank's rows of the weight, fp32 (FSDP2's shard on dim 0; every rank's
        of the same shape). scale: delayed scaling's scale, the same on every rank; None: current
        scaling, from the whole weight's amax (``float8_scale_of_shards``: one all-reduce first).

    Each rank casts its own rows with the common scale and sends their bytes: the result is, byte
    for byte, ``quantize(whole weight, E4M3, scale)`` computed on one process, ready for
    ``float8_matmul`` with no cast of its own. The bytes travel as uint8: gloo carries no float8.
    """
    if scale is None:
        scale = float8_scale_of_shards(shard, group, label=f"{label}.amax")
    n = comm.group_size(group)
    shard_fp8, _ = quantize(shard, E4M3, scale)  # (rows/n, ...) e4m3: 1 byte each
    sent = shard_fp8.contiguous().view(torch.uint8)
    # (rows, ...): every rank's rows, in rank order
    gathered = torch.empty((n * shard.shape[0], *shard.shape[1:]), dtype=torch.uint8,
                           device=shard.device)
    comm.all_gather(gathered, sent, group, label=label)
    return gathered.view(E4M3), scale


def _check_format(dtype: torch.dtype) -> torch.dtype:
    if dtype not in FORMATS:
        raise ValueError(f"unsupported FP8 format {dtype}; expected torch.float8_e4m3fn or "
                         "torch.float8_e5m2")
    return dtype
