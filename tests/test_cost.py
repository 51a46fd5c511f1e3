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


# -- numbers chapters 05, 07 and 08 state -------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 3, 4, 8, 16])
def test_ring_attention_sends_3cp_minus_2_hops_of_2kv(cp):
    kv2 = 2 * cost.cp_kv_block_bytes(1, 4096, 8, 128, cp, 2)
    assert cost.cp_attention_bytes(1, 4096, 8, 128, cp, 2, backward=False) == (cp - 1) * kv2
    assert cost.cp_attention_bytes(1, 4096, 8, 128, cp, 2) == (3 * cp - 2) * kv2  # not (4cp - 3)


@pytest.mark.parametrize("cp, per_rank", [(2, 256), (4, 256), (8, 1024)])
def test_contiguous_causal_slices_give_rank_r_r_blocks_and_half_its_own(cp, per_rank):
    # tile=1: the diagonal block counts exactly its c(c+1)/2 unmasked pairs
    c = per_rank
    pairs = [cost.cp_attention_flops_per_rank(c * cp, cp, r, 1, 1, balanced=False, tile=1) / 4 for r in range(cp)]
    assert pairs == [r * c * c + c * (c + 1) / 2 for r in range(cp)]
    assert pairs[-1] / pairs[0] == pytest.approx(1 + 2 * (cp - 1) * c / (c + 1))
    assert pairs[-1] / pairs[0] == pytest.approx(2 * cp - 1, rel=0.01)


def _interleaved_sends(p, m, v):
    """Messages each rank sends in one step, counted from the schedule table: a forward sends unless
    its chunk is the model's last piece, a backward unless it is the first (piece = chunk·p + rank)."""
    from minitp import pp
    table = pp.make_schedule("interleaved", p, m, v) if v > 1 else pp.make_schedule("1f1b", p, m)
    sends = []
    for rank, actions in enumerate(table):
        pieces = [a.chunk * p + rank for a in actions if a.kind in "FB"]
        kinds = [a.kind for a in actions if a.kind in "FB"]
        sends.append(sum(1 for k, x in zip(kinds, pieces) if (k == "F" and x != p * v - 1) or (k == "B" and x != 0)))
    return sends


@pytest.mark.parametrize("p, v", [(4, 2), (4, 3), (8, 2)])
def test_interleaving_multiplies_messages_by_pv_minus_1_over_p_minus_1_in_all(p, v):
    m = 2 * p
    plain, chunked = _interleaved_sends(p, m, 1), _interleaved_sends(p, m, v)
    ratios = [c / s for c, s in zip(chunked, plain)]
    assert ratios == [2 * v - 1] + [v] * (p - 2) + [2 * v - 1]  # the end ranks pay more than v
    assert sum(chunked) / sum(plain) == pytest.approx((p * v - 1) / (p - 1))
    bytes_ = [cost.pp_step_bytes(m, 16, 8, p, s, virtual_stages=v) / cost.pp_step_bytes(m, 16, 8, p, s)
              for s in range(p)]
    assert bytes_ == ratios


def _draw_nodes(rng, n_experts, top_k, nodes, max_nodes):
    per_node = n_experts // nodes
    chosen = rng.sample(range(nodes), max_nodes)
    experts = rng.sample([n * per_node + i for n in chosen for i in range(per_node)], top_k)
    return {e // per_node for e in experts}


def test_expected_nodes_per_token_equals_enumeration_on_a_small_case():
    from itertools import combinations

    n_experts, top_k, nodes, max_nodes = 12, 3, 4, 2  # 3 experts a node
    per_node = n_experts // nodes
    hits = [len({e // per_node for e in experts})
            for chosen in combinations(range(nodes), max_nodes)
            for experts in combinations([n * per_node + i for n in chosen for i in range(per_node)], top_k)]
    want = sum(hits) / len(hits)
    assert cost.experts.expected_nodes_per_token(n_experts, top_k, nodes, max_nodes) == pytest.approx(want)
    unlimited = [len({e // per_node for e in experts}) for experts in combinations(range(n_experts), top_k)]
    assert cost.experts.expected_nodes_per_token(n_experts, top_k, nodes) == pytest.approx(
        sum(unlimited) / len(unlimited))


def test_deepseek_v3_node_limited_routing_crosses_infiniband_about_3_2_times_per_token():
    import random

    rng = random.Random(0)
    n_experts, top_k, nodes, max_nodes, draws = 256, 8, 8, 4, 20000
    hit = remote = 0
    for _ in range(draws):
        own = rng.randrange(nodes)
        targets = _draw_nodes(rng, n_experts, top_k, nodes, max_nodes)
        hit += len(targets)
        remote += len(targets - {own})
    expected = cost.experts.expected_nodes_per_token(n_experts, top_k, nodes, max_nodes)
    assert expected == pytest.approx(3.629, abs=1e-3)
    assert hit / draws == pytest.approx(expected, abs=0.02)
    row = cost.experts.moe_internode_bytes(1, 1, top_k, n_experts, 64, 8, max_nodes, 1, 1, 1)["dispatch"]
    assert row == pytest.approx(expected * 7 / 8)
    assert remote / draws == pytest.approx(row, abs=0.02)
    # against one row per assignment leaving the GPU, k·(ep-1)/ep = 7.875: about 2.5 times fewer
    assert cost.moe_all_to_all_bytes(1, 1, top_k, 64, 1, 1)["dispatch"] / row == pytest.approx(2.48, abs=0.01)


def test_internode_bytes_follow_the_all_to_all_split():
    full = cost.experts.moe_internode_bytes(4096, 7168, 8, 256, 64, 8, 4, dispatch_bytes=1, combine_bytes=2,
                                            grad_bytes=2)
    rows = 4096 * cost.experts.expected_nodes_per_token(256, 8, 8, 4) * 7 / 8
    assert full == pytest.approx({"dispatch": rows * 7168, "combine": rows * 7168 * 2,
                                  "backward": rows * 7168 * 4, "total": rows * 7168 * 7})
    assert cost.experts.moe_internode_bytes(4096, 7168, 8, 256, 8, 8)["total"] == 0  # one node: nothing crosses
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and the 8 experts"):
        cost.experts.expected_nodes_per_token(16, 9, 4, 2)
