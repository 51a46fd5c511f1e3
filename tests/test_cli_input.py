"""Bad input to ``minitp run`` / ``minitp plan`` and to the runners: refused in the parent, before any
process starts, with one line naming the option, the value and what is allowed (exit code 2)."""

import inspect
import json

import pytest

from minitp import cli, runs
from minitp.runs import common, registry


@pytest.mark.parametrize("argv, message", [
    (["run", "ddp", "--nprocs", "0"], "--nprocs 0 is not allowed: expected an integer >= 1"),
    (["run", "tp", "--nprocs", "0"], "--nprocs 0 is not allowed: expected an integer >= 1"),
    (["run", "swiglu", "--nprocs", "0"], "--nprocs 0 is not allowed: expected an integer >= 1"),
    (["run", "ddp", "--steps", "0"], "--steps 0 is not allowed: expected an integer from 1 to 10000"),
    (["run", "ddp", "--steps", "-1"], "--steps -1 is not allowed: expected an integer from 1 to 10000"),
    (["run", "ddp", "--steps", "100000000"], "--steps 100000000 is not allowed: expected an integer from 1 to 10000"),
    (["run", "ddp", "--batch-size", "0"], "--batch-size 0 is not allowed: expected an integer >= 1"),
    (["run", "ddp", "--batch-size", "-4"], "--batch-size -4 is not allowed: expected an integer >= 1"),
    (["run", "ddp", "--timeout", "nan"], "--timeout nan is not allowed: expected a finite number > 0"),
    (["run", "ddp", "--timeout", "inf"], "--timeout inf is not allowed: expected a finite number > 0"),
    (["run", "ddp", "--timeout", "0"], "--timeout 0.0 is not allowed: expected a finite number > 0"),
    (["run", "ddp", "--bucket-mb", "nan"], "--bucket-mb nan is not allowed: expected a finite number > 0"),
    (["run", "pp", "--microbatches", "0"], "--microbatches 0 is not allowed: expected an integer >= 1"),
    (["run", "3d", "--microbatches", "0"], "--microbatches 0 is not allowed: expected an integer >= 1"),
    (["run", "3d", "--dp", "0"], "--dp 0 is not allowed: expected an integer >= 1"),
    (["run", "3d", "--nprocs", "4"], "dp*pp*tp = 2*2*2 = 8 but the world has 4 ranks"),
    (["run", "3d", "--nprocs", "4", "--cp", "2"], "dp*cp*pp*tp = 2*2*2*2 = 16 but the world has 4 ranks"),
    (["run", "ep", "--capacity-factor", "1e308"], "--capacity-factor 1e+308 is not allowed: expected a finite "
                                                  "number > 0 and at most 1048576"),
    (["plan", "--gpus", "1099511627776", "--cp", "2"], "--gpus 1099511627776 is not allowed: expected an integer "
                                                       "from 1 to 1048576"),
    (["run", "tp", "--seq-len", "33"], "--seq-len 33 is not allowed: expected an integer from 1 to 32"),
    (["run", "ddp", "--nprocs", "100000"], "nprocs=100000 is more than the cap of"),
    (["run", "ddp", "--json", "/nonexistent/dir/r.json"], "--json /nonexistent/dir/r.json: the folder "
                                                          "/nonexistent/dir does not exist"),
    (["plan", "--gpus", "0", "--gpu-memory", "80"], "--gpus 0 is not allowed: expected an integer >= 1"),
    (["run", "ep", "--aux-loss-coef", "-0.1"], "--aux-loss-coef -0.1 is not allowed: expected a finite number >= 0"),
    (["run", "ep", "--capacity-factor", "0"], "--capacity-factor 0.0 is not allowed: expected a finite number > 0"),
    (["plan", "--gpus", "8", "--gpu-memory", "nan"], "--gpu-memory nan is not allowed: expected a finite number > 0"),
    (["plan", "--gpu-memory", "80"], "--gpus is required"),
    (["plan", "--gpus", "8", "--gpu-memory", "80", "--dim", "0"], "--dim 0 is not allowed: expected an integer >= 1"),
])
def test_bad_argument_is_one_line_naming_it(argv, message, capsys, no_launch):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minitp: error: ") and message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_run_too_big_for_this_machine_is_refused(capsys, no_launch, monkeypatch):
    monkeypatch.setattr(common, "available_memory", lambda: 8 * 2**30)
    monkeypatch.setenv("MINITP_MAX_PROCS", "64")  # the process cap reads memory too: keep it out of the way
    assert cli.main(["run", "ddp", "--batch-size", "40000"]) == 2
    err = capsys.readouterr().err
    assert "this run needs about" in err and "8.0 GiB is available" in err


