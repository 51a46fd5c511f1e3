"""Issue 24, round two: minitp's environment variables read one way (a flag is 1/0, true/false,
yes/no or on/off; anything else names the variable), torchrun's variables checked before a rank joins
with them, a rendezvous that works in any folder, and bad input said in one line: argparse's errors, a
3D mesh named as it was typed, why no layout is possible, bounds the planner and the runners serve at
once, and a memory estimate that counts a MoE's experts. None of these tests waits on a clock: each bad
value is refused before anything joins or starts."""

import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import psutil
import pytest
import torch
import torch.distributed as dist

import minitp
from minitp import cli, comm, plan
from minitp.launcher import check_launch, guard, progress
from minitp.models import get_config
from minitp.models.moe import moe_config
from minitp.runs import common

FLAG_ERROR = "expected 1/0, true/false, yes/no or on/off"


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """launch's temporary folders go to a folder of this test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def live_children() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True)
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def _return_rank():
    return dist.get_rank()


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- 1. one reader for minitp's variables -----------------------------------------------------------------
@pytest.mark.parametrize("raw, value", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" 1 ", True),
    ("0", False), ("false", False), ("False", False), ("no", False), ("OFF", False), ("", False),
])
def test_a_flag_reads_every_usual_spelling(raw, value, monkeypatch):
    monkeypatch.setenv("MINITP_SOME_FLAG", raw)
    assert guard.env_flag("MINITP_SOME_FLAG") is value


@pytest.mark.parametrize("raw", ["maybe", "2", "tru", "-1", "yes please"])
def test_a_flag_with_another_value_is_an_error_naming_the_variable_and_the_value(raw, monkeypatch):
    monkeypatch.setenv("MINITP_PROGRESS", raw)
    with pytest.raises(ValueError) as info:
        guard.env_flag("MINITP_PROGRESS")
    assert str(info.value) == f"MINITP_PROGRESS={raw!r}: {FLAG_ERROR}"


def test_an_unset_flag_is_its_default(monkeypatch):
    monkeypatch.delenv("MINITP_SOME_FLAG", raising=False)
    assert guard.env_flag("MINITP_SOME_FLAG") is False and guard.env_flag("MINITP_SOME_FLAG", True) is True


@pytest.mark.parametrize("raw", ["²", "١٢", "lots", "1.5", "0", "-3", "", "9" * 30])
def test_an_integer_variable_takes_ascii_digits_only_and_names_itself(raw, monkeypatch):
    monkeypatch.setenv("MINITP_MAX_PROCS", raw)
    with pytest.raises(ValueError) as info:
        guard.env_int("MINITP_MAX_PROCS")
    assert str(info.value) == f"MINITP_MAX_PROCS must be an integer >= 1, got {raw!r}"


def test_an_integer_variable_reads_its_value(monkeypatch):
    monkeypatch.setenv("MINITP_MAX_PROCS", " 12 ")
    assert guard.env_int("MINITP_MAX_PROCS") == 12
    monkeypatch.delenv("MINITP_MAX_PROCS")
    assert guard.env_int("MINITP_MAX_PROCS", 5) == 5


def test_progress_false_means_off(monkeypatch):
    monkeypatch.setenv("MINITP_PROGRESS", "false")
    assert not progress.enabled()
    monkeypatch.setenv("MINITP_PROGRESS", "on")
    assert progress.enabled()


@pytest.mark.parametrize("name, raw, message", [
    ("MINITP_PROGRESS", "maybe", f"MINITP_PROGRESS='maybe': {FLAG_ERROR}"),
    ("MINITP_MAX_PROCS", "²", "MINITP_MAX_PROCS must be an integer >= 1, got '²'"),
])
def test_a_bad_variable_is_refused_before_any_process_starts(name, raw, message, monkeypatch, private_tmp):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError) as info:
        minitp.launch(_return_rank, 2)
    assert str(info.value) == message
    assert live_children() == [] and list(private_tmp.iterdir()) == []


def test_the_command_line_names_a_bad_variable_in_one_line(monkeypatch, capsys, no_launch):
    monkeypatch.setenv("MINITP_PROGRESS", "maybe")
    assert cli.main(["run", "ddp"]) == 2
    assert one_error_line(capsys) == f"minitp: error: MINITP_PROGRESS='maybe': {FLAG_ERROR}"


@pytest.mark.parametrize("off", ["0", "false", "no"])
def test_skip_memory_check_set_to_off_keeps_the_check(off, monkeypatch, capsys, no_launch):
    monkeypatch.setattr(common, "available_memory", lambda: 8 * 2**30)
    monkeypatch.setenv("MINITP_MAX_PROCS", "64")
    monkeypatch.setenv("MINITP_SKIP_MEMORY_CHECK", off)
    assert cli.main(["run", "ddp", "--batch-size", "40000"]) == 2
    assert "this run needs about" in one_error_line(capsys)


def test_skip_memory_check_with_another_value_is_named(monkeypatch, capsys, no_launch):
    monkeypatch.setenv("MINITP_SKIP_MEMORY_CHECK", "perhaps")
    assert cli.main(["run", "ddp"]) == 2
    assert one_error_line(capsys) == f"minitp: error: MINITP_SKIP_MEMORY_CHECK='perhaps': {FLAG_ERROR}"


def test_minitp_live_is_read_as_a_flag(monkeypatch):
    pytest.importorskip("ipywidgets")
    from minitp.viz.explore import LIVE_ENV, explore

    calls = []

    def run(**setting):
        calls.append(setting)
        return setting["a"]

    monkeypatch.setenv(LIVE_ENV, "off")  # not live: the twin is built (was taken for live: not "", not "0")
    assert explore(run, lambda r, s: str(r), {"a": [1, 2]}).with_twin().twin
    monkeypatch.setenv(LIVE_ENV, "maybe")
    with pytest.raises(ValueError, match=f"MINITP_LIVE='maybe': {FLAG_ERROR}"):
        explore(run, lambda r, s: str(r), {"a": [1, 2]}).with_twin()


# -- MINITP_WORKER: a stale value is ignored; a real rank still cannot launch ------------------------------
def test_a_stale_minitp_worker_in_the_parent_is_ignored(monkeypatch, private_tmp):
    monkeypatch.setenv("MINITP_WORKER", "1")  # exported in a shell, or inherited from a rank
    assert list(minitp.launch(_return_rank, 2, echo=False)) == [0, 1]
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    assert guard.under_torchrun()  # torchrun's variables are what count, not a stale marker


def _launch_inside():
    return minitp.launch(_return_rank, 1)


def test_launch_inside_a_launched_rank_is_still_refused(private_tmp):
    with pytest.raises(minitp.RankError, match="launch\\(\\) was called inside a launched rank"):
        minitp.launch(_launch_inside, 1, echo=False)


# -- 2. torchrun's variables, checked before joining -------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_env(monkeypatch, **values):
    base = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in {**base, **values}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


STALE = "if torchrun did not start it, they are stale: unset them"


@pytest.mark.parametrize("values, said", [
    ({"RANK": "7"}, ["RANK=7 is not a rank of WORLD_SIZE=4: expected 0 to 3", STALE]),
    ({"RANK": "-1"}, ["RANK=-1 is not a rank of WORLD_SIZE=4: expected 0 to 3", STALE]),
    ({"RANK": "first"}, ["RANK must be an integer from 0 to WORLD_SIZE-1 = 3, got 'first'"]),
    ({"WORLD_SIZE": "abc"}, ["WORLD_SIZE must be an integer >= 1, got 'abc'", STALE]),
    ({"WORLD_SIZE": "0"}, ["WORLD_SIZE must be an integer >= 1, got '0'"]),
    ({"MASTER_ADDR": "no-such-host.invalid"}, ["MASTER_ADDR='no-such-host.invalid' does not resolve to an address"]),
    ({"MASTER_ADDR": ""}, ["MASTER_ADDR='' does not resolve to an address"]),
    ({"MASTER_PORT": None}, ["MASTER_PORT is not set", STALE]),
    ({"MASTER_PORT": "99999"}, ["MASTER_PORT must be a port number from 1 to 65535, got '99999'"]),
    ({"LOCAL_RANK": "x"}, ["LOCAL_RANK must be an integer >= 0, got 'x'"]),
    ({"MINITP_JOIN_TIMEOUT": "soon"}, ["MINITP_JOIN_TIMEOUT must be an integer >= 1, got 'soon'"]),
])
def test_torchrun_variables_are_checked_before_joining(values, said, monkeypatch):
    _torchrun_env(monkeypatch, **values)
    with pytest.raises(ValueError) as info:
        check_launch(4)
    message = str(info.value)
    assert all(part in message for part in said) and "\n" not in message, message


def test_good_torchrun_variables_pass(monkeypatch):
    _torchrun_env(monkeypatch, RANK="3", LOCAL_RANK="3", MASTER_ADDR="localhost")
    check_launch(4)
    check_launch(None)


def test_the_command_line_names_a_stale_torchrun_variable_in_one_line(monkeypatch, capsys, no_launch):
    _torchrun_env(monkeypatch, RANK="7")
    assert cli.main(["run", "ddp"]) == 2
    assert one_error_line(capsys).startswith("minitp: error: RANK=7 is not a rank of WORLD_SIZE=4")


def test_launch_under_stale_torchrun_variables_is_refused_before_joining(monkeypatch):
    _torchrun_env(monkeypatch, RANK="7")
    with pytest.raises(ValueError, match="RANK=7 is not a rank of WORLD_SIZE=4"):
        minitp.launch(_return_rank, None)
    assert not dist.is_initialized()


JOIN_SCRIPT = textwrap.dedent("""
    import minitp

    def nothing():
        return 1

    minitp.launch(nothing, None, timeout=120)
    print("RETURNED")
