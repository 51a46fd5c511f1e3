"""Checkers for chapter 10, planning a run.

* ``check_choose_layout(fn)``: chapter 06's checker (``ch06.check_choose_layout``), the layout whose
  states fit.
* ``check_recompute(fn)``: ``fn(forward, x, *args)`` runs one block under full activation
  recomputation (what ``TransformerBlock`` takes as ``recompute=``): the tiny model's loss and every
  gradient must equal the plain model's, and each block must keep exactly its input,
  ``cost.tiny_block_activation_bytes(..., recompute=True)``, measured with saved-tensor hooks.
* ``check_mixed_precision_step(fn)``: ``fn(master, x, y, lr)`` does one SGD step of bf16 mixed
  precision on a linear layer: copy the fp32 master weight to bf16, forward and backward in bf16,
  the gradient back to fp32, the update on the fp32 master. Compared with the reference over 20
  steps whose updates are smaller than half a bf16 step of the weights (they vanish if the bf16 copy
  is updated).
* ``check_mfu(fn)``: ``fn(cfg, tokens, seq, step_s, gpus, peak_flops)`` is the model FLOPs
  utilisation of a step, compared with ``minitp.cost.step_time``'s.
* ``check_problem(n, answer)``: the chapter's worked problems.
"""

from __future__ import annotations

import math

import torch

from minitp import cost
from minitp.exercises import ExerciseError, call_answer, passed, problems, refuse_own, wrong
from minitp.exercises.ch06 import check_choose_layout  # noqa: F401  (chapter 10's Exercise 1)
from minitp.exercises.problems import Problem
from minitp.models import LLAMA3_8B, LLAMA3_70B, TINY, build_model

GIB = 2**30


# -- exercise 2: full activation recomputation -----------------------------------------------------
def _loss_and_grads(model, tokens, recompute) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(tokens, recompute=recompute)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}


def check_recompute(fn) -> None:
    """``fn(forward, x, *args)``: the block's output, keeping only ``x`` for backward."""
    from minitp.measure import activations

    name = "full recomputation"
    refuse_own(name, fn, activations.run_recomputed, activations._Recompute)
    torch.manual_seed(0)
    model = build_model(TINY, seed=0)
    batch, seq = 2, 16
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq),
                           generator=torch.Generator().manual_seed(0))
    want_loss, want = _loss_and_grads(model, tokens, None)
    kept = call_answer(name, activations.saved_bytes_per_block, model,
                       lambda: model(tokens, recompute=fn))
    got_loss, got = call_answer(name, _loss_and_grads, model, tokens, fn)
    input_only = cost.tiny_block_activation_bytes(TINY, batch, seq, recompute=True)
    if abs(got_loss - want_loss) > 1e-5:
        raise wrong(
            name, f"the loss is {got_loss:.6f}: the block's output must be what its forward gives",
            f"{want_loss:.6f}")
    missing = sorted(n for n in want if n not in got or got[n].abs().max() == 0)
    if missing:
        raise wrong(name, f"{len(missing)} parameters got no gradient ({missing[0]}, ...): "
                          "backward must run the block's forward again with gradients on, then "
                          "backward through it")
    diffs = {n: (got[n] - want[n]).abs().max().item() for n in want}
    worst = max(diffs, key=diffs.get)
    if diffs[worst] > 1e-5:
        ratio = (got[worst].norm() / want[worst].norm()).item()
        hint = ("twice the right one: the block's backward ran twice (once in your backward, once "
                "by autograd?)"
                if abs(ratio - 2) < 0.05
                else "check what backward returns for x and what it passes as the "
                "output's gradient")
        raise wrong(name, f"the gradient of {worst} differs by {diffs[worst]:.2e} ({ratio:.2f}× "
                          f"its size): {hint}")
    if kept != [input_only] * TINY.n_layers:
        more = kept[0] / input_only
        raise wrong(name, f"each block keeps {kept[0]:,} bytes for backward, {more:.1f}× its "
                          "input: the forward must run without recording (torch.no_grad()) and "
                          "save only x",
                    f"{input_only:,} bytes per block (the block's input, (B, S, D) in fp32)")
    passed(name, f"loss and all {len(want)} gradients equal the plain model's; each block keeps "
                 f"{input_only:,} bytes, its input alone")


