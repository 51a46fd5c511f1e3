"""The chapter 06 checkers accept the right answers and catch the usual mistakes with a useful message."""

import pytest
from hint_levels import first_then_second as _first_then_second

from minitp import cost
from minitp.exercises import ExerciseError, ch06


# -- a rank's coordinates and groups -----------------------------------------------------------------
def position_right(rank, dp, pp, tp):
    d, p, t = rank // (pp * tp), rank // tp % pp, rank % tp

    def at(d, p, t):
        return (d * pp + p) * tp + t
    return (d, p, t), {"tp": [at(d, p, x) for x in range(tp)], "pp": [at(d, x, t) for x in range(pp)],
                       "dp": [at(x, p, t) for x in range(dp)]}


def position_dp_fastest(rank, dp, pp, tp):
    d, p, t = rank % dp, rank // dp % pp, rank // (dp * pp)

    def at(d, p, t):
        return (t * pp + p) * dp + d
    return (d, p, t), {"tp": [at(d, p, x) for x in range(tp)], "pp": [at(d, x, t) for x in range(pp)],
                       "dp": [at(x, p, t) for x in range(dp)]}


def position_pp_tp_swapped(rank, dp, pp, tp):
    d, p, t = rank // (pp * tp), rank % pp, rank // pp % tp

    def at(d, p, t):
        return (d * tp + t) * pp + p
    return (d, p, t), {"tp": [at(d, p, x) for x in range(tp)], "pp": [at(d, x, t) for x in range(pp)],
                       "dp": [at(x, p, t) for x in range(dp)]}


def position_wrong_dp_group(rank, dp, pp, tp):
    coords, groups = position_right(rank, dp, pp, tp)
    return coords, {**groups, "dp": [rank]}


def position_stub(rank, dp, pp, tp):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_mesh_position_accepts_the_answer(capsys):
    ch06.check_mesh_position(position_right)
    assert "[ok] a rank's coordinates and groups" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (position_dp_fastest, "you let dp vary fastest"),
    (position_pp_tp_swapped, "pp and tp are swapped"),
    (position_wrong_dp_group, "the dp group is"),
    (position_stub, "not done yet"),
])
def test_mesh_position_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch06.check_mesh_position(answer)


# -- bytes of one step -------------------------------------------------------------------------------
def bytes_right(cfg, batch, seq, dp, tp, pp, stage):  # the notebook's answer, from the per-strategy formulas
    b = batch // dp
    act = b * seq * cfg.dim * 4
    tp_bytes = cost.stage_num_blocks(cfg.n_layers, pp, stage) * cost.tp_block_bytes(b, seq, cfg.dim, tp)
    if stage == 0:
        tp_bytes += cost.collective_sent_bytes("all_reduce", act, tp)
    if stage == pp - 1:
        tp_bytes += cost.collective_sent_bytes("all_reduce", act, tp)
        tp_bytes += cost.collective_sent_bytes("all_reduce", b * seq * 4, tp)
        tp_bytes += cost.collective_sent_bytes("all_reduce", 2 * b * seq * 4, tp)
    return {"tp": tp_bytes, "pp": cost.pp_step_bytes(b, seq, cfg.dim, pp, stage),
            "dp": cost.ddp_step_bytes(cost.threed_params_per_rank(cfg, tp, pp, stage), dp)}


def bytes_without_dp(cfg, batch, seq, dp, tp, pp, stage):
    return {**bytes_right(cfg, batch, seq, dp, tp, pp, stage), "dp": 0}


def bytes_global_batch(cfg, batch, seq, dp, tp, pp, stage):
    right = bytes_right(cfg, batch, seq, dp, tp, pp, stage)
    return {**right, "tp": right["tp"] * dp}


def bytes_blocks_only(cfg, batch, seq, dp, tp, pp, stage):
    blocks = cost.stage_num_blocks(cfg.n_layers, pp, stage) * cost.tp_block_bytes(batch // dp, seq, cfg.dim, tp)
    return {**bytes_right(cfg, batch, seq, dp, tp, pp, stage), "tp": blocks}


def bytes_whole_model(cfg, batch, seq, dp, tp, pp, stage):
    return {**bytes_right(cfg, batch, seq, dp, tp, pp, stage), "dp": 2 * (dp - 1) / dp * 4 * cfg.num_params()}


def test_step_bytes_accepts_the_answer(capsys):
    ch06.check_step_bytes(bytes_right)
    assert "[ok] bytes of one step per dimension" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (bytes_without_dp, "you left out the dp bytes"),
    (bytes_global_batch, "the global batch"),
    (bytes_blocks_only, "the blocks alone"),
    (bytes_whole_model, "whole model's parameters"),
    (lambda *a: [1, 2, 3], "return a dict"),
])
def test_step_bytes_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch06.check_step_bytes(answer)


