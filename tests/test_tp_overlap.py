"""minitp.tp_overlap (the collective matmul) against its oracles: the unfused sequence-parallel
layers of minitp.tp on the same ranks, the plain layers on one process, and the byte formula; and
its trace's order, read from the record, showing each message posted before the matmul chunk it
hides behind ends and waited for only after it.

Each worker runs both versions of a layer on every rank, in two trace scopes ("unfused",
"overlapped"), and returns outputs and gradients as the rank holds them; the test puts the shards
together and compares them with each other and with the plain layer run here.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import minitp
from minitp import cost, tp, tp_overlap
from minitp.models import TINY, build_model

B, S, D, F = 2, 8, 16, 24  # batch, sequence, model and hidden features of the linear checks
TOL = 1e-5  # fp32: max |difference|
SIZES = [2, 4]
RINGS = ("all_gather_matmul.forward", "all_gather_matmul.backward",
         "matmul_reduce_scatter.forward", "matmul_reduce_scatter.backward")
# which rings gather (messages beside steps 0..n-2) and which scatter (beside steps 1..n-1)
GATHER_RINGS = ("all_gather_matmul.forward", "matmul_reduce_scatter.backward")


def _max_diff(actual, expected) -> float:
    return (actual - expected).abs().max().item()


def _assert_close(actual, expected, what):
    diff = _max_diff(actual, expected)
    assert diff <= TOL, f"{what}: max |difference| = {diff:.3g} > {TOL:g}"


def _plain_linears():
    torch.manual_seed(0)
    return nn.Linear(D, F), nn.Linear(F, D)  # the column layer, the row layer


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, D, generator=g), torch.randn(B, S, F, generator=g)


def _loss(y):
    """Each rank's share of one loss, the mean square over the B·S positions: the shares add up to
    the one-process loss."""
    return y.pow(2).sum() / (B * S)


def _run(layer, mine):
    """Forward and backward of ``layer`` on this rank's input; its output, input gradient and
    gradient shards."""
    mine = mine.detach().clone().requires_grad_()
    y = layer(mine)
    _loss(y).backward()
    return {"out": y.detach(), "x_grad": mine.grad, "grads": tp.local_shards(layer, grads=True)}


def _linears():
    n, rank = dist.get_world_size(), dist.get_rank()
    column, row = _plain_linears()
    x, h = _inputs()
    x_mine = x.chunk(n, dim=1)[rank]  # (B, S/n, D): this rank's positions
    h_mine = h.chunk(n, dim=-1)[rank]  # (B, S, F/n): this rank's hidden features
    layers = {
        "unfused": (tp.ColumnParallelLinear(column, None, sequence_parallel=True),
                    tp.RowParallelLinear(row, None, sequence_parallel=True)),
        "overlapped": (tp_overlap.OverlappedColumnParallelLinear(column, None),
                       tp_overlap.OverlappedRowParallelLinear(row, None)),
    }
    out = {}
    for kind, (col, rw) in layers.items():
        with minitp.trace.scope(kind, "column"):
            out[kind, "column"] = _run(col, x_mine)
        with minitp.trace.scope(kind, "row"):
            out[kind, "row"] = _run(rw, h_mine)
    # an input that needs no gradient (a model's first layer): weight gradients only, no message
    frozen = tp_overlap.OverlappedColumnParallelLinear(column, None)
    with minitp.trace.scope("frozen"):
        _loss(frozen(x_mine)).backward()
    out["frozen"] = tp.local_shards(frozen, grads=True)
    return out


@pytest.fixture(scope="module", params=SIZES, ids=[f"tp{n}" for n in SIZES])
def linears(request):
    n = request.param
    return n, minitp.launch(_linears, n, echo=False)


def _plain_results():
    column, row = _plain_linears()
    x, h = _inputs()
    results = {}
    for name, layer, inp in (("column", column, x), ("row", row, h)):
        inp = inp.clone().requires_grad_()
        y = layer(inp)
        _loss(y).backward()
        results[name] = (y.detach(), inp.grad, layer)
    return results


def test_overlapped_linears_equal_the_unfused_ones_and_one_process(linears):
    n, results = linears
    plain = _plain_results()
    # how each layer's shards join: column output by features, input gradient by positions; row
    # output by positions, input gradient by features
    joins = {"column": (-1, 1), "row": (1, -1)}
    for name, (out_dim, grad_dim) in joins.items():
        y, x_grad, layer = plain[name]
        for kind in ("unfused", "overlapped"):
            got = [r[kind, name] for r in results]
            _assert_close(torch.cat([g["out"] for g in got], dim=out_dim), y, f"{kind} {name} out")
            _assert_close(torch.cat([g["x_grad"] for g in got], dim=grad_dim), x_grad,
                          f"{kind} {name} input gradient")
            for rank in range(n):
                grads = tp.unshard([g["grads"] for g in got], rank)
                assert set(grads) == {p for p, _ in layer.named_parameters()}
                for p, param in layer.named_parameters():
                    _assert_close(grads[p], param.grad, f"{kind} {name} rank {rank} grad of {p}")
        for r in results:  # and rank by rank, against the unfused layer
            ours, theirs = r["overlapped", name], r["unfused", name]
            _assert_close(ours["out"], theirs["out"], f"{name} out against unfused")
            _assert_close(ours["x_grad"], theirs["x_grad"], f"{name} input grad against unfused")
            for p, (shard, _) in ours["grads"].items():
                _assert_close(shard, theirs["grads"][p][0], f"{name} {p} grad against unfused")


def test_an_input_that_needs_no_gradient_sends_nothing_backward(linears):
    n, results = linears
    for r, trace in zip(results, results.traces):
        for p, (shard, _) in r["frozen"].items():
            _assert_close(shard, r["overlapped", "column"]["grads"][p][0], f"frozen {p} grad")
        assert [e.phase for e in trace.comm() if e.within("frozen")] == ["forward"] * 2 * (n - 1)


def _sent(trace, kind, name, phase, overlap_only=False):
    return sum(e.sent_bytes for e in trace.comm()
               if e.within(kind, name) and e.phase == phase
               and (not overlap_only or "/overlap/" in e.label))


def test_overlapped_linears_send_the_bytes_of_the_all_gather_and_reduce_scatter(linears):
    n, results = linears
    gathered = B * S * D * 4  # fp32: the gathered input of the column, the summed output of the row
    formula = cost.collective_sent_bytes("all_gather", gathered, n)  # (n-1)/n of it
    assert formula == cost.collective_sent_bytes("reduce_scatter", gathered, n)
    assert formula == (n - 1) / n * gathered
    for trace in results.traces:
        for name in ("column", "row"):
            for phase in ("forward", "backward"):
                # the layer's whole traffic (the row's bias all-reduce too) is the same
                assert _sent(trace, "overlapped", name, phase) == \
                    _sent(trace, "unfused", name, phase), (name, phase)
                assert _sent(trace, "overlapped", name, phase, overlap_only=True) == formula
                ring = [e for e in trace.comm() if e.within("overlapped", name)
                        and e.phase == phase and "/overlap/" in e.label]
                assert sorted(e.op for e in ring) == ["recv"] * (n - 1) + ["send"] * (n - 1)
                assert all(e.dim == "tp" and e.bytes == gathered // n for e in ring)
                assert all(e.labelled(f"overlapped/{name}/tp/overlap/") for e in ring)


def test_each_message_is_posted_before_its_matmul_chunk_ends_and_waited_after(linears):
    """From the record's order (a message is recorded as it starts, a span as it ends): the send
    and receive of ring step j come before matmul chunk j ends; their wait ends after it, and
    before the next chunk's matmul."""
    n, results = linears
    for trace in results.traces:
        ranks = list(range(n))
        right, left = ranks[(trace.rank + 1) % n], ranks[(trace.rank - 1) % n]
        for ring in RINGS:
            at = {}  # (kind of record, ring step) -> positions in the record
            for i, e in enumerate(trace.events):
                if e.within("overlapped") and f"/overlap/{ring}/step" in e.label:
                    at.setdefault((e.op, e.ring_step), []).append(i)
            matmul = [at[("matmul", j)] for j in range(n)]
            assert all(len(m) == 1 for m in matmul), (ring, at)
            steps = range(n - 1) if ring in GATHER_RINGS else range(1, n)
            assert sorted({j for op, j in at if op in ("send", "recv")}) == list(steps), ring
            for j in steps:
                sends, recvs = at[("send", j)], at[("recv", j)]
                assert len(sends) == len(recvs) == 1
                assert max(sends + recvs) < matmul[j][0] < at[("wait", j)][0], (ring, j)
                if j + 1 < n:
                    assert at[("wait", j)][0] < matmul[j + 1][0], (ring, j)
                send, recv = trace.events[sends[0]], trace.events[recvs[0]]
                assert (send.peer, recv.peer) == (right, left)
            for j in steps[:-1] if ring in GATHER_RINGS else ():
                # the chunk that came in step j goes on in step j + 1, after it came
                assert at[("wait", j)][0] < at[("send", j + 1)][0]


