"""minitp.launch: results and output in rank order, failures end the run fast, nothing left behind."""

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import minitp
from minitp import comm


def no_children_left() -> bool:
    """No rank is left. (Where ranks start by spawn, on a machine with a GPU, multiprocessing keeps one
    resource tracker for the whole parent's life: it is not a rank.)"""
    time.sleep(0.2)
    return [c for c in psutil.Process().children(recursive=True) if c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())] == []


def _rank_and_world(offset):
    print(f"I am rank {dist.get_rank()} of {dist.get_world_size()}")
    return dist.get_rank() + offset


def test_results_and_output_come_back_in_rank_order(capsys):
    results = minitp.launch(_rank_and_world, 4, 100)
    assert list(results) == [100, 101, 102, 103]
    assert results.outputs == [f"I am rank {r} of 4\n" for r in range(4)]
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"[rank {r}] I am rank {r} of 4" for r in range(4)]
    assert no_children_left()


def test_one_rank_runs_without_a_second_process():
    assert list(minitp.launch(_rank_and_world, 1, 7, echo=False)) == [7]


def _all_reduce_labelled():
    t = torch.ones(6)
    comm.all_reduce(t, label="demo")
    return t.sum().item()


def test_each_ranks_trace_comes_back():
    results = minitp.launch(_all_reduce_labelled, 3, echo=False)
    assert list(results) == [18.0] * 3
    for rank, tr in enumerate(results.traces):
        (event,) = tr.comm()
        assert (tr.rank, event.op, event.label, event.group, event.bytes) == (rank, "all_reduce", "demo",
                                                                             (0, 1, 2), 24)
        assert event.sent_bytes == pytest.approx(2 * 2 / 3 * 24)
    assert results.sent_bytes() == pytest.approx([32.0] * 3)


def _raise_on_rank_two():
    if dist.get_rank() == 2:
        raise ValueError("rank two refuses")
    comm.all_reduce(torch.ones(3))  # the others wait in a collective rank 2 never joins
    time.sleep(60)


def test_a_raising_rank_ends_the_run_with_its_traceback():
    t0 = time.perf_counter()
    with pytest.raises(minitp.RankError) as info:
        minitp.launch(_raise_on_rank_two, 4, timeout=60, echo=False)
    assert time.perf_counter() - t0 < 10
    assert info.value.rank == 2
    assert "ValueError: rank two refuses" in str(info.value)
    assert "_raise_on_rank_two" in info.value.remote_traceback
    assert no_children_left()


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(120)
    comm.all_reduce(torch.ones(3))


def test_a_hanging_rank_ends_in_a_timeout_that_shows_where_each_rank_was():
    t0 = time.perf_counter()
    with pytest.raises(minitp.LaunchTimeout) as info:
        # fork: a few seconds' timeout must not be spent importing torch (spawn, the default beside a GPU)
        minitp.launch(_hang_on_rank_one, 3, timeout=3, echo=False, start_method="fork")
    assert time.perf_counter() - t0 < 10
    assert "timed out after 3 s" in str(info.value)
    assert "_hang_on_rank_one" in info.value.stacks[1]
    assert "all_reduce" in info.value.stacks[0]
    assert "  rank 0: in all_reduce over ranks (0, 1, 2), shape (3,), for " in str(info.value)
    assert "  rank 1: not in a minitp.comm call, in _hang_on_rank_one (test_launch.py:" in str(info.value)
    assert no_children_left()


# -- a timeout names the call each stuck rank waits in, and the likely mistake ---------------------------
def _stuck(pattern):
    r = dist.get_rank()
    if pattern == "both receive":
        comm.irecv(torch.ones(4), 1 - r, label="grad").wait()
    elif pattern == "blocking send both ways":  # gloo holds a send until the other side receives it
        comm.send(torch.ones(2, 8, 64), 1 - r, label=f"from{r}")
        comm.recv(torch.ones(2, 8, 64), 1 - r)
    elif pattern == "collectives in another order":
        calls = [lambda: comm.all_reduce(torch.ones(4), async_op=True).wait(),
                 lambda: comm.all_gather(torch.ones(8), torch.ones(4))]
        for call in calls if r == 0 else calls[::-1]:
            call()


