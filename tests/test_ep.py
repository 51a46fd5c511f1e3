"""Expert parallel: the traced all-to-all, the MoE model, its experts over ranks, and the checked run."""

import math

import pytest
import torch

from minitp import comm, cost, ep
from minitp.launcher import launch
from minitp.models import TINY, FeedForward
from minitp.models.moe import (
    build_moe_model,
    capacity_mask,
    load_balancing_loss,
    moe_config,
    moe_layers,
    moe_loss,
    route,
)
from minitp.runs import run_ep
from minitp.runs.registry import STRATEGIES, OptionError


# -- the traced all-to-all -----------------------------------------------------------------------
def _uneven_all_to_all():
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    send = [(rank + j) % 3 for j in range(n)]  # rows for rank j; some are 0
    x = torch.cat([torch.full((send[j], 2), 10.0 * rank + j) for j in range(n)])  # (sum, 2)
    recv = [(i + rank) % 3 for i in range(n)]  # what rank i sends me
    out = torch.empty(sum(recv), 2)
    comm.all_to_all(out, x, recv, send, label="uneven")
    try:
        comm.all_to_all(out, x, recv, [x.shape[0] + 1] + [0] * (n - 1))  # one row more than x has
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"out": out[:, 0].tolist(), "send": send, "refused": refused}


def test_all_to_all_delivers_uneven_chunks_and_counts_only_bytes_that_leave_the_rank():
    results = launch(_uneven_all_to_all, 3, echo=False)
    for rank, r in enumerate(results):
        expected = [10.0 * i + rank for i in range(3) for _ in range((i + rank) % 3)]
        assert r["out"] == expected
        assert "should be 3 sizes" in r["refused"]
        event = results.traces[rank].comm()[0]
        assert event.op == "all_to_all" and event.bytes == sum(r["send"]) * 2 * 4  # the logical buffer
        assert event.sent_bytes == (sum(r["send"]) - r["send"][rank]) * 2 * 4  # its own chunk stays


def test_even_all_to_all_sends_all_but_one_nth_of_the_buffer():
    assert cost.collective_sent_bytes("all_to_all", 1200, 4) == 900
    assert cost.collective_sent_bytes("all_to_all", 1200, 4, kept_bytes=0) == 1200
    assert cost.collective_sent_bytes("all_to_all", 1200, 1) == 0


# -- the MoE model on one process ----------------------------------------------------------------
def test_capacity_keeps_first_choices_first_then_earlier_tokens():
    # one sequence of 3 tokens, k=2, 2 experts; token choices (0,1), (0,1), (1,0); capacity 2
    expert = torch.tensor([[[0, 1], [0, 1], [1, 0]]])
    keep = capacity_mask(expert, 2, capacity=2)
    # queue of expert 0: t0 (1st), t1 (1st), t2 (2nd) -> t2's dropped; expert 1: t2 (1st), t0 (2nd), t1 (2nd)
    assert keep.tolist() == [[[True, True], [True, False], [True, False]]]


def test_uniform_routing_has_a_load_balancing_loss_of_one():
    probs_logits = torch.zeros(2, 8, 4)
    probs_logits[:, torch.arange(8), torch.arange(8) % 4] = 5.0  # each token prefers a different expert
    routing = route(probs_logits, top_k=1, capacity=8)
    assert load_balancing_loss(routing).item() == pytest.approx(1.0)
    skewed = route(torch.zeros(2, 8, 4).index_fill(2, torch.tensor([0]), 5.0), top_k=1, capacity=8)
    assert load_balancing_loss(skewed).item() > 3  # everything on expert 0: about E


def test_one_expert_of_one_is_the_plain_swiglu_mlp():
    cfg = moe_config(TINY, n_experts=1, top_k=1, expert_hidden=TINY.ffn_hidden, capacity_factor=None, n_layers=1)
    layer = moe_layers(build_moe_model(cfg))[0]
    dense = FeedForward(cfg.dim, cfg.ffn_hidden)
    dense.load_state_dict(layer.experts[0].state_dict())
    x = torch.randn(2, 5, cfg.dim)
    assert torch.allclose(layer(x), dense(x), atol=1e-6)


def test_moe_config_counts_its_parameters_and_capacity():
    cfg = moe_config(TINY, n_experts=8, top_k=2, expert_hidden=64, capacity_factor=1.25)
    assert cfg.num_params() == sum(p.numel() for p in build_moe_model(cfg).parameters())
    assert cfg.capacity(16) == math.ceil(1.25 * 16 * 2 / 8)
    assert moe_config(TINY, capacity_factor=None).capacity(16) == 16
    with pytest.raises(ValueError, match="top_k=9"):
        moe_config(TINY, n_experts=8, top_k=9)


