"""The planner with expert parallel: a MoE's experts split over ep of the data-parallel GPUs. Every number
here is derived by hand from the shapes (Mixtral 8x7B's), not by calling the planner's formulas again."""

import json

import pytest

from minitp import cli, cost, plan
from minitp.models import LLAMA3_8B, TINY
from minitp.models.moe import MIXTRAL_8X7B

M = MIXTRAL_8X7B
D, L, FE, E, K = 4096, 32, 14336, 8, 2
EXPERT = 3 * D * FE  # w1, w3, w2 of one expert
ATTENTION = 2 * D * D + 2 * D * 1024  # wq, wo; wk, wv of 8 key/value heads of 128
DENSE = L * (ATTENTION + E * D + 2 * D) + 2 * 32000 * D + D  # attention, router, norms; embedding, head, norm


def test_mixtral_has_the_published_parameter_counts():
    assert M.num_params() == DENSE + L * E * EXPERT
    assert M.num_params() == pytest.approx(46.7e9, rel=0.01)
    assert cost.active_params(M) == DENSE + L * K * EXPERT  # two experts per token
    assert cost.active_params(M) == pytest.approx(12.9e9, rel=0.01)
    assert cost.active_params(LLAMA3_8B) == LLAMA3_8B.num_params()


def test_each_rank_holds_the_dense_part_and_its_share_of_the_experts():
    # DDP: whole tensors, 2 bytes per bf16 parameter; ep = 8 leaves one expert of each layer per rank
    row = plan.plan_layout(M, 8, 1, 1, 8, 4096, data_parallel="ddp", ep=8)
    assert row["memory"]["params"] == 2 * (DENSE + L * 1 * EXPERT)
    assert row["memory"]["grads"] == 2 * (DENSE + L * EXPERT)
    # ZeRO-3 over dp = 16: the dense part over 16 ranks, each expert over its 16/8 = 2 copies
    row = plan.plan_layout(M, 16, 1, 1, 16, 4096, ep=8)
    assert row["memory"]["params"] == pytest.approx(2 * (DENSE / 16 + L * EXPERT / 2), rel=1e-6)
    assert row["memory"]["optimizer"] == pytest.approx(12 * (DENSE / 16 + L * EXPERT / 2), rel=1e-6)


