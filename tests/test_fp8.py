"""minitp.fp8 (simulated FP8 training) against its oracles: torch's own float8 casts, the rounding
bounds of the two formats, ``torch._scaled_mm`` (which runs on the CPU in torch 2.13), the fp32
layer and model it stands in for, one process for the FP8 all-gather on 2 ranks, and
``minitp.cost.float8_all_gather_bytes`` for its traced bytes. Planted mistakes (a forgotten unscale,
e4m3 for the gradient, a wrong scale) must fail the same checks.

The tolerance of a matmul is derived from the formats, element by element: with Â = A + δA,
|δA| ≤ u_A·|A| + e_A (u: half a mantissa step, 2^-4 for e4m3, 2^-3 for e5m2; e: half the smallest
subnormal over the scale, where a value is too small for the normal range),

    |Â B̂ − A B| = |A (B̂ − B) + (Â − A) B̂|  ≤  |A| (u_B|B| + e_B) + (u_A|A| + e_A) |B̂|,

plus fp32's own rounding of the sum (``_matmul_bound``). That bound holds for every input, so it is
loose: the errors of a sum's terms mostly cancel. A mistake that only doubles them (a scale that
pushes the values down into the subnormal steps) hides under it, so the typical error is checked too: each operand's rounding is
at most u of it, about uniformly, an RMS of u/√3, so ‖Â B̂ − A B‖ / ‖A B‖ ≈ √((u_A² + u_B²)/3)
(``_typical_error_bound``; a statistical bound, not a proof: 0.036 measured for e4m3 × e4m3
against 0.051).
"""

import pytest
import torch
import torch.nn as nn

import minitp
from minitp import cost, fp8
from minitp.fp8 import E4M3, E5M2
from minitp.models import TINY, build_model, loss_fn
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches

