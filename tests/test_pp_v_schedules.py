"""ZB-V and DualPipeV: two chunks per rank in a V (rank r holds pieces r and 2p-1-r). The tables
against PyTorch's own ``pipeline_order`` (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``),
played by ``simulate`` against their bubble formulas, and run on 2 and 4 ranks against one process.

PyTorch's order is read from its real constructors, given stand-in stages that carry only what
they read (group size and rank, number of stages, no module): no process, no group.
"""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

from minitp import runs
from minitp.launcher import launch
from minitp.models import TINY, build_model, loss_fn
from minitp.models.train import TrainConfig, synthetic_batches
from minitp.pp_schedules import (
    RUNNER_SCHEDULES,
    SCHEDULES,
    V_SHAPE,
    Action,
    bubble_fraction,
    dualpipe_v,
    make_schedule,
    peak_in_flight,
    simulate,
    zbv_zero_bubble,
)

CFG = TINY.with_(n_layers=8)  # 8 pieces at pp=4, 4 of two blocks each at pp=2
TRAIN = TrainConfig(steps=1, batch_size=16)
TORCH = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
OPS = {"F": "forward", "B": "backward", "W": "weight"}


def torch_order_in_minitp_terms(name, p, m):
    """PyTorch's compute actions of every rank, as minitp's Actions: FORWARD -> F, BACKWARD_INPUT
    -> B, BACKWARD_WEIGHT -> W, FULL_BACKWARD -> B then W, OVERLAP_F_B -> its sub-actions in order
    (PyTorch's runtime runs them one after the other); idle slots (None) dropped. Its stage index
    s of rank r is chunk 0 when s = r, chunk 1 when s = 2p-1-r."""
    stages = [SimpleNamespace(group_size=p, group_rank=0, num_stages=2 * p, submod=None)
              for _ in range(2)]
    order = TORCH[name](stages, m).pipeline_order
    kinds = {"F": "F", "I": "B", "W": "W", "B": "BW"}
    out = []
    for r in range(p):
        chunk = {r: 0, 2 * p - 1 - r: 1}
        actions = []
        for a in order[r]:
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                actions += [Action(k, sub.microbatch_index, chunk[sub.stage_index])
                            for k in kinds[sub.computation_type.value]]
        out.append(actions)
    return out


# -- the tables ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_each_v_table_is_pytorchs_order_action_for_action(name, p):
    low = 1 if name == "zbv" else 2 * p  # DualPipeV needs m >= 2p; ZB-V takes any m
    for m in sorted({low, low + 1, 2 * p - 1, 2 * p, 3 * p, 4 * p + 1} - set(range(low))):
        assert make_schedule(name, p, m) == torch_order_in_minitp_terms(name, p, m), (p, m)


def test_dualpipev_pairs_a_forward_with_the_other_chunks_whole_backward():
    # rank 1 of 2 (pieces 1 and 2): its steady state is (F1c0, B0c1 W0c1), (F2c1, B0 W0), ...
    assert dualpipe_v(2, 4)[1][:12] == [
        Action("F", 0), Action("F", 0, 1), Action("F", 1), Action("F", 1, 1),
        Action("F", 2), Action("B", 0, 1), Action("W", 0, 1),  # the last rank's first pair, apart
        Action("F", 2, 1), Action("B", 0), Action("W", 0),
        Action("F", 3), Action("B", 1, 1),
    ]


