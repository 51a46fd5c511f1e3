"""The Chrome trace-event file of a run: what Perfetto and chrome://tracing need, one slice per traced event."""

import json
from collections import Counter, defaultdict

import pytest
import torch

from minitp import cli, launch, trainer
from minitp import trace as _trace
from minitp.data import COURSE_CORPUS
from minitp.runs import data_parallel, training
from minitp.viz.chrome_trace import chrome_trace, report_coords


def _traced_step():
    """A small traced step on 2 ranks: compute, an all-reduce over a "tp" group, a send and an
    asynchronous send/recv pair over the world named "pp"."""
    import torch.distributed as dist

    from minitp import comm

    comm.name_group(None, "pp")
    tp = dist.new_group([0, 1])
    comm.name_group(tp, "tp")
    rank = dist.get_rank()
    x = torch.ones(64)
    with _trace.span("forward"), _trace.tagged(phase="forward", microbatch=0):
        comm.all_reduce(x, tp, label="partial sums")
    with _trace.tagged(phase="forward", step=0):
        if rank == 0:
            comm.send(x, 1, label="activations")
            comm.isend(x[:8], 1, label="small").wait()
        else:
            comm.recv(x, 0, label="activations")
            comm.irecv(x[:8], 0, label="small").wait()
    with _trace.span("optimizer"):
        x.mul_(0.5)


@pytest.fixture(scope="module")
def run():
    return launch(_traced_step, 2, echo=False)


def _check_viewer_rules(data: dict) -> None:
    """What a viewer needs of every event: phase, process, thread, time; a name for each thread used;
    slices that nest on each thread (two that overlap otherwise are dropped or misdrawn)."""
    assert data["displayTimeUnit"] == "ms"
    events = data["traceEvents"]
    assert events
    for e in events:
        assert {"ph", "pid", "tid", "ts"} <= set(e) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["name"]
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in events if e["ph"] in "Xsf"} <= named
    on_thread = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            on_thread[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for slices in on_thread.values():
        open_ends = []
        for start, end in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], "slices on one thread overlap without nesting"
            open_ends.append(end)


def test_every_traced_message_is_one_slice_on_its_rank_and_dimension(run):
    data = json.loads(json.dumps(chrome_trace(run.traces)))  # plain JSON, read back
    _check_viewer_rules(data)
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in data["traceEvents"]} == {0, 1}
    messages = [e for e in slices if e["cat"] == "comm"]
    traced = [e for t in run.traces for e in t.comm()]
    assert Counter((e["pid"], e["args"]["label"], e["args"]["op"], e["args"]["bytes"]) for e in messages) == \
        Counter((e.rank, e.label, e.op, e.bytes) for e in traced)
    for rank in (0, 1):
        assert sum(e["args"]["sent_bytes"] for e in messages if e["pid"] == rank) == pytest.approx(
            run.sent_bytes()[rank])
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert {threads[e["pid"], e["tid"]] for e in messages if e["args"]["op"] == "all_reduce"} == {"tp"}
    assert {threads[e["pid"], e["tid"]] for e in messages if e["args"]["op"] in ("send", "recv")} == {"pp"}
    compute = [e for e in slices if e["cat"] == "compute"]
    assert {threads[e["pid"], e["tid"]] for e in compute} == {"compute"}
    assert Counter(e["name"] for e in compute) == {"forward": 2, "optimizer": 2}
    assert min(e["ts"] for e in slices) == 0.0  # times from the earliest event of any rank


def test_slices_carry_where_in_the_run_they_happened(run):
    slices = [e for e in chrome_trace(run.traces)["traceEvents"] if e["ph"] == "X"]
    reduce = next(e for e in slices if e["args"].get("op") == "all_reduce")
    assert reduce["args"]["peers"] == [0, 1] and reduce["args"]["phase"] == "forward"
    assert reduce["args"]["microbatch"] == 0 and "step" not in reduce["args"]
    send = next(e for e in slices if e["args"].get("op") == "send" and e["args"]["label"] == "activations")
    assert send["pid"] == 0 and send["args"]["peer"] == 1 and send["args"]["step"] == 0


