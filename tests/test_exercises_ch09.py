"""The chapter 09 checkers accept the right answers and catch the usual mistakes with a useful message."""

import math

import pytest
import torch
import torch.distributed as dist
from hint_levels import first_then_second

from minitp import comm, cost, pp, tp
from minitp.exercises import ExerciseError, ch09
from minitp.fsdp import FullyShardedDataParallel
from minitp.models import LLAMA3_70B, loss_fn


def _stub(*args):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


# -- exercise 1: compose the layout ------------------------------------------------------------------------
def parallelize_right(model, mesh):
    if mesh.tp > 1:
        tp.parallelize(model, mesh.tp_group)
    module = pp.PipelineStage(model, mesh.coords.pp, mesh.pp) if mesh.pp > 1 else model
    if mesh.dp > 1:
        module = FullyShardedDataParallel(module, mesh.dp_group, zero=1 if mesh.pp > 1 else 3)
    return module


def parallelize_every_dimension_even_of_size_1(model, mesh):
    tp.parallelize(model, mesh.tp_group)
    module = pp.PipelineStage(model, mesh.coords.pp, mesh.pp)
    return FullyShardedDataParallel(module, mesh.dp_group, zero=1 if mesh.pp > 1 else 3)


def parallelize_fsdp_first(model, mesh):
    module = FullyShardedDataParallel(model, mesh.dp_group, zero=3)
    tp.parallelize(model, mesh.tp_group)
    return module


def parallelize_fsdp_first_zero1(model, mesh):
    module = FullyShardedDataParallel(model, mesh.dp_group, zero=1)
    tp.parallelize(model, mesh.tp_group)
    return module


def parallelize_stage_first(model, mesh):
    stage = pp.PipelineStage(model, mesh.coords.pp, mesh.pp)
    if mesh.tp > 1:
        tp.parallelize(model, mesh.tp_group)
    return FullyShardedDataParallel(stage, mesh.dp_group, zero=1 if mesh.pp > 1 else 3)


def parallelize_without_tp(model, mesh):
    module = pp.PipelineStage(model, mesh.coords.pp, mesh.pp) if mesh.pp > 1 else model
    return FullyShardedDataParallel(module, mesh.dp_group, zero=1 if mesh.pp > 1 else 3)


def parallelize_without_fsdp(model, mesh):
    if mesh.tp > 1:
        tp.parallelize(model, mesh.tp_group)
    return pp.PipelineStage(model, mesh.coords.pp, mesh.pp) if mesh.pp > 1 else model


def parallelize_fsdp_over_the_world(model, mesh):
    if mesh.tp > 1:
        tp.parallelize(model, mesh.tp_group)
    module = pp.PipelineStage(model, mesh.coords.pp, mesh.pp) if mesh.pp > 1 else model
    return FullyShardedDataParallel(module, None, zero=1 if mesh.pp > 1 else 3)


def parallelize_zero3_in_a_pipeline(model, mesh):
    if mesh.tp > 1:
        tp.parallelize(model, mesh.tp_group)
    module = pp.PipelineStage(model, mesh.coords.pp, mesh.pp) if mesh.pp > 1 else model
    return FullyShardedDataParallel(module, mesh.dp_group, zero=3) if mesh.dp > 1 else module


def parallelize_no_stage(model, mesh):
    if mesh.tp > 1:
        tp.parallelize(model, mesh.tp_group)
    return FullyShardedDataParallel(model, mesh.dp_group, zero=1 if mesh.pp > 1 else 3) if mesh.dp > 1 else model


def parallelize_tp_over_dp(model, mesh):
    tp.parallelize(model, mesh.dp_group)
    return FullyShardedDataParallel(model, mesh.dp_group, zero=3)


def test_parallelize_accepts_the_answer(capsys):
    ch09.check_parallelize(parallelize_right)
    assert "[ok] parallelize on a mesh" in capsys.readouterr().out


def test_parallelize_accepts_wrappers_of_size_1():
    ch09.check_parallelize(parallelize_every_dimension_even_of_size_1)