ROWS, IN, OUT = 24, 32, 48  # a layer's batch of rows, in and out features


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _wide(n: int, seed: int, decades: float = 6.0) -> torch.Tensor:
    """n values of random sign spread over ``decades`` powers of ten (1e-3 .. 1e3 by default)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(n, generator=g) * decades - decades / 2)
    return magnitude * torch.randn(n, generator=g).sign()


# -- the casts ----------------------------------------------------------------------------------------
def test_quantize_at_scale_one_is_torchs_own_cast_and_saturates_where_e5m2_would_overflow():
    special = torch.tensor([0.0, -0.0, 1.0, 447.0, 448.0, 460.0, 500.0, 1e5, -1e5, 57344.0, 6e4,
                            7e4, -7e4, float("inf"), float("-inf"), 1e-3, 2.0 ** -10, 2.0 ** -17])
    x = torch.cat([special, _wide(4000, 0), torch.randn(1000)])
    one = torch.tensor(1.0)
    mine, _ = fp8.quantize(x, E4M3, one)
    # e4m3fn has no infinity: torch's cast saturates at ±448 itself, and quantize matches it bit
    # for bit everywhere
    assert torch.equal(_bytes(mine), _bytes(x.to(E4M3)))
    assert mine[:len(special)][special == 1e5].float().item() == 448.0
    nan = fp8.quantize(torch.tensor([float("nan")]), E4M3, one)[0]
    assert torch.isnan(nan.float()).all()
    # e5m2 has an infinity: torch's cast overflows into it; quantize clamps first, as TE and
    # torchao do, so a value past the range saturates at ±57344 instead of poisoning the matmul
    mine, _ = fp8.quantize(x, E5M2, one)
    theirs = x.to(E5M2)
    in_range = theirs.float().isfinite()
    assert torch.equal(_bytes(mine[in_range]), _bytes(theirs[in_range]))
    assert (~in_range).sum() >= 5  # 7e4, -7e4, ±1e5, ±inf
    assert torch.equal(mine[~in_range].float(), 57344.0 * x[~in_range].sign())


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_scaled_round_trip_is_within_half_a_mantissa_step(dtype):
    x = _wide(20000, 1, decades=5.0)
    x_fp8, scale = fp8.quantize(x, dtype)  # current scaling: x's amax at the format's largest
    back = fp8.dequantize(x_fp8, scale)
    u, e = fp8.relative_error_bound(dtype), fp8.absolute_error_bound(dtype)
    assert u == {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}[dtype]
    normal = (x * scale).abs() >= torch.finfo(dtype).tiny  # the smallest normal, scaled units
    error = (back - x).abs()
    relative = error[normal] / x[normal].abs()
    assert relative.max() <= u
    # and it binds: the worst value, halfway past a power of two 2^k, is off by u·2^k, u/(1+u) of
    # itself (1/17 for e4m3, 1/9 for e5m2); 20000 values come within 1% of it
    assert relative.max() >= 0.99 * u / (1 + u)
    assert (error[~normal] <= e / scale).all()  # below the normal range: a fixed step
    assert normal.float().mean() > 0.5


def test_the_scale_puts_the_amax_at_the_largest_value_less_the_margin():
    x = torch.randn(100) * 0.02
    for dtype in (E4M3, E5M2):
        top = fp8.max_representable(dtype)
        assert fp8.quantize(x, dtype)[0].float().abs().max() == top
        scale = fp8.scale_from_amax(fp8.amax(x), dtype, margin=1)
        assert fp8.quantize(x, dtype, scale)[0].float().abs().max() == top / 2
    assert fp8.scale_from_amax(fp8.amax(torch.zeros(4)), E4M3) == 1.0  # nothing to scale
    with pytest.raises(ValueError, match="unsupported FP8 format torch.bfloat16"):
        fp8.max_representable(torch.bfloat16)
    with pytest.raises(ValueError, match="unknown FP8 recipe 'dynamic'; expected one of current, "
                                         "delayed"):
        fp8.Scaling(E4M3, "dynamic")


# -- the matmul and the layer ---------------------------------------------------------------------------
def _matmul_bound(a, b, a_dtype, b_dtype):
    """The largest |Â B̂ − A B| the formats allow, element by element (the top of this file), for
    A (M, K) and B (K, N) each cast with current scaling; plus fp32's rounding of the sum."""
    u_a, u_b = fp8.relative_error_bound(a_dtype), fp8.relative_error_bound(b_dtype)
    e_a = fp8.absolute_error_bound(a_dtype) / fp8.scale_from_amax(fp8.amax(a), a_dtype)
    e_b = fp8.absolute_error_bound(b_dtype) / fp8.scale_from_amax(fp8.amax(b), b_dtype)
    a, b = a.abs(), b.abs()
    b_hat = b * (1 + u_b) + e_b
    bound = a @ (u_b * b + e_b) + (u_a * a + e_a) @ b_hat
    return bound + 1e-5 * (a @ b) + 1e-30


def _within_bound(got, a, b, a_dtype, b_dtype) -> bool:
    return bool(((got - a @ b).abs() <= _matmul_bound(a, b, a_dtype, b_dtype)).all())


def _typical_error_bound(a_dtype, b_dtype) -> float:
    u_a, u_b = fp8.relative_error_bound(a_dtype), fp8.relative_error_bound(b_dtype)
    return ((u_a ** 2 + u_b ** 2) / 3) ** 0.5


def _typical_error_ok(got, a, b, a_dtype, b_dtype) -> bool:
    exact = a @ b
    return bool((got - exact).norm() / exact.norm() <= _typical_error_bound(a_dtype, b_dtype))


def _checked(got, a, b, a_dtype, b_dtype) -> bool:
    """Within the worst-case bound and the typical error: what the right code meets."""
    return _within_bound(got, a, b, a_dtype, b_dtype) and _typical_error_ok(got, a, b, a_dtype,
                                                                           b_dtype)


def _layer_pair(bias=True, **options):
    torch.manual_seed(0)
    plain = nn.Linear(IN, OUT, bias=bias)
    ours = fp8.Float8Linear.from_linear(nn.Linear(IN, OUT, bias=bias), **options)
    ours.load_state_dict(plain.state_dict())
    return plain, ours


