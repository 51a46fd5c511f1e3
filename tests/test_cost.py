"""minitp.cost: the formulas, checked by hand on small cases and by their defining identities."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minitp import cost


def test_ring_collectives_by_hand():
    assert cost.collective_sent_bytes("all_reduce", 1000, 4) == 1500.0
    assert cost.collective_sent_bytes("all_gather", 1000, 4) == 750.0
    assert cost.collective_sent_bytes("reduce_scatter", 1000, 4) == 750.0
    assert cost.collective_sent_bytes("send", 1000, 2) == 1000.0
    assert cost.collective_sent_bytes("recv", 1000, 2) == 0.0
    assert cost.collective_sent_bytes("all_reduce", 1000, 1) == 0.0
    assert [cost.collective_sent_bytes("broadcast", 10, 3, p) for p in range(3)] == [10.0, 10.0, 0.0]


@given(nbytes=st.integers(1, 10**9), n=st.integers(2, 512))
def test_all_reduce_is_a_reduce_scatter_then_an_all_gather(nbytes, n):
    ar = cost.collective_sent_bytes("all_reduce", nbytes, n)
    rs = cost.collective_sent_bytes("reduce_scatter", nbytes, n)
    ag = cost.collective_sent_bytes("all_gather", nbytes, n)
    assert ar == pytest.approx(rs + ag)
    assert n * ar == pytest.approx(2 * (n - 1) * nbytes)  # the whole ring moves 2(n-1) buffers


def test_unknown_collective_is_refused():
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        cost.collective_sent_bytes("gather", 10, 2)


def test_ddp_run_bytes_count_the_start_up_broadcast_and_every_step():
    # 100 parameters of 4 bytes, 4 ranks, 3 steps: 3 * 1.5 * 400 plus 400 for all but the chain's end
    assert [cost.ddp_run_bytes(100, 4, 3, r) for r in range(4)] == [2200.0, 2200.0, 2200.0, 1800.0]
    assert cost.ddp_run_bytes(100, 4, 3, 0, broadcast_at_init=False) == 1800.0


def test_buckets_fill_in_order_and_an_oversized_parameter_gets_its_own():
    assert cost.num_buckets([40, 40, 40], 100) == 2  # [40, 40] [40]
    assert cost.num_buckets([40, 40, 40], 120) == 1
    assert cost.num_buckets([10, 500, 10], 100) == 3  # [10] [500] [10]
    assert cost.num_buckets([10] * 7, 1) == 7
    with pytest.raises(ValueError, match="bucket_bytes must be > 0, got 0"):
        cost.num_buckets([10], 0)


PSI, N = 1_000_000, 8


@pytest.mark.parametrize("zero, per_psi", [
    (0, 16),  # DDP: 2 + 2 + 12
    (1, 4 + 12 / N),
    (2, 2 + 14 / N),
    (3, 16 / N),
])
def test_zero_memory_in_mixed_precision_is_the_papers_split(zero, per_psi):
    m = cost.memory_per_rank(PSI, N, zero=zero, precision="bf16")
    assert cost.total_memory(m) == pytest.approx(per_psi * PSI)


@pytest.mark.parametrize("zero, per_psi", [(0, 16), (1, 8 + 8 / N), (2, 4 + 12 / N), (3, 16 / N)])
def test_zero_memory_in_fp32(zero, per_psi):
    assert cost.total_memory(cost.memory_per_rank(PSI, N, zero=zero)) == pytest.approx(per_psi * PSI)


def test_adam_step_counters_add_four_bytes_per_tensor():
    assert cost.memory_per_rank(10, num_tensors=3)["optimizer"] == 80 + 12


def test_memory_bad_input():
    with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3, got 4"):
        cost.memory_per_rank(10, 2, zero=4)
    with pytest.raises(ValueError, match="precision must be"):
        cost.memory_per_rank(10, 2, precision="int8")
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        cost.memory_per_rank(10, 0)