# -- the layout that fits ----------------------------------------------------------------------------
def _choose(cfg, gpus, budget, node, per_param=16, whole=False):
    best = None
    for dp, pp, tp in ch06.mesh_layouts(gpus):
        if tp > node:
            continue
        try:
            cost.check_3d_layout(cfg, dp, pp, tp)
        except ValueError:
            continue
        held = cfg.num_params() if whole else max(cost.threed_params_per_rank(cfg, tp, pp, s) for s in range(pp))
        if held * per_param <= budget and (best is None or (dp, tp) > (best[0], best[2])):
            best = (dp, pp, tp)
    return best


def test_choose_layout_accepts_the_answer(capsys):
    ch06.check_choose_layout(lambda cfg, gpus, budget, node: _choose(cfg, gpus, budget, node))
    assert "[ok] the layout that fits" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda cfg, gpus, budget, node: _choose(cfg, gpus, budget, node, per_param=4), "without the optimizer"),
    (lambda cfg, gpus, budget, node: _choose(cfg, gpus, budget, node, per_param=32), "also fits"),
    (lambda cfg, gpus, budget, node: (gpus, 1, 1), "more than"),
    (lambda cfg, gpus, budget, node: None, "returned None"),
    (lambda cfg, gpus, budget, node: (1, 1, gpus), "tp=64"),
])
def test_choose_layout_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch06.check_choose_layout(answer)


def test_choose_layout_wants_none_when_nothing_fits():
    def never_none(cfg, gpus, budget, node):
        return _choose(cfg, gpus, budget, node) or (1, 1, 8)
    with pytest.raises(ExerciseError, match="no layout fits"):
        ch06.check_choose_layout(never_none)


def _stub(*args):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


@pytest.mark.parametrize("checker", [ch06.check_step_bytes, ch06.check_choose_layout])
def test_a_stub_is_not_done_yet(checker):
    with pytest.raises(ExerciseError, match="not done yet"):
        checker(_stub)