def _forward_backward(layer, x, grad_y):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(grad_y)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _inputs(rows_scale=None):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, ROWS // 2, IN, generator=g)  # (B, S, in): the rows are B·S
    grad_y = torch.randn(2, ROWS // 2, OUT, generator=g) * 1e-3  # a gradient's size
    if rows_scale is not None:
        grad_y = grad_y * rows_scale.reshape(2, ROWS // 2, 1)
    return x, grad_y


def test_float8_matmul_equals_torch_scaled_mm():
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no torch._scaled_mm: the casts are checked against torch's "
                    "dtype conversion only")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(ROWS, IN, generator=g), torch.randn(IN, OUT, generator=g) * 0.02
    for a_dtype in (E4M3, E5M2):  # e4m3 × e4m3 (forward), e5m2 × e4m3 (backward)
        a_fp8, a_scale = fp8.quantize(a, a_dtype)
        b_fp8, b_scale = fp8.quantize(b, E4M3)
        try:
            theirs = torch._scaled_mm(a_fp8, b_fp8, scale_a=1 / a_scale, scale_b=1 / b_scale,
                                      out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError) as error:  # a build without the CPU kernel
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {error}")
        mine = fp8.float8_matmul(a_fp8, a_scale, b_fp8, b_scale)
        assert (mine - theirs).abs().max() <= 1e-6 * (a @ b).abs().max()


def test_float8_linear_forward_and_backward_are_within_the_formats_bound_of_fp32():
    plain, ours = _layer_pair()
    x, grad_y = _inputs()
    y, x_grad, w_grad, b_grad = _forward_backward(ours, x, grad_y)
    y32, x_grad32, w_grad32, b_grad32 = _forward_backward(plain, x, grad_y)
    x_rows, g_rows, w = x.reshape(ROWS, IN), grad_y.reshape(ROWS, OUT), plain.weight.detach()
    bias = plain.bias.detach()
    # Y = X Wᵀ + b (X, W e4m3); dX = G W (G e5m2, W e4m3); dW = Gᵀ X (G e5m2, X e4m3)
    assert _checked(y.reshape(ROWS, OUT) - bias, x_rows, w.t(), E4M3, E4M3)
    assert _checked(x_grad.reshape(ROWS, IN), g_rows, w, E5M2, E4M3)
    assert _checked(w_grad, g_rows.t(), x_rows, E5M2, E4M3)
    assert torch.allclose(b_grad, b_grad32, rtol=1e-6, atol=0)  # the bias stays in fp32
    # in words: a few per cent of the output's size, as 2^-4 of each operand suggests
    assert (y - y32).abs().max() <= 0.1 * y32.abs().max()
    assert (x_grad - x_grad32).abs().max() <= 0.25 * x_grad32.abs().max()
    assert (w_grad - w_grad32).abs().max() <= 0.25 * w_grad32.abs().max()
    assert (y - y32).abs().max() > 0  # and it is FP8: not fp32 by accident


def test_convert_to_float8_swaps_every_linear_but_the_head_and_keeps_the_parameters():
    model = build_model(TINY, seed=0)
    before = dict(model.named_parameters())
    fp8.convert_to_float8(model, recipe="delayed", history=4)
    swapped = [name for name, m in model.named_modules() if isinstance(m, fp8.Float8Linear)]
    assert len(swapped) == 7 * TINY.n_layers  # wq wk wv wo, w1 w3 w2 of each block
    assert type(model.output) is nn.Linear  # the head stays in high precision
    assert all(model.get_submodule(n).recipe == "delayed" for n in swapped)
    assert {k: id(v) for k, v in model.named_parameters()} == {k: id(v) for k, v in before.items()}
    with pytest.raises(ValueError, match=r"skip names modules the model does not have: \['head'\]"):
        fp8.convert_to_float8(build_model(TINY), skip=("head",))
    everything = fp8.convert_to_float8(build_model(TINY), skip=())
    assert isinstance(everything.output, fp8.Float8Linear)


# -- current against delayed scaling ------------------------------------------------------------------
def test_delayed_scaling_saturates_when_the_amax_jumps_and_current_scaling_does_not():
    g = torch.Generator().manual_seed(4)
    # amax 3, step after step (a delayed scale saturates any growth, however small: the margin's
    # job)
    steady = [torch.randn(256, generator=g) for _ in range(4)]
    steady = [3 * x / fp8.amax(x) for x in steady]
    jump = torch.randn(256, generator=g) * 100  # then a step whose amax is about 100 times more
    for recipe in fp8.RECIPES:
        scaling = fp8.Scaling(E4M3, recipe, history=4)
        for x in steady:
            scaling.cast(x)
            assert scaling.saturated == 0
        x_fp8, scale = scaling.cast(jump)
        back = fp8.dequantize(x_fp8, scale)
        if recipe == "current":
            assert scaling.saturated == 0
            assert (back - jump).abs().max() <= fp8.relative_error_bound(E4M3) * jump.abs().max()
        else:  # scaled for the history's amax: everything above it is clamped there
            stale = max(fp8.amax(x) for x in steady)
            assert scaling.saturated > 200  # most of the values
            assert back.abs().max() == pytest.approx(stale.item(), rel=1e-6)
            assert (back - jump).abs().max() > 0.9 * (jump.abs().max() - stale)
            # the jump is in the history now: the next cast of the same tensor is exact again
            scaling.cast(jump)
            assert scaling.saturated == 0


def test_a_delayed_float8_linear_with_a_stale_history_fails_the_bound_a_current_one_meets():
    x, grad_y = _inputs()
    results = {}
    for recipe in fp8.RECIPES:
        plain, ours = _layer_pair(recipe=recipe, history=4)
        for _ in range(3):  # three steps at the input's usual size
            ours(x * 0.01)
        results[recipe] = _forward_backward(ours, x, grad_y)[0]  # then 100 times larger
    x_rows, w = x.reshape(ROWS, IN), plain.weight.detach()
    bias = plain.bias.detach()
    assert _within_bound(results["current"].reshape(ROWS, OUT) - bias, x_rows, w.t(), E4M3, E4M3)
    assert not _within_bound(results["delayed"].reshape(ROWS, OUT) - bias, x_rows, w.t(), E4M3,
                             E4M3)


# -- a model trains with FP8 linears ----------------------------------------------------------------------
def _train(recipe: str | None, steps: int = 60) -> list[float]:
    model = build_model(TINY, seed=0)
    if recipe is not None:
        fp8.convert_to_float8(model, recipe=recipe)
    optimizer = make_optimizer(model.parameters(), 3e-3)
    losses = []
    for tokens, targets in synthetic_batches(TINY, TrainConfig(steps=steps)):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_tiny_model_trains_with_float8_linears_within_0_05_of_fp32():
    def late(losses):
        return sum(losses[-10:]) / 10  # the mean of the last 10 steps: less noise than one step

    fp32 = _train(None)
    for recipe in fp8.RECIPES:
        losses = _train(recipe)
        assert losses[0] == pytest.approx(fp32[0], abs=0.02)  # the same model and batch at step 0
        assert late(losses) < losses[0] - 1.0, recipe  # it learns: 4.87 -> about 3.55 nats
        assert abs(late(losses) - late(fp32)) <= 0.05, (recipe, late(losses), late(fp32))
        assert losses != fp32  # and the linears did run in FP8


# -- FSDP's all-gather in FP8, on 2 ranks -------------------------------------------------------------------
def _weight() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(5)) * 0.02  # (out, in)


