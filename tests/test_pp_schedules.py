"""Interleaved 1F1B and zero-bubble (ZB-H1): the tables as data, and real runs of them checked against
one process, ``torch.distributed.pipelining`` (``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``) and the formulas of ``minitp.cost``.

Every configuration of one pipeline depth runs in one launch, so the file stays near half a minute.
"""

import json

import pytest
import torch

from minitp import cli, cost, pp, runs
from minitp.launcher import launch
from minitp.models import TINY
from minitp.models.train import TrainConfig, train_reference
from minitp.pp import Action, interleaved_1f1b, simulate, zero_bubble_h1

CFG = TINY.with_(n_layers=8)  # 8 pieces: 4 stages × 2 chunks
TRAIN = TrainConfig(steps=2, batch_size=16)
OPS = {"F": "forward", "B": "backward", "W": "weight"}


def F(i, c=0):
    return Action("F", i, c)


def B(i, c=0):
    return Action("B", i, c)


def W(i):
    return Action("W", i)


# -- the tables ------------------------------------------------------------------------------------
def test_zero_bubble_runs_w_right_after_b_on_the_first_stage_and_holds_w_back_on_the_last():
    assert zero_bubble_h1(2, 4) == [
        [F(0), F(1), B(0), W(0), F(2), B(1), W(1), F(3), B(2), W(2), B(3), W(3)],
        [F(0), B(0), F(1), B(1), W(0), F(2), B(2), W(1), F(3), B(3), W(2), W(3)],  # its W's one behind
    ]


def test_interleaved_goes_through_the_chunks_p_microbatches_at_a_time():
    # rank 1 of 2 holds pieces 1 and 3: forwards of mb 0, 1 on chunk 0, then on chunk 1, ...
    assert interleaved_1f1b(2, 4, 2)[1][:6] == [F(0), F(1), F(0, 1), B(0, 1), F(1, 1), B(1, 1)]


@pytest.mark.parametrize("name, v", [("interleaved", 2), ("interleaved", 3), ("zb", 1)])
def test_each_table_runs_every_action_once_in_order_and_meets_its_ideal_bubble(name, v):
    for p in range(2, 6):
        for m in range(p, 4 * p + 1, p):  # m from p to 4p (interleaving needs multiples of p)
            schedule = pp.make_schedule(name, p, m, v)
            kinds = "FBW" if name == "zb" else "FB"
            for actions in schedule:
                assert sorted(actions) == sorted(Action(k, i, c) for k in kinds for i in range(m) for c in range(v))
                for i in range(m):
                    for c in range(v):
                        at = [actions.index(Action(k, i, c)) for k in kinds]
                        assert at == sorted(at), (p, m, i, c)  # F before B before W
            # F, B = 2F (a piece is 1/v of a stage); zero-bubble cuts B in equal halves B and W
            timelines = simulate(schedule, forward_time=1.0 / v, backward_time=2.0 / v)
            assert pp.bubble_fraction(timelines) == pytest.approx([cost.pp_bubble_fraction(p, m, name, v)] * p)
            peaks = [pp.peak_in_flight(a) for a in schedule]
            assert peaks == [cost.pp_peak_microbatches_in_flight(p, m, s, name, v) for s in range(p)]


def test_interleaving_divides_the_bubble_by_v_and_zero_bubble_cuts_it_to_a_third():
    p, m = 4, 8
    assert cost.pp_bubble_fraction(p, m, "interleaved", 2) == pytest.approx(3 / 19)
    assert cost.pp_bubble_fraction(p, m, "zb") == pytest.approx(3 / 27)  # (p-1) slots of 3m+p-1
    assert cost.pp_bubble_fraction(p, m, "1f1b") == pytest.approx(9 / 33)  # the same unit: 3(p-1) of 3(m+p-1)


def test_interleaving_sends_v_times_the_bytes():
    a = 16 * 16 * 64 * 4  # B·S·D·4
    assert [cost.pp_step_bytes(16, 16, 64, 4, s, virtual_stages=2) for s in range(4)] == [3 * a, 4 * a, 4 * a, 3 * a]
    assert [cost.pp_step_bytes(16, 16, 64, 2, s, virtual_stages=1) for s in range(2)] == [a, a]


