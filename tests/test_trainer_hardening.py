"""`minitp train` never loses a learner's work: a finished --out is not written over, one run holds its
--out, a signal to the parent saves and stops, a torn log line resumes, a damaged checkpoint is refused
before any rank starts and never restarted, and bad values are one line before any rank."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minitp import cli
from minitp.data import COURSE_CORPUS
from minitp.runs import training
from minitp.runs.train_log import read_log

RUN = ["--steps", "6", "--batch-size", "8", "--seq-len", "32", "--corpus", COURSE_CORPUS, "--eval-every", "0",
       "--save-every", "2", "--warmup", "1"]


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if the run gets as far as starting processes."""
    def refuse(*args, **kwargs):
        raise AssertionError("processes were started for input that should have been refused")
    monkeypatch.setattr("minitp.launcher.launch", refuse)


def _files(folder) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes (the lock file aside: a refused run may open it)."""
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names if name != training.LOCK}


def _log(out) -> list[dict]:
    return read_log(os.path.join(out, "log.jsonl"))


def test_a_finished_run_is_not_replaced_without_resume_or_overwrite(tmp_path, capsys):
    out = str(tmp_path / "a")
    assert cli.main(["train", *RUN, "--out", out]) == 0
    (tmp_path / "a" / "notes.txt").write_text("mine")
    before = _files(out)
    assert cli.main(["train", *RUN, "--steps", "4", "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a run (log.jsonl, loss.png, checkpoint): add --resume" in err[0]
    assert _files(out) == before  # nothing changed
    assert cli.main(["train", *RUN, "--steps", "4", "--out", out, "--overwrite"]) == 0
    assert [r["step"] for r in _log(out) if "loss" in r] == [1, 2, 3, 4]  # the 6-step run's log is gone
    assert (tmp_path / "a" / "notes.txt").read_text() == "mine"  # the learner's own file stays


def test_a_second_run_into_a_held_out_is_refused(tmp_path, capsys, no_ranks):
    out = tmp_path / "held"
    out.mkdir()
    with open(out / training.LOCK, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a run in progress holds it
        held.write("pid 12345\n")
        held.flush()
        assert cli.main(["train", *RUN, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is in use by another minitp train (pid 12345)" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_parent_alone_saves_the_step_and_resume_goes_on_bit_for_bit(tmp_path, signum):
    """Jupyter's Interrupt and ``timeout`` signal the parent alone: the ranks still save and leave."""
    steps = ["--dp", "2", *RUN, "--steps", "40", "--save-every", "0"]
    whole = tmp_path / "whole"
    assert cli.main(["train", *steps, "--out", str(whole)]) == 0
    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "minitp.cli", "train", *steps, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_steps(out)) < 3:
            time.sleep(0.05)
        assert _steps(out), "no step was logged"
        os.kill(proc.pid, signum)  # the parent only, not its process group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert proc.returncode == 128 + signum, err
    assert f"stopped by {name}" in err
    saved = json.loads((out / "checkpoint" / "index.json").read_text())["step"]
    assert saved == _steps(out)[-1] < 40
    assert cli.main(["train", *steps, "--out", str(out), "--resume"]) == 0
    assert [(r["step"], r["loss"]) for r in _log(out) if "loss" in r] == [
        (r["step"], r["loss"]) for r in _log(whole) if "loss" in r]


def _steps(out) -> list[int]:
    path = out / "log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")
            and '"loss"' in line]