def _gather_worker():
    import torch.distributed as dist

    from minitp import comm, trace

    n, rank = dist.get_world_size(), dist.get_rank()
    shard = _weight().chunk(n)[rank]  # (out/n, in): this rank's rows, FSDP2's shard on dim 0
    delayed_scale = torch.tensor(1000.0)  # a scale every rank has from its history
    with trace.recording(rank) as tr:
        current, current_scale = fp8.all_gather_float8(shard, label="fp8/current")
        delayed, _ = fp8.all_gather_float8(shard, scale=delayed_scale, label="fp8/delayed")
        bf16 = torch.empty(OUT, IN, dtype=torch.bfloat16)
        comm.all_gather(bf16, shard.to(torch.bfloat16), label="bf16/all_gather")
    shard_fp8, _ = fp8.quantize(shard, E4M3, current_scale)
    return {"current": _bytes(current), "scale": current_scale, "delayed": _bytes(delayed),
            "dequantized_shard": fp8.dequantize(shard_fp8, current_scale),
            "sent": {k: tr.sent_bytes(k) for k in ("fp8/current", "fp8/delayed", "bf16/")},
            "dtypes": sorted({e.dtype for e in tr.comm() if e.op == "all_gather"})}


@pytest.fixture(scope="module")
def gathered():
    return minitp.launch(_gather_worker, 2, echo=False)