# -- exercise 3: a step of bf16 mixed precision ----------------------------------------------------
def reference_mixed_precision_step(master: torch.nn.Linear, x, y, lr) -> None:
    """One SGD step of bf16 mixed precision on ``master`` (fp32): the checker's reference."""
    w16, b16 = (p.detach().to(torch.bfloat16).requires_grad_()
                for p in (master.weight, master.bias))
    out = torch.nn.functional.linear(x.to(torch.bfloat16), w16, b16)
    loss = ((out.float() - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        for p, g in ((master.weight, w16.grad), (master.bias, b16.grad)):
            p -= lr * g.float()


def _mixed_case():
    torch.manual_seed(0)
    master = torch.nn.Linear(16, 4)
    with torch.no_grad():
        # just below 1 a bf16 step is 2**-8: updates of ~1e-4 round away in bf16
        master.weight.fill_(1.0)
        master.bias.zero_()
    xs = [torch.randn(8, 16) for _ in range(20)]
    ys = [torch.randn(8, 4) for _ in range(20)]
    return master, xs, ys


def check_mixed_precision_step(fn, lr: float = 2e-4) -> None:
    """``fn(master, x, y, lr)`` updates ``master`` (fp32) in place, 20 times; compared with the
    reference."""
    name = "the mixed-precision step"
    refuse_own(name, fn, reference_mixed_precision_step)
    want, xs, ys = _mixed_case()
    got, _, _ = _mixed_case()
    for x, y in zip(xs, ys):
        reference_mixed_precision_step(want, x, y, lr)
        call_answer(name, fn, got, x, y, lr)
    if got.weight.dtype != torch.float32:
        raise wrong(name, f"the master weight became {got.weight.dtype}: it must stay fp32; the "
                          "bf16 copy is made afresh each step")
    moved = (got.weight - 1.0).abs().max().item()
    if moved == 0:
        raise wrong(name, "after 20 steps the weights have not moved: each update (lr × gradient, "
                          "about 1e-4) is smaller than half a bf16 step just below 1.0 (2**-9), so "
                          "an update applied to bf16 weights rounds away. Apply it to the fp32 "
                          "master")
    diff = max((got.weight - want.weight).abs().max().item(),
               (got.bias - want.bias).abs().max().item())
    if diff > 1e-6:
        fp32_grads = diff < 1e-3
        raise wrong(name, f"after 20 steps the weights differ from the reference by {diff:.2e}: "
                    + ("close, but not the same: the forward and backward must run in bf16 (a bf16 "
                       "copy of the weights and the input), only the update in "
                       "fp32" if fp32_grads else
                       "check the order: copy to bf16, forward and backward, gradient to fp32, "
                       "update the master"),
                    f"a weight of {want.weight[0, 0].item():.6f} at [0, 0]")
    passed(name, "20 steps equal the reference (max |diff| <= 1e-6); the weights moved by up to "
                 f"{moved:.1e}, though each update was below half a bf16 step")


# -- exercise 4: MFU -------------------------------------------------------------------------------
def check_mfu(fn) -> None:
    """``fn(cfg, tokens, seq, step_s, gpus, peak_flops)`` -> model FLOPs utilisation, a fraction."""
    name = "MFU"
    for cfg, model, (dp, pp, tp), tokens_per_seq, sequences in (
            (LLAMA3_70B, "LLaMA-3-70B", (2, 4, 8), 8192, 64), (LLAMA3_8B, "LLaMA-3-8B", (8, 1, 8),
                                                               8192, 64),
            (LLAMA3_8B, "LLaMA-3-8B", (64, 1, 1), 2048, 256)):
        t = cost.step_time(cfg, sequences, tokens_per_seq, dp, tp, pp, cost.H100, sequences // dp
                           if pp > 1 else 1)
        gpus = dp * pp * tp
        got = call_answer(name, fn, cfg, sequences * tokens_per_seq, tokens_per_seq, t.step_s, gpus,
                          cost.H100.flops_per_s)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            raise ExerciseError(f"{name}: return a number (a fraction such as 0.45), got {got!r}")
        if abs(got - t.mfu) <= 1e-3 * t.mfu:
            continue
        tokens, peak = sequences * tokens_per_seq, gpus * cost.H100.flops_per_s * t.step_s
        weights, attention = (6 * cfg.num_params() * tokens,
                              12 * cfg.n_layers * cfg.dim * tokens_per_seq * tokens)
        slips = {100 * t.mfu: "100× too big: a fraction, not a percentage",
                 (weights + attention) / 3 / peak: "3× too small: training is 6 FLOPs per "
                                                  "parameter and token (2 forward, 4 backward), "
                                                  "not 2",
                 weights / 3 / peak: "3× too small: training is 6 FLOPs per parameter and token (2 "
                                     "forward, 4 backward), not 2; and attention's 12·L·D·S per "
                                     "token count too",
                 weights / peak: "too small: attention's FLOPs (12·L·D·S per token) count too",
                 t.mfu / gpus: f"{gpus}× too small: the step's FLOPs are shared by the {gpus} GPUs"}
        hint = next((why for value, why in slips.items() if abs(got - value) <= 1e-3 * value),
                    "check each factor: the model's FLOPs per step over (step time × GPUs × peak)")
        raise wrong(name,
                    f"{model} on {gpus} GPUs, {sequences} sequences of {tokens_per_seq}, step "
                          f"{t.step_s:.2f} s: {got:.4g} is {hint}", f"{t.mfu:.4f}")
    passed(name, "3 layouts, 70B and 8B, equal minitp.cost.step_time's MFU")


# -- worked problems -------------------------------------------------------------------------------
def _days_for_15t_tokens() -> float:
    """15 T tokens on 2,048 GPUs: 32 copies of the 64-GPU layout dp = 2, pp = 4, tp = 8, each as
    fast."""
    from minitp import plan

    row = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    tokens_per_s = 2048 // 64 * 64 * 8192 / row["step_s"]
    return 15e12 / tokens_per_s / 86400


def _ridge_tokens() -> float:
    """The fewest tokens m for which (m, D) @ (D, F/8) of 70B in bf16 is compute-bound on an
    H100."""
    ridge = cost.H100.flops_per_s / cost.H100.memory_bytes_per_s
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi) // 2
        if cost.arithmetic_intensity(mid, LLAMA3_70B.dim, LLAMA3_70B.ffn_hidden // 8) >= ridge:
            hi = mid
        else:
            lo = mid + 1
    return float(lo)


def _first_stage_activations_gib() -> float:
    return cost.activation_bytes_per_rank(LLAMA3_70B, 1, 8192, 8, 4, 0, 32, sequence_parallel=True,
                                          formula="llama") / GIB


PROBLEMS = {
    1: Problem("problem 1, days for 15 T tokens", _days_for_15t_tokens, "days",
               {32.0: "that is 64 GPUs: 2,048 are 32 copies of the layout, each doing 64 sequences "
                      "per step",
                24.0: "that is hours, not days"}),
    2: Problem("problem 2, tokens for a compute-bound matmul", _ridge_tokens, "tokens"),
    3: Problem("problem 3, the first stage's activations", _first_stage_activations_gib, "GiB",
               {0.25: "one micro-batch: the first stage of 1F1B keeps pp = 4 in flight",
                4.0: "every block of the model: a stage holds 80/pp = 20"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 10: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
