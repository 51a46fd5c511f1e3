"""The chapter 10 checkers: full recomputation, a bf16 mixed-precision step, MFU and the worked problems
accept the right answers and name the usual mistakes, the expected value only from the second try."""

import pytest
import torch
from hint_levels import first_then_second

from minitp import cost, plan
from minitp.exercises import ExerciseError, ch10
from minitp.models import LLAMA3_70B


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward, args, keep_graph):
        ctx.forward, ctx.args = forward, args
        ctx.save_for_backward(x)
        if keep_graph:  # the mistake: a recorded forward inside keeps every activation
            with torch.enable_grad():
                return forward(x, *args).detach()
        with torch.no_grad():
            return forward(x, *args)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.forward(x, *ctx.args)
        torch.autograd.backward(y, grad)
        return x.grad, None, None, None


def recompute(forward, x, *args):
    return _Recomputed.apply(x, forward, args, False)


def test_recompute_passes_and_keeps_the_input_alone(capsys):
    ch10.check_recompute(recompute)
    assert "each block keeps 8,192 bytes, its input alone" in capsys.readouterr().out
    assert cost.tiny_block_activation_bytes(ch10.TINY, 2, 16, recompute=True) == 2 * 16 * 64 * 4


def test_recompute_names_a_forward_that_keeps_everything_and_one_without_backward():
    def plain(forward, x, *args):  # autograd keeps everything: no recomputation
        return forward(x, *args)

    first_then_second(ch10.check_recompute, plain, expected="8,192 bytes per block")

    def no_backward(forward, x, *args):
        with torch.no_grad():
            return forward(x, *args)

    with pytest.raises(ExerciseError, match="parameters got no gradient"):
        ch10.check_recompute(no_backward)


def test_recompute_refuses_minitps_own():
    from minitp.measure.activations import run_recomputed

    with pytest.raises(ExerciseError, match="the exercise is to write it"):
        ch10.check_recompute(run_recomputed)

    def calls_its_function(forward, x, *args):
        from minitp.measure import activations

        return activations._Recompute.apply(x, forward, args)

    with pytest.raises(ExerciseError, match="_Recompute"):
        ch10.check_recompute(calls_its_function)

    def imports_its_function(forward, x, *args):  # imported inside the answer: the same refusal
        from minitp.measure.activations import _Recompute

        return _Recompute.apply(x, forward, args)

    with pytest.raises(ExerciseError, match="your code calls minitp.measure.activations._Recompute"):
        ch10.check_recompute(imports_its_function)


def mixed_step(master, x, y, lr, update="master", compute="bf16"):
    dtype = torch.bfloat16 if compute == "bf16" else torch.float32
    w, b = (p.detach().to(dtype).requires_grad_() for p in (master.weight, master.bias))
    ((torch.nn.functional.linear(x.to(dtype), w, b).float() - y) ** 2).mean().backward()
    with torch.no_grad():
        if update == "master":
            master.weight -= lr * w.grad.float()
            master.bias -= lr * b.grad.float()
        else:  # the update applied to the bf16 copy, then copied back: it rounds away
            master.weight.copy_((w - lr * w.grad).float())
            master.bias.copy_((b - lr * b.grad).float())


def test_mixed_precision_step_passes_and_names_an_update_that_rounds_away(capsys):
    ch10.check_mixed_precision_step(mixed_step)
    assert "[ok] the mixed-precision step" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match="rounds away. Apply it to the fp32 master"):
        ch10.check_mixed_precision_step(lambda m, x, y, lr: mixed_step(m, x, y, lr, update="bf16"))
    with pytest.raises(ExerciseError, match="the forward and backward must run in bf16"):
        ch10.check_mixed_precision_step(lambda m, x, y, lr: mixed_step(m, x, y, lr, compute="fp32"))


def mfu(cfg, tokens, seq, step_s, gpus, peak_flops, attention=True, per_token=6):
    flops = tokens * (per_token * cfg.num_params() + (12 * cfg.n_layers * cfg.dim * seq if attention else 0))
    return flops / (step_s * gpus * peak_flops)


def test_mfu_equals_the_time_models_and_names_the_usual_slips(capsys):
    ch10.check_mfu(mfu)
    assert "[ok] MFU" in capsys.readouterr().out
    row = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    assert mfu(LLAMA3_70B, 64 * 8192, 8192, row["step_s"], 64, cost.H100.flops_per_s) == pytest.approx(row["mfu"])
    with pytest.raises(ExerciseError, match="6 FLOPs per parameter and token"):
        ch10.check_mfu(lambda *a: mfu(*a, per_token=2, attention=False) * 1.0)
    with pytest.raises(ExerciseError, match="attention's FLOPs"):
        ch10.check_mfu(lambda *a: mfu(*a, attention=False))
    with pytest.raises(ExerciseError, match="a fraction, not a percentage"):
        ch10.check_mfu(lambda *a: 100 * mfu(*a))


def test_the_chapter_10_problems_are_the_numbers_by_hand():
    row = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    assert ch10.PROBLEMS[1].want() == pytest.approx(15e12 / (32 * 64 * 8192 / row["step_s"]) / 86400)
    assert round(ch10.PROBLEMS[1].want()) == 89 and round(row["step_s"], 2) == 8.60
    m = int(ch10.PROBLEMS[2].want())
    ridge = 989e12 / 3.35e12
    assert cost.arithmetic_intensity(m, 8192, 3584) >= ridge > cost.arithmetic_intensity(m - 1, 8192, 3584)
    assert m == 335
    per_block = cost.llama_block_activation_bytes(LLAMA3_70B, 1, 8192, 8, True, repeat_kv=False)
    assert ch10.PROBLEMS[3].want() == pytest.approx(per_block * 20 * 4 / 2**30)
    assert row["memory"]["activations"] == pytest.approx(per_block * 20 * 4)  # the planner's, first stage
    with pytest.raises(ExerciseError, match="that is 64 GPUs"):
        ch10.check_problem(1, lambda: ch10.PROBLEMS[1].want() * 32)
    with pytest.raises(ExerciseError, match="one micro-batch"):
        ch10.check_problem(3, lambda: ch10.PROBLEMS[3].want() / 4)