def test_the_float8_all_gather_on_2_ranks_is_the_one_process_cast_byte_for_byte(gathered):
    w = _weight()
    w_fp8, scale = fp8.quantize(w, E4M3)  # one process: the whole weight, its own amax
    for r in gathered:
        assert r["scale"] == scale  # the amax all-reduced over the shards is the whole weight's
        assert torch.equal(r["current"], _bytes(w_fp8))
        # what each rank sent is what arrived: the dequantized shards, side by side
        whole = fp8.dequantize(r["current"].view(E4M3), r["scale"])
        assert torch.equal(whole, torch.cat([s["dequantized_shard"] for s in gathered]))
        delayed, _ = fp8.quantize(w, E4M3, torch.tensor(1000.0))
        assert torch.equal(r["delayed"], _bytes(delayed))
        assert r["dtypes"] == ["bfloat16", "uint8"]  # gloo carries no float8: the same bytes
    # the gathered weight feeds the matmul as it is: a Float8Linear on one process computes the same
    x = torch.randn(ROWS, IN)
    layer = fp8.Float8Linear(IN, OUT, bias=False)
    layer.weight.data.copy_(w)
    x_fp8, x_scale = fp8.quantize(x, E4M3)
    from_gather = fp8.float8_matmul(x_fp8, x_scale, gathered[0]["current"].view(E4M3).t(),
                                    gathered[0]["scale"])
    assert torch.equal(from_gather, layer(x).detach())


def test_the_float8_all_gather_sends_what_the_formula_says_about_half_of_bf16(gathered):
    n, numel = 2, OUT * IN
    current = cost.float8_all_gather_bytes(numel, n)
    delayed = cost.float8_all_gather_bytes(numel, n, current_scaling=False)
    bf16 = cost.collective_sent_bytes("all_gather", numel * 2, n)
    assert current == (n - 1) / n * numel + 2 * (n - 1) / n * 4  # the bytes, and the amax's 4
    for r in gathered:
        assert r["sent"]["fp8/current"] == current  # the gather and its amax all-reduce
        assert r["sent"]["fp8/delayed"] == delayed  # no amax: the scale came from the history
        assert r["sent"]["bf16/"] == bf16
        assert r["sent"]["fp8/delayed"] == bf16 / 2
        assert r["sent"]["fp8/current"] / bf16 == pytest.approx(0.5, abs=0.01)


# -- planted mistakes: each fails the check the right code meets ----------------------------------------------
def test_a_forgotten_unscale_fails_the_bound():
    plain, _ = _layer_pair(bias=False)
    x, w = _inputs()[0].reshape(ROWS, IN), plain.weight.detach()
    x_fp8, x_scale = fp8.quantize(x, E4M3)
    w_fp8, w_scale = fp8.quantize(w, E4M3)
    right = fp8.float8_matmul(x_fp8, x_scale, w_fp8.t(), w_scale)
    forgot = x_fp8.float() @ w_fp8.float().t()  # the bytes multiplied, the scales never divided
    assert _checked(right, x, w.t(), E4M3, E4M3)
    assert not _within_bound(forgot, x, w.t(), E4M3, E4M3)
    assert (forgot / right).abs().median() == pytest.approx((x_scale * w_scale).item(), rel=1e-3)