@pytest.mark.parametrize("answer, layouts, message", [
    (parallelize_fsdp_first, ((2, 1, 2),), "FSDP had wrapped the model first"),
    (parallelize_fsdp_first_zero1, ((2, 1, 2),), "FSDP wrapped the model before tensor parallel"),
    (parallelize_stage_first, ((2, 1, 2), (1, 2, 2)), "the stage was cut before tensor parallel"),
    (parallelize_without_tp, ((2, 1, 2),), "nothing is split over tp"),
    (parallelize_without_fsdp, ((2, 1, 2),), "never averages its gradients"),
    (parallelize_fsdp_over_the_world, ((2, 1, 2),), "not the dp group"),
    (parallelize_zero3_in_a_pipeline, ((2, 2, 1),), "not the stage this layout needs"),
    (parallelize_no_stage, ((1, 2, 2),), "the whole model"),
    (parallelize_tp_over_dp, ((2, 1, 2),), "not the values"),
    (_stub, ((2, 1, 2),), "not done yet"),
])
def test_parallelize_catches_mistakes(answer, layouts, message):
    with pytest.raises(ExerciseError, match=message):
        ch09.check_parallelize(answer, layouts=layouts)


# -- exercise 2: the step, by hand ---------------------------------------------------------------------------
def step_right(stage, mesh, tokens, targets, m, split=True, scale=True, average=True, divide=True,
               send=None):
    """GPipe's order: every micro-batch forward, then every backward; the dp mean at the end."""
    send = send or comm.send
    c = mesh.coords
    if split:  # this replica's rows
        rows = tokens.shape[0] // mesh.dp
        tokens, targets = (t[c.dp * rows:(c.dp + 1) * rows] for t in (tokens, targets))
    first, last = c.pp == 0, c.pp == mesh.pp - 1
    ranks = comm.group_ranks(mesh.pp_group)
    b = tokens.shape[0] // m
    shape = (b, tokens.shape[1], stage.config.dim)
    held, losses = [], []
    for i in range(m):
        if first:
            x = tokens[i * b:(i + 1) * b]
        else:
            x = torch.empty(shape)
            comm.recv(x, ranks[c.pp - 1], mesh.pp_group)
            x.requires_grad_()
        y = stage(x)
        if last:
            y_i = targets[i * b:(i + 1) * b]
            loss = (tp.vocab_parallel_cross_entropy(y, y_i, mesh.tp_group) if mesh.tp > 1
                    else loss_fn(y, y_i))
            y = loss / m if scale else loss
            losses.append(loss.item() / m)
        else:
            send(y.detach(), ranks[c.pp + 1], mesh.pp_group)
        held.append((x, y))
    for x, y in held:
        if last:
            y.backward()
        else:
            g = torch.empty(shape)
            comm.recv(g, ranks[c.pp + 1], mesh.pp_group)
            y.backward(g)
        if not first:
            send(x.grad, ranks[c.pp - 1], mesh.pp_group)
    if mesh.dp > 1 and average:
        for p in stage.parameters():
            comm.all_reduce(p.grad, mesh.dp_group)
            if divide:
                p.grad /= mesh.dp
    return sum(losses) if last else None


def step_with_minitps_pipeline(stage, mesh, tokens, targets, m):
    """The pipeline's sends and receives left to minitp's 1F1B runtime: also an answer."""
    def loss_of(logits, y):
        return tp.vocab_parallel_cross_entropy(logits, y, mesh.tp_group) if mesh.tp > 1 else loss_fn(logits, y)
    rows = tokens.shape[0] // mesh.dp
    tokens, targets = (t[mesh.coords.dp * rows:(mesh.coords.dp + 1) * rows] for t in (tokens, targets))
    spec = pp.StageSpec(stage.stage, stage.num_stages, stage, stage, stage.config.dim, torch.float32,
                        torch.device("cpu"))
    loss = pp.Pipeline(spec, mesh.pp_group, "1f1b", m, loss=loss_of).forward_backward(tokens, targets).loss
    for p in stage.parameters():
        comm.all_reduce(p.grad, mesh.dp_group)
        p.grad /= mesh.dp
    return loss


def step_plain_loss_under_tp(stage, mesh, tokens, targets, m):
    for p in stage.parameters():  # a loss of the local V/tp logits
        p.grad = torch.zeros_like(p)
    return loss_fn(stage(tokens), targets).item()


def _untraced_send(tensor, dst, group):
    dist.send(tensor, dst=dst, group=group)


def step_whole_batch(*args):
    return step_right(*args, split=False)


def step_sum_of_microbatches(*args):
    return step_right(*args, scale=False)