""")


def test_a_rank_whose_peers_never_come_names_the_variables_after_the_join_timeout(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(JOIN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MINITP_WORKER"}
    # rank 1 of 2: rank 0, who would listen on MASTER_PORT, never comes
    env.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               MINITP_JOIN_TIMEOUT="1")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=110)
    assert out.returncode != 0 and "RETURNED" not in out.stdout
    assert "rank 1 of 2 could not join the process group at 127.0.0.1:" in out.stderr, out.stderr[-2000:]
    assert "within 1 s" in out.stderr and "MINITP_JOIN_TIMEOUT" in out.stderr
    assert "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are stale" in out.stderr
    assert "ran past timeout" not in out.stderr  # the join said why, the watchdog did not have to


def test_the_join_waits_at_most_half_the_run(monkeypatch):
    monkeypatch.delenv("MINITP_JOIN_TIMEOUT", raising=False)
    assert guard.join_timeout(300) == 60 and guard.join_timeout(8) == 4
    monkeypatch.setenv("MINITP_JOIN_TIMEOUT", "100")
    assert guard.join_timeout(300) == 100


# -- 3. the rendezvous in a folder of any name --------------------------------------------------------------
def _sum_of_ranks():
    t = torch.full((2,), float(dist.get_rank() + 1))
    comm.all_reduce(t, label="sum")
    return t.tolist()


def test_launch_runs_in_a_temporary_folder_named_with_url_characters(tmp_path, monkeypatch):
    odd = tmp_path / "run ?x #2 %41 z"  # a file:// URL would cut the path at ? (and #), and %41 is no "A"
    odd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(odd))
    assert list(minitp.launch(_sum_of_ranks, 2, echo=False, timeout=60)) == [[3.0, 3.0], [3.0, 3.0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [odd.name]  # nothing written beside the folder
    assert [p.name for p in odd.iterdir() if p.name.startswith("minitp-")] == []  # and its own run's folder gone


# -- 4. messages ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, line", [
    (["run", "3d", "--dp", "x"], "minitp run 3d: error: argument --dp: invalid int value: 'x'"),
    (["plan", "--gpus", "x"], "minitp plan: error: argument --gpus: invalid int value: 'x'"),
    (["run", "ddp", "--steps", "1.5"], "minitp run ddp: error: argument --steps: invalid int value: '1.5'"),
    (["run", "ddp", "--bogus", "3"], "minitp run ddp: error: unrecognized arguments: --bogus 3"),
    (["plan", "--gpus", "8", "--nonsense"], "minitp plan: error: unrecognized arguments: --nonsense"),
    (["run", "ddp", "--model", "huge"], "minitp run ddp: error: argument --model: invalid choice: 'huge' "
                                       "(choose from 'tiny', 'small')"),
    (["run", "nothing"], "minitp run: error: argument STRATEGY: invalid choice: 'nothing'"),
    (["fly"], "minitp: error: argument command: invalid choice: 'fly'"),
])
def test_argparse_errors_are_one_line_without_the_usage_block(argv, line, capsys, no_launch):
    assert cli.main(argv) == 2
    err = one_error_line(capsys)
    assert err.startswith(line), err
    assert "usage:" not in err


def test_help_still_shows_the_usage(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "3d", "--help"])
    assert info.value.code == 0 and "usage: minitp run 3d" in capsys.readouterr().out


def test_a_3d_mesh_is_named_as_it_was_typed(capsys, no_launch):
    assert cli.main(["run", "3d", "--nprocs", "4", "--cp", "2"]) == 2
    err = one_error_line(capsys)
    assert "dp*cp*pp*tp = 2*2*2*2 = 16 but the world has 4 ranks (nproc=4" in err, err
    assert "4*2*2" not in err  # the mesh's dp axis (dp·cp) is nobody's input


def test_why_no_layout_is_possible_is_said(capsys):
    argv = ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "8", "--batch-size", "4", "--gpu-memory", "80"]
    assert cli.main(argv) == 2
    err = one_error_line(capsys)
    assert "no layout of 8 GPUs is possible" in err and "ep=8 must divide dp" in err, err
    assert "batch_size=4" in err and "a multiple of 8 sequences" in err, err


def test_why_no_layout_lists_the_reasons_when_no_one_rule_explains_it():
    refused = []
    assert plan.plan(get_config("tiny"), 1024, 80, batch_size=1, refused=refused) == []
    why = plan.why_no_layout(refused, 1024, 1)
    assert why.startswith("no layout of 1024 GPUs is possible for this model and batch: ")
    assert "batch_size=1 does not split into dp=" in why and "tp=8 does not divide n_kv_heads=4" in why


# -- 5. bounds served at once ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["run", "ep", "--capacity-factor", "1e308"],
     "--capacity-factor 1e+308 is not allowed: expected a finite number > 0 and at most 1048576"),
    (["run", "ep", "--experts", "2097152"], "--experts 2097152 is not allowed: expected an integer from 1 to 1048576"),
    (["run", "3d", "--ep", "2", "--experts", "2097152"],
     "--experts 2097152 is not allowed: expected an integer from 1 to 1048576"),
    (["plan", "--gpus", "1099511627776", "--cp", "2", "--gpu-memory", "80"],
     "--gpus 1099511627776 is not allowed: expected an integer from 1 to 1048576"),
])
def test_bounds_are_refused_in_one_line(argv, message, capsys, no_launch):
    assert cli.main(argv) == 2
    assert one_error_line(capsys) == f"minitp: error: {message}"


def test_the_planner_enumerates_divisors_only():
    for n in (1, 7, 8, 12, 64, 720):
        for per_node in (1, 4, 8, 1000):
            assert plan.candidate_layouts(n, per_node) == [x for x in plan.layouts(n) if x[2] <= per_node]
    assert plan.divisors(2**20) == [2**i for i in range(21)]
    rows = plan.plan(get_config("llama3-8b"), 2**20, 80)  # a million GPUs: 21 divisors, not a million tps
    assert rows and all(r["dp"] * r["pp"] * r["tp"] == 2**20 for r in rows)
    with pytest.raises(ValueError, match=r"gpus=2097152 is more than the planner's 1048576 \(2\*\*20\)"):
        plan.plan(get_config("llama3-8b"), 2**21, 80)


@pytest.mark.parametrize("argv", [
    ["run", "ep", "--experts", "1048576"],
    ["run", "3d", "--ep", "2", "--experts", "1048576"],
    ["run", "3d", "--ep", "2", "--tp", "1", "--experts", "1048576"],
])
def test_a_moe_too_big_for_this_machine_is_refused_in_the_parent(argv, monkeypatch, capsys, no_launch):
    monkeypatch.setattr(common, "available_memory", lambda: 64 * 2**30)
    monkeypatch.setenv("MINITP_MAX_PROCS", "64")
    monkeypatch.delenv("MINITP_SKIP_MEMORY_CHECK", raising=False)
    assert cli.main(argv) == 2
    err = one_error_line(capsys)
    assert err.startswith("minitp: error: this run needs about") and "64.0 GiB is available" in err, err
    assert "51.81 B parameters with 1048576 experts per block" in err and "fewer experts" in err, err


def test_the_estimate_counts_every_expert():
    tiny = get_config("tiny")
    moe = moe_config(tiny, n_experts=64)
    assert common.estimate_rank_bytes(moe, 2, 16) - common.estimate_rank_bytes(tiny, 2, 16) >= \
        16 * (moe.num_params() - tiny.num_params())
    assert common.built_config("ep", tiny, {"experts": 64, "top_k": 2}) == moe_config(tiny, n_experts=64, top_k=2)
    assert common.built_config("3d", tiny, {"ep": 1, "experts": 64}) is tiny
    assert common.built_config("3d", tiny, {"ep": 2, "experts": 64}).n_experts == 64
