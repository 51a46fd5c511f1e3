"""minitp.comm: each collective gives torch.distributed's result and records what it sent."""

import pytest
import torch
import torch.distributed as dist

import minitp
from minitp import comm


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


def _tensor_parallel_operators():
    torch.manual_seed(0)
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(3, 4, requires_grad=True)  # the same on every rank (same seed)
    w = torch.randn(4, 6)
    # y = x @ w with w split by columns: f (copy) in, gather out
    local_w = w.chunk(n, dim=1)[r]
    y = comm.gather_from_parallel(comm.copy_to_parallel(x) @ local_w, dim=-1)
    y.pow(2).sum().backward()
    grad_col = x.grad.clone()
    # the same product with w split by rows: split x's features, g (reduce) out
    x.grad = None
    local_w_rows = w.chunk(n, dim=0)[r]
    z = comm.reduce_from_parallel(comm.split_to_parallel(x, dim=-1) @ local_w_rows)
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