def step_no_dp_average(*args):
    return step_right(*args, average=False)


def step_dp_sum(*args):
    return step_right(*args, divide=False)


def step_untraced_sends(*args):
    return step_right(*args, send=_untraced_send)


def step_minitps_own(stage, mesh, tokens, targets, m):
    from minitp import trainer
    return trainer.train_step(stage, tokens, targets)


def test_the_step_accepts_the_answer(capsys):
    ch09.check_train_step(step_right)
    assert "[ok] the 3D step" in capsys.readouterr().out


def test_the_step_accepts_minitps_pipeline_runtime():
    ch09.check_train_step(step_with_minitps_pipeline, layouts=((2, 2, 1),))


@pytest.mark.parametrize("answer, layout, message", [
    (step_whole_batch, (2, 2, 1), "every replica trained on the whole batch"),
    (step_sum_of_microbatches, (2, 2, 1), "divide each micro-batch's loss by m = 3"),
    (step_no_dp_average, (2, 2, 1), "each replica kept the gradient of its own rows"),
    (step_dp_sum, (2, 1, 2), "divide by dp = 2 to average them"),
    (step_untraced_sends, (1, 2, 2), r"sent to ranks \[\]"),
    (step_plain_loss_under_tp, (2, 1, 2), "Target .* is out of bounds.\nUnder tp the last stage's logits"),
    (step_minitps_own, (2, 2, 1), "calls minitp.trainer.train_step"),
    (_stub, (2, 2, 1), "not done yet"),
])
def test_the_step_catches_mistakes(answer, layout, message):
    with pytest.raises(ExerciseError, match=message):
        ch09.check_train_step(answer, layouts=(layout,))


# -- exercise 3: clip by the global norm ---------------------------------------------------------------------
def _pieces(par, counted, every_replica=False, experts=True):
    """(gradients counted in the norm, every gradient) of this rank. ``experts``: a MoE's experts
    count on each of the first ep ranks of the dp axis, which hold different ones."""
    c = par.mesh.coords
    if par.fsdp is not None:
        pieces = par.fsdp.gradient_pieces()
        return [g for n, g in pieces if counted(n)], [g for _, g in pieces]
    grads = [(n, p.grad) for n, p in par.module.named_parameters() if p.grad is not None]
    owner = lambda n: c.dp == 0 or (experts and c.dp < par.mesh.ep and ".experts." in n)  # noqa: E731
    return [g for n, g in grads if counted(n) and (every_replica or owner(n))], [g for _, g in grads]


def _counted(par):
    """The right rule: a tp-split parameter on every tp rank, a replicated one on the first."""
    return lambda name: par.split_dims[name] is not None or par.mesh.coords.tp == 0


def _squares(grads) -> torch.Tensor:
    return sum(g.pow(2).sum() for g in grads) + torch.zeros(())


def _finish(squares, every, max_norm, group=None, scale=True, upwards=False, root=True):
    comm.all_reduce(squares, group=group)
    norm = squares.sqrt().item() if root else squares.item()
    coef = max_norm / (norm + 1e-6) if upwards else min(1.0, max_norm / (norm + 1e-6))
    if scale:
        for g in every:
            g.mul_(coef)
    return norm


@torch.no_grad()
def clip_right(par, max_norm):
    mine, every = _pieces(par, _counted(par))
    return _finish(_squares(mine), every, max_norm)


@torch.no_grad()
def clip_norm_weights_twice(par, max_norm):
    mine, every = _pieces(par, lambda name: True)
    return _finish(_squares(mine), every, max_norm)


@torch.no_grad()
def clip_within_the_stage(par, max_norm):
    mine, every = _pieces(par, _counted(par))
    return _finish(_squares(mine), every, max_norm, group=par.mesh.tp_group)


@torch.no_grad()
def clip_every_replica(par, max_norm):
    mine, every = _pieces(par, _counted(par), every_replica=True)
    return _finish(_squares(mine), every, max_norm)


@torch.no_grad()
def clip_without_scaling(par, max_norm):
    mine, every = _pieces(par, _counted(par))
    return _finish(_squares(mine), every, max_norm, scale=False)


@torch.no_grad()
def clip_scales_up(par, max_norm):
    mine, every = _pieces(par, _counted(par))
    return _finish(_squares(mine), every, max_norm, upwards=True)


