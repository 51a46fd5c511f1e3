"""``minitp train`` checked like every strategy: each layout equals one process on the same batches
(schedule and clipping included), the clipped global norm equals ``torch.nn.utils.clip_grad_norm_``, and
a run that loses a rank (minitp's launcher or torchrun restarting it, or resumed on another layout)
continues the uninterrupted run's curve. Tiny settings: a few steps on 30 files of the corpus."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from minitp import cli, trainer
from minitp.data import COURSE_CORPUS
from minitp.parallel3d import unshard_3d
from minitp.runs import sampling, training
from minitp.runs.train_log import read_log

BASE = trainer.Settings(steps=3, batch_size=8, seq_len=32, corpus=COURSE_CORPUS, eval_every=0, warmup=1, clip=0.5)
SMALL_RUN = ["--steps", "6", "--batch-size", "8", "--seq-len", "32", "--max-files", "30", "--eval-every", "3",
             "--save-every", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def reference():
    losses, norms, model = trainer.reference(BASE)
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def _whole(results) -> dict[str, torch.Tensor]:
    """The first replica's parameters, put together from its stages' tp slices."""
    first = [r for r in results if r["coords"][0] == 0]
    pp = max(r["coords"][1] for r in first) + 1
    tp = max(r["coords"][2] for r in first) + 1
    shards = [[None] * tp for _ in range(pp)]
    for r in first:
        shards[r["coords"][1]][r["coords"][2]] = r["shards"]
    return unshard_3d(shards)


LAYOUTS = [dict(dp=2), dict(dp=2, data_parallel="fsdp"), dict(tp=2), dict(pp=2, microbatches=2), dict(cp=2),
           dict(dp=2, tp=2), dict(tp=2, pp=2, microbatches=2), dict(dp=2, tp=2, data_parallel="fsdp"),
           dict(dp=2, pp=2, microbatches=2, data_parallel="fsdp", zero=1), dict(dp=2, tp=2, pp=2, microbatches=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_each_layout_equals_one_process_with_clipping(layout, reference):
    ref_losses, ref_norms, ref_params = reference
    assert min(ref_norms) > BASE.clip  # clipping acts at every step: the check covers it
    results = training.train(replace(BASE, **layout), echo=False, keep_shards=True)
    losses = next(r["losses"] for r in results if r["losses"])
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for r in results:  # every rank agrees on the global norm
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
    whole = _whole(results)
    assert set(whole) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(whole[name], p, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_expert_parallel_equals_one_process():
    s = replace(BASE, model="byte-moe")
    ref_losses, ref_norms, _ = trainer.reference(s)
    results = training.train(replace(s, dp=2, ep=2), echo=False)
    assert results[0]["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert results[0]["norms"] == pytest.approx(ref_norms, rel=1e-5)


def test_owned_gradients_count_every_element_once():
    """Planted: a norm counted on every rank (replicated weights twice, replicas twice) is larger."""
    def worker():
        from minitp.mesh import Mesh
        from minitp.parallel3d import Parallel3D

        mesh = Mesh(2, 1, 2)
        par = Parallel3D(trainer.build(BASE.config, 0), mesh)
        tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
        par.forward_backward(tokens, tokens.roll(-1, 1))
        owned = sum(g.pow(2).sum() for g in trainer.owned_gradients(par))
        every = sum(p.grad.pow(2).sum() for p in par.module.parameters())
        return float(owned), float(every)

    from minitp import launch

    values = launch(worker, 4, echo=False)
    model = trainer.build(BASE.config, 0)
    tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    from minitp.models import loss_fn

    loss_fn(model(tokens), tokens.roll(-1, 1)).backward()
    whole = sum(float(p.grad.pow(2).sum()) for p in model.parameters())
    assert sum(v[0] for v in values) == pytest.approx(whole, rel=1e-5)
    assert sum(v[1] for v in values) > 1.5 * whole  # what counting everything everywhere would give


def test_lr_warms_up_then_decays_to_its_floor():
    s = replace(BASE, steps=101, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    assert trainer.lr_at(0, s) == pytest.approx(1e-4)
    assert trainer.lr_at(9, s) == pytest.approx(1e-3)
    assert trainer.lr_at(55, s) == pytest.approx(0.55e-3)  # half-way down the cosine
    assert trainer.lr_at(100, s) == pytest.approx(1e-4)


def _log(out) -> list[dict]:
    return read_log(os.path.join(out, "log.jsonl"))


def _uninterrupted(tmp_path, extra=()) -> list[dict]:
    out = str(tmp_path / "whole")
    assert cli.main(["train", "--dp", "2", *SMALL_RUN, "--out", out, *extra]) == 0
    return _log(out)


def _same_curve(log: list[dict], whole: list[dict]) -> None:
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))  # every step once: a redone step replaces its record
    expected = {r["step"]: r for r in whole if "loss" in r}
    for r in steps:
        assert r["loss"] == pytest.approx(expected[r["step"]]["loss"], abs=1e-4), r["step"]
        assert ("val_loss" in r) == ("val_loss" in expected[r["step"]])
        if "val_loss" in r:
            assert r["val_loss"] == pytest.approx(expected[r["step"]]["val_loss"], abs=1e-4)


def test_a_killed_rank_restarts_from_the_checkpoint_and_continues_the_curve(tmp_path, capsys):
    whole = _uninterrupted(tmp_path)
    out = str(tmp_path / "killed")
    code = cli.main(["train", "--dp", "2", *SMALL_RUN, "--out", out, "--kill-at", "3", "--max-restarts", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "rank 1 was killed by SIGKILL (signal 9) at step 3: the failure --kill-at planted" in err
    assert "restart 1 of 1" in err
    log = _log(out)
    assert [r["step"] for r in log if r.get("event") == "start"] == [0, 2]  # resumed at the step-2 checkpoint
    _same_curve(log, whole)
    assert os.path.exists(os.path.join(out, "loss.png"))


def test_without_restarts_a_lost_rank_ends_the_run_and_another_layout_resumes_it(tmp_path, capsys):
    whole = _uninterrupted(tmp_path)
    out = str(tmp_path / "moved")
    # 4 ranks (dp 2 x tp 2) lose one at step 3; the checkpoint of step 2 goes on 2 ranks, tp 2
    assert cli.main(["train", "--dp", "2", "--tp", "2", *SMALL_RUN, "--out", out, "--kill-at", "3"]) == 1
    assert "rank 3 was killed by SIGKILL" in capsys.readouterr().err
    assert cli.main(["train", "--tp", "2", *SMALL_RUN, "--out", out, "--resume"]) == 0
    log = _log(out)
    starts = [r for r in log if r.get("event") == "start"]
    assert [(r["step"], r["world"]) for r in starts] == [(0, 4), (2, 2)]
    _same_curve(log, whole)


def test_torchrun_restarts_a_killed_rank_and_the_run_resumes(tmp_path):
    whole = _uninterrupted(tmp_path)
    out = str(tmp_path / "torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MINITP_WORKER")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "minitp.cli", "train", "--dp", "2", *SMALL_RUN, "--out", out,
           "--kill-at", "3", "--resume"]
    # its own session, so that on a failure torchrun and its workers end together
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    log = _log(out)
    assert [r["step"] for r in log if r.get("event") == "start"] == [0, 2]
    _same_curve(log, whole)


def test_ctrl_c_saves_a_checkpoint_and_resume_goes_on(tmp_path):
    out = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "minitp.cli", "train", "--dp", "2", "--steps", "400", "--batch-size", "8",
           "--seq-len", "32", "--max-files", "30", "--eval-every", "0", "--save-every", "0", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_steps(out)) < 3:
            time.sleep(0.2)
        assert _steps(out), "no step was logged"
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the parent and every rank
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "stopped by Ctrl-C" in err
    saved = json.loads((out / "checkpoint" / "index.json").read_text())["step"]
    assert saved == _steps(out)[-1] < 400


def _steps(out) -> list[int]:
    path = out / "log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


def test_sample_prints_the_prompt_and_what_the_model_writes(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert cli.main(["train", *SMALL_RUN, "--out", out]) == 0
    capsys.readouterr()
    assert cli.main(["sample", "--checkpoint", os.path.join(out, "checkpoint"), "--prompt", "def ",
                     "--tokens", "40", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text.rstrip("\n")) > 10
    model = sampling.load_for_sampling(os.path.join(out, "checkpoint"))
    assert sampling.sample(model, "import ", 30, seed=1) == sampling.sample(model, "import ", 30, seed=1)


def test_trace_out_holds_the_last_steps_messages(tmp_path):
    path = tmp_path / "trace.json"
    assert cli.main(["train", "--dp", "2", "--tp", "2", *SMALL_RUN, "--trace-out", str(path)]) == 0
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert any("clip/norm" in n for n in names) and any(n.startswith("forward") for n in names)


@pytest.mark.parametrize("argv, said", [
    (["--ep", "2", "--dp", "2"], "ep=2 needs a mixture of experts"),
    (["--seq-len", "300"], "longer than the model allows"),
    (["--dp", "2", "--batch-size", "7"], "batch_size=7 must divide by dp"),
    (["--resume"], "--resume needs --out"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--steps", "0"], "--steps 0 is not allowed"),
    (["--warmup", "5", "--steps", "5"], "warmup=5 must be from 0 to steps-1"),
    (["--nprocs", "4", "--dp", "2"], "--nprocs 4 but dp x tp x pp x cp = 2 x 1 x 1 x 1 = 2 processes"),
])
def test_bad_input_is_one_line_before_anything_starts(argv, said, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("processes were started for input that should have been refused")
    monkeypatch.setattr("minitp.launcher.launch", refuse)
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err


def test_an_out_folder_that_cannot_be_one_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("processes were started for input that should have been refused")
    monkeypatch.setattr("minitp.launcher.launch", refuse)
    (tmp_path / "a-file").write_text("mine")
    assert cli.main(["train", "--out", str(tmp_path / "a-file")]) == 2
    assert "is a file; expected a folder" in capsys.readouterr().err
    assert cli.main(["train", "--out", str(tmp_path / "a-file" / "below")]) == 2
    assert "cannot make the folder" in capsys.readouterr().err


def test_sample_refuses_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    assert cli.main(["sample"]) == 2
    assert "--checkpoint DIR is required" in capsys.readouterr().err
    assert cli.main(["sample", "--checkpoint", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "none" in err



def test_layout_auto_picks_the_fastest_predicted_layout_and_needs_a_calibration(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("processes were started for input that should have been refused")
    monkeypatch.setattr("minitp.launcher.launch", refuse)
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "none.json"))
    assert cli.main(["train", "--layout", "auto", "--nprocs", "4"]) == 2
    assert "minitp calibrate" in capsys.readouterr().err
    # a machine whose messages are free: the time model then splits the work evenly, and dp wastes nothing
    (tmp_path / "cal.json").write_text(json.dumps({"flops_per_s": 1e10, "bytes_per_s": 1e15, "alpha_s": 0.0}))
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "cal.json"))
    s, rows = training.auto_layout(BASE, 4)
    assert (s.dp, s.tp, s.pp) == (4, 1, 1) and rows[0]["step_s"] == min(r["step_s"] for r in rows)
    assert {(r["dp"], r["pp"], r["tp"]) for r in rows} == {(4, 1, 1), (2, 1, 2), (2, 2, 1), (1, 4, 1), (1, 1, 4),
                                                            (1, 2, 2)}
    # slow links and a fast core: the messages decide, and the pick is still the fastest predicted
    (tmp_path / "cal.json").write_text(json.dumps({"flops_per_s": 1e13, "bytes_per_s": 1e6, "alpha_s": 1e-2}))
    s, slow = training.auto_layout(BASE, 4)
    assert [r["step_s"] for r in slow] == sorted(r["step_s"] for r in slow)
    assert (s.dp, s.pp, s.tp) == (slow[0]["dp"], slow[0]["pp"], slow[0]["tp"]) != (4, 1, 1)
    assert cli.main(["train", "--layout", "auto", "--dp", "2"]) == 2
    assert "without --dp" in capsys.readouterr().err