# -- expert parallel against one process ---------------------------------------------------------
def _ep_step(cfg, tokens):
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    model = build_moe_model(cfg)
    ep.ExpertParallel(model)
    mine = tokens.chunk(n)[rank]
    logits = model(mine)
    moe_loss(model)(logits, mine).backward()
    return {"logits": logits.detach(), "grads": {k: p.grad for k, p in model.named_parameters()},
            "counts": [layer.history[0].tolist() for layer in moe_layers(model)]}


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_expert_parallel_matches_one_process_and_sends_what_the_routing_implies(capacity_factor):
    cfg = moe_config(TINY, n_layers=2, capacity_factor=capacity_factor)
    tokens = torch.randint(0, cfg.vocab_size, (8, 16), generator=torch.Generator().manual_seed(3))
    model = build_moe_model(cfg)
    logits = model(tokens)
    moe_loss(model)(logits, tokens).backward()
    dropped = sum(layer.routing.dropped for layer in moe_layers(model))
    assert (dropped == 0) == (capacity_factor is None)
    for n in (2, 4):
        results = launch(_ep_step, n, cfg, tokens, echo=False)
        assert (torch.cat([r["logits"] for r in results]) - logits).abs().max() <= 1e-5
        for name, p in model.named_parameters():
            holders = [r for r in results if name in r["grads"]]
            assert len(holders) == (1 if ".experts." in name else n), name  # each expert on one rank
            for r in holders:
                assert (r["grads"][name] - p.grad).abs().max() <= 1e-5, name
        replicated, _ = cost.moe_param_split(cfg)
        for rank, tr in enumerate(results.traces):
            a2a = sum(cost.ep_layer_bytes([r["counts"][layer] for r in results], rank, cfg.dim)
                      for layer in range(cfg.n_layers))
            assert tr.sent_bytes("ep/layers") == a2a  # the all-to-alls of every MoE layer
            assert tr.sent_bytes() == a2a + cost.collective_sent_bytes("all_reduce", 4 * replicated, n)


def test_experts_of_rank_split_evenly_or_refuse():
    assert list(ep.experts_of_rank(8, 4, 1)) == [2, 3]
    with pytest.raises(ValueError, match="n_experts=6 is not divisible by ep=4"):
        ep.experts_of_rank(6, 4, 0)


def test_tokens_between_ranks_sums_the_experts_each_rank_holds():
    counts = [[1, 2, 3, 4], [5, 6, 7, 8]]  # 2 ranks, 4 experts: rank 0 holds 0-1, rank 1 holds 2-3
    assert cost.tokens_between_ranks(counts, 2) == [[3, 7], [11, 15]]
    # rank 0 sends 7 rows out and receives 11: twice each (forward, backward), plus the counts
    assert cost.ep_layer_bytes(counts, 0, dim=4) == 2 * (7 + 11) * 4 * 4 + 4 * 8 / 2


def test_at_scale_volume_spreads_k_tokens_over_the_other_ranks():
    v = cost.moe_all_to_all_bytes(tokens=4096, dim=7168, top_k=8, ep=64, dispatch_bytes=1, combine_bytes=2)
    rows = 8 * 4096 * 63 / 64
    assert v["dispatch"] == rows * 7168 and v["combine"] == 2 * rows * 7168
    assert v["total"] == v["dispatch"] + v["combine"] + 4 * rows * 7168


# -- the checked run -----------------------------------------------------------------------------
def test_run_ep_on_four_ranks_matches_one_process_with_drops_and_the_byte_formula():
    report = run_ep(nproc=4, steps=2)
    assert report.check() == []
    assert report["routing_matches_reference"]
    assert sum(map(sum, report["dropped"])) > 0  # capacity 1.25 drops some tokens, identically
    assert report.comm_bytes_traced_by_dim[0]["ep"] > 0


def test_run_ep_without_a_capacity_limit_drops_nothing():
    report = run_ep(nproc=2, steps=1, experts=4, top_k=1, capacity_factor=None)
    assert report.check() == []
    assert report["dropped"] == [[0] * 4]


def test_run_ep_refuses_experts_that_do_not_split_over_the_ranks():
    with pytest.raises(ValueError, match="experts=6 is not divisible by ep=4"):
        run_ep(nproc=4, experts=6)
    with pytest.raises(OptionError, match="top_k"):
        run_ep(nproc=2, top_k=0)
    assert {"experts", "top_k", "capacity_factor"} <= {o.name for o in STRATEGIES["ep"].options}