@pytest.mark.parametrize("pattern, lines, likely", [
    ("both receive", ['  rank 0: in irecv(...).wait() from rank 1, label "grad", shape (4,), for ',
                      '  rank 1: in irecv(...).wait() from rank 0, label "grad", shape (4,), for '],
     "Every stuck rank waits to receive: a send is missing or goes the wrong way."),
    ("blocking send both ways", ['  rank 0: in send to rank 1, label "from0", shape (2, 8, 64), for ',
                                 '  rank 1: in send to rank 0, label "from1", shape (2, 8, 64), for '],
     "Rank 0's send waits for rank 1 to receive it, but rank 1 is in send to rank 0: a blocking send returns only "
     "once the other side receives, so post one side with isend (or receive first on one side)."),
    ("collectives in another order", ["  rank 0: in all_reduce(..., async_op=True).wait() over ranks (0, 1), "
                                      "shape (4,), for ",
                                      "  rank 1: in all_gather over ranks (0, 1), shape (8,), for "],
     "The ranks call collectives in a different order: every rank of a group must make the same collectives, in the "
     "same order."),
])
def test_a_timeout_names_the_call_each_rank_waits_in_and_the_likely_mistake(pattern, lines, likely):
    with pytest.raises(minitp.LaunchTimeout) as info:
        minitp.launch(_stuck, 2, pattern, timeout=3, echo=False, start_method="fork")
    summary = info.value.summary.splitlines()
    assert len(summary) == 3 and all(got.startswith(want) for got, want in zip(summary, lines)), summary
    assert summary[2] == likely
    assert info.value.summary in str(info.value)  # the message says it too, before the stacks
    assert info.value.calls[0]["peer"] in (1, None) and set(info.value.calls) == {0, 1}
    assert no_children_left()


def test_the_likely_mistake_is_named_only_for_a_known_pattern():
    from minitp.launcher.stuck import likely_mistake

    def call(op, peer=None, label="", shape=(4,), group=(0, 1)):
        return {"call": op, "op": op, "peer": peer, "label": label, "group": list(group), "shape": list(shape)}

    assert likely_mistake({0: call("send", 1)}, returned=[1]) == \
        "Rank 0's send to rank 1 waits for a receive, but rank 1 returned: a recv is missing."
    assert likely_mistake({0: call("all_reduce", shape=(4,)), 1: call("all_reduce", shape=(6,))}, []) == \
        "The ranks called all_reduce with different shapes ((4,), (6,)): every rank passes the same."
    assert likely_mistake({2: call("all_reduce", group=(0, 1, 2))}, returned=[0, 1]) == \
        "Ranks 0, 1 returned without joining all_reduce: every rank of the group must call it."
    assert likely_mistake({0: call("send", 1), 1: call("recv", 0)}, []) == ""  # matched: not a known mistake
    assert likely_mistake({0: call("recv", 1), 1: {"where": "sleep (x.py:3)"}}, []) == ""  # one rank not in comm
    assert likely_mistake({0: call("all_reduce"), 1: call("recv", 0)}, []) == ""


def _exit_hard():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(60)


def test_a_rank_that_dies_without_python_traceback_is_reported():
    with pytest.raises(minitp.RankError, match="rank 1 died with exit code 3"):
        minitp.launch(_exit_hard, 2, timeout=30, echo=False)
    assert no_children_left()


def _unpicklable():
    return lambda_holder()


class lambda_holder:
    def __reduce__(self):
        raise TypeError("cannot pickle this")


def test_a_return_value_that_cannot_be_sent_back_is_a_clear_error():
    with pytest.raises(minitp.RankError, match="could not be pickled"):
        minitp.launch(_unpicklable, 2, echo=False)


@pytest.mark.parametrize("nprocs", [0, -1, "4", 2.0, True, None])
def test_nprocs_must_be_a_positive_integer(nprocs):
    with pytest.raises(ValueError, match="nprocs must be an integer >= 1"):
        minitp.launch(_rank_and_world, nprocs, 0)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'mpi'; expected one of gloo, nccl"):
        minitp.launch(_rank_and_world, 2, 0, backend="mpi")


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout must be"):
        minitp.launch(_rank_and_world, 2, 0, timeout=0)


SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import minitp
    from minitp import comm

    def work(scale):  # defined in __main__: a new process could not import it
        t = torch.full((2,), float(dist.get_rank()))
        comm.all_reduce(t, label="script")
        print("sum", t.tolist())
        return t.sum().item() * scale

    if __name__ == "__main__":
        results = minitp.launch(work, int(sys.argv[1]), 10, start_method=sys.argv[2] if len(sys.argv) > 2 else None)
        if os.environ.get("RANK", "0") == "0":  # the parent, or rank 0 under torchrun
            print("RESULT", json.dumps({"values": list(results), "ops": [e.op for e in results.events]}))