def test_zbv_puts_the_first_and_last_pieces_on_rank_0_and_the_turn_on_the_last_rank():
    assert [V_SHAPE.piece(4, r, c) for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert [V_SHAPE.holder(4, k) for k in range(8)] == [
        (0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert zbv_zero_bubble(2, 4)[1][:5] == [  # rank 1 turns micro-batch 0 at once
        Action("F", 0), Action("F", 0, 1), Action("F", 1), Action("F", 1, 1), Action("B", 0, 1)]


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_simulate_plays_each_v_table_and_its_bubble_and_peak_are_the_formulas(name):
    entry = SCHEDULES[name]
    for p in range(1, 7):
        low = 1 if name == "zbv" else 2 * p
        for m in range(low, 4 * p + 2):
            schedule = make_schedule(name, p, m)
            for actions in schedule:  # every F, B and W once, F before B before W
                assert sorted(actions) == sorted(
                    Action(k, i, c) for k in "FBW" for i in range(m) for c in (0, 1))
                for i in range(m):
                    for c in (0, 1):
                        at = [actions.index(Action(k, i, c)) for k in "FBW"]
                        assert at == sorted(at), (p, m, i, c)
            # F = B = W = one slot (a whole backward is 2); raises if the table deadlocks
            timelines = simulate(schedule, 1.0, 2.0, placement=V_SHAPE)
            assert bubble_fraction(timelines) == pytest.approx([entry.bubble(p, m, 1)] * p), (p, m)
            peaks = [peak_in_flight(a) for a in schedule]
            assert peaks == [entry.peak_in_flight(p, m, s, 1) for s in range(p)], (p, m)


def test_the_v_bubble_is_half_of_zero_bubbles_at_equal_f_b_w():
    zb, zbv, dualpipev = (SCHEDULES[n].bubble for n in ("zb", "zbv", "dualpipev"))
    assert zbv(4, 8, 1) == dualpipev(4, 8, 1) == pytest.approx(3 / 51)  # (p-1) of 6m + p-1 slots
    assert zb(4, 8, 1) == pytest.approx(3 / 27)  # the same p-1 slots, each a whole stage's
    assert zbv(4, 4, 1) == pytest.approx(6 / 30)  # few micro-batches: 3p-1-2m = 3 slots more
    assert zbv(2, 3, 1) == pytest.approx(1 / 19) and dualpipev(2, 4, 1) == pytest.approx(1 / 25)


def test_played_in_the_interleaved_placement_a_v_table_is_another_schedule():
    # with c·p + r, rank 0's chunk 1 is piece 2: its B0 waits for piece 3's B0 (rank 1), which
    # waits for rank 1's F1 of piece 3, which waits for piece 2's F1, after that B0 on rank 0
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(zbv_zero_bubble(2, 4))


# -- bad input -----------------------------------------------------------------------------------
def test_bad_v_input_gets_one_clear_error():
    with pytest.raises(ValueError, match=r"DualPipeV needs at least as many micro-batches as "
                                         r"pieces \(2·pp = 8\), got microbatches=7"):
        make_schedule("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="virtual_stages=2 is for the interleaved schedule; 'zbv' "
                                         "runs two chunks per rank, in a V"):
        make_schedule("zbv", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1, got 0"):
        zbv_zero_bubble(0, 4)
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1, got 0"):
        dualpipe_v(2, 0)


# -- real runs ------------------------------------------------------------------------------------
def _worker(cfg, train, configs):
    """Each (schedule, m) from the same seed: one forward_backward. Returns each rank's loss,
    gradients, executed order and sends, and the gradients of PyTorch's own schedule run on the
    same pieces (its ``PipelineStage``s, gloo)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage

    from minitp import trace
    from minitp.models import build_model, loss_fn
    from minitp.models.train import synthetic_batches
    from minitp.pp import Pipeline, PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = synthetic_batches(cfg, train)[0]
    out = []
    for schedule, m in configs:
        pipe = Pipeline(build_model(cfg, seed=train.seed), None, schedule, m)
        with trace.recording(rank) as tr:
            record = pipe.forward_backward(tokens, targets)
        out.append({
            "loss": record.loss, "peak": record.peak_in_flight,
            "grads": {k: p.grad.detach().clone() for k, p in pipe.module.named_parameters()},
            "order": [(e.op, e.label) for e in tr.events if e.kind == "compute"],
            "sends": [(e.label, e.bytes) for e in tr.comm() if e.op == "send"],
        })
        model, pieces = build_model(cfg, seed=train.seed), [rank, 2 * world - 1 - rank]
        modules = [PipelineStage(model, k, 2 * world) for k in pieces]
        stages = [TorchStage(mod, k, 2 * world, torch.device("cpu")) for mod, k in zip(modules, pieces)]
        theirs = TORCH[schedule](stages, m, loss_fn=loss_fn)  # mean loss per micro-batch, grads / m
        if rank == 0:  # the first and the last piece: tokens in, targets in
            theirs.step(tokens, target=targets)
        else:
            theirs.step()
        out[-1]["torch"] = {k: p.grad.detach().clone() for mod in modules for k, p in mod.named_parameters()}
    return out


def _reference():
    model = build_model(CFG, seed=TRAIN.seed)
    tokens, targets = synthetic_batches(CFG, TRAIN)[0]
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    return loss.item(), {k: p.grad.detach() for k, p in model.named_parameters()}


@pytest.mark.parametrize("stages", [2, 4])
def test_v_schedules_on_several_ranks_match_one_process(stages):
    ms = {"zbv": [stages, 2 * stages], "dualpipev": [2 * stages, 4 * stages]}  # zbv: m < 2p-1 too
    configs = [(name, m) for name in ("zbv", "dualpipev") for m in ms[name]]
    ref_loss, ref_grads = _reference()
    results = launch(_worker, stages, CFG, TRAIN, configs, echo=False, timeout=240)
    whole = TRAIN.batch_size * TRAIN.seq_len * CFG.dim * 4  # B·S·D fp32: m messages of b·S·D
    for n, (name, m) in enumerate(configs):
        where = f"pp={stages} {name} m={m}"
        grads = {k: g for r in results for k, g in r[n]["grads"].items()}  # the ranks' pieces
        assert set(grads) == set(ref_grads), where
        assert runs.max_abs_diff(grads, ref_grads) <= 1e-5, where
        assert results[0][n]["loss"] == pytest.approx(ref_loss, abs=1e-5), where  # rank 0: loss
        assert all(r[n]["loss"] is None for r in results[1:]), where
        theirs = {k: g for r in results for k, g in r[n]["torch"].items()}
        assert runs.max_abs_diff(grads, theirs) <= 1e-5, where + " against torch.distributed.pipelining"
        table = make_schedule(name, stages, m)
        for s, r in enumerate(results):
            want = [(OPS[a.kind], f"mb{a.microbatch}/chunk{a.chunk}") for a in table[s]]
            assert r[n]["order"] == want, where  # executed order = the table
            assert r[n]["peak"] == SCHEDULES[name].peak_in_flight(stages, m, s, 1), where
            # rank s sends activations from piece s down (unless it is the last rank: the turn
            # stays on it) and from piece 2p-1-s up to rank s-1 (unless first: the loss is here);
            # gradients from piece s up to rank s-1 and from piece 2p-1-s down to rank s+1
            down, up = ([s] if s < stages - 1 else []), ([2 * stages - 1 - s] if s > 0 else [])
            back_up = [s] if s > 0 else []
            back_down = [2 * stages - 1 - s] if s < stages - 1 else []
            want = [f"pp/forward/mb{i}/piece{k}" for k in down + up for i in range(m)]
            want += [f"pp/backward/mb{i}/piece{k}" for k in back_up + back_down for i in range(m)]
            assert sorted(label for label, _ in r[n]["sends"]) == sorted(want), where
            assert sum(b for _, b in r[n]["sends"]) == len(down + up + back_up + back_down) * whole


def test_the_turn_of_the_v_is_handed_over_in_memory_on_one_rank():
    results = launch(_worker, 1, CFG, TRAIN, [("zbv", 2), ("dualpipev", 2)], echo=False,
                     timeout=120)
    ref_loss, ref_grads = _reference()
    for n in range(2):
        assert results[0][n]["sends"] == []
        assert runs.max_abs_diff(results[0][n]["grads"], ref_grads) <= 1e-5
        assert runs.max_abs_diff(results[0][n]["grads"], results[0][n]["torch"]) <= 1e-5
        assert results[0][n]["loss"] == pytest.approx(ref_loss, abs=1e-5)


@pytest.mark.parametrize("argv", [["run", "pp", "--schedule", "zbv"], ["run", "3d", "--schedule", "dualpipev"],
                                  ["train", "--pp", "2", "--schedule", "zbv"]])
def test_the_runners_refuse_a_v_schedule_before_any_process_starts(argv, capsys):
    # their stages' blocks and byte model are the interleaved placement's: a V schedule runs through Pipeline
    from minitp import cli

    assert cli.main(argv) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert set(RUNNER_SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb"}