# -- a SwiGLU MLP built from them --------------------------------------------------------------------
def _x_mlp():
    return torch.randn(B, S, TINY.dim, generator=torch.Generator().manual_seed(2))


def _mlp():
    n, rank = dist.get_world_size(), dist.get_rank()
    mine = _x_mlp().chunk(n, dim=1)[rank]
    plain = build_model(TINY).layers[0].feed_forward
    out = {}
    for kind, mlp in (("unfused", tp.ParallelFeedForward(plain, None, sequence_parallel=True)),
                      ("overlapped", tp_overlap.OverlappedFeedForward(plain, None))):
        with minitp.trace.scope(kind):
            out[kind] = _run(mlp, mine)
    return out


@pytest.mark.parametrize("n", SIZES)
def test_overlapped_swiglu_mlp_equals_one_process_and_sends_what_the_unfused_one_sends(n):
    results = minitp.launch(_mlp, n, echo=False)
    plain = build_model(TINY).layers[0].feed_forward
    x = _x_mlp().requires_grad_()
    y = plain(x)
    _loss(y).backward()
    got = [r["overlapped"] for r in results]
    _assert_close(torch.cat([g["out"] for g in got], dim=1), y, "MLP output (positions)")
    _assert_close(torch.cat([g["x_grad"] for g in got], dim=1), x.grad, "MLP input gradient")
    for rank in range(n):
        grads = tp.unshard([g["grads"] for g in got], rank)
        for name, p in plain.named_parameters():
            _assert_close(grads[name], p.grad, f"rank {rank} gradient of {name}")
    gathered = B * S * TINY.dim * 4
    for trace in results.traces:
        for phase in ("forward", "backward"):
            sent = {kind: sum(e.sent_bytes for e in trace.comm()
                              if e.within(kind) and e.phase == phase)
                    for kind in ("unfused", "overlapped")}
            # one gather (w1 and w3 share it) and one reduce-scatter each way
            assert sent["overlapped"] == sent["unfused"] == 2 * (n - 1) / n * gathered


