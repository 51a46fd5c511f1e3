"""Context parallel LLaMA 3's way (all-gather the keys and values) against one process and minitp.cost."""

import pytest
from test_cp_ulysses import attend_worker, matches_one_process

import minitp
from minitp import cost, cp, runs
from minitp.models import LLAMA3_8B, TINY


@pytest.fixture(scope="module", params=[2, 4])
def allgather_run(request):
    make = lambda balanced: cp.AllGatherAttend(None, balanced)  # noqa: E731
    return request.param, minitp.launch(attend_worker, request.param, make, echo=False)


@pytest.mark.parametrize("balanced", [True, False])
def test_allgather_output_and_gradients_equal_one_process(allgather_run, balanced):
    n, results = allgather_run
    matches_one_process(results, n, balanced)


def test_allgather_gathers_keys_and_values_and_scatters_their_gradients_back(allgather_run):
    n, results = allgather_run
    B, Hkv, S, Dh = 2, 4, 16, 8
    kv = B * Hkv * (S // n) * Dh * 4  # one rank's keys (or values), fp32
    assert cost.allgather_attention_bytes(B, S, Hkv, Dh, n) == 2 * (n - 1) * 2 * kv
    for tr in results.traces:
        for balanced in (0, 1):
            assert tr.sent_bytes(f"balanced{balanced}/cp/allgather") == cost.allgather_attention_bytes(B, S, Hkv, Dh, n)
        ops = [e.op for e in tr.comm() if e.label.startswith("balanced1/")]
        assert sorted(ops) == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]


def test_allgather_sends_fewer_bytes_than_the_ring_but_does_not_shrink_with_ranks_as_ulysses_does():
    cfg, S = LLAMA3_8B, 131072  # one sequence, bf16, per rank and attention call
    ring, gathered, ulysses = ([f(c) for c in (2, 4, 8)] for f in (
        lambda c: cost.cp_attention_bytes(1, S, cfg.kv_heads, cfg.head_dim, c, 2),
        lambda c: cost.allgather_attention_bytes(1, S, cfg.kv_heads, cfg.head_dim, c, 2),
        lambda c: cost.ulysses_attention_bytes(1, S, cfg.n_heads, cfg.kv_heads, cfg.head_dim, c, 2)))
    assert all(g < r for g, r in zip(gathered, ring))  # 2(c-1) against 3c-2 blocks of 2KV
    assert [g / r for g, r in zip(gathered, ring)] == pytest.approx([2 * (c - 1) / (3 * c - 2) for c in (2, 4, 8)])
    assert gathered[0] < gathered[1] < gathered[2] and ulysses[0] > ulysses[2]


@pytest.mark.parametrize("balanced", [True, False])
def test_run_cp_with_allgather_matches_one_process_and_the_formula(balanced):
    report = runs.run_cp(nproc=2, steps=2, attention="allgather", balanced=balanced)
    assert runs.check(report) == [] and report["attention"] == "allgather"
    assert report["ring_bytes"] == report["ring_bytes_expected"]
    assert report["ring_bytes"][0] == 2 * TINY.n_layers * cost.allgather_attention_bytes(
        8, 16, TINY.kv_heads, TINY.head_dim, 2)