def test_a_torn_last_log_line_is_dropped_once_and_the_run_resumes(tmp_path, capsys):
    out = tmp_path / "torn"
    assert cli.main(["train", *RUN, "--out", str(out)]) == 0
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 4.0')  # a crash in the middle of a line
    capsys.readouterr()
    assert cli.main(["train", *RUN, "--steps", "8", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert err.count("its last line was cut short") == 1
    assert [r["step"] for r in _log(out) if "loss" in r] == list(range(1, 9))


def test_a_damaged_line_inside_the_log_is_refused_in_one_line(tmp_path, capsys, no_ranks):
    out = tmp_path / "edited"
    out.mkdir()
    (out / "log.jsonl").write_text('{"event": "start", "step": 0}\nnot json\n{"step": 1, "loss": 5.0}\n')
    assert cli.main(["train", *RUN, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "log.jsonl, line 2, is not a JSON record" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("damage", ["file", "index"])
def test_a_damaged_checkpoint_is_refused_before_any_rank_and_never_restarted(tmp_path, capsys, monkeypatch, damage):
    out = tmp_path / "damaged"
    assert cli.main(["train", *RUN, "--out", str(out)]) == 0
    folder = out / "checkpoint"
    if damage == "file":
        (saved,) = [p for p in folder.glob("save-*/*.pt")]
        blob = bytearray(saved.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        saved.write_bytes(bytes(blob))
    else:
        (folder / "index.json").write_text('{"format": 1, "step": 6, "fold')  # torn while written
    capsys.readouterr()

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started for a checkpoint the parent could refuse")
    monkeypatch.setattr("minitp.launcher.launch", refuse)
    assert cli.main(["train", *RUN, "--steps", "8", "--out", str(out), "--resume", "--max-restarts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "restart" not in err, err
    assert ("torn or was changed" in err) if damage == "file" else ("damaged minitp checkpoint" in err
                                                                    and "not valid JSON" in err)


def test_a_refusal_in_a_rank_is_not_restarted():
    """A rank that raises ``ValueError``/``CheckpointError`` refuses its input: a restart would refuse again."""
    from minitp.launcher import RankError

    refused = RankError("rank 0 raised", 0, "Traceback...\nminitp.checkpoint.CheckpointError: x.pt is torn")
    lost = RankError("rank 1 was killed by SIGKILL", 1, "")
    assert training._refused(refused) and not training._refused(lost)


@pytest.mark.parametrize("argv, said", [
    (["--batch-size", "1000000000"], "this run needs about"),
    (["--max-restarts", "1"], "--max-restarts needs --out"),
    (["--cp", "3"], "seq_len=128 is not divisible by 2*cp=6"),
    (["--model", "byte-moe", "--ep", "3", "--dp", "3", "--batch-size", "6"], "n_experts=4 is not divisible by ep=3"),
    (["--seed", str(2**70)], "seed must be from 0 to 2**63 - 1"),
    (["--lr", "1e308"], "lr=1e+308 is far above"),
    (["--zero", "3"], "--zero 3 sets FSDP's stage: add --fsdp"),
    (["--corpus", "/no/such/folder"], "expected a folder of .py files or a .tar.gz"),
    (["--overwrite"], "need --out"),
    (["--model", "byte-moe", "--tp", "2"], "trains with tp = 1 and cp = 1"),
    (["--model", "byte-moe", "--cp", "2"], "trains with tp = 1 and cp = 1"),
])
def test_each_bad_value_is_one_line_before_any_rank(argv, said, capsys, no_ranks):
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err


def test_an_unwritable_corpus_cache_is_one_line_naming_it(tmp_path, capsys, monkeypatch, no_ranks):
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("MINITP_CACHE", str(tmp_path / "a-file" / "cache"))
    assert cli.main(["train", "--corpus", COURSE_CORPUS]) == 2
    err = capsys.readouterr().err.strip()
    assert "the corpus cache" in err and "MINITP_CACHE" in err and len(err.splitlines()) == 1, err


def test_sample_takes_any_temperature_and_any_bytes(tmp_path, capsys):
    out = tmp_path / "s"
    assert cli.main(["train", *RUN, "--out", str(out)]) == 0
    capsys.readouterr()
    folder = str(out / "checkpoint")
    assert cli.main(["sample", "--checkpoint", folder, "--temperature", "1e-40", "--tokens", "8"]) == 0
    greedy = capsys.readouterr().out
    assert cli.main(["sample", "--checkpoint", folder, "--temperature", "0", "--tokens", "8"]) == 0
    assert capsys.readouterr().out == greedy  # a temperature near 0 is the most likely byte each time
    latin1 = b"caf\xe9 ".decode("utf-8", errors="surrogateescape")  # as Python hands a non-UTF-8 argv
    assert cli.main(["sample", "--checkpoint", folder, "--prompt", latin1, "--tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("caf\ufffd ")
    assert cli.main(["sample", "--checkpoint", folder, "--temperature", "nan"]) == 2
    assert "--temperature nan is not allowed" in capsys.readouterr().err
