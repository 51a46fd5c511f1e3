"""minitp.trace: bytes added up by the mesh dimension each message went through, per rank."""

from minitp import trace


def _sent(rank: int, dim: str, nbytes: float, label: str = "any") -> trace.Event:
    return trace.Event(rank, "comm", "all_reduce", label, 0.0, 0.0, group=(0, 1), dim=dim, sent_bytes=nbytes)


def _traces() -> list[trace.Trace]:
    rank1 = trace.Trace(1, [_sent(1, "tp", 10.0), _sent(1, "dp", 4.0), _sent(1, "", 1.0)])
    rank0 = trace.Trace(0, [_sent(0, "tp", 10.0), _sent(0, "tp", 6.0, label="answer/x"),
                            trace.Event(0, "compute", "forward", "tp/not a message", 0.0, 1.0, dim="tp")])
    return [rank1, rank0]  # out of order: the readers sort by rank


def test_sent_bytes_by_dim_gives_every_rank_every_dimension_in_rank_order():
    assert trace.sent_bytes_by_dim(_traces()) == [{"": 0.0, "dp": 0.0, "tp": 16.0},
                                                  {"": 1.0, "dp": 4.0, "tp": 10.0}]


def test_sent_bytes_per_rank_filters_by_dimension_and_by_label_prefix():
    assert trace.sent_bytes_per_rank(_traces()) == [16.0, 15.0]
    assert trace.sent_bytes_per_rank(_traces(), dim="dp") == [0.0, 4.0]
    assert trace.sent_bytes_per_rank(_traces(), "answer") == [6.0, 0.0]  # the exercises' answer scope
    assert trace.sent_bytes_per_rank(_traces(), "answer", dim="dp") == [0.0, 0.0]


def test_totals_group_by_dimension():
    events = [e for t in _traces() for e in t.events]
    by_dim = trace.totals(events, by=("dim",))
    assert by_dim[("tp",)] == {"calls": 3, "bytes": 0, "sent_bytes": 26.0}  # the compute span is not counted
    assert set(by_dim) == {("tp",), ("dp",), ("",)}


def test_merge_keeps_the_dimension():
    assert [e.dim for e in trace.merge(_traces()) if e.kind == "comm"] == ["tp", "tp", "tp", "dp", ""]