def test_output_folders_are_checked_before_training(tmp_path, capsys, no_launch):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert cli.main(["run", "3d", "--save-to", str(a_file)]) == 2
    assert "is a file; expected a folder" in capsys.readouterr().err
    assert cli.main(["run", "3d", "--save-to", str(tmp_path / "no" / "such")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["run", "ddp", "--json", str(tmp_path)]) == 2
    assert "is a folder; expected a file name" in capsys.readouterr().err


# one process, one step of two sequences of 16 bytes, on 30 files of the corpus (fewer may leave the
# validation split empty): seconds
TINY_TRAIN = ["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--max-files", "30",
              "--eval-every", "0"]


def test_train_writes_a_trace_into_the_out_folder_it_makes(tmp_path, capsys):
    """``--out runs/t0 --trace-out runs/t0/trace.json`` into a fresh folder: train makes runs/t0, so the
    trace may name it before it exists."""
    out = tmp_path / "runs" / "t0"
    trace = out / "trace.json"
    assert cli.main([*TINY_TRAIN, "--out", str(out), "--trace-out", str(trace)]) == 0, capsys.readouterr().err
    assert json.loads(trace.read_text())["traceEvents"]
    assert (out / "log.jsonl").is_file()
    assert f"the last step's trace written to {trace}" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["elsewhere/trace.json", "t0/below/trace.json"])
def test_train_refuses_a_trace_into_a_folder_it_will_not_make_before_anything_starts(where, tmp_path, capsys,
                                                                                      monkeypatch):
    """Only --out itself is made: a trace into another missing folder (or one below --out) is refused in
    one line, before --out is made or any process starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("processes were started for input that should have been refused")
    monkeypatch.setattr("minitp.launcher.launch", refuse)
    out, trace = tmp_path / "t0", tmp_path / where
    assert cli.main([*TINY_TRAIN, "--out", str(out), "--trace-out", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"minitp: error: --trace-out {trace}: the folder {trace.parent} does not exist", err
    assert not out.exists()


def test_runners_refuse_the_same_values_from_python(no_launch):
    with pytest.raises(ValueError, match="steps=0 is not allowed"):
        runs.run_ddp(steps=0)
    with pytest.raises(ValueError, match="timeout=nan is not allowed"):
        runs.run_fsdp(timeout=float("nan"))
    with pytest.raises(ValueError, match="microbatches=0 is not allowed"):
        runs.run_pp(microbatches=0)
    with pytest.raises(ValueError, match="nproc=0 is not allowed"):
        runs.run_swiglu(nproc=0)


@pytest.mark.parametrize("strategy, own, foreign", [
    ("ddp", ["--bucket-mb"], ["--zero", "--microbatches", "--dp", "--save-to", "--sequence-parallel"]),
    ("fsdp", ["--zero", "--no-prefetch"], ["--microbatches", "--schedule", "--dp", "--tp", "--pp", "--save-to"]),
    ("pp", ["--microbatches", "--schedule"], ["--zero", "--bucket-mb", "--dp", "--save-to"]),
    ("3d", ["--dp", "--tp", "--pp", "--save-to"], ["--bucket-mb", "--sequence-parallel"]),
])
def test_each_strategy_help_lists_its_own_options_only(strategy, own, foreign, capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", strategy, "--help"])
    text = capsys.readouterr().out
    for flag in own + ["--nprocs", "--steps", "--json"]:
        assert flag in text, flag
    for flag in foreign:
        assert flag not in text, flag


def test_every_registered_option_is_a_keyword_of_its_runner_with_the_same_default():
    assert set(registry.STRATEGIES) == {"ddp", "fsdp", "hsdp", "tp", "swiglu", "pp", "3d", "cp", "ep"}
    for name, strategy in registry.STRATEGIES.items():
        assert strategy.runner is getattr(runs, f"run_{name}")
        signature = inspect.signature(strategy.runner).parameters
        for option in strategy.all_options():
            assert option.name in signature, (name, option.name)
            assert signature[option.name].default == option.default, (name, option.name)


def test_zero_is_allowed_where_it_means_off_and_refused_where_it_means_nothing():
    ep = {o.name: o for o in registry.STRATEGIES["ep"].options}
    ep["aux_loss_coef"].check(0.0)  # no load-balancing loss: a setting, not a mistake
    common_options = {o.name: o for o in registry.COMMON}
    for name in ("lr", "timeout"):
        with pytest.raises(registry.OptionError, match="> 0"):
            common_options[name].check(0.0)
