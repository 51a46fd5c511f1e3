"""minitp.ring's pipelined all-reduce: the same sums and the same bytes as the whole-chunk ring,
cut into more messages, each sub-chunk passed on before the rest of its chunk has arrived."""

import pytest
import torch
import torch.distributed as dist

import minitp
from minitp import cost, ring


def _sums(numel, sub_chunk_bytes):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    whole, piped, reference = x.clone(), x.clone(), x.clone()
    ring.ring_all_reduce(whole, label="whole", sub_chunk_bytes=2**40)
    ring.ring_all_reduce(piped, label="piped", sub_chunk_bytes=sub_chunk_bytes)
    dist.all_reduce(reference)
    return {"whole": whole, "piped": piped, "reference": reference}


@pytest.mark.parametrize("world_size, numel, sub_chunk_bytes", [
    (4, 4096, 1024),     # 1,024-element chunks in 4 sub-chunks of 256
    (3, 1001, 64),       # uneven chunks (334, 334, 333) in uneven sub-chunks
    (2, 5, 4),           # sub-chunks of one element
    (4, 4096, 2**20),    # a sub-chunk larger than the chunk: the chunk goes whole
])
def test_pipelined_ring_gives_the_same_sums_to_the_bit_and_equals_all_reduce(world_size, numel, sub_chunk_bytes):
    for r in minitp.launch(_sums, world_size, numel, sub_chunk_bytes, echo=False):
        assert torch.equal(r["piped"], r["whole"])  # each element added in the same order
        torch.testing.assert_close(r["piped"], r["reference"])


def test_pipelining_sends_the_same_bytes_in_more_messages():
    results = minitp.launch(_sums, 4, 4096, 1024, echo=False)  # 4 sub-chunks per chunk
    formula = cost.collective_sent_bytes("all_reduce", 4096 * 4, 4)
    assert results.sent_bytes("piped") == results.sent_bytes("whole") == [formula] * 4
    for trace in results.traces:
        sends = {label: [e for e in trace.comm() if e.op == "send" and e.label.startswith(label)]
                 for label in ("whole", "piped")}
        assert len(sends["whole"]) == 2 * (4 - 1)
        assert len(sends["piped"]) == 2 * (4 - 1) * 4


def _step_events():
    x = torch.ones(4096)
    ring.ring_all_reduce(x, label="piped", sub_chunk_bytes=1024)
    return None


def test_a_sub_chunk_goes_on_before_the_rest_of_its_chunk_has_arrived():
    """Pipelined, not lock-step: the first sub-chunk of step s+1 leaves before the last sub-chunk of
    step s is in."""
    results = minitp.launch(_step_events, 4, echo=False)
    events = results.traces[0].comm()
    recvs = [e for e in events if e.op == "recv" and e.label == "piped/reduce_scatter/step0"]
    sends = [e for e in events if e.op == "send" and e.label == "piped/reduce_scatter/step1"]
    assert len(recvs) == len(sends) == 4
    assert sends[0].start < max(e.end for e in recvs)


def _record(sub_chunk_bytes):
    record = []
    ring.ring_all_reduce(torch.full((8,), float(2 ** dist.get_rank())), record=record, sub_chunk_bytes=sub_chunk_bytes)
    return [(e["phase"], e["step"], e["sent"], e["received"], e["tensor"].tolist()) for e in record]


def test_the_step_by_step_record_is_the_same_pipelined_or_not():
    assert list(minitp.launch(_record, 4, 4, echo=False)) == list(minitp.launch(_record, 4, 2**20, echo=False))


def _bad(sub_chunk_bytes):
    ring.ring_all_reduce(torch.ones(4), sub_chunk_bytes=sub_chunk_bytes)


def test_a_sub_chunk_size_that_is_not_positive_is_refused():
    with pytest.raises(minitp.RankError, match="sub_chunk_bytes must be > 0, got 0"):
        minitp.launch(_bad, 2, 0, echo=False)



def _twice(numel):
    """Two all-reduces of one size, then one of another: whether each call's inboxes are the ones the
    call before used (references kept, so a freed buffer's address cannot pass for the same one), and
    whether each sum is right."""
    out, before = [], None
    for k, n in enumerate((numel, numel, numel + 8)):
        x = torch.randn(n, generator=torch.Generator().manual_seed(10 * dist.get_rank() + k))
        reference = x.clone()
        dist.all_reduce(reference)
        ring.ring_all_reduce(x, sub_chunk_bytes=256)
        (inbox,) = ring._INBOXES.values()  # the last size's only
        out.append((torch.allclose(x, reference, atol=1e-6), inbox is before))
        before = inbox
    return out


def test_the_inboxes_are_kept_between_calls_of_one_size_and_the_sums_stay_right():
    for (right0, _), (right1, same1), (right2, same2) in minitp.launch(_twice, 3, 999, echo=False):
        assert right0 and right1 and right2
        assert same1 and not same2  # the same buffers for the same size; another size, new ones