# -- real runs ------------------------------------------------------------------------------------
def _worker(cfg, train, configs, torch_ms):
    """Each (schedule, m, v) from the same seed, AdamW; then, for m in ``torch_ms``, torch's own
    schedule on the same pieces. Returns what each rank saw, sent, held, and torch's parameters."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    from minitp import trace
    from minitp.models import build_model, loss_fn
    from minitp.models.train import make_optimizer, synthetic_batches
    from minitp.pp import Pipeline, PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = synthetic_batches(cfg, train)
    out = []
    for schedule, m, v in configs:
        with trace.recording(rank) as tr:
            pipe = Pipeline(build_model(cfg, seed=train.seed), None, schedule, m, virtual_stages=v)
            optimizer = make_optimizer(pipe.parameters(), train.lr)
            records = []
            for tokens, targets in batches:
                optimizer.zero_grad()
                records.append(pipe.forward_backward(tokens, targets))
                optimizer.step()
        got = {"state": pipe.state_dict(), "losses": [r.loss for r in records],
               "peak": max(r.peak_in_flight for r in records), "sent": tr.sent_bytes(),
               "order": [(e.op, e.label) for e in tr.events if e.kind == "compute"]}
        if m in torch_ms:
            model = build_model(cfg, seed=train.seed)
            pieces = [c * world + rank for c in range(v)]
            modules = [PipelineStage(model, k, world * v) for k in pieces]
            stages = [TorchStage(mod, k, world * v, torch.device("cpu")) for mod, k in zip(modules, pieces)]
            theirs = (ScheduleInterleaved1F1B if schedule == "interleaved" else ScheduleInterleavedZeroBubble)(
                stages, m, loss_fn=loss_fn)
            params = [q for mod in modules for q in mod.parameters()]
            opt = make_optimizer(params, train.lr)
            for tokens, targets in batches:
                opt.zero_grad()
                if rank == 0:
                    theirs.step(tokens)
                elif rank == world - 1:
                    theirs.step(target=targets)
                else:
                    theirs.step()
                opt.step()
            got["torch"] = {k: t.detach().clone() for mod in modules for k, t in mod.state_dict().items()}
        out.append(got)
    return out


@pytest.mark.parametrize("stages", [2, 4])
def test_interleaved_and_zero_bubble_match_one_process_torch_and_formulas(stages):
    ms = [stages, 2 * stages, 4 * stages]  # m from p to 4p
    configs = [(name, m, 2 if name == "interleaved" else 1) for name in ("interleaved", "zb") for m in ms]
    ref_losses, ref_model = train_reference(CFG, TRAIN)
    reference = {k: t.detach() for k, t in ref_model.state_dict().items()}
    results = launch(_worker, stages, CFG, TRAIN, configs, (ms[0], ms[-1]), echo=False, timeout=240)
    for n, (name, m, v) in enumerate(configs):
        where = f"pp={stages} {name} m={m} v={v}"
        full = {k: t for r in results for k, t in r[n]["state"].items()}  # the ranks' pieces put together
        assert set(full) == set(reference), where
        assert runs.max_abs_diff(full, reference) <= 1e-5, where
        assert results[-1][n]["losses"] == pytest.approx(ref_losses, abs=1e-6), where
        if "torch" in results[0][n]:
            theirs = {k: t for r in results for k, t in r[n]["torch"].items()}
            assert runs.max_abs_diff(full, theirs) <= 1e-5, where + " against torch.distributed.pipelining"
        table = pp.make_schedule(name, stages, m, v)
        for s, r in enumerate(results):
            want = [(OPS[a.kind], f"mb{a.microbatch}" + (f"/chunk{a.chunk}" if v > 1 else "")) for a in table[s]]
            assert r[n]["order"] == want * TRAIN.steps, where  # executed order = the table
            assert r[n]["sent"] == pytest.approx(
                cost.pp_run_bytes(16, 16, CFG.dim, stages, s, TRAIN.steps, virtual_stages=v)), where
            assert r[n]["peak"] == cost.pp_peak_microbatches_in_flight(stages, m, s, name, v), where


@pytest.mark.parametrize("args", [["--schedule", "interleaved", "--virtual-stages", "2"], ["--schedule", "zb"]])
def test_cli_runs_the_new_schedules_and_checks_them(tmp_path, args):
    path = tmp_path / "r.json"
    assert cli.main(["run", "pp", "--nprocs", "2", "--microbatches", "8", "--steps", "2", *args,
                     "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert runs.check(report) == []
    assert report["comm_bytes_traced"] == pytest.approx(report["comm_bytes_expected"])
    name, v = report["schedule"], report["virtual_stages"]
    assert report["bubble_fraction_expected"] == pytest.approx(cost.pp_bubble_fraction(2, 8, name, v))
    assert 0 < report["bubble_fraction_measured"] < 1
    assert report["peak_microbatches_in_flight"] == report["peak_microbatches_in_flight_expected"]


def test_an_interleaved_split_finer_than_the_model_is_refused():
    with pytest.raises(ValueError, match="pp=8 stages but the model has 4 blocks"):
        runs.run_pp(nproc=4, schedule="interleaved", virtual_stages=2, microbatches=4, steps=1)
    with pytest.raises(ValueError, match="virtual_stages=2 is for the interleaved schedule"):
        runs.run_pp(nproc=2, schedule="1f1b", virtual_stages=2, steps=1)


def test_the_3d_run_takes_zero_bubble_with_data_parallel_averaging_the_w_gradients():
    report = runs.run_3d(nproc=4, dp=2, tp=1, pp=2, schedule="zb", microbatches=2, steps=2)
    assert runs.check(report) == [] and report["schedule"] == "zb"


def test_the_3d_run_refuses_zero_bubble_under_fsdp_before_any_process_starts():
    with pytest.raises(ValueError, match="schedule='zb' with fsdp"):
        runs.run_3d(nproc=4, dp=2, tp=1, pp=2, fsdp=True, schedule="zb", microbatches=2, steps=1)