@torch.no_grad()
def clip_only_what_was_counted(par, max_norm):
    mine, _ = _pieces(par, _counted(par))
    return _finish(_squares(mine), mine, max_norm)


@torch.no_grad()
def clip_squares(par, max_norm):
    mine, every = _pieces(par, _counted(par))
    return _finish(_squares(mine), every, max_norm, root=False)


@torch.no_grad()
def clip_untraced(par, max_norm):
    mine, every = _pieces(par, _counted(par))
    squares = _squares(mine)
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    for g in every:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


@torch.no_grad()
def clip_three_all_reduces(par, max_norm):
    mine, every = _pieces(par, _counted(par), every_replica=True)
    squares = _squares(mine)
    m = par.mesh
    comm.all_reduce(squares, group=m.tp_group)
    comm.all_reduce(squares, group=m.pp_group)
    if par.fsdp is not None:
        comm.all_reduce(squares, group=m.dp_group)
    norm = squares.sqrt().item()
    for g in every:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def test_clip_accepts_the_answer(capsys):
    ch09.check_clip_grad_norm(clip_right)
    assert "[ok] clip by the global norm" in capsys.readouterr().out


TP_PP, DP_TP, FSDP_DP_TP, CP, EP = ch09.CLIP_LAYOUTS


@torch.no_grad()
def clip_experts_on_dp_rank_0_only(par, max_norm):
    mine, every = _pieces(par, _counted(par), experts=False)
    return _finish(_squares(mine), every, max_norm)


@pytest.mark.parametrize("answer, layouts, message", [
    (clip_norm_weights_twice, (TP_PP,), "counted twice"),
    (clip_within_the_stage, (TP_PP,), "missing across pipeline stages"),
    (clip_every_replica, (DP_TP,), "DDP replicas summed"),
    (clip_every_replica, (CP,), "DDP replicas summed"),
    (clip_experts_on_dp_rank_0_only, (EP,), "experts of its own"),
    (clip_without_scaling, (TP_PP,), "forgot to scale"),
    (clip_scales_up, (TP_PP,), "only ever shrinks"),
    (clip_only_what_was_counted, (TP_PP,), "not only the ones you counted"),
    (clip_squares, (TP_PP,), "square root"),
    (clip_untraced, (TP_PP,), "nothing traced"),
    (clip_three_all_reduces, (TP_PP,), "One all-reduce"),
    (_stub, (TP_PP,), "not done yet"),
])
def test_clip_catches_mistakes(answer, layouts, message):
    with pytest.raises(ExerciseError, match=message):
        ch09.check_clip_grad_norm(answer, layouts=layouts)


# -- exercise 4: the learning rate ---------------------------------------------------------------------------
def lr_right(step, steps, warmup, lr, min_ratio):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_warmup_from_zero(step, steps, warmup, lr, min_ratio):
    return lr * step / warmup if step < warmup else lr_right(step, steps, warmup, lr, min_ratio)


def lr_down_to_zero(step, steps, warmup, lr, min_ratio):
    return lr_right(step, steps, warmup, lr, 0.0)


def lr_progress_over_steps(step, steps, warmup, lr, min_ratio):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / (steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_linear(step, steps, warmup, lr, min_ratio):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (min_ratio + (1 - min_ratio) * (1 - progress))


def test_lr_accepts_the_answer(capsys):
    ch09.check_lr_schedule(lr_right)
    assert "[ok] learning rate" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lr_warmup_from_zero, "step 0 gets"),
    (lr_down_to_zero, "not to 0"),
    (lr_progress_over_steps, "must reach min_ratio"),
    (lr_linear, "decays linearly"),
    (_stub, "not done yet"),
])
def test_lr_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch09.check_lr_schedule(answer)


# -- exercise 5: how often to save ---------------------------------------------------------------------------
def waste_right(interval, save_seconds, restart_seconds, mtbf):
    return save_seconds / interval + (interval / 2 + restart_seconds) / mtbf


def test_waste_accepts_the_answer(capsys):
    ch09.check_wasted_fraction(waste_right)
    assert "[ok] time lost to checkpoints and failures" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda i, c, r, m: c / i + (i + r) / m, "halfway"),
    (lambda i, c, r, m: c / i + i / 2 / m, "the restart"),
    (lambda i, c, r, m: (i / 2 + r) / m, "save/interval"),
    (lambda i, c, r, m: 100 * waste_right(i, c, r, m), "not a percentage"),
    (lambda i, c, r, m: c / i + i / 2 + r, "divide the time each one costs by mtbf"),
    (_stub, "not done yet"),
])
def test_waste_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch09.check_wasted_fraction(answer)


