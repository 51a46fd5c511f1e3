"""minitp.comm: each collective gives torch.distributed's result and records what it sent."""

import pytest
import torch
import torch.distributed as dist

import minitp
from minitp import comm, regions


def _every_collective():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.full((4,), float(r + 1))
    comm.all_reduce(t, label="ar")
    out["all_reduce"] = t
    gathered = torch.empty(n * 2)
    comm.all_gather(gathered, torch.full((2,), float(r)), label="ag")
    out["all_gather"] = gathered
    shard = torch.empty(2)
    comm.reduce_scatter(shard, torch.arange(2.0 * n) + r, label="rs")
    out["reduce_scatter"] = shard
    b = torch.full((3,), float(r))
    comm.broadcast(b, src=1, label="bc")
    out["broadcast"] = b
    if r == 0:
        comm.send(torch.tensor([42.0, 43.0]), dst=3, label="p2p")
    elif r == 3:
        got = torch.empty(2)
        comm.recv(got, src=0, label="p2p")
        out["recv"] = got
    handle = comm.all_reduce(torch.ones(5), label="async", async_op=True)
    handle.wait()
    pair = dist.new_group([0, 2])
    if r in (0, 2):
        s = torch.ones(2)
        comm.all_reduce(s, group=pair, label="pair")
        out["pair"] = s
    return out


