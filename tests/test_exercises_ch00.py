"""The chapter 00 checkers accept the right answers and catch the usual mistakes with a useful message."""

import pytest
import torch
import torch.distributed as dist
from hint_levels import first_then_second

from minitp import comm, cost, ring
from minitp.exercises import ExerciseError, ch00


# -- ring all-reduce: the answer and planted mistakes --------------------------------------------
def _ring_all_reduce(tensor, *, add=True, rs_offset=0, send_offset=0, left_step=-1, steps_less=0,
                     whole=False):
    """A ring all-reduce with knobs that plant one typical mistake each."""
    n, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % n, (r + left_step) % n
    chunks = list(tensor.view(-1).chunk(n))
    for s in range(n - 1 - steps_less):
        send_i, recv_i = (r - s + send_offset) % n, (r - s - 1 + rs_offset) % n
        incoming = torch.empty_like(tensor if whole else chunks[recv_i])
        h = comm.isend(tensor if whole else chunks[send_i], right)
        comm.recv(incoming, left)
        h.wait()
        if whole:
            incoming = incoming.view(-1).chunk(n)[send_i - 1 if send_offset == 0 else recv_i]
        if add:
            chunks[recv_i] += incoming
        else:
            chunks[recv_i].copy_(incoming)
    for s in range(n - 1):
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        h = comm.isend(tensor if whole else chunks[send_i], right)
        if whole:
            buf = torch.empty_like(tensor)
            comm.recv(buf, left)
            chunks[recv_i].copy_(buf.view(-1).chunk(n)[recv_i])
        else:
            comm.recv(chunks[recv_i], left)
        h.wait()
    return tensor


def right_answer(tensor):
    return _ring_all_reduce(tensor)


def copies_instead_of_adding(tensor):
    return _ring_all_reduce(tensor, add=False)


def off_by_one_receive_index(tensor):
    return _ring_all_reduce(tensor, rs_offset=1)


def sends_the_wrong_chunk(tensor):
    return _ring_all_reduce(tensor, send_offset=1)


def receives_from_the_wrong_neighbour(tensor):
    return _ring_all_reduce(tensor, left_step=+1)


def stops_one_step_early(tensor):
    return _ring_all_reduce(tensor, steps_less=1)


def sends_whole_tensor(tensor):
    return _ring_all_reduce(tensor, whole=True)


def not_in_place(tensor):
    out = tensor.clone()
    ring.ring_all_reduce(out)
    return out


def uses_all_reduce(tensor):
    comm.all_reduce(tensor)
    return tensor


def untraced(tensor):
    dist.all_reduce(tensor)
    return tensor


def stub(tensor):
    raise NotImplementedError("exercise: write the ring all-reduce")


def test_ring_all_reduce_accepts_the_right_answer(capsys):
    ch00.check_ring_all_reduce(right_answer)
    assert "[ok] ring all-reduce: correct" in capsys.readouterr().out


def test_ring_all_reduce_accepts_minitp_own_ring():
    ch00.check_ring_all_reduce(ring.ring_all_reduce)


@pytest.mark.parametrize("fn, expected", [
    (copies_instead_of_adding, "ADD the incoming chunk"),
    (off_by_one_receive_index, "wrong tensor"),
    (sends_the_wrong_chunk, "wrong tensor"),
    (stops_one_step_early, "only"),
    (sends_whole_tensor, "not the whole tensor"),
    (not_in_place, "in place"),
    (uses_all_reduce, "send / comm.recv"),
    (untraced, "no message was traced"),
    (stub, "not done yet"),
])
def test_ring_all_reduce_catches_mistake(fn, expected):
    with pytest.raises(ExerciseError, match=expected):
        ch00.check_ring_all_reduce(fn)


def test_ring_all_reduce_says_which_ranks_a_copied_chunk_holds():
    with pytest.raises(ExerciseError) as info:
        ch00.check_ring_all_reduce(copies_instead_of_adding)
    assert "sum of ranks" in str(info.value) or "data only" in str(info.value)


def test_ring_all_reduce_catches_a_hang_from_the_wrong_neighbour():
    with pytest.raises(ExerciseError, match="hung.*left one"):
        ch00.check_ring_all_reduce(receives_from_the_wrong_neighbour, timeout=3)


# -- ring all-gather -----------------------------------------------------------------------------
def _ring_all_gather(output, input, *, offset=0, copy_own=True, whole=False):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(output.view(-1).chunk(n))
    if copy_own:
        chunks[r].copy_(input)
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1 + offset) % n
        h = comm.isend(output if whole else chunks[send_i], (r + 1) % n)
        if whole:
            buf = torch.empty_like(output)
            comm.recv(buf, (r - 1) % n)
            chunks[recv_i].copy_(buf.view(-1).chunk(n)[recv_i])
        else:
            comm.recv(chunks[recv_i], (r - 1) % n)
        h.wait()
    return output