def test_each_send_has_an_arrow_to_the_receive_that_took_it(run):
    events = chrome_trace(run.traces)["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(ends) == 2 and set(starts) == set(ends)
    assert all(starts[i]["pid"] == 0 and ends[i]["pid"] == 1 for i in starts)


def _arrows(data: dict) -> list[tuple[dict, dict]]:
    """Each arrow's two ends: (the flow start at the send, the flow end at the receive)."""
    starts = {e["id"]: e for e in data["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in data["traceEvents"] if e["ph"] == "f"}
    assert set(starts) == set(ends)
    return [(starts[i], ends[i]) for i in sorted(starts)]


def _slice_at(data: dict, end: dict) -> dict:
    """The innermost slice on the thread of an arrow's end that holds its time (what a viewer ties it to)."""
    around = [e for e in data["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) == (end["pid"], end["tid"])
              and e["ts"] <= end["ts"] <= e["ts"] + e["dur"]]
    assert around, f"an arrow's end at {end['ts']} µs lies in no slice of its thread"
    return max(around, key=lambda e: e["ts"])


def test_an_arrow_lands_where_a_receive_posted_early_completes():
    """A pipeline posts its receives as the step starts (irecv) and waits on each when it needs it: the
    arrow leaves as the send starts and lands as the receive completes, never before it left."""
    def message(rank, op, peer, start, end):
        return _trace.Event(rank, "comm", op, "pp/forward/mb0", start, end, group=(0, 1), dim="pp", peer=peer,
                            bytes=8)

    data = chrome_trace([[message(0, "send", 1, 5.0, 9.0)], [message(1, "recv", 0, 1.0, 6.0)]])
    ((leaves, lands),) = _arrows(data)
    assert _slice_at(data, leaves)["args"]["op"] == "send" and leaves["pid"] == 0
    assert _slice_at(data, lands)["args"]["op"] == "recv" and lands["pid"] == 1
    assert leaves["ts"] == pytest.approx(4e6, abs=2) and lands["ts"] == pytest.approx(5e6, abs=2)  # t0: 1 s


TRAINED = trainer.Settings(dp=2, pp=2, microbatches=4, steps=2, batch_size=8, seq_len=32, corpus=COURSE_CORPUS,
                           eval_every=1, eval_batches=2, warmup=1)


@pytest.fixture(scope="module")
def trained():
    """The last step of a dp2·pp2 training run (4 micro-batches), validated after every step: what
    ``minitp train --trace-out`` writes."""
    results = training.train(TRAINED, echo=False)
    coords = [dict(zip(("dp", "pp", "tp"), r["coords"])) for r in results]
    return results, chrome_trace(results.traces, coords=coords)


def test_every_arrow_of_a_dp2_pp2_training_step_goes_forward_in_time(trained):
    _, data = trained
    _check_viewer_rules(data)
    arrows = _arrows(data)
    assert len(arrows) == 2 * TRAINED.dp * TRAINED.microbatches  # each micro-batch: activations and gradients
    for leaves, lands in arrows:
        assert lands["ts"] > leaves["ts"], f"an arrow from rank {leaves['pid']} ends before it starts"
        sent, received = _slice_at(data, leaves), _slice_at(data, lands)
        assert sent["args"]["op"] == "send" and received["args"]["op"] == "recv"
        assert sent["args"]["label"] == received["args"]["label"]  # the message that took it
        assert received["ts"] + received["dur"] - lands["ts"] <= 1.001  # where the receive completes (µs)


def test_the_last_steps_trace_holds_the_training_step_alone(trained):
    """Validation (a forward and backward per batch) runs after the last step; it is no part of it."""
    _, data = trained
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    m = TRAINED.microbatches
    for rank in range(TRAINED.world):
        compute = Counter(e["name"].split()[0] for e in slices if e["pid"] == rank and e["cat"] == "compute")
        assert compute == {"forward": m, "backward": m, "optimizer": 1}
        messages = Counter(e["args"]["op"] for e in slices if e["pid"] == rank and e["cat"] == "comm")
        assert messages == {"send": m, "recv": m, "all_reduce": 2}  # the gradients' bucket, the clipping norm


def test_process_names_say_each_ranks_place_on_the_mesh(run):
    events = chrome_trace(run.traces, coords=[{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}])["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (dp 0, tp 0)", 1: "rank 1 (dp 0, tp 1)"}
    plain = chrome_trace(run.traces)["traceEvents"]
    assert {e["args"]["name"] for e in plain if e["name"] == "process_name"} == {"rank 0", "rank 1"}


def test_spans_passed_apart_land_on_the_compute_thread():
    spans = [[_trace.Event(0, "compute", "forward", "mb0", 10.0, 10.5, phase="forward", microbatch=0)]]
    events = chrome_trace([[]], spans)["traceEvents"]
    (forward,) = [e for e in events if e["ph"] == "X"]
    assert forward["name"] == "forward mb0" and forward["ts"] == 0.0 and forward["dur"] == 5e5
    assert forward["args"] == {"label": "mb0", "phase": "forward", "microbatch": 0}


def test_messages_in_flight_together_get_a_second_lane_of_their_dimension():
    def bucket(i, start, end):  # asynchronous all-reduces: the second starts before the first is waited
        return _trace.Event(0, "comm", "all_reduce", f"ddp/bucket{i}", start, end, group=(0, 1), dim="dp", bytes=8)

    data = chrome_trace([[bucket(0, 0.0, 3.0), bucket(1, 1.0, 4.0), bucket(2, 3.5, 3.8)]])
    _check_viewer_rules(data)
    threads = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    lanes = {e["args"]["label"]: threads[e["tid"]] for e in data["traceEvents"] if e["ph"] == "X"}
    assert lanes == {"ddp/bucket0": "dp", "ddp/bucket1": "dp #2", "ddp/bucket2": "dp"}


def test_report_coords_names_the_dimensions_a_run_splits():
    class Report(dict):  # the two things report_coords reads
        layout = {"dp": 2, "tp": 2, "pp": 1}
        world_size = 4

    three_d = Report(coords=[[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]])
    assert report_coords(three_d)[3] == {"dp": 1, "tp": 1}
    one_dim = Report()
    one_dim.layout, one_dim.world_size = {"dp": 1, "tp": 1, "pp": 2}, 2
    assert report_coords(one_dim) == [{"pp": 0}, {"pp": 1}]


def test_minitp_run_trace_out_writes_the_trace(tmp_path, capsys):
    path = tmp_path / "ddp.json"
    assert cli.main(["run", "ddp", "--nprocs", "2", "--steps", "1", "--trace-out", str(path)]) == 0
    assert f"trace written to {path}" in capsys.readouterr().out
    data = json.loads(path.read_text())
    _check_viewer_rules(data)
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"
             and e["name"] in ("process_name", "thread_name")}
    assert {"rank 0 (dp 0)", "rank 1 (dp 1)", "compute", "dp"} <= names
    ops = Counter(e["args"].get("op") for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm")
    assert ops["all_reduce"] >= 2  # each rank's gradient buckets


def test_trace_out_into_a_missing_folder_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(data_parallel, "launch", never)
    missing = tmp_path / "nowhere" / "t.json"
    assert cli.main(["run", "ddp", "--nprocs", "2", "--trace-out", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"minitp: error: --trace-out {missing}: the folder") and "does not exist" in err


# -- --profile: PyTorch's operators under minitp's spans -------------------------------------------------------
def _inside(op: dict, span: dict) -> bool:
    return span["ts"] <= op["ts"] and op["ts"] + op["dur"] <= span["ts"] + span["dur"]


def test_operators_land_inside_the_span_that_ran_them():
    """One process: the profiler's clock lined up with perf_counter's through the span's own mark."""
    from minitp.measure.operators import operators

    a = torch.randn(64, 64)
    with _trace.recording(0) as tr, operators(tr):
        with _trace.span("forward"):
            b = a @ a
        with _trace.span("optimizer"):
            b.mul_(0.5)
    spans = {e.op: e for e in tr.events if e.kind == "compute"}
    ops = [e for e in tr.events if e.kind == "op"]
    mm = [e for e in ops if e.op == "aten::mm"]
    mul = [e for e in ops if e.op == "aten::mul_"]
    assert mm and mul and tr.mark is None  # the marks end with the profile
    for op, span in ((mm[0], spans["forward"]), (mul[0], spans["optimizer"])):
        assert span.start <= op.start <= op.end <= span.end, (op, span)
    assert not any(e.op.startswith("minitp/") for e in ops)  # the marks are the spans, not operators


PROFILED = trainer.Settings(dp=2, steps=2, batch_size=4, seq_len=32, corpus=COURSE_CORPUS,
                            eval_every=0, warmup=1, profile=True)


def test_a_profiled_training_step_nests_operators_under_its_spans_on_every_rank():
    """``minitp train --trace-out FILE --profile``: the last step's operators on each rank's compute thread,
    each inside a span (forward, backward, optimizer), a matrix multiply in the forward."""
    results = training.train(PROFILED, echo=False)
    data = json.loads(json.dumps(chrome_trace(results.traces)))  # valid JSON, as written
    _check_viewer_rules(data)
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    for rank in range(PROFILED.world):
        spans = [e for e in slices if e["pid"] == rank and e["cat"] == "compute"]
        ops = [e for e in slices if e["pid"] == rank and e["cat"] == "op"]
        assert {s["name"] for s in spans} == {"forward", "backward", "optimizer"}
        assert ops and all(o["tid"] == spans[0]["tid"] for o in ops)
        held = {s["name"]: [o["name"] for o in ops if _inside(o, s)] for s in spans}
        assert "aten::mm" in held["forward"] or "aten::addmm" in held["forward"], held["forward"][:20]
        assert held["backward"] and held["optimizer"], {k: len(v) for k, v in held.items()}
        inside = sum(any(_inside(o, s) for s in spans) for o in ops)
        # the rest ran between spans: the batch's rows, zero_grad, the clipping's norm
        assert inside / len(ops) > 0.8, f"rank {rank}: {len(ops) - inside} of {len(ops)} operators outside every span"


def test_profile_prints_where_the_last_steps_time_went(capsys):
    assert cli.main(["train", "--dp", "2", "--steps", "2", "--batch-size", "4", "--seq-len", "32",
                     "--corpus", COURSE_CORPUS, "--eval-every", "0", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "where the last step's time went" in out
    head, *rows = out.split("where the last step's time went")[1].splitlines()[1:4]
    assert head.split() == ["rank", "step", "ms", "matmul", "attention", "elementwise", "optimizer",
                            "communication", "python"]
    for rank, row in enumerate(rows):  # each rank's shares of its step add up to all of it
        cells = row.split()
        assert cells[0] == str(rank) and sum(int(c.rstrip("%")) for c in cells[2:]) in range(98, 103)


def test_each_moment_of_a_step_counts_as_the_innermost_operator_or_the_wait():
    from minitp.measure.operators import CATEGORIES, shares

    def ev(kind, op, start, end, **more):
        return _trace.Event(0, kind, op, "", start, end, **more)

    events = [ev("compute", "forward", 0.0, 10.0), ev("compute", "optimizer", 12.0, 14.0),
              ev("op", "aten::linear", 1.0, 5.0), ev("op", "aten::mm", 1.5, 4.5),  # the linear holds the mm
              ev("op", "aten::_softmax", 5.0, 6.0), ev("op", "aten::add_", 12.5, 13.5),
              ev("op", "c10d::allreduce_", 10.0, 11.0),
              ev("comm", "all_reduce", 6.0, 8.0, dim="tp")]  # in flight while no kernel runs: a wait
    got = shares(events)
    assert list(got) == list(CATEGORIES)
    assert got == {"matmul": 3.0, "attention": 1.0, "elementwise": 1.0, "optimizer": 2.0,
                   "communication": 1.0 + 2.0, "python": 1.0 + 2.0 + 1.0}
    assert sum(got.values()) == 14.0  # the step's wall time, first span to last