@pytest.mark.parametrize("data_parallel, zero, whole", [("ddp", None, 2 + 2 + 12), ("fsdp", 1, 2 + 2)])
def test_memory_per_gpu_falls_as_ep_grows(data_parallel, zero, whole):
    states = [plan.plan_layout(M, 8, 1, 1, 8, 4096, data_parallel, zero, ep=ep)["memory_states"]
              for ep in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4
    # ep = 2 drops half the experts of each layer and the bytes held whole for them (DDP: all 16 per
    # parameter; ZeRO-1: bf16 parameters and gradients, the optimizer's 12 being Ψ_e/dp either way)
    assert states[0] - states[1] == pytest.approx(whole * L * (E - E // 2) * EXPERT, rel=1e-6)


def test_zero_3_already_shards_the_experts_over_dp_so_ep_saves_bytes_sent_not_memory():
    rows = [plan.plan_layout(M, 8, 1, 1, 8, 4096, zero=3, ep=ep) for ep in (1, 8)]
    assert rows[1]["memory_states"] == pytest.approx(rows[0]["memory_states"], rel=1e-6)  # Ψ_e/dp either way
    assert rows[1]["bytes_per_step"]["dp"] < rows[0]["bytes_per_step"]["dp"] / 2  # no expert gathered


def test_the_all_to_all_bytes_are_four_passes_of_k_rows_per_token():
    # dp = 16, pp = 2, tp = 2: a rank has 64/16 = 4 sequences of 4096 tokens and 16 MoE layers; per layer
    # the dispatch, combine and their two gradients each send k·T rows of D bf16 values, 7/8 to other ranks
    row = plan.plan_layout(M, 16, 2, 2, 64, 4096, ep=8)
    tokens = 64 // 16 * 4096
    assert row["ep"] == 8
    assert row["bytes_per_step"]["ep"] == 16 * 4 * K * tokens * 7 / 8 * D * 2
    # dp: the dense gradients' all-reduce over dp = 16, the experts' over their 16/8 = 2 copies
    ddp = plan.plan_layout(M, 16, 1, 1, 16, 4096, data_parallel="ddp", ep=8)
    assert ddp["bytes_per_step"]["dp"] == pytest.approx(2 * 15 / 16 * DENSE * 2 + 2 * 1 / 2 * L * EXPERT * 2)
    assert ddp["bytes_per_step"]["ep"] == L * 4 * K * 4096 * 7 / 8 * D * 2
    # ep = 1: every rank holds every expert, nothing to send
    assert plan.plan_layout(M, 16, 1, 1, 16, 4096, ep=1)["bytes_per_step"]["ep"] == 0.0


def test_moe_activations_keep_k_expert_rows_per_token():
    # one 4096-token sequence per rank, tp = pp = 1, FlashAttention: Korthikanti's 34·D bytes per token,
    # less its MLP's 16·D, plus per token k·(2 rows of D + 4 tensors of Fe) in bf16 and E fp32 probabilities
    row = plan.plan_layout(M, 8, 1, 1, 8, 4096, ep=8)
    per_token = 34 * D - 16 * D + K * (2 * D + 4 * FE) * 2 + 4 * E
    # and, the one stage being the last: the final norm (input, normalised, 1/rms), the output layer's input, in bf16;
    # the loss's fp32 log-probabilities over the 32,000 tokens, its int64 targets and 4-byte total weight
    n = 4096
    output = (3 * n * D + n) * 2 + 4 * n * 32000 + 8 * n + 4
    assert row["memory"]["activations"] == pytest.approx(L * 4096 * per_token + output)


def test_step_time_counts_active_flops_and_the_all_to_all_on_the_link_it_spans():
    inside = plan.plan_layout(M, 8, 1, 1, 8, 4096, ep=8)  # the ep group: 8 GPUs of one machine
    tokens = 8 * 4096
    assert inside["time"]["model_flops"] == tokens * (6 * (DENSE + L * K * EXPERT) + 12 * L * D * 4096)
    assert inside["mfu"] == pytest.approx(inside["time"]["model_flops"] / (inside["step_s"] * 8 * 989e12))
    sent = L * 4 * K * 4096 * 7 / 8 * D * 2
    steps = L * 5 * 7  # five all-to-alls per layer (the counts, then four of rows), each 7 message steps
    assert inside["time"]["ep_s"] == pytest.approx(steps * 5e-6 + sent / 450e9)  # NVLink
    across = plan.plan_layout(M, 8, 1, 2, 8, 4096, ep=8)  # ep·tp = 16 GPUs: two machines
    assert across["time"]["ep_s"] == pytest.approx(steps * 10e-6 + sent / 50e9)  # InfiniBand
    assert inside["step_s"] == pytest.approx(inside["time"]["compute_s"] + inside["time"]["tp_s"]
                                             + inside["time"]["dp_exposed_s"] + inside["time"]["ep_s"])


@pytest.mark.parametrize("call, message", [
    (lambda: plan.plan_layout(LLAMA3_8B, 8, 1, 1, 8, 4096, ep=2),
     "ep=2 needs a mixture-of-experts model (a MoEConfig, e.g. --model mixtral-8x7b), got a dense ModelConfig"),
    (lambda: plan.plan_layout(M, 12, 1, 1, 12, 4096, ep=3), "n_experts=8 is not divisible by ep=3"),
    (lambda: plan.plan_layout(M, 4, 2, 1, 8, 4096, ep=8),
     "dp·cp=4 is not divisible by ep=8: the experts are split over ep of the data-parallel ranks"),
    (lambda: plan.plan_layout(M, 8, 1, 1, 8, 4096, ep=0), "ep must be an integer >= 1, got 0"),
    (lambda: plan.plan(M, 12, 80.0, ep=8), "gpus=12 is not divisible by ep=8"),
    (lambda: plan.plan(TINY, 8, 80.0, ep=2), "ep=2 needs a mixture-of-experts model"),
])
def test_bad_ep_is_refused_with_what_was_expected(call, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_ep_1_leaves_every_dense_row_unchanged():
    for kw in ({}, {"data_parallel": "ddp"}, {"sequence_parallel": True, "recompute": "selective"}):
        rows = plan.plan(LLAMA3_8B, 64, 80.0, include_unfit=True, **kw)
        assert rows == plan.plan(LLAMA3_8B, 64, 80.0, include_unfit=True, ep=1, **kw)
        assert all(r["ep"] == 1 and set(r["bytes_per_step"]) == {"tp", "pp", "dp", "cp"} for r in rows)
        assert all(r["time"]["ep_s"] == 0.0 for r in rows)
    assert "ep MiB/step" not in plan.format_plan(rows) and " ep " not in plan.format_plan(rows).splitlines()[0]


def test_plan_lists_the_layouts_whose_data_parallel_ranks_hold_the_ep_group():
    rows = plan.plan(M, 64, 80.0, seq_len=4096, ep=8, include_unfit=True)
    assert rows and all(r["ep"] == 8 and (r["dp"] * r["cp"]) % 8 == 0 for r in rows)
    assert {(r["dp"], r["pp"], r["tp"]) for r in rows} == {(dp, pp, tp) for dp, pp, tp in [
        (64, 1, 1), (32, 2, 1), (32, 1, 2), (16, 4, 1), (16, 2, 2), (16, 1, 4), (8, 8, 1), (8, 4, 2), (8, 2, 4),
        (8, 1, 8)]}
    table = plan.format_plan(rows)
    assert "ep MiB/step" in table and " ep " in table.splitlines()[0]
    assert "ep MiB/step" in plan.markdown_table(rows)


def test_cli_plans_mixtral_with_ep(capsys, tmp_path):
    args = ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--gpu-memory", "80", "--ep", "8"]
    # sequences of 32K (the preset's): no layout keeps every activation, the table says what each needs
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert "46.70 B parameters, 12.88 B active" in out and "experts split over ep = 8" in out
    assert "no layout fits" in out and "ep MiB/step" in out
    # full recomputation keeps block inputs only: layouts fit
    assert cli.main(args + ["--recompute", "--json", str(tmp_path / "ep.json")]) == 0
    out = capsys.readouterr().out
    assert "no layout fits" not in out and "ep MiB/step" in out
    report = json.loads((tmp_path / "ep.json").read_text())
    assert report["active_params"] == DENSE + L * K * EXPERT
    assert report["layouts"] and all(r["fits"] and r["ep"] == 8 and r["bytes_per_step"]["ep"] > 0
                                     for r in report["layouts"])


@pytest.mark.parametrize("argv, message", [
    (["--ep", "3"], "n_experts=8 is not divisible by ep=3"),
    (["--ep", "0"], "--ep 0 is not allowed: expected an integer >= 1"),
    (["--ep", "16"], "n_experts=8 is not divisible by ep=16"),
    (["--model", "llama3-8b", "--ep", "2"], "ep=2 needs a mixture-of-experts model"),
])
def test_bad_ep_on_the_command_line_is_one_line(argv, message, capsys):
    base = ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--gpu-memory", "80"]
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
