"""Context parallel the all-to-all way (DeepSpeed-Ulysses) against one process and minitp.cost."""

import math

import pytest
import torch

import minitp
from minitp import cost, cp, runs
from minitp.models import TINY


def causal_attention(q, k, v):
    """The layer's own attention on one process: GQA by repeating k and v, the causal mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    S = q.shape[2]
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(
        ~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def qkv(B=2, H=8, Hkv=4, S=16, Dh=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, S, Dh, generator=g) for h in (H, Hkv, Hkv, H)]  # q, k, v, grad_out


def attend_worker(make_attend):
    """On each rank: ``make_attend(balanced)``'s attention of this rank's q, k, v and its backward, for
    both layouts (traced under the scopes balanced1 and balanced0): output and gradients per layout."""
    out = {}
    for balanced in (True, False):
        q, k, v, go = qkv()
        local = [cp.shard_sequence(t, None, balanced, dim=2).requires_grad_() for t in (q, k, v)]
        with minitp.trace.scope(f"balanced{int(balanced)}"):
            o = make_attend(balanced)(*local)
            o.backward(cp.shard_sequence(go, None, balanced, dim=2))
        out[balanced] = [o.detach()] + [t.grad for t in local]
    return out


def matches_one_process(results, n: int, balanced: bool) -> None:
    """The ranks' pieces, in sequence order, equal one process's output and q, k, v gradients."""
    q, k, v, go = [t.requires_grad_() for t in qkv()]
    want = causal_attention(q, k, v)
    want.backward(go)
    for i, (name, expected) in enumerate(zip(("out", "dq", "dk", "dv"), (want.detach(), q.grad, k.grad, v.grad))):
        got = cp.unshard_sequence([r[balanced][i] for r in results], balanced, dim=2)
        assert (got - expected).abs().max().item() <= 1e-5, f"{name} on {n} ranks, balanced={balanced}"


@pytest.fixture(scope="module", params=[2, 4])
def ulysses_run(request):
    make = lambda balanced: cp.UlyssesAttend(causal_attention, None, balanced)  # noqa: E731
    return request.param, minitp.launch(attend_worker, request.param, make, echo=False)


@pytest.mark.parametrize("balanced", [True, False])
def test_ulysses_output_and_gradients_equal_one_process(ulysses_run, balanced):
    n, results = ulysses_run
    matches_one_process(results, n, balanced)


def test_ulysses_sends_four_all_to_alls_each_way_of_which_n_minus_1_over_n_leaves(ulysses_run):
    n, results = ulysses_run
    B, H, Hkv, S, Dh = 2, 8, 4, 16, 8
    expected = cost.ulysses_attention_bytes(B, S, H, Hkv, Dh, n)
    # q and the output: B·(S/n)·H·Dh fp32 each, k and v B·(S/n)·Hkv·Dh, forward and backward
    assert expected == 2 * (2 * H + 2 * Hkv) * B * (S // n) * Dh * 4 * (n - 1) / n
    for tr in results.traces:
        for balanced in (0, 1):
            assert tr.sent_bytes(f"balanced{balanced}/cp/ulysses") == expected
        ops = [e.op for e in tr.comm() if e.label.startswith("balanced1/")]
        assert ops == ["all_to_all"] * 8  # q, k, v, out forward; their transposes backward


def test_ulysses_sends_less_than_the_ring_and_less_the_more_ranks_share_the_sequence():
    # LLaMA-3-8B, one sequence of 131,072 tokens in bf16: per rank and attention call
    cfg = minitp.models.LLAMA3_8B
    S, Dh = 131072, cfg.head_dim
    ring = [cost.cp_attention_bytes(1, S, cfg.kv_heads, Dh, c, 2) for c in (2, 4, 8)]
    ulysses = [cost.ulysses_attention_bytes(1, S, cfg.n_heads, cfg.kv_heads, Dh, c, 2) for c in (2, 4, 8)]
    assert ulysses[0] > ulysses[1] > ulysses[2] and ring[0] < ring[1] < ring[2]
    assert all(u < r for u, r in zip(ulysses[1:], ring[1:]))


def test_run_cp_with_ulysses_matches_one_process_and_refuses_more_ranks_than_key_value_heads():
    report = runs.run_cp(nproc=2, steps=2, attention="ulysses")
    assert runs.check(report) == [] and report["attention"] == "ulysses"
    assert report["ring_bytes"] == report["ring_bytes_expected"]
    assert report["ring_bytes"][0] == 2 * TINY.n_layers * cost.ulysses_attention_bytes(
        8, 16, TINY.n_heads, TINY.kv_heads, TINY.head_dim, 2)
    with pytest.raises(ValueError, match="n_kv_heads=4 is not divisible by nproc=8"):
        runs.run_cp(nproc=8, attention="ulysses")
    with pytest.raises(ValueError, match="attention must be one of ring, ulysses, allgather, got 'tree'"):
        cp.parallelize(minitp.models.build_model(TINY), None, attention="tree")