""")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_functions_from_a_scripts_main_run(tmp_path, start_method):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), "2", start_method], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[rank 0] sum [1.0, 1.0]" in out.stdout and "[rank 1] sum [1.0, 1.0]" in out.stdout
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result == {"values": [20.0, 20.0], "ops": ["all_reduce", "all_reduce"]}


def test_the_same_worker_code_runs_under_torchrun(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), "2"], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result == {"values": [20.0, 20.0], "ops": ["all_reduce", "all_reduce"]}


def test_launch_under_torchrun_refuses_a_different_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=r"launch\(nprocs=4\) under torchrun, whose WORLD_SIZE is 2"):
        minitp.launch(_rank_and_world, 4, 0)


def _mismatched_shapes():
    # gloo lets the ranks with 4 elements return with an undefined result; the odd one out waits
    comm.all_reduce(torch.ones(6 if dist.get_rank() == 2 else 4))


def test_a_timeout_says_which_ranks_returned_and_which_were_still_inside():
    with pytest.raises(minitp.LaunchTimeout) as info:
        minitp.launch(_mismatched_shapes, 4, timeout=4, echo=False, start_method="fork")
    message = str(info.value)
    assert "ranks [2] of 4 were still inside the function" in message
    assert "ranks [0, 1, 3] had returned from it and were waiting for them at the end" in message
    assert "rank 2 was here" in message and "rank 0 was here" not in message
    assert no_children_left()


def _all_reduce_mismatched_under_detail():
    comm.all_reduce(torch.ones(3 if dist.get_rank() == 1 else 4))


def test_the_debug_level_set_after_import_reaches_the_ranks(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    try:
        with pytest.raises(minitp.RankError, match="(?i)shape|size|mismatch"):
            minitp.launch(_all_reduce_mismatched_under_detail, 2, timeout=20, echo=False)
    finally:
        monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
        dist.set_debug_level_from_env()


def test_ranks_start_by_spawn_where_torch_sees_a_gpu(monkeypatch):
    """A forked child can neither start CUDA nor run a backward after the parent ran one (seen on an
    H200: "Unable to handle autograd's threading in combination with fork-based multiprocessing")."""
    from minitp.launcher.local import default_start_method

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_start_method() == ("fork" if sys.platform.startswith("linux") else "spawn")


# -- torch._dynamo (what an optimizer's first step imports): warmed in the parent only when needed --------
class _Hidden:
    def step(self, p):  # reached through an object: not followed by uses_optimizer
        return self.make([p])

    make = staticmethod(lambda params: None)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _trains():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    _sgd([p]).step()


def test_uses_optimizer_follows_globals_closures_partials_and_classes_to_torch_optim():
    import functools

    from torch.optim import AdamW

    from minitp.launcher.guard import uses_optimizer

    def collectives():
        t = torch.ones(2)
        dist.all_reduce(t)
        return comm.all_reduce(t)

    def through_closure():
        return AdamW

    class Trainer:
        def fit(self):
            return _trains()

    assert uses_optimizer(_trains)  # via a module-level helper naming torch.optim
    assert uses_optimizer(through_closure) and uses_optimizer(Trainer) and uses_optimizer(functools.partial(_trains))
    assert uses_optimizer(collectives, (torch.ones(1),)) is False
    assert uses_optimizer(lambda: _Hidden().step(1)) is False  # an object's method is not followed
    from minitp.measure import calibrate
    from minitp.runs import data_parallel
    assert uses_optimizer(data_parallel._ddp_worker) and not uses_optimizer(calibrate._all_reduce_worker)


def test_the_parent_imports_torch_dynamo_only_for_a_launch_that_needs_it(tmp_path):
    """In a fresh process: a launch without an optimizer leaves torch._dynamo unimported; one whose
    optimizer the code scan cannot see makes its ranks import it, and the parent warms it for the next."""
    script = tmp_path / "warm.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        import minitp
        from minitp.launcher import guard

        class Hidden:
            def step(self):
                p = torch.nn.Parameter(torch.ones(2))
                p.grad = torch.ones(2)
                self.opt([p], lr=0.1).step()

        def hidden():
            Hidden.opt = getattr(torch, "op" + "tim").SGD  # no name on the way says optim
            Hidden().step()

        def noop():
            return 1

        minitp.launch(noop, 2, echo=False, start_method="fork")
        print("after noop", "torch._dynamo" in sys.modules)
        minitp.launch(hidden, 2, echo=False, start_method="fork")
        print("after hidden", "torch._dynamo" in sys.modules, guard._optimizer_seen)
        minitp.launch(noop, 2, echo=False, start_method="fork")
        print("after the next", "torch._dynamo" in sys.modules)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["after noop False", "after hidden False True", "after the next True"]
