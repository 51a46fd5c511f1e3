"""minitp calibrate: this machine's figures for the time model, measured, fitted and stored."""

import json

import pytest

from minitp import calibrate, cli, cost


def test_alpha_and_beta_are_recovered_from_all_reduce_times_on_a_line():
    alpha, beta = 40e-6, 2e9  # 2 ranks: T = 2α + B/β
    times = {b: 2 * alpha + b / beta for b in (4, 2**14, 2**20, 2**22)}
    fitted = calibrate.fit_alpha_beta(times, 2)
    assert fitted == (pytest.approx(alpha), pytest.approx(beta))
    with pytest.raises(ValueError, match="do not grow with size"):
        calibrate.fit_alpha_beta({4: 1e-3, 2**20: 1e-4}, 2)


def test_a_calibration_is_measured_and_read_back_as_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "cal.json"))
    cal = calibrate.calibrate(repeats=3, sizes=(4, 2**16, 2**20))
    assert cal["flops_per_s"] > 1e8 and cal["alpha_s"] >= 0 and cal["bytes_per_s"] > 1e6
    assert cal["step_overhead_s"] >= 0 and cal["cores"] >= 1
    path = calibrate.save(cal)
    assert path == str(tmp_path / "cal.json") and json.loads(open(path).read()) == cal
    device = cost.this_machine()
    assert device.flops_per_s == cal["flops_per_s"] and device.intra.bytes_per_s == cal["bytes_per_s"]


def test_cli_calibrate_stores_unless_dry_run(tmp_path, monkeypatch, capsys):
    fixture = {"name": "fixture", "flops_per_s": 5e10, "flops_per_s_large": 6e10, "matmul_shape": [1, 2, 3],
               "step_overhead_s": 0.01, "alpha_s": 5e-5, "bytes_per_s": 1e9, "cores": 2}
    monkeypatch.setattr(calibrate, "calibrate", lambda: dict(fixture))
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "sub" / "cal.json"))
    assert cli.main(["calibrate", "--dry-run"]) == 0
    assert "50.00 GFLOP/s per rank" in capsys.readouterr().out and not (tmp_path / "sub").exists()
    assert cli.main(["calibrate", "--json", str(tmp_path / "out.json")]) == 0
    assert cost.load_calibration() == fixture == json.loads((tmp_path / "out.json").read_text())
    assert cli.main(["calibrate", "--json", str(tmp_path)]) == 2  # a folder: refused before measuring