# -- bad input ----------------------------------------------------------------------------------------
def _refusals():
    n = dist.get_world_size()
    weight = torch.randn(F // n, D)  # (out/n, D)
    calls = {
        "odd sequence": lambda: tp_overlap.matmul_reduce_scatter(
            torch.randn(B, 7, F // n), torch.randn(D, F // n)),
        "row weight": lambda: tp_overlap.matmul_reduce_scatter(
            torch.randn(B, S, F // n), torch.randn(D, F // n + 1)),
        "column weight": lambda: tp_overlap.all_gather_matmul(
            torch.randn(B, S // n, D + 1), weight),
        "flat input": lambda: tp_overlap.all_gather_matmul(torch.randn(S // n, D), weight),
    }
    said = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as error:
            said[name] = str(error)
    return {"said": said, "messages": len(minitp.trace.current().comm())}


def test_bad_input_is_refused_naming_what_was_expected_and_what_came():
    results = minitp.launch(_refusals, 2, echo=False)
    for r in results:
        said = r["said"]
        assert r["messages"] == 0  # refused before anything was sent
        assert "S=7" in said["odd sequence"] and "tp=2" in said["odd sequence"]
        assert f"(out, {F // 2})" in said["row weight"] and f"({D}, {F // 2 + 1})" in \
            said["row weight"]
        assert f"(out, {D + 1})" in said["column weight"] and f"({F // 2}, {D})" in \
            said["column weight"]
        assert "(B, S/tp, D)" in said["flat input"] and f"({S // 2}, {D})" in said["flat input"]