# -- exercise 4: the mesh's process groups, created for real (8 processes) -------------------------
def make_groups(dp, pp, tp, *, order="tp", wrong_pp=False):
    import torch.distributed as dist

    def at(d, p, t):
        return (d * pp + p) * tp + t if order == "tp" else (t * pp + p) * dp + d  # planted: dp fastest

    lists = {
        "tp": [[at(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
        "pp": [[at(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "dp": [[at(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
    }
    if wrong_pp:  # planted: the stages of a replica taken as consecutive ranks
        lists["pp"] = [list(range(i * pp, (i + 1) * pp)) for i in range(dp * tp)]
    rank, mine = dist.get_rank(), {}
    for dim in ("tp", "pp", "dp"):
        for ranks in lists[dim]:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[dim] = (ranks, group)
    return mine


def test_make_groups_passes(capsys):
    ch06.check_make_groups(make_groups)
    assert "[ok] the mesh's process groups" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    ({"order": "dp"}, "dp vary fastest"),
    ({"wrong_pp": True}, "the pp group is"),
])
def test_make_groups_mistakes_caught(kwargs, message):
    def answer(dp, pp, tp):
        return make_groups(dp, pp, tp, **kwargs)

    with pytest.raises(ExerciseError, match=message):
        ch06.check_make_groups(answer, layouts=((2, 2, 2),))


def test_make_groups_hang_is_named_when_a_rank_skips_other_groups():
    def own_groups_only(dp, pp, tp):  # new_group is collective over the world: skipping one hangs
        import torch.distributed as dist

        from minitp.grid import group_lists

        rank, mine = dist.get_rank(), {}
        for dim, lists in group_lists(dp, pp, tp).items():
            for ranks in lists:
                if rank in ranks:
                    mine[dim] = (ranks, dist.new_group(ranks))
        return mine

    with pytest.raises(ExerciseError, match="hung .* called by EVERY rank for EVERY group"):
        ch06.check_make_groups(own_groups_only, layouts=((2, 2, 2),), timeout=10)


# -- hints in levels: the expected value shows from the second wrong try on ----------------------------
def test_mesh_position_shows_the_expected_group_from_the_second_try():
    # rank 0 of dp=2, pp=2, tp=2: its dp group is rank 0 and the rank one replica on, (1·2 + 0)·2 + 0 = 4
    _first_then_second(ch06.check_mesh_position, position_wrong_dp_group, expected="the dp group [0, 4]")


def test_step_bytes_show_the_expected_bytes_from_the_second_try():
    want = cost.threed_step_bytes(ch06.TINY, 8, 16, 2, 2, 2, 0)["dp"]  # the first case
    assert want == bytes_right(ch06.TINY, 8, 16, 2, 2, 2, 0)["dp"]
    assert want > 0
    _first_then_second(ch06.check_step_bytes, bytes_without_dp, expected=f"dp = {want:,.0f} bytes")


def test_choose_layout_shows_the_expected_layout_from_the_second_try():
    want = _choose(ch06.LLAMA3_8B, 64, cost.H100.memory_bytes, 8)  # the first case: LLaMA-3-8B on 64 H100s
    assert want is not None
    _first_then_second(ch06.check_choose_layout, lambda cfg, gpus, budget, node: None, expected=str(want))


def test_choose_layout_shows_the_expected_layout_after_show_expected(capsys):
    from minitp.exercises import show_expected

    show_expected("the layout that fits")
    want = _choose(ch06.LLAMA3_8B, 64, cost.H100.memory_bytes, 8)
    with pytest.raises(ExerciseError, match=f"Expected: {want}".replace("(", r"\(").replace(")", r"\)")):
        ch06.check_choose_layout(lambda cfg, gpus, budget, node: None)


def test_make_groups_shows_the_expected_group_from_the_second_try():
    def answer(dp, pp, tp):
        return make_groups(dp, pp, tp, wrong_pp=True)

    # rank 0 of dp=2, pp=2, tp=2: its pp group runs through pp_rank with dp_rank = tp_rank = 0: ranks 0 and 2
    _first_then_second(ch06.check_make_groups, answer, expected="the pp group [0, 2]", layouts=((2, 2, 2),))


def test_choose_layout_refuses_minitps_own_answer():
    with pytest.raises(ExerciseError, match="the exercise is to write it"):
        ch06.check_choose_layout(ch06.reference_layout)


def test_step_bytes_refuses_minitps_own_formula():
    with pytest.raises(ExerciseError, match="that is minitp.cost.*threed_step_bytes, minitp's own answer"):
        ch06.check_step_bytes(cost.threed_step_bytes)
    with pytest.raises(ExerciseError, match="your code calls minitp.cost.*threed_step_bytes"):
        ch06.check_step_bytes(lambda *args: dict(cost.threed_step_bytes(*args)))


# -- exercise 4: one step of dp × tp --------------------------------------------------------------------
def dp_tp_step(model, rows, loss_fn, mesh, lr, group="dp", divide="dp", rows_by="dp"):
    import torch

    from minitp import comm

    share = {"dp": mesh.coords.dp, "tp": mesh.coords.tp % mesh.dp}[rows_by]
    loss = loss_fn(model, rows.chunk(mesh.dp)[share])
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if group:
                comm.all_reduce(p.grad, group=mesh.dp_group if group == "dp" else None)
            p -= lr * p.grad / {"dp": mesh.dp, "world": mesh.world_size, "none": 1}[divide]
            p.grad = None


def test_the_dp_tp_step_equals_one_process_on_three_layouts(capsys):
    ch06.check_dp_tp_step(dp_tp_step)
    assert "[ok] the dp × tp step" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, message", [
    ({"group": "world"}, "the all-reduce ran over the whole world"),
    ({"divide": "none"}, "one process at 2× the learning rate: the gradients were summed"),
    ({"divide": "world"}, "one process at 1/2 of the learning rate: divide by dp, not by the world size"),
    ({"rows_by": "tp"}, "the tp ranks of a replica must see the same rows"),
    ({"group": None, "divide": "none"}, "the 2 replicas hold different parameters"),
])
def test_the_dp_tp_step_names_each_mistake(mistake, message):
    def answer(model, rows, loss_fn, mesh, lr):
        return dp_tp_step(model, rows, loss_fn, mesh, lr, **mistake)

    with pytest.raises(ExerciseError, match=message):
        ch06.check_dp_tp_step(answer, layouts=((2, 1, 2),))


def test_the_dp_tp_step_shows_one_process_losses_from_the_second_try():
    losses = [round(x, 5) for x in ch06._reference_step()[0]]

    def answer(model, rows, loss_fn, mesh, lr):
        return dp_tp_step(model, rows, loss_fn, mesh, lr, divide="none")

    _first_then_second(ch06.check_dp_tp_step, answer, expected=f"losses {losses}", layouts=((2, 1, 2),))


def test_the_chapter_06_problems_are_the_numbers_by_hand():
    from minitp.models import LLAMA3_70B

    first, middle = (cost.threed_params_per_rank(LLAMA3_70B, 8, 4, s) for s in (0, 1))
    assert round(first / 1e9, 2) == 2.27 and round(middle / 1e9, 2) == 2.14  # as the chapter states them
    assert ch06.PROBLEMS[1].want() == pytest.approx(middle * 2 / 1e9)  # a ring of 2 sends the buffer once
    assert ch06.PROBLEMS[2].want() == pytest.approx(2 * 32 * 8192 * 8192 * 2 / 50e9)
    assert ch06.PROBLEMS[3].want() == pytest.approx(first * 10 / 2**30)
    with pytest.raises(ExerciseError, match="fp32's"):
        ch06.check_problem(1, lambda: middle * 4 / 1e9)
    with pytest.raises(ExerciseError, match="crosses twice"):
        ch06.check_problem(2, lambda: 32 * 8192 * 8192 * 2 / 50e9)
    with pytest.raises(ExerciseError, match="weight and gradient stay whole"):
        ch06.check_problem(3, lambda: first * 8 / 2**30)
