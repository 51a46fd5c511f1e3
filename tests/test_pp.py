"""minitp.pp against its three oracles: the one-process run, PyTorch's ``torch.distributed.pipelining``,
and the byte, memory and bubble formulas of ``minitp.cost``; plus the schedules as data.

Every configuration of one pipeline depth runs in one launch (one after the other, each with its
own trace recording), so the file stays well under a minute and a half on two cores.
"""

import json
import time

import pytest
import torch

from minitp import cli, cost, pp, runs
from minitp.launcher import RankError, launch
from minitp.models import build_model, get_config, loss_fn
from minitp.models.train import TrainConfig, synthetic_batches, train_reference
from minitp.pp import Action, gpipe, one_f_one_b, simulate

CFG = get_config("tiny")
TRAIN = TrainConfig(steps=4, batch_size=8)
CONFIGS = [(schedule, m) for schedule in ("gpipe", "1f1b") for m in (1, 2, 4, 8)]  # m < p included


def F(i):
    return Action("F", i)


def B(i):
    return Action("B", i)


# -- the schedules, as data (no processes) ---------------------------------------------------------
def test_gpipe_runs_every_forward_then_every_backward():
    assert gpipe(2, 3) == [[F(0), F(1), F(2), B(2), B(1), B(0)]] * 2


def test_1f1b_warms_up_then_alternates_then_drains():
    assert one_f_one_b(3, 4) == [
        [F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)],  # 2 warm-up forwards
        [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)],  # 1
        [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)],  # the last stage: none
    ]
    assert one_f_one_b(4, 2)[0] == [F(0), F(1), B(0), B(1)]  # fewer micro-batches than warm-up slots


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_run_each_microbatch_forward_then_backward_once_and_never_deadlock(name):
    for p in range(1, 6):
        for m in range(1, 10):
            schedule = pp.make_schedule(name, p, m)
            for actions in schedule:
                assert sorted(actions) == sorted([F(i) for i in range(m)] + [B(i) for i in range(m)])
                assert all(actions.index(F(i)) < actions.index(B(i)) for i in range(m))
            timelines = simulate(schedule, forward_time=1.0, backward_time=2.0)  # B = 2F
            # the ideal bubble is the formula on every stage, for both schedules
            assert pp.bubble_fraction(timelines) == pytest.approx([cost.pp_bubble_fraction(p, m)] * p)
            peaks = [pp.peak_in_flight(a) for a in schedule]
            assert peaks == [cost.pp_peak_microbatches_in_flight(p, m, s, name) for s in range(p)]


def test_simulate_refuses_a_schedule_that_deadlocks():
    # stage 0 waits for the gradient of micro-batch 0 before sending micro-batch 1 forward, while
    # stage 1 wants micro-batch 1 before it runs the backward of 0
    bad = [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad)