def test_the_best_interval_is_youngs_square_root():
    save, restart, mtbf = 60.0, 600.0, 11_000.0
    best = min(range(60, 20_000), key=lambda i: ch09.wasted_fraction(i, save, restart, mtbf))
    assert abs(best - math.sqrt(2 * save * mtbf)) <= 1


# -- the chapter's stored live control -------------------------------------------------------------------------
def test_stored_twin_trains_every_layout_like_one_process():
    """Chapter 09's website twin is honest: each stored layout's loss is one process's, and its ranks hold
    the share of the model the layout gives them (dp: all of it, tp and pp: about half)."""
    import json
    import re
    from pathlib import Path

    from minitp.trainer import BYTE
    from minitp.viz.explore import stored_twins, twin_texts

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "09_capstone.ipynb"
    twins = stored_twins(json.loads(notebook.read_text(encoding="utf-8")))
    assert len(twins) == 1
    texts = twin_texts(twins[0])
    assert len(texts) == 3
    for text in texts:
        loss, reference, gap = re.search(r"step 24: loss ([\d.]+), one process ([\d.]+); largest gap ([\d.e+-]+)",
                                         text).groups()
        assert loss == reference and float(gap) < 1e-5, text
        held = [int(h.replace(",", "")) for h in re.search(r"per rank: ([\d, ]+) \(", text)[1].split(", ")]
        assert len(held) == 2
        share = sum(held) / BYTE.num_params()
        assert share == 2 or 0.99 < share < 1.01, text  # dp 2: two copies; tp 2 and pp 2: one model between them


# -- hints in levels: the expected value shows from the second wrong try on ----------------------------
def test_lr_shows_the_expected_rate_from_the_second_try():
    want = f"{lr_right(0, 100, 10, 3e-3, 0.1):.6g}"  # the first case: step 0 of 100, warm-up 10: lr/10
    with pytest.raises(ExerciseError) as first:
        ch09.check_lr_schedule(lr_warmup_from_zero)
    assert want not in str(first.value) and "show_expected('learning rate')" in str(first.value)
    with pytest.raises(ExerciseError, match=f"Expected: {want}"):
        ch09.check_lr_schedule(lr_warmup_from_zero)


def test_waste_shows_the_expected_fraction_from_the_second_try():
    want = f"{waste_right(600, 30, 120, 3 * 3600):.6g}"  # the first case
    answer = lambda i, c, r, m: (i / 2 + r) / m  # noqa: E731  the saves left out
    with pytest.raises(ExerciseError) as first:
        ch09.check_wasted_fraction(answer)
    assert want not in str(first.value) and "Expected:" not in str(first.value)
    with pytest.raises(ExerciseError, match=f"Expected: {want}"):
        ch09.check_wasted_fraction(answer)


def test_waste_refuses_minitps_own_answer():
    with pytest.raises(ExerciseError, match="the exercise is to write it"):
        ch09.check_wasted_fraction(ch09.wasted_fraction)


def test_clip_shows_the_expected_norm_from_the_second_try():
    with pytest.raises(ExerciseError) as first:
        ch09.check_clip_grad_norm(clip_squares, layouts=(TP_PP,))
    assert "square root" in str(first.value) and "Expected:" not in str(first.value)
    with pytest.raises(ExerciseError, match=r"Expected: \d+\.\d{6}"):
        ch09.check_clip_grad_norm(clip_squares, layouts=(TP_PP,))


# -- worked problems -----------------------------------------------------------------------------------
def test_the_problems_answers_are_the_numbers_by_hand():
    psi = LLAMA3_70B.num_params()  # 70.6 B
    per_token = 6 * psi + 12 * 80 * 8192 * 8192
    assert ch09.PROBLEMS[1].want() == pytest.approx(15e12 * per_token / (8192 * 989e12 * 0.40) / 86400)
    assert round(ch09.PROBLEMS[1].want()) == 26
    assert ch09.checkpoint_bytes() == 14 * psi  # 2 (bf16 weights) + 4 + 4 + 4 (AdamW's fp32 state)
    assert ch09.PROBLEMS[2].want() == pytest.approx(14 * psi / 100e9) == pytest.approx(9.88, abs=0.01)
    mtbf = 54 * 24 * 3600 / 419
    young = math.sqrt(2 * 14 * psi / 100e9 * mtbf) / 60
    assert ch09.PROBLEMS[3].want() == pytest.approx(young, rel=1e-6) == pytest.approx(7.8, abs=0.05)