def gather_right(output, input):
    return _ring_all_gather(output, input)


def gather_off_by_one(output, input):
    return _ring_all_gather(output, input, offset=1)


def gather_forgets_own_input(output, input):
    return _ring_all_gather(output, input, copy_own=False)


def gather_sends_whole_output(output, input):
    return _ring_all_gather(output, input, whole=True)


def gather_stub(output, input):
    raise NotImplementedError


def test_ring_all_gather_accepts_the_right_answer(capsys):
    ch00.check_ring_all_gather(gather_right)
    assert "[ok] ring all-gather: correct" in capsys.readouterr().out


def test_ring_all_gather_accepts_minitp_own_ring():
    ch00.check_ring_all_gather(ring.ring_all_gather)


@pytest.mark.parametrize("fn, expected", [
    (gather_off_by_one, "expected rank \\d's input, got rank \\d's input"),
    (gather_forgets_own_input, "nothing \\(never written\\)"),
    (gather_sends_whole_output, "not the whole tensor"),
    (gather_stub, "not done yet"),
])
def test_ring_all_gather_catches_mistake(fn, expected):
    with pytest.raises(ExerciseError, match=expected):
        ch00.check_ring_all_gather(fn)


# -- bytes by hand -------------------------------------------------------------------------------
def bytes_right(op, nbytes, n):
    return (2 if op == "all_reduce" else 1) * (n - 1) / n * nbytes


def test_ring_bytes_accepts_the_right_answer(capsys):
    ch00.check_ring_bytes(bytes_right)
    assert "[ok] ring bytes" in capsys.readouterr().out


@pytest.mark.parametrize("fn, expected", [
    (lambda op, B, n: (n - 1) / n * B, "one phase only"),
    (lambda op, B, n: 2 * (n - 1) / n * B, "is just one of its two phases"),
    (lambda op, B, n: (2 if op == "all_reduce" else 1) * (n - 1) * B, "divide by n"),
    (lambda op, B, n: (2 if op == "all_reduce" else 1) * B, "n - 1 steps"),
    (lambda op, B, n: None, "returned None"),
    (lambda op, B, n: (_ for _ in ()).throw(NotImplementedError()), "not done yet"),
])
def test_ring_bytes_catches_mistake(fn, expected):
    with pytest.raises(ExerciseError, match=expected):
        ch00.check_ring_bytes(fn)


# -- exercise 4: a tree broadcast (4 and 6 processes) ----------------------------------------------
def tree_broadcast(tensor, src, *, copy_back=True):
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    me = (rank - src) % n
    have = tensor if copy_back else tensor.clone()  # planted: received into a copy, never written back
    step = 1
    while step < n:
        if me < step and me + step < n:
            comm.send(have, (rank + step) % n)
        elif step <= me < 2 * step:
            comm.recv(have, (rank - step) % n)
        step *= 2


def linear_broadcast(tensor, src):  # src sends to every rank itself: n-1 messages from one rank
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    if rank == src:
        for dst in range(n):
            if dst != src:
                comm.send(tensor, dst)
    else:
        comm.recv(tensor, src)


def chain_broadcast(tensor, src):  # each rank passes it on: n-1 messages deep
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    me = (rank - src) % n
    if me:
        comm.recv(tensor, (rank - 1) % n)
    if me < n - 1:
        comm.send(tensor, (rank + 1) % n)


def broadcast_with_collective(tensor, src):
    comm.broadcast(tensor, src=src)


def test_tree_broadcast_passes(capsys):
    ch00.check_tree_broadcast(tree_broadcast)
    assert "[ok] tree broadcast" in capsys.readouterr().out


@pytest.mark.parametrize("fn, message", [
    (lambda t, s: tree_broadcast(t, s, copy_back=False), "rank 1 ends with zeros"),
    (linear_broadcast, "rank 0 sent 3 messages"),
    (chain_broadcast, "a chain"),
    (broadcast_with_collective, "called broadcast"),
])
def test_tree_broadcast_mistakes_caught(fn, message):
    with pytest.raises(ExerciseError, match=message):
        ch00.check_tree_broadcast(fn, runs=((4, 0),))