def test_blocks_are_balanced_over_the_stages():
    assert pp.stage_blocks(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert pp.stage_blocks(5, 2) == [range(0, 3), range(3, 5)]  # the spare block to the first stage
    model = build_model(CFG)
    names = [set(pp.PipelineStage(model, s, 2).state_dict()) for s in range(2)]
    assert names[0] | names[1] == set(model.state_dict()) and not names[0] & names[1]
    assert "tok_embeddings.weight" in names[0] and {"norm.weight", "output.weight"} <= names[1]
    for s, blocks in enumerate(pp.stage_blocks(4, 2)):
        held = sum(p.numel() for p in pp.PipelineStage(model, s, 2).parameters())
        assert held == cost.pp_stage_params(CFG, len(blocks), s == 0, s == 1)


def test_stages_chained_on_one_process_give_the_models_logits():
    model = build_model(CFG)
    tokens = synthetic_batches(CFG, TRAIN)[0][0]  # (8, 16)
    h = tokens
    for s in range(3):  # blocks [0, 1], [2], [3]: each stage runs the model's own block loop on its share
        h = pp.PipelineStage(model, s, 3)(h)
    assert torch.equal(h, model(tokens))  # (8, 16, V), bit for bit


def test_a_stage_description_allocates_its_messages_in_the_stages_dtype_and_device():
    stage = pp.StageSpec.of(pp.PipelineStage(build_model(CFG).to(torch.bfloat16), 1, 2))
    assert (stage.index, stage.num_stages, stage.is_first, stage.is_last) == (1, 2, False, True)
    buffer = stage.boundary_buffer(2, 16)
    assert (buffer.shape, buffer.dtype, buffer.device) == ((2, 16, CFG.dim), torch.bfloat16, torch.device("cpu"))
    assert pp.StageSpec.of(pp.PipelineStage(build_model(CFG), 0, 2)).boundary_buffer(2, 16).dtype == torch.float32


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="pp=5 stages but the model has 4 blocks"):
        pp.stage_blocks(4, 5)
    with pytest.raises(ValueError, match="batch_size=10 is not divisible by microbatches=4"):
        pp.split_microbatches(torch.zeros(10, 16), 4)
    with pytest.raises(ValueError, match="unknown schedule 'zb-v'"):
        pp.make_schedule("zb-v", 2, 4)
    with pytest.raises(ValueError, match="microbatches=6 is not divisible by pp=4"):
        pp.make_schedule("interleaved", 4, 6, virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages=2 is for the interleaved schedule"):
        pp.make_schedule("1f1b", 4, 8, virtual_stages=2)
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1, got 0"):
        one_f_one_b(2, 0)


def test_pipeline_bytes_follow_the_boundaries():
    a = 8 * 16 * 64 * 4  # B·S·D·4: the whole batch's activation at one boundary
    assert [cost.pp_step_bytes(8, 16, 64, 4, s) for s in range(4)] == [a, 2 * a, 2 * a, a]
    assert cost.pp_step_bytes(8, 16, 64, 1, 0) == 0
    assert cost.pp_bubble_fraction(4, 8) == pytest.approx(3 / 11)


# -- real runs ------------------------------------------------------------------------------------
def _configs_worker(train, configs):
    """Each (schedule, m) from the same seed: 4 AdamW steps, then one SGD step of size 1 (which
    shows the accumulated gradient itself). Returns what each rank saw, sent and held."""
    import torch.distributed as dist

    from minitp import trace
    from minitp.models import build_model, get_config
    from minitp.models.train import make_optimizer, synthetic_batches
    from minitp.pp import Pipeline

    cfg, rank, out = get_config("tiny"), dist.get_rank(), []
    batches = synthetic_batches(cfg, train)
    for schedule, m in configs:
        with trace.recording(rank) as tr:
            pipe = Pipeline(build_model(cfg, seed=train.seed), None, schedule, m)
            optimizer = make_optimizer(pipe.parameters(), train.lr)
            records = []
            for tokens, targets in batches:
                optimizer.zero_grad()
                records.append(pipe.forward_backward(tokens, targets))
                optimizer.step()
        sgd = Pipeline(build_model(cfg, seed=train.seed), None, schedule, m)
        sgd.forward_backward(*batches[0])
        torch.optim.SGD(sgd.parameters(), lr=1.0).step()
        out.append({
            "state": pipe.state_dict(), "sgd_state": sgd.state_dict(),
            "losses": [r.loss for r in records], "peak": max(r.peak_in_flight for r in records),
            "sent": tr.sent_bytes(),
            "order": [(e.op, e.label) for e in tr.events if e.kind == "compute"],
            "sends": [e.label for e in tr.comm() if e.op == "send"],
        })
    return out


def _sgd_reference():
    model = build_model(CFG, seed=TRAIN.seed)
    tokens, targets = synthetic_batches(CFG, TRAIN)[0]
    loss_fn(model(tokens), targets).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_matches_single_process_and_formulas(stages):
    ref_losses, ref_model = train_reference(CFG, TRAIN)
    reference = {k: v.detach() for k, v in ref_model.state_dict().items()}
    sgd_reference = _sgd_reference()
    results = launch(_configs_worker, stages, TRAIN, CONFIGS, echo=False)
    for c, (schedule, m) in enumerate(CONFIGS):
        where = f"pp={stages} {schedule} m={m}"
        full = {k: v for r in results for k, v in r[c]["state"].items()}  # the stages put together
        assert runs.max_abs_diff(full, reference) <= 1e-5, where
        full_sgd = {k: v for r in results for k, v in r[c]["sgd_state"].items()}
        assert runs.max_abs_diff(full_sgd, sgd_reference) <= 1e-6, where  # the gradient itself
        assert results[-1][c]["losses"] == pytest.approx(ref_losses, abs=1e-6), where
        actions = pp.make_schedule(schedule, stages, m)
        for s, r in enumerate(results):
            got = r[c]
            # the recorded order of compute on each rank is its schedule, step after step
            ops = {"F": "forward", "B": "backward"}
            assert got["order"] == [(ops[a.kind], f"mb{a.microbatch}") for a in actions[s]] * TRAIN.steps, where
            assert got["peak"] == cost.pp_peak_microbatches_in_flight(stages, m, s, schedule), where
            assert got["sent"] == pytest.approx(cost.pp_run_bytes(8, 16, CFG.dim, stages, s, TRAIN.steps)), where
            forward = [f"pp/forward/mb{i}" for i in range(m)] if s < stages - 1 else []
            backward = [f"pp/backward/mb{a.microbatch}" for a in actions[s] if a.kind == "B"] if s > 0 else []
            assert sorted(got["sends"]) == sorted((forward + backward) * TRAIN.steps), where


def _with_torch_pipelining(train, m):
    """minitp's pipeline and torch.distributed.pipelining's, each schedule, from the same seed."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from minitp.models import build_model, get_config, loss_fn
    from minitp.models.train import make_optimizer, synthetic_batches
    from minitp.pp import Pipeline, PipelineStage
    from minitp.runs.pytorch import pipeline_step

    cfg, rank, world = get_config("tiny"), dist.get_rank(), dist.get_world_size()
    out = {}
    for name, torch_schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        ours = Pipeline(build_model(cfg, seed=train.seed), None, name, m)
        ours_opt = make_optimizer(ours.parameters(), train.lr)
        module = PipelineStage(build_model(cfg, seed=train.seed), rank, world)  # the same plain pieces
        schedule = torch_schedule(TorchStage(module, rank, world, torch.device("cpu")), m, loss_fn=loss_fn)
        theirs_opt = make_optimizer(module.parameters(), train.lr)
        losses = {"minitp": [], "torch": []}
        for tokens, targets in synthetic_batches(cfg, train):
            ours_opt.zero_grad()
            losses["minitp"].append(ours.forward_backward(tokens, targets).loss)
            ours_opt.step()
            theirs_opt.zero_grad()
            losses["torch"].append(pipeline_step(schedule, rank, world, tokens, targets))
            theirs_opt.step()
        out[name] = {"minitp": ours.state_dict(), "torch": {k: v.detach().clone() for k, v in
                                                            module.state_dict().items()}, "losses": losses}
    return out


@pytest.mark.parametrize("stages, m", [(2, 4), (4, 8)])
def test_pipeline_matches_torch_pipelining(stages, m):
    results = launch(_with_torch_pipelining, stages, TRAIN, m, echo=False, timeout=180)
    for name in ("gpipe", "1f1b"):
        ours = {k: v for r in results for k, v in r[name]["minitp"].items()}
        theirs = {k: v for r in results for k, v in r[name]["torch"].items()}
        assert set(ours) == set(theirs) == set(build_model(CFG).state_dict())
        assert runs.max_abs_diff(ours, theirs) <= 1e-5, name
        last = results[-1][name]["losses"]
        assert last["minitp"] == pytest.approx(last["torch"], abs=1e-6), name


def _stage_fails_at_microbatch_2():
    from minitp.models import build_model, get_config
    from minitp.models.train import synthetic_batches
    from minitp.pp import Pipeline

    cfg = get_config("tiny")
    pipe = Pipeline(build_model(cfg), None, "1f1b", 4)
    if pipe.stage == 1:
        calls = []

        def fail(module, args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("stage 1 failed in the forward of micro-batch 2")

        next(iter(pipe.module.layers.values())).register_forward_pre_hook(fail)
    pipe.forward_backward(*synthetic_batches(cfg, TrainConfig(steps=1))[0])


def test_a_failing_stage_does_not_hang_its_neighbours():
    t0 = time.perf_counter()
    with pytest.raises(RankError, match="micro-batch 2") as info:
        launch(_stage_fails_at_microbatch_2, 4, echo=False, timeout=120)
    assert info.value.rank == 1
    assert time.perf_counter() - t0 < 30  # ended by the failure, not by the timeout


def _bf16_pipeline(m):
    import torch.distributed as dist

    from minitp import trace
    from minitp.models import build_model, get_config
    from minitp.models.train import synthetic_batches
    from minitp.pp import Pipeline

    cfg = get_config("tiny")
    pipe = Pipeline(build_model(cfg).to(torch.bfloat16), None, "1f1b", m)
    with trace.recording(dist.get_rank()) as tr:
        record = pipe.forward_backward(*synthetic_batches(cfg, TrainConfig(steps=1))[0])
    grads = {p.grad.dtype for p in pipe.parameters()}
    return {"loss": record.loss, "messages": [(e.op, e.label, e.dtype) for e in tr.comm()], "grads": grads}


def test_a_bf16_pipeline_sends_and_receives_bf16():
    m = 2
    results = launch(_bf16_pipeline, 2, m, echo=False)
    for rank, r in enumerate(results):
        ops = sorted({op for op, _, _ in r["messages"]})
        assert ops == ["recv", "send"] and len(r["messages"]) == 2 * m, r["messages"]
        assert {dtype for _, _, dtype in r["messages"]} == {"bfloat16"}, f"rank {rank}: {r['messages']}"
        assert r["grads"] == {torch.bfloat16}
    assert results[-1]["loss"] == pytest.approx(float(torch.log(torch.tensor(CFG.vocab_size))), rel=0.05)


def _stage_of_another_rank():
    from minitp.models import build_model, get_config
    from minitp.pp import Pipeline, PipelineStage, StageSpec

    Pipeline(StageSpec.of(PipelineStage(build_model(get_config("tiny")), 0, 2)), None)


def test_a_stage_description_for_another_place_in_the_group_is_refused():
    with pytest.raises(RankError, match="stage given is stage 0 of 2, but this rank is stage 1 of the 2 ranks"):
        launch(_stage_of_another_rank, 2, echo=False, timeout=60)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cli_runs_pp_and_checks_it(tmp_path, capsys, schedule):
    path = tmp_path / "r.json"
    args = ["run", "pp", "--nprocs", "4", "--microbatches", "8", "--schedule", schedule, "--json", str(path)]
    assert cli.main(args) == 0
    report = json.loads(path.read_text())
    assert runs.check(report) == []
    assert report["comm_bytes_traced"] == pytest.approx(report["comm_bytes_expected"])
    assert report["bubble_fraction_expected"] == pytest.approx(3 / 11)
    assert 0 < report["bubble_fraction_measured"] < 1
    assert report["peak_microbatches_in_flight"] == report["peak_microbatches_in_flight_expected"]
    assert "bubble" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--nprocs", "5"], "pp=5 stages but the model has 4 blocks"),
    (["--nprocs", "2", "--microbatches", "3"], "batch_size=8 is not divisible by microbatches=3"),
])
def test_cli_refuses_bad_pipelines(capsys, args, message):
    assert cli.main(["run", "pp", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_sequence_longer_than_the_model_allows_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="seq_len=64 is not allowed: expected an integer from 1 to 32"):
        runs.run_pp(nproc=2, microbatches=2, steps=1, seq_len=64)