def test_the_best_interval_minimises_exercise_4s_wasted_fraction():
    for save, restart, mtbf in ((60.0, 600.0, 11_135.0), (9.9, 120.0, 3600.0), (300.0, 900.0, 86_400.0)):
        best = ch09.best_interval(save, restart, mtbf)
        assert best == pytest.approx(math.sqrt(2 * save * mtbf), rel=1e-6)
        for other in (0.9 * best, 1.1 * best):
            assert ch09.wasted_fraction(other, save, restart, mtbf) > ch09.wasted_fraction(best, save, restart, mtbf)


@pytest.mark.parametrize("number, factor, slip", [
    (1, 6 * LLAMA3_70B.num_params() / cost.training_flops_per_token(LLAMA3_70B, 8192), "12·L·D·S"),
    (1, 0.4 / 0.6, "not the sheet's 60 %"),
    (1, 1 / 3, "the forward alone"),
    (2, 16 / 14, "gradients are not saved"),
    (2, 12 / 14, "bf16 weights are saved too"),
    (3, 1 / math.sqrt(2), "sqrt\\(2CM\\)"),
    (3, 60.0, "in minutes, not seconds"),
])
def test_a_problems_slip_is_named(number, factor, slip):
    with pytest.raises(ExerciseError, match=slip):
        ch09.check_problem(number, lambda: ch09.PROBLEMS[number].want() * factor)


def test_a_problem_shows_its_answer_only_from_the_second_try():
    first_then_second(ch09.check_problem, 1, lambda: 1.0, expected="26.13 days")


def test_the_problems_solutions_state_the_numbers_minitp_cost_gives():
    import json
    from pathlib import Path

    cells = json.loads((Path(__file__).parents[1] / "notebooks" / "09_capstone.ipynb").read_text())["cells"]
    text = " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())
    cfg = LLAMA3_70B
    per_token = cost.training_flops_per_token(cfg, 8192)
    seconds = 15e12 * per_token / (8192 * cost.H100.flops_per_s * 0.40)
    assert f"$\\Psi$ = {cfg.num_params() / 1e9:.1f} B parameters" in text
    assert f"{per_token / 1e11:.1f} \\cdot 10^{{11}}$ FLOPs per token" in text
    assert f"{15e12 * per_token / 1e24:.1f} \\cdot 10^{{24}}$ in all" in text
    assert f"{seconds / 1e6:.1f} \\cdot 10^6$ s, **{ch09.PROBLEMS[1].want():.0f} days**" in text
    assert f"it would be {ch09.PROBLEMS[1].want() * 0.4 / cost.H100.efficiency:.0f}:" in text
    assert f"= {ch09.checkpoint_bytes() / 1e9:.0f} GB, **{ch09.PROBLEMS[2].want():.1f} s**" in text
    save, mtbf = ch09.PROBLEMS[2].want(), ch09.MTBF_S
    best = ch09.best_interval(save, ch09.RESTART_S, mtbf)
    assert f"{mtbf:,.0f}".replace(",", "{,}") in text and f"= {best:.0f} s, **{best / 60:.1f} minutes**" in text
    saving, twice, restarting = (f"{x:.1%}".replace("%", " %") for x in (save / best, best / 2 / mtbf,
                                                                          ch09.RESTART_S / mtbf))
    lost = f"{ch09.wasted_fraction(best, save, ch09.RESTART_S, mtbf):.1%}".replace("%", " %")
    assert (f"`wasted_fraction` is then {lost}: {saving} saving, {twice} work done twice, {restarting} "
            "restarting") in text
    assert round(60 / save) == 6 and "A save six times shorter" in text



def test_parallelize_shows_the_expected_zero_stage_from_the_second_try():
    first_then_second(ch09.check_parallelize, parallelize_zero3_in_a_pipeline, layouts=((2, 2, 1),),
                      expected="zero=1")
