"""The minitp command line: a run checked against its oracles, its JSON report, and bad input."""

import dataclasses
import json
import subprocess
import sys

import pytest

from minitp import cli, runs


def test_run_ddp_reports_a_match_on_every_oracle(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert cli.main(["run", "ddp", "--nprocs", "4", "--steps", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "check: matches the reference, the traced bytes and the memory formulas" in out
    report = json.loads(path.read_text())
    for key in ("strategy", "world_size", "layout", "loss", "reference_loss", "max_abs_param_diff",
                "comm_bytes_traced", "comm_bytes_expected", "memory", "wall_s"):
        assert key in report
    assert report["strategy"] == "ddp" and report["world_size"] == 4
    assert report["layout"] == {"dp": 4, "tp": 1, "pp": 1}
    assert len(report["loss"]) == len(report["reference_loss"]) == 3
    assert report["max_abs_param_diff"] <= 1e-5
    assert report["comm_bytes_traced"] == pytest.approx(report["comm_bytes_expected"])
    assert len(report["memory"]) == 4 and set(report["memory"][0]) == {"params", "grads", "optimizer"}
    assert runs.check(report) == []


def test_check_catches_a_run_that_drifted():
    report = runs.run_ddp(nproc=2, steps=1)
    assert runs.check(report) == []
    drifted = dataclasses.replace(report, max_abs_param_diff=1e-3, comm_bytes_traced=[0.0, 0.0])
    problems = runs.check(drifted)
    assert any("differ from the one-process reference by 0.001" in p for p in problems)
    assert sum("sent 0.0 bytes" in p for p in problems) == 2


@pytest.mark.parametrize("args, message", [
    (["--nprocs", "3"], "batch_size=8 is not divisible by nproc=3"),
    (["--bucket-mb", "0"], "--bucket-mb 0.0 is not allowed: expected a finite number > 0"),
    (["--nprocs", "0"], "--nprocs 0 is not allowed: expected an integer >= 1"),
    (["--seq-len", "64"], "--seq-len 64 is not allowed: expected an integer from 1 to 32, the model's max_seq_len"),
])
def test_bad_input_is_one_clear_line(args, message, capsys):
    assert cli.main(["run", "ddp", *args]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"minitp: error: {message}"


def test_the_installed_command_runs():
    out = subprocess.run([sys.executable, "-m", "minitp.cli", "run", "ddp", "--nprocs", "2", "--steps", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "minitp run ddp: 2 ranks (dp=2 tp=1 pp=1)" in out.stdout