def test_every_collective_computes_and_is_traced():
    results = minitp.launch(_every_collective, 4, echo=False)
    for r, out in enumerate(results):
        assert out["all_reduce"].tolist() == [10.0] * 4
        assert out["all_gather"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        # sum over ranks of (arange(8) + rank) = 4 * arange(8) + 6; rank r keeps elements 2r, 2r+1
        assert out["reduce_scatter"].tolist() == [4.0 * (2 * r) + 6, 4.0 * (2 * r + 1) + 6]
        assert out["broadcast"].tolist() == [1.0] * 3
    assert results[3]["recv"].tolist() == [42.0, 43.0]
    assert results[0]["pair"].tolist() == [2.0, 2.0]

    by_label = {(e.rank, e.label): e for e in results.events}
    ar = by_label[(1, "ar")]
    assert (ar.op, ar.group, ar.shape, ar.dtype, ar.bytes) == ("all_reduce", (0, 1, 2, 3), (4,), "float32", 16)
    assert ar.sent_bytes == pytest.approx(2 * 3 / 4 * 16)
    assert by_label[(0, "ag")].bytes == 32 and by_label[(0, "ag")].sent_bytes == pytest.approx(24)
    assert by_label[(0, "rs")].bytes == 32 and by_label[(0, "rs")].sent_bytes == pytest.approx(24)
    # broadcast from rank 1 along the chain 1 -> 2 -> 3 -> 0: rank 0 is last and forwards nothing
    assert [by_label[(r, "bc")].sent_bytes for r in range(4)] == [0.0, 12.0, 12.0, 12.0]
    send, recv = by_label[(0, "p2p")], by_label[(3, "p2p")]
    assert (send.op, send.peer, send.sent_bytes) == ("send", 3, 8.0)
    assert (recv.op, recv.peer, recv.sent_bytes) == ("recv", 0, 0.0)
    assert by_label[(2, "pair")].group == (0, 2)
    assert by_label[(2, "pair")].sent_bytes == pytest.approx(8.0)  # 2(n-1)/n * 8 with n = 2
    assert all(e.end >= e.start for e in results.events)
    assert (1, "pair") not in by_label


def _mismatched_sizes():
    comm.all_gather(torch.empty(5), torch.ones(2))


def test_a_wrongly_sized_buffer_names_the_numbers():
    with pytest.raises(minitp.RankError, match="output has 5 elements, expected 2 ranks x 2 = 4"):
        minitp.launch(_mismatched_sizes, 2, echo=False)


# -- a bad argument is refused at the call, in one sentence, before any message ---------------------------
def _bad_calls():
    import traceback

    r, n = dist.get_rank(), dist.get_world_size()
    other = 1 - r
    x, half = torch.ones(4), torch.ones(4, dtype=torch.float16)
    calls = {
        "isend None": lambda: comm.isend(None, other),
        "send a list": lambda: comm.send([1.0, 2.0], other),
        "recv None": lambda: comm.recv(None, other),
        "all_reduce None": lambda: comm.all_reduce(None),
        "all_gather output None": lambda: comm.all_gather(None, x),
        "reduce_scatter input None": lambda: comm.reduce_scatter(x, None),
        "broadcast None": lambda: comm.broadcast(None, 0),
        "all_to_all input None": lambda: comm.all_to_all(x, None),
        "irecv from -1": lambda: comm.irecv(x, -1),
        "isend to world_size": lambda: comm.isend(x, n),
        "send to -1": lambda: comm.send(x, -1),
        "recv from world_size": lambda: comm.recv(x, n),
        "broadcast from world_size": lambda: comm.broadcast(x, n),
        "all_gather dtypes": lambda: comm.all_gather(torch.empty(n * 4, dtype=torch.float16), x),
        "reduce_scatter dtypes": lambda: comm.reduce_scatter(half[:2], torch.ones(4)),
        "all_to_all dtypes": lambda: comm.all_to_all(half, x),
    }
    refused = {}
    for name, call in calls.items():
        try:
            call()
            refused[name] = None
        except (TypeError, ValueError) as e:
            refused[name] = (type(e).__name__, str(e), traceback.extract_tb(e.__traceback__)[-1].name)
    still = torch.ones(2)
    comm.all_reduce(still, label="after the refusals")  # nothing half-sent is left in the way
    return {"refused": refused, "after": still}


def test_every_call_refuses_a_bad_argument_in_one_sentence_before_any_message():
    results = minitp.launch(_bad_calls, 2, echo=False)
    refused = results[0]["refused"]
    assert all(refused.values()), [k for k, v in refused.items() if v is None]
    assert refused["isend None"][:2] == (
        "TypeError", "comm.isend: tensor must be a torch.Tensor, got None (a gradient that was never computed?)")
    assert refused["send a list"][1] == "comm.send: tensor must be a torch.Tensor, got list [1.0, 2.0]"
    assert refused["all_gather output None"][1].startswith("comm.all_gather: output must be a torch.Tensor, got None")
    assert refused["reduce_scatter input None"][1].startswith("comm.reduce_scatter: input must be a torch.Tensor")
    assert refused["irecv from -1"][:2] == (
        "ValueError", "comm.irecv: src=-1 is not a rank of the group; expected one of (0, 1) (global ranks)")
    assert refused["isend to world_size"][1].startswith("comm.isend: dst=2 is not a rank of the group")
    assert refused["broadcast from world_size"][1].startswith("comm.broadcast: src=2 is not a rank of the group")
    assert refused["all_gather dtypes"][:2] == (
        "TypeError", "comm.all_gather: output is torch.float16 but input is torch.float32; they must have the "
                     "same dtype")
    assert refused["all_to_all dtypes"][1].startswith("comm.all_to_all: output is torch.float16 but input is")
    for name, (_, message, raised_in) in refused.items():
        assert message.count(". ") == 0 and "\n" not in message, (name, message)  # one sentence
        assert raised_in == "_check", (name, raised_in)  # by comm's own check, not deep inside (no _nbytes)
    assert [e.label for e in results.traces[0].comm()] == ["after the refusals"]  # nothing was sent or traced
    assert results[0]["after"].tolist() == [2.0, 2.0]


def _tensor_parallel_operators():
    torch.manual_seed(0)
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(3, 4, requires_grad=True)  # the same on every rank (same seed)
    w = torch.randn(4, 6)
    # y = x @ w with w split by columns: f (copy) in, gather out
    local_w = w.chunk(n, dim=1)[r]
    y = regions.gather_from_parallel(regions.copy_to_parallel(x) @ local_w, dim=-1)
    y.pow(2).sum().backward()
    grad_col = x.grad.clone()
    # the same product with w split by rows: split x's features, g (reduce) out
    x.grad = None
    local_w_rows = w.chunk(n, dim=0)[r]
    z = regions.reduce_from_parallel(regions.split_to_parallel(x, dim=-1) @ local_w_rows)
    z.pow(2).sum().backward()
    return y.detach(), grad_col, z.detach(), x.grad.clone()


def test_tensor_parallel_operators_give_the_unsplit_result_and_gradient():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 6)
    y = x @ w
    y.pow(2).sum().backward()
    results = minitp.launch(_tensor_parallel_operators, 2, echo=False)
    for y_col, g_col, y_row, g_row in results:
        torch.testing.assert_close(y_col, y.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(y_row, y.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g_col, x.grad, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(g_row, x.grad, atol=1e-5, rtol=1e-6)
    labels = sorted({e.label for e in results.traces[0].comm()})
    assert labels == ["tp/f.backward", "tp/g.forward", "tp/gather.forward", "tp/split.backward"]


# -- each message knows the mesh dimension of its group ---------------------------------------------------
def _messages_on_named_groups():
    from minitp.ddp import DistributedDataParallel
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.mesh import Mesh

    r = dist.get_rank()
    mesh = Mesh(dp=2, pp=1, tp=2)  # tp groups {0,1} {2,3}, dp groups {0,2} {1,3}
    comm.all_reduce(torch.ones(2), group=mesh.tp_group, label="on the tp group")
    comm.all_reduce(torch.ones(2), group=mesh.dp_group, label="on the dp group")
    comm.all_reduce(torch.ones(2), label="on the unnamed world")
    unnamed = dist.new_group([0, 1, 2, 3])
    comm.all_reduce(torch.ones(2), group=unnamed, label="on an unnamed group")
    for_ddp, for_fsdp = dist.new_group([0, 1, 2, 3]), dist.new_group([0, 1, 2, 3])
    DistributedDataParallel(torch.nn.Linear(4, 4), for_ddp)  # its start-up broadcast: "dp"
    FullyShardedDataParallel(torch.nn.Linear(4, 4), for_fsdp)
    comm.all_reduce(torch.ones(2), group=for_fsdp, label="on FSDP's group")
    FullyShardedDataParallel(torch.nn.Linear(4, 4), mesh.dp_group)  # the mesh named it first: it stays "dp"
    comm.all_reduce(torch.ones(2), group=mesh.dp_group, label="on the mesh's dp group under FSDP")
    try:
        comm.name_group(mesh.tp_group, "pp")
        refused = ""
    except ValueError as e:
        refused = str(e)
    comm.name_group(None, "dp")
    comm.name_group(None, "fsdp")  # the world takes the latest name: strategies take turns on it
    comm.all_reduce(torch.ones(2), label="on the world renamed")
    return {"refused": refused, "rank": r}


def test_an_events_dim_comes_from_the_group_it_went_through():
    results = minitp.launch(_messages_on_named_groups, 4, echo=False)
    for tr in results.traces:
        dims = {e.label: e.dim for e in tr.comm()}
        assert dims["on the tp group"] == "tp" and dims["on the dp group"] == "dp"
        assert dims["on the unnamed world"] == "" and dims["on an unnamed group"] == ""
        assert dims["ddp/init"] == "dp" and dims["on FSDP's group"] == "fsdp"
        assert dims["on the mesh's dp group under FSDP"] == "dp"
        assert dims["on the world renamed"] == "fsdp"
    assert all("already named 'tp'" in r["refused"] and "'pp'" in r["refused"] for r in results)
    assert minitp.trace.totals(results.events, by=("dim",))[("tp",)]["calls"] == 4


_RENAMED_WORLD_IN_ONE_PROCESS = """
import os, sys
import torch.distributed as dist
from minitp import comm
for i in range(2):
    where = os.path.join(sys.argv[1], f"rendezvous{i}")
    dist.init_process_group("gloo", init_method=f"file://{where}", rank=0, world_size=1)
    print(repr(comm.group_dim()))
    comm.name_group(None, "tp")
    dist.destroy_process_group()
"""


def test_a_new_world_in_the_same_process_starts_unnamed(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RENAMED_WORLD_IN_ONE_PROCESS, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["''", "''"]
