"""Chapter 12's checkers: the right answers pass, each planted mistake is caught and named, the stub
is "not done yet", minitp's own answer is refused, and the worked problems' numbers."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from minitp import cost, fp8, offload
from minitp.exercises import ExerciseError, ch12, reset_tries


@pytest.fixture(autouse=True)
def _fresh_tries():
    reset_tries()


def stub(*args):
    raise NotImplementedError


# -- exercise 1: the cast --------------------------------------------------------------------------
def quantize(x, dtype):
    limit = torch.finfo(dtype).max
    peak = x.abs().max().float()
    scale = limit / peak if 0 < peak < float("inf") else torch.tensor(1.0)
    return (x.float() * scale).clamp(-limit, limit).to(dtype), scale


def quantize_with_a_python_scale(x, dtype):
    """The scale as a Python float, computed in float64: the same bytes."""
    limit = torch.finfo(dtype).max
    peak = x.abs().max().item()
    scale = limit / peak if 0 < peak < float("inf") else 1.0
    return (x * scale).clamp(-limit, limit).to(dtype), scale


def no_scaling(x, dtype):
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype), 1.0


def inverted_scale(x, dtype):
    limit = torch.finfo(dtype).max
    peak = x.abs().max().float()
    scale = peak / limit if 0 < peak < float("inf") else torch.tensor(1.0)
    return (x * scale).clamp(-limit, limit).to(dtype), scale


def no_clamp(x, dtype):
    limit = torch.finfo(dtype).max
    peak = x.abs().max().float()
    scale = limit / peak if 0 < peak < float("inf") else torch.tensor(1.0)
    return (x * scale).to(dtype), scale


def fp32_values(x, dtype):
    x_fp8, scale = quantize(x, dtype)
    return x_fp8.float(), scale


def always_e4m3(x, dtype):
    return quantize(x, torch.float8_e4m3fn)


def zeros_not_handled(x, dtype):
    limit = torch.finfo(dtype).max
    scale = limit / x.abs().max()
    return (x * scale).clamp(-limit, limit).to(dtype), scale


def test_the_cast_passes():
    ch12.check_quantize(quantize)
    ch12.check_quantize(quantize_with_a_python_scale)


@pytest.mark.parametrize("answer, says", [
    (no_scaling, "no scaling.*flush to zero"),
    (inverted_scale, "the inverse, amax / max"),
    (no_clamp, "inf among.*e5m2: x_fp8 holds inf: no clamp"),
    (fp32_values, "you returned fp32 values"),
    (always_e4m3, "wrong dtype"),
    (zeros_not_handled, "all zeros.*amax is 0"),
    (stub, "not done yet"),
])
def test_a_wrong_cast_is_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch12.check_quantize(answer)


def test_minitps_own_cast_is_refused():
    with pytest.raises(ExerciseError, match="exercise is to write it"):
        ch12.check_quantize(lambda x, dtype: fp8.quantize(x, dtype))
    with pytest.raises(ExerciseError, match="exercise is to write it"):
        ch12.check_quantize(fp8.quantize)


# -- exercise 2: the forward matmul ----------------------------------------------------------------
def float8_linear(x, weight):
    x8, s_x = quantize(x, torch.float8_e4m3fn)
    w8, s_w = quantize(weight, torch.float8_e4m3fn)
    return (x8.float() @ w8.float().t()) / (s_x * s_w)


def dequantized_first(x, weight):
    """Each copy turned back into fp32 values, then multiplied: the same to rounding."""
    x8, s_x = quantize(x, torch.float8_e4m3fn)
    w8, s_w = quantize(weight, torch.float8_e4m3fn)
    return (x8.float() / s_x) @ (w8.float() / s_w).t()


def not_unscaled(x, weight):
    x8, _ = quantize(x, torch.float8_e4m3fn)
    w8, _ = quantize(weight, torch.float8_e4m3fn)
    return x8.float() @ w8.float().t()


def e5m2_forward(x, weight):
    x8, s_x = quantize(x, torch.float8_e5m2)
    w8, s_w = quantize(weight, torch.float8_e5m2)
    return (x8.float() @ w8.float().t()) / (s_x * s_w)


def test_the_float8_linear_passes():
    ch12.check_float8_linear(float8_linear)
    ch12.check_float8_linear(dequantized_first)


@pytest.mark.parametrize("answer, says", [
    (not_unscaled, "forgot to unscale"),
    (e5m2_forward, "use e4m3 for forward"),
    (lambda x, w: x @ w.t(), "you did not cast"),
    (lambda x, w: float8_linear(x, w).t(), "y has shape"),
    (stub, "not done yet"),
])
def test_a_wrong_float8_linear_is_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch12.check_float8_linear(answer)


def test_minitps_own_matmul_is_refused():
    def with_float8_matmul(x, weight):
        x8, s_x = quantize(x, torch.float8_e4m3fn)
        w8, s_w = quantize(weight, torch.float8_e4m3fn)
        return fp8.float8_matmul(x8, s_x, w8.t(), s_w)

    with pytest.raises(ExerciseError, match="exercise is to write it"):
        ch12.check_float8_linear(with_float8_matmul)


# -- exercise 3: offload with saved-tensor hooks ---------------------------------------------------
def offload_hooks(store, model):
    held = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}

    def pack(t):
        if t.untyped_storage().data_ptr() in held:
            return t  # a parameter or buffer (or a view of one): on the device anyway
        key = store.put(t.detach().contiguous().view(-1).view(torch.uint8))
        return key, t.dtype, t.shape, t.device

    def unpack(ticket):
        if isinstance(ticket, torch.Tensor):
            return ticket
        key, dtype, shape, device = ticket
        return store.take(key, device).view(dtype).view(shape)

    return pack, unpack


def minitps_storage_by_storage(store, model):
    """Each storage once (minitp.offload.Offloaded's way, written out): accepted too."""
    hooks = offload.Offloaded(store, keep=model)
    return hooks.pack, hooks.unpack


def moving_the_parameters(store, model):
    def pack(t):
        key = store.put(t.detach().contiguous().view(-1).view(torch.uint8))
        return key, t.dtype, t.shape

    def unpack(ticket):
        key, dtype, shape = ticket
        return store.take(key, torch.device("cpu")).view(dtype).view(shape)

    return pack, unpack


def parameters_by_identity(store, model):
    """Leaves out a parameter when it is one, not when it is a view of one (weight.t())."""
    params = list(model.parameters())
    pack, unpack = moving_the_parameters(store, model)
    return (lambda t: t if any(t is p for p in params) else pack(t)), \
        (lambda ticket: ticket if isinstance(ticket, torch.Tensor) else unpack(ticket))


def a_stack(store, model):
    held = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    keys = []

    def pack(t):
        if t.untyped_storage().data_ptr() in held:
            return t
        keys.append(store.put(t.detach().contiguous().view(-1).view(torch.uint8)))
        return t.dtype, t.shape

    def unpack(ticket):
        if isinstance(ticket, torch.Tensor):
            return ticket
        dtype, shape = ticket
        return store.take(keys.pop(), torch.device("cpu")).view(dtype).view(shape)

    return pack, unpack


def moving_nothing(store, model):
    return (lambda t: t), (lambda t: t)


def never_taking_back(store, model):
    """Copies out, but unpack hands back the tensor itself: the host's copies never come back."""
    held = offload.held_storages(model)

    def pack(t):
        if t.untyped_storage().data_ptr() not in held:
            store.put(t.detach().contiguous().view(-1).view(torch.uint8))
        return t

    return pack, lambda t: t


def test_the_offload_hooks_pass():
    ch12.check_offload_hooks(offload_hooks)


def test_each_storage_once_passes_too(capsys):
    # minitp's own, wrapped so as not to be refused: the byte count it meets is the storages'
    ch12.check_offload_hooks(lambda s, m: minitps_storage_by_storage(s, m))
    assert "each storage once" in capsys.readouterr().out


@pytest.mark.parametrize("answer, says", [
    (moving_the_parameters, "sent the model's parameters"),
    (parameters_by_identity, "often saved as a view"),
    (a_stack, "a stack"),
    (moving_nothing, "you moved nothing"),
    (never_taking_back, "never came back"),
    (stub, "not done yet"),
])
def test_wrong_offload_hooks_are_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch12.check_offload_hooks(answer)


def test_minitps_own_hooks_are_refused():
    with pytest.raises(ExerciseError, match="exercise is to write it"):
        ch12.check_offload_hooks(minitps_storage_by_storage)


# -- exercise 4: the policy of selective checkpointing ---------------------------------------------
aten = torch.ops.aten
SAVE = {aten.mm.default, aten.bmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default}


def policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def test_the_policy_passes():
    ch12.check_selective_policy(policy)


@pytest.mark.parametrize("answer, says", [
    (lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE, "You recompute everything"),
    (lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE, "you save everything"),
    (lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE if op == aten.mm.default
     else CheckpointPolicy.PREFER_RECOMPUTE, "aten.bmm.default ×8 again: attention's ops"),
    (stub, "not done yet"),
])
def test_a_wrong_policy_is_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch12.check_selective_policy(answer)


def test_a_policy_that_forgets_the_fused_kernel_is_caught():
    def matmuls_only(ctx, op, *args, **kwargs):
        saved = op in (aten.mm.default, aten.bmm.default)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    with pytest.raises(ExerciseError, match="fused attention: backward ran "
                                            "aten._scaled_dot_product_flash_attention_for_cpu"):
        ch12.check_selective_policy(matmuls_only)


def test_minitps_own_policy_is_refused():
    with pytest.raises(ExerciseError, match="exercise is to write it"):
        ch12.check_selective_policy(offload.keep_matmuls)


# -- exercise 5: the host link against compute -----------------------------------------------------
def exposed(nbytes, bytes_per_s, forward_s, backward_s):
    link_s = nbytes / bytes_per_s
    return max(0.0, link_s - forward_s) + max(0.0, link_s - backward_s)


def test_the_exposed_time_passes():
    ch12.check_offload_exposed(exposed)


@pytest.mark.parametrize("answer, says", [
    (lambda n, r, f, b: max(0.0, 2 * n / r - f - b), "both directions against the whole step"),
    (lambda n, r, f, b: max(0.0, n / r - f), "one direction only, against forward"),
    (lambda n, r, f, b: max(0.0, n / r - b), "one direction only, against backward"),
    (lambda n, r, f, b: 2 * n / r, "Each way takes bytes / rate"),
    (stub, "not done yet"),
])
def test_a_wrong_exposed_time_is_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch12.check_offload_exposed(answer)


# -- worked problems -------------------------------------------------------------------------------
def test_the_worked_problems_numbers():
    psi = 70_553_706_496  # LLaMA-3-70B's parameters
    assert ch12.PROBLEMS[1].want() == pytest.approx(2 * (63 / 64 * psi + 2 * 63 / 64 * 4) / 2**30)
    assert ch12.PROBLEMS[1].want() == pytest.approx(129.36, abs=0.01)
    block = 4_328_783_872  # one block of 8B at tp = 8, 8 sequences of 8192, bf16 (test_offload)
    assert ch12.PROBLEMS[2].want() == pytest.approx(32 * block / 64e9) == pytest.approx(2.164, abs=1e-3)
    assert ch12.PROBLEMS[3].want() == pytest.approx(35.3125)
    n, d, f, t, kvd = 8192, 8192, 28672, 8, 1024  # 70B's selective-op block, by hand (test_offload)
    selective = 2 * (4 * n * d // t + 2 * n * kvd // t + n * d // t + 2 * n * f // t + 2 * n * d)
    assert ch12.PROBLEMS[3].want() * 2**30 == 20 * 4 * selective  # 20 blocks, 4 micro-batches


def test_a_slip_in_a_worked_problem_is_named():
    with pytest.raises(ExerciseError, match="bf16"):
        ch12.check_problem(1, lambda: 2 * ch12.PROBLEMS[1].want())
    with pytest.raises(ExerciseError, match="full duplex"):
        ch12.check_problem(2, lambda: 2 * ch12.PROBLEMS[2].want())
    with pytest.raises(ExerciseError, match="recompute none"):
        ch12.check_problem(3, lambda: 45.31)
    ch12.check_problem(1, lambda: 130.0)
    ch12.check_problem(2, lambda: 138.5e9 / 64e9)
    ch12.check_problem(3, lambda: 35.3)


def test_the_checkers_measure_against_minitps_formulas():
    """What the checkers compare with is minitp's own: the selective block's bytes and the link's
    exposed time."""
    assert cost.tiny_selective_block_bytes(ch12.TINY, ch12.B, ch12.S) == 4 * 24_576
    assert ch12._link_exposed(100e9, 64e9, 1.0) == pytest.approx(100 / 64 - 1.0)


def test_the_offload_checker_counts_what_autograd_saves():
    """Each storage once is SavedTensors' count (test_offload's oracle for a whole model): the
    blocks' and the rest; each save's own bytes are more, some tensors being saved twice."""
    from minitp.measure.activations import SavedTensors
    from minitp.models import build_model, loss_fn

    per_save, per_storage = ch12._saved_bytes(build_model(ch12.TINY))
    model = build_model(ch12.TINY)
    x, y = ch12._batch()
    with SavedTensors(model) as counter:
        loss_fn(model(x), y)
    assert per_storage == counter.bytes == 699_028
    assert per_storage > ch12.TINY.n_layers * cost.tiny_block_activation_bytes(ch12.TINY, 2, 16)
    assert per_save == 954_116
