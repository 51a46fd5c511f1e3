"""The planner and the time model with context parallel: the same formulas the cp runs are checked
against (``cost.cp3d_step_bytes``, traced on dp × cp × tp meshes in tests/test_parallel3d.py)."""

import pytest

from minitp import cli, cost, plan
from minitp.models import LLAMA3_8B, get_config


def test_cp_1_changes_nothing():
    before = plan.plan_layout(LLAMA3_8B, 4, 2, 8, 64, 8192)
    after = plan.plan_layout(LLAMA3_8B, 4, 2, 8, 64, 8192, cp=1)
    assert before == after and after["cp"] == 1 and after["bytes_per_step"]["cp"] == 0.0
    assert after["time"]["cp_s"] == 0.0 and after["time"]["cp_exposed_s"] == 0.0


@pytest.mark.parametrize("dp, tp", [(1, 1), (2, 1), (2, 2)])
def test_planned_bytes_are_the_checked_mesh_formula(dp, tp):
    cfg = get_config("tiny")
    row = plan.plan_layout(cfg, dp, 1, tp, batch_size=4, seq_len=16, data_parallel="ddp", precision="fp32", cp=2)
    mesh = cost.cp3d_step_bytes(cfg, 4, 16, dp, 2, tp, dtype_bytes=4)
    assert row["bytes_per_step"] == pytest.approx(mesh)


def test_a_sequence_split_over_cp_keeps_the_activations_of_its_share():
    seq = 131072
    split = plan.plan_layout(LLAMA3_8B, 2, 1, 4, batch_size=2, seq_len=seq, cp=8)
    # the activations of S/cp positions; the model's states shared by the dp·cp ranks (ZeRO-3)
    shorter = plan.plan_layout(LLAMA3_8B, 2, 1, 4, batch_size=2, seq_len=seq // 8)
    assert split["memory"]["activations"] == shorter["memory"]["activations"]
    assert split["memory_states"] == pytest.approx(plan.plan_layout(LLAMA3_8B, 16, 1, 4, 16, 8192)["memory_states"])
    # the ring: per block (3c-2)·2·B·(Hkv/t)·(S/c)·Dh·b, for one replica's B/dp = 1 sequence
    kv = 1 * (LLAMA3_8B.kv_heads // 4) * seq / 8 * LLAMA3_8B.head_dim * 2
    assert split["bytes_per_step"]["cp"] == pytest.approx(LLAMA3_8B.n_layers * (3 * 8 - 2) * 2 * kv)


def test_the_ring_hides_behind_attention_unless_the_link_is_slow():
    fast = cost.step_time(LLAMA3_8B, 8, 131072, dp=1, tp=8, cp=8)
    assert 0 < fast.cp_s < fast.compute_s and fast.cp_exposed_s == 0.0
    # every cp neighbour on another machine, a link 100x slower: the ring outlasts the attention
    slow_link = cost.Link("slow", 10e-6, 0.5e9)
    slow = cost.step_time(LLAMA3_8B, 8, 131072, dp=1, tp=8, cp=8,
                          device=cost.Device("slow", 989e12, slow_link, slow_link, efficiency=0.6))
    assert slow.cp_exposed_s > 0 and slow.step_s > fast.step_s
    # the work per rank: cp divides it like dp does
    assert cost.step_time(LLAMA3_8B, 8, 131072, tp=8, cp=8).compute_s == pytest.approx(
        cost.step_time(LLAMA3_8B, 8, 131072, dp=8, tp=8).compute_s)


def test_plan_lists_the_layouts_of_the_remaining_gpus():
    rows = plan.plan(LLAMA3_8B, 64, 80.0, seq_len=131072, cp=8)
    assert rows and all(r["dp"] * r["pp"] * r["tp"] == 8 and r["cp"] == 8 for r in rows)
    assert any(r["fits"] for r in rows)
    assert not any(r["fits"] for r in plan.plan(LLAMA3_8B, 64, 80.0, seq_len=131072, include_unfit=True))
    table = plan.format_plan(rows)
    assert "cp MiB/step" in table and "cp MiB/step" not in plan.format_plan(plan.plan(LLAMA3_8B, 64, 80.0))


@pytest.mark.parametrize("argv, message", [
    (["plan", "--gpus", "64", "--gpu-memory", "80", "--cp", "3"], "gpus=64 is not divisible by cp=3"),
    (["plan", "--gpus", "64", "--gpu-memory", "80", "--cp", "0"], "--cp 0 is not allowed: expected an integer >= 1"),
    (["plan", "--gpus", "64", "--gpu-memory", "80", "--cp", "4", "--seq-len", "100"],
     "seq_len=100 is not divisible by 2·cp=8"),
])
def test_bad_cp_is_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


# -- full recomputation runs each block's forward again, the attention's messages with it -----------------------
@pytest.mark.parametrize("kind", ["ring", "ulysses", "allgather"])
def test_full_recomputation_sends_the_attentions_forward_messages_again(kind):
    from minitp.cost.context import cp_kind_attention_bytes
    from minitp.models import LLAMA3_70B

    args = (LLAMA3_70B, 8, 131072, 8, 8, 1, 1, 0)  # cfg, batch, seq, dp, cp, tp, pp, stage
    kept = cost.cp_mesh_step_bytes(*args, attention=kind, recompute="none")["cp"]
    full = cost.cp_mesh_step_bytes(*args, attention=kind, recompute="full")["cp"]
    forward = LLAMA3_70B.n_layers * cp_kind_attention_bytes(
        kind, 1, 131072, LLAMA3_70B.n_heads, LLAMA3_70B.kv_heads, LLAMA3_70B.head_dim, 8, 4, backward=False)
    assert full - kept == pytest.approx(forward)
    sizes = {"tp": 1, "pp": 1, "dp": 8, "cp": 8, "ep": 1}
    hops = {r: cost.time._ring_steps(1, 1, sizes, "ddp", 3, r, 0.0, None, cp_attention=kind)["cp"]
            for r in ("none", "full")}
    assert hops["full"] - hops["none"] == {"ring": 7, "ulysses": 4 * 7, "allgather": 2 * 7}[kind]


def test_chapter_10_long_sequences_at_128k_with_recomputation_and_a_causal_kernel():
    """Chapter 10's 128K plan on 64 H100s: the three ways' bytes with the recomputed forward's messages
    (the issue's figures: ring 145 GiB, Ulysses 118, all-gather 105, where 110, 79 and 70 left them out) and
    the step a causal kernel takes (34.4 s at cp = 8, not 53.4 with every score computed)."""
    from minitp.models import LLAMA3_70B

    def fastest(cp, **kw):
        return plan.plan(LLAMA3_70B, 64, 80, seq_len=131072, batch_size=8, cp=cp, sequence_parallel=True,
                         recompute=True, **kw)[0]

    gib = {kind: round(fastest(8, cp_attention=kind)["bytes_per_step"]["cp"] / 2**30)
           for kind in ("ring", "ulysses", "allgather")}
    assert gib == {"ring": 145, "ulysses": 118, "allgather": 105}
    assert round(fastest(8)["step_s"], 1) == 34.4 and round(fastest(1)["step_s"], 1) == 38.5