# -- what the chapter says at real scale, recomputed from the hardware sheet ----------------------
def _chapter(name: str, kind: str) -> str:
    """A chapter's Markdown (kind "markdown"), whitespace collapsed, or its stored text outputs (kind "outputs")."""
    import json
    from pathlib import Path

    cells = json.loads((Path(__file__).parent.parent / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    if kind == "outputs":
        return "\n".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", []))
    return " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())


def test_chapter_00_llama3_8b_gradients_take_0_06_s_on_nvlink_and_0_63_s_on_infiniband():
    from minitp import cost
    from minitp.models import LLAMA3_8B

    grads = 2 * LLAMA3_8B.num_params()  # bf16
    sent = {n: cost.collective_sent_bytes("all_reduce", grads, n) for n in (8, 64)}
    seconds = {8: sent[8] / cost.H100.intra.bytes_per_s, 64: sent[64] / cost.H100.inter.bytes_per_s}
    assert (cost.H100.intra.bytes_per_s, cost.H100.inter.bytes_per_s) == (450e9, 50e9)
    assert [round(sent[n] / 1e9) for n in (8, 64)] == [28, 32]
    assert [round(seconds[n], 2) for n in (8, 64)] == [0.06, 0.63]
    assert round(cost.H100.intra.bytes_per_s / cost.H100.inter.bytes_per_s) == 9
    assert round(seconds[64] / seconds[8]) == 10
    text, outputs = _chapter("00_collectives", "markdown"), _chapter("00_collectives", "outputs")
    assert "About 28 GB sent by every GPU, every step, on 8 GPUs, and 32 GB on 64" in text
    assert ("over NVLink, that is about 0.06 s; across machines, at a ninth of the bandwidth, 0.63 s per step, "
            "ten times as long") in text
    for n, link in ((8, cost.H100.intra), (64, cost.H100.inter)):
        assert (f"n = {n:>2}: each GPU sends {sent[n] / 1e9:5.2f} GB per step, {seconds[n]:.2f} s on {link.name} "
                f"at {link.bytes_per_s / 1e9:.0f} GB/s") in outputs
    assert f"InfiniBand has 1/9 of NVLink's bandwidth: the 64 GPUs' all-reduce takes {seconds[64] / seconds[8]:.1f}" \
        in outputs


def test_chapter_00_says_once_what_gb_gib_and_a_links_bandwidth_are():
    text = _chapter("00_collectives", "markdown")
    said = ("**GB is $10^9$ bytes and GiB $2^{30}$ bytes, and a link's bandwidth is per GPU and per direction**")
    assert text.count(said) == 1
    assert "GB is $10^9$" not in _chapter("01_ddp", "markdown")  # said once, in chapter 00


# -- hints in levels: the expected value shows only from the second wrong try -------------------------
def test_ring_bytes_shows_the_expected_bytes_from_the_second_try():
    want = cost.collective_sent_bytes("all_reduce", 2**20, 4)  # the first case: all-reduce of 1 MiB over 4
    first_then_second(ch00.check_ring_bytes, lambda op, B, n: 1.0, expected=f"{want:g} bytes per rank")


def test_ring_all_reduce_shows_the_expected_chunks_from_the_second_try():
    want = sum(ch00._inputs(rank, 16, 4) for rank in range(4))  # 4 ranks, 4 elements per chunk, seed 4
    chunks = [str(want[c * 4:(c + 1) * 4].tolist()) for c in range(4)]
    with pytest.raises(ExerciseError) as first:
        ch00.check_ring_all_reduce(copies_instead_of_adding)
    assert "Expected:" not in str(first.value) and "show_expected" in str(first.value)
    assert not any(chunk in str(first.value) for chunk in chunks)
    with pytest.raises(ExerciseError) as second:
        ch00.check_ring_all_reduce(copies_instead_of_adding)
    assert "Expected: on rank 0, chunk" in str(second.value) and any(chunk in str(second.value) for chunk in chunks)


def test_ring_all_gather_shows_the_expected_output_from_the_second_try():
    want = torch.cat([ch00._inputs(rank, 3, 4) for rank in range(4)])  # 4 ranks of 3 elements, seed 4
    first_then_second(ch00.check_ring_all_gather, gather_off_by_one, expected=f"on rank 0, output = {want.tolist()}")


def test_tree_broadcast_shows_srcs_tensor_from_the_second_try():
    data = ch00._inputs(0, 5, seed=3).tolist()  # src 0's tensor
    first_then_second(ch00.check_tree_broadcast, lambda t, s: tree_broadcast(t, s, copy_back=False),
                      runs=((4, 0),), expected=f"src's tensor {data} on every rank")


def test_ring_all_reduce_names_a_mistake_without_an_expected_value():
    with pytest.raises(ExerciseError) as first:  # nothing to show: "Expected" never comes, nor a pointer to it
        ch00.check_ring_all_reduce(uses_all_reduce)
    assert "send / comm.recv" in str(first.value) and "show_expected" not in str(first.value)
