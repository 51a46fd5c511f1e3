"""minitp.launch under hostile conditions: bad arguments refused before any process starts, the rank
that died named (not a survivor), ranks listening on loopback only, the timeout kept under torchrun,
and no temporary folder left behind by a parent that was terminated or killed."""

import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import minitp
from minitp import comm
from minitp.launcher import RANK_MEMORY_BYTES, check_launch


def live_children() -> list[psutil.Process]:
    time.sleep(0.1)
    return [c for c in psutil.Process().children(recursive=True)
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def _return_rank():
    return dist.get_rank()


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """launch's temporary folders go to a folder of this test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


# -- 1. every argument is checked in the parent, before any process starts --------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"timeout": math.nan}, "timeout must be a finite number of seconds > 0, got nan"),
    ({"timeout": math.inf}, "timeout must be a finite number of seconds > 0, got inf"),
    ({"timeout": -1}, "timeout must be a finite number of seconds > 0, got -1"),
    ({"timeout": "5"}, "timeout must be a finite number of seconds > 0, got '5'"),
    ({"timeout": True}, "timeout must be a finite number of seconds > 0, got True"),
    ({"backend": "mpi"}, "unknown backend 'mpi'; expected one of gloo, nccl"),
    ({"start_method": "thread"}, "start_method must be None or one of .*fork.*spawn.*, got 'thread'"),
    ({"echo": "yes"}, "echo must be True or False, got 'yes'"),
    ({"max_procs": 0}, "max_procs must be an integer >= 1 or None, got 0"),
])
def test_each_bad_argument_is_refused_by_name_before_any_process_starts(kwargs, message, private_tmp):
    with pytest.raises(ValueError, match=message):
        minitp.launch(_return_rank, 2, **kwargs)
    assert live_children() == [] and list(private_tmp.iterdir()) == []


def test_a_function_that_is_not_callable_is_refused():
    with pytest.raises(ValueError, match="fn must be a callable to run on every rank, got int 3"):
        minitp.launch(3, 2)


def test_more_processes_than_memory_holds_are_refused_with_the_cap_and_how_to_lift_it(private_tmp, monkeypatch):
    monkeypatch.delenv("MINITP_MAX_PROCS", raising=False)
    cap = psutil.virtual_memory().available // RANK_MEMORY_BYTES
    asked = 2 * cap + 10  # far past the cap, however the available memory moves meanwhile
    with pytest.raises(ValueError) as info:
        minitp.launch(_return_rank, asked)
    message = str(info.value)
    said = re.match(rf"nprocs={asked} is more than the cap of (\d+) processes: each rank holds about 160 MiB", message)
    assert said and abs(int(said[1]) - cap) <= 2, message
    assert "GiB of memory is available" in message
    assert "pass max_procs=N to launch or set MINITP_MAX_PROCS=N" in message
    assert live_children() == [] and list(private_tmp.iterdir()) == []


def test_the_cap_is_lifted_by_the_argument_and_set_by_the_environment(monkeypatch):
    monkeypatch.delenv("MINITP_MAX_PROCS", raising=False)
    far = 2 * psutil.virtual_memory().available // RANK_MEMORY_BYTES + 10
    check_launch(far, max_procs=far)  # refused above by default; passes (check_launch starts nothing)
    monkeypatch.setenv("MINITP_MAX_PROCS", "2")
    with pytest.raises(ValueError, match="nprocs=3 is more than the cap of 2 processes: MINITP_MAX_PROCS=2 is set"):
        minitp.launch(_return_rank, 3)
    assert list(minitp.launch(_return_rank, 2, echo=False)) == [0, 1]
    with pytest.raises(ValueError, match="nprocs=2 is more than the cap of 1 processes: max_procs=1 was passed"):
        minitp.launch(_return_rank, 2, max_procs=1)  # the argument wins over the variable
    monkeypatch.setenv("MINITP_MAX_PROCS", "lots")
    with pytest.raises(ValueError, match="MINITP_MAX_PROCS must be an integer >= 1, got 'lots'"):
        minitp.launch(_return_rank, 2)


def test_a_bad_timeout_is_refused_under_torchrun_too(monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0, got nan"):
        minitp.launch(_return_rank, None, timeout=math.nan)


# -- 2. the rank that died is the cause, not a survivor's "connection closed" -----------------------
def _rank_one_kills_itself():
    if dist.get_rank() == 1:
        time.sleep(0.2)  # rank 0 is blocked in the all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.ones(3))
    time.sleep(30)


def _rank_one_waits_to_be_killed(pid_file):
    if dist.get_rank() == 1:
        Path(pid_file).write_text(str(os.getpid()))
        time.sleep(30)
    comm.all_reduce(torch.ones(3))
    time.sleep(30)


def _kill_when_written(pid_file: Path):
    deadline = time.time() + 20
    while not pid_file.exists() or not pid_file.read_text():
        if time.time() > deadline:
            return
        time.sleep(0.01)
    time.sleep(0.1)  # rank 0 is blocked in the all-reduce by now
    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _assert_rank_one_was_named_as_killed(info):
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 was killed by SIGKILL (signal 9) before returning a result, "
                                      "likely out of memory"), str(info.value)[:500]
    assert live_children() == []


def test_a_rank_that_kills_itself_is_named_every_time():
    t0 = time.perf_counter()
    for _ in range(20):
        with pytest.raises(minitp.RankError) as info:
            minitp.launch(_rank_one_kills_itself, 2, timeout=30, echo=False)
        _assert_rank_one_was_named_as_killed(info)
    print(f"20 self-kills: {time.perf_counter() - t0:.1f} s")


def test_a_rank_killed_from_outside_is_named_every_time(tmp_path):
    t0 = time.perf_counter()
    for attempt in range(20):
        pid_file = tmp_path / f"rank1-{attempt}.pid"
        killer = threading.Thread(target=_kill_when_written, args=(pid_file,))
        killer.start()
        try:
            with pytest.raises(minitp.RankError) as info:
                minitp.launch(_rank_one_waits_to_be_killed, 2, str(pid_file), timeout=30, echo=False)
        finally:
            killer.join()
        _assert_rank_one_was_named_as_killed(info)
    print(f"20 kills from outside: {time.perf_counter() - t0:.1f} s")


def _rank_one_segfaults():
    if dist.get_rank() == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0
    comm.all_reduce(torch.ones(3))


def test_a_rank_that_crashes_in_native_code_is_named_with_its_signal():
    with pytest.raises(minitp.RankError) as info:
        minitp.launch(_rank_one_segfaults, 2, timeout=30, echo=False)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 was killed by SIGSEGV (signal 11) before returning a result")
    assert "_rank_one_segfaults" in info.value.remote_traceback  # faulthandler's stack, from its stderr
    assert live_children() == []


# -- 3. local ranks listen on loopback only ---------------------------------------------------------
def _connect_then_wait_for(go_file, ready_dir):
    comm.all_reduce(torch.ones(3))  # every connection is up
    Path(ready_dir, f"rank{dist.get_rank()}").touch()
    deadline = time.time() + 30
    while not Path(go_file).exists() and time.time() < deadline:
        time.sleep(0.01)
    comm.all_reduce(torch.ones(3))


def test_ranks_listen_on_loopback_only_even_when_told_to_use_the_network(tmp_path, monkeypatch):
    network = [name for name, addresses in psutil.net_if_addrs().items()
               if any(a.family == socket.AF_INET and not a.address.startswith("127.") for a in addresses)]
    if network:  # what gloo would bind to if launch did not insist on loopback
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", network[0])
    go_file = tmp_path / "go"
    seen: dict[int, list] = {}

    def inspect_while_running():
        deadline = time.time() + 30
        while len(list(tmp_path.glob("rank*"))) < 2 and time.time() < deadline:
            time.sleep(0.01)
        for child in psutil.Process().children(recursive=True):
            seen[child.pid] = [c.laddr for c in child.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        go_file.touch()

    inspector = threading.Thread(target=inspect_while_running)
    inspector.start()
    minitp.launch(_connect_then_wait_for, 2, str(go_file), str(tmp_path), timeout=60, echo=False)
    inspector.join()
    listening = [address for addresses in seen.values() for address in addresses]
    assert len(seen) == 2 and len(listening) >= 2, seen  # each rank listens somewhere
    assert {address.ip for address in listening} == {"127.0.0.1"}, seen


# -- 4. the timeout holds under torchrun ------------------------------------------------------------
TORCHRUN_SCRIPT = textwrap.dedent("""
    import sys, time
    import minitp

    def sleep_past_the_timeout():
        time.sleep(60)

    def nothing():
        return 1

    fn = sleep_past_the_timeout if sys.argv[1] == "hang" else nothing
    minitp.launch(fn, None, timeout=3)
    print("RETURNED")
""")


def _run_as_torchrun_rank(tmp_path, world_size: int, what: str):
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "MINITP_WORKER"}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), what], capture_output=True, text=True, env=env, timeout=60)
    return out, time.perf_counter() - t0


def test_under_torchrun_a_rendezvous_that_never_completes_ends_at_the_timeout(tmp_path):
    out, seconds = _run_as_torchrun_rank(tmp_path, 2, "nothing")  # rank 1 of 2 never comes
    assert out.returncode != 0 and "RETURNED" not in out.stdout
    assert seconds < 20, seconds  # torch's own default would wait 30 minutes
    assert "rank 0 of 2" in out.stderr and "timeout=3 s" in out.stderr, out.stderr[-2000:]


def test_under_torchrun_a_function_that_runs_past_the_timeout_is_ended_with_its_stack(tmp_path):
    out, seconds = _run_as_torchrun_rank(tmp_path, 1, "hang")
    assert out.returncode == 124 and seconds < 20, (out.returncode, seconds)
    assert "rank 0 of 1 ran past timeout=3 s; ending this process" in out.stderr
    assert "sleep_past_the_timeout" in out.stderr  # where it was


def test_under_torchrun_a_run_within_the_timeout_returns_and_leaves_no_watchdog(tmp_path):
    out, _ = _run_as_torchrun_rank(tmp_path, 1, "nothing")
    assert out.returncode == 0 and "RETURNED" in out.stdout, out.stderr[-2000:]


# -- 5. no temporary folder outlives its run --------------------------------------------------------
PARENT_SCRIPT = textwrap.dedent("""
    import time
    import minitp

    def wait():
        time.sleep(60)

    minitp.launch(wait, 2, timeout=120)
""")


def _start_parent_and_wait_for_its_ranks(tmp_path):
    """A parent process running a 2-rank launch, its temporary folder and its ranks' pids."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MINITP_WORKER"} | {"TMPDIR": str(temp)}
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    deadline = time.time() + 60
    while time.time() < deadline:
        folders = list(temp.glob(f"minitp-{parent.pid}-*"))
        ranks = psutil.Process(parent.pid).children() if parent.poll() is None else []
        if folders and len(ranks) == 2 and all((folders[0] / f"rank{r}.out").exists() for r in range(2)):
            return parent, folders[0], [r.pid for r in ranks]
        time.sleep(0.05)
    parent.kill()
    raise AssertionError("the parent never started its two ranks")


def _gone(pids) -> bool:
    deadline = time.time() + 10
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_a_terminated_parent_ends_its_ranks_and_removes_its_folder(tmp_path):
    parent, folder, ranks = _start_parent_and_wait_for_its_ranks(tmp_path)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == -signal.SIGTERM  # it still dies by SIGTERM, as it would have
    assert not folder.exists()
    assert _gone(ranks)


def test_a_folder_left_by_a_killed_parent_is_removed_by_the_next_launch(tmp_path, monkeypatch):
    parent, folder, ranks = _start_parent_and_wait_for_its_ranks(tmp_path)
    parent.kill()
    parent.wait(timeout=30)
    assert folder.exists()  # nothing can clean up on SIGKILL
    assert _gone(ranks)  # the ranks die with their parent
    live_owner = folder.parent / f"minitp-{os.getppid()}-live"  # a folder whose owner still runs
    live_owner.mkdir()
    not_ours = folder.parent / "minitp-chromium-profile"
    not_ours.mkdir()
    learners = folder.parent / "minitp-2024-results"  # the launch's pattern, a dead "pid", no launch's mark
    learners.mkdir()
    (learners / "table.csv").write_text("step,loss\n1,4.87\n")
    other_mark = folder.parent / "minitp-2025-x"  # a mark naming another pid than its name: not proven ours
    other_mark.mkdir()
    (other_mark / ".minitp-launch").write_text("77\n")
    monkeypatch.setattr(tempfile, "tempdir", str(folder.parent))
    assert list(minitp.launch(_return_rank, 1, echo=False)) == [0]
    assert not folder.exists()
    assert live_owner.exists() and not_ours.exists()
    assert (learners / "table.csv").read_text() == "step,loss\n1,4.87\n" and other_mark.exists()
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted(
        [not_ours.name, live_owner.name, learners.name, other_mark.name])