def test_a_wrong_scale_fails_the_bound():
    plain, _ = _layer_pair(bias=False)
    x, w = _inputs()[0].reshape(ROWS, IN), plain.weight.detach()
    w_fp8, w_scale = fp8.quantize(w, E4M3)
    inverted = fp8.amax(x) / fp8.max_representable(E4M3)  # amax / max: the values shrink to ~0
    x_fp8, _ = fp8.quantize(x, E4M3, inverted)
    inverted_result = fp8.float8_matmul(x_fp8, inverted, w_fp8.t(), w_scale)
    # x's largest value cast to 448·(amax/448)² ≈ 0.02: its bits are subnormal steps of 2^-9, an
    # error of several per cent, twice what e4m3 allows: under the worst case, over the typical
    assert _within_bound(inverted_result, x, w.t(), E4M3, E4M3)
    assert not _typical_error_ok(inverted_result, x, w.t(), E4M3, E4M3)
    assert not _checked(inverted_result, x, w.t(), E4M3, E4M3)
    x_fp8, x_scale = fp8.quantize(x, E4M3)  # the right scale, then multiplied back, not divided
    times = (x_fp8.float() * x_scale) @ (w_fp8.float() * w_scale).t()
    assert not _checked(times, x, w.t(), E4M3, E4M3)
    assert _checked(fp8.float8_matmul(x_fp8, x_scale, w_fp8.t(), w_scale), x, w.t(), E4M3, E4M3)


def test_e4m3_for_the_gradient_flushes_what_e5m2_keeps():
    # the gradient's rows span 2^0 .. 2^-24 of its largest (tokens whose loss barely moves): one
    # scale for the tensor, and e4m3's 2^18 of range cannot hold them all
    rows = 2.0 ** -torch.linspace(0, 24, ROWS)
    x, grad_y = _inputs(rows)
    g_rows, w = grad_y.reshape(ROWS, OUT), _layer_pair()[0].weight.detach()
    grads = {}
    for dtype in (E5M2, E4M3):
        _, ours = _layer_pair(grad_dtype=dtype)
        grads[dtype] = _forward_backward(ours, x, grad_y)[1].reshape(ROWS, IN)
    assert _checked(grads[E5M2], g_rows, w, E5M2, E4M3)
    assert not _within_bound(grads[E4M3], g_rows, w, E5M2, E4M3)
    flushed = (grads[E4M3] == 0).all(dim=1)  # rows whose every input gradient became 0
    assert flushed[-4:].all() and not (grads[E5M2] == 0).all(dim=1).any()


def test_e5m2_holds_an_unscaled_gradient_that_overflows_e4m3():
    # without a scale the formats' own ranges decide: a gradient of 1000 (a summed loss) is past
    # e4m3's 448 and saturates; e5m2 (up to 57344) holds it within 2^-3, and its small values too
    grad = torch.tensor([1000.0, -3000.0, 2.0, 1e-3, -2e-4])
    one = torch.tensor(1.0)
    e4m3 = fp8.dequantize(fp8.quantize(grad, E4M3, one)[0], one)
    e5m2 = fp8.dequantize(fp8.quantize(grad, E5M2, one)[0], one)
    assert e4m3[:2].tolist() == [448.0, -448.0]  # overflow: clamped, 55% and 85% off
    assert e4m3[4] == 0  # 2e-4 is under e4m3's smallest subnormal, 2^-9: flushed
    assert ((e5m2 - grad).abs() <= fp8.relative_error_bound(E5M2) * grad.abs()).all()
