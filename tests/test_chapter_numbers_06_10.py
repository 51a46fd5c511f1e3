"""The numbers chapters 06 (3D mesh) and 10 (planning a run) state in their prose, recomputed with
``minitp.cost``, ``minitp.plan`` and ``minitp.models``: a changed formula, planner or sheet that the
text does not follow fails here. Each test recomputes a number and asserts the prose says it as written."""

from functools import cache

import pytest
from test_chapter_numbers import prose
from test_cost_time import _chapter_text, _figures_off_the_sheet

from minitp import cost, plan
from minitp.models import LLAMA3_70B, TINY
from minitp.models.moe import MOE_PRESETS

GIB = 2**30
H100 = cost.H100
HBM_GIB = H100.memory_bytes / GIB  # 80


def text06() -> str:
    return prose("06_3d.ipynb")


def text10() -> str:
    return prose("10_planning.ipynb")


def percent(x: float) -> str:
    """A share as the chapters write it: "45 %"."""
    return f"{round(100 * x)} %"


@cache
def layout_70b(dp: int = 2, pp: int = 4, tp: int = 8, **kw) -> dict:
    """The planner's row of LLaMA-3-70B on 64 GPUs, 64 sequences of 8192 tokens (chapter 10's layout)."""
    return plan.plan_layout(LLAMA3_70B, dp, pp, tp, 64, 8192, **({"sequence_parallel": True} | kw))


@cache
def plan_70b(**kw) -> list[dict]:
    return plan.plan(LLAMA3_70B, gpus=64, gpu_memory_gib=HBM_GIB, seq_len=8192, **kw)


def params_70b(stage: int) -> int:
    """Ψ_rank of LLaMA-3-70B at tp = 8, pp = 4."""
    return cost.threed_params_per_rank(LLAMA3_70B, 8, 4, stage)


# -- both chapters: hardware figures only from the sheet ------------------------------------------------------
@pytest.mark.parametrize("chapter", ["06_3d", "10_planning"])
def test_chapters_06_and_10_quote_only_the_hardware_sheets_figures(chapter):
    assert _figures_off_the_sheet(_chapter_text(chapter)) == []


# -- 06 3D: the tiny run -----------------------------------------------------------------------------------
def test_06_tiny_run_bytes_per_dimension_in_kilobytes():
    text = text06()
    held = cost.threed_params_per_rank(TINY, 2, 2, 0)
    sent = [cost.threed_step_bytes(TINY, 8, 16, 2, 2, 2, stage) for stage in (0, 1)]
    assert sent[0]["dp"] == 4 * held  # 2(dp-1)/dp of 4 bytes per parameter, at dp = 2
    assert all(round(s["dp"] / 1e3) == 165 for s in sent)
    assert f"({round(sent[0]['dp'] / 1e3)} KB per rank: the gradients of the {held:,} parameters" in text
    assert f"nearly as much ({sent[0]['tp'] / 1e3:.0f} KB)" in text
    activation = 8 // 2 * 16 * TINY.dim * 4  # one (B/dp, S, D) fp32 activation, all micro-batches together
    assert sent[0]["pp"] == sent[1]["pp"] == activation and f"the fewest** ({activation / 1e3:.0f} KB" in text
    assert sent[0]["dp"] > sent[0]["tp"] > sent[0]["pp"]  # dp the most, pp the fewest on the tiny model


def test_06_stage_1_holds_the_final_norms_weight_more():
    more = cost.threed_params_per_rank(TINY, 2, 2, 1) - cost.threed_params_per_rank(TINY, 2, 2, 0)
    assert more == TINY.dim and f"hold {more} parameters more than stage 0's" in text06()


def test_06_tp_messages_per_rank_of_the_tiny_run():
    microbatches, blocks = 8 // 2, TINY.n_layers // 2
    first = 4 * blocks * microbatches + microbatches  # 4 per block, and the embedding's g
    last = 4 * blocks * microbatches + 3 * microbatches  # the output layer's f and the loss's two
    assert (first, last) == (36, 44)
    assert f"{microbatches} micro-batches, {blocks} blocks per stage" in text06()


def test_06_doubling_dp_grows_the_dp_bytes_by_half():
    two, four = (cost.threed_step_bytes(TINY, 8, 16, dp, 2, 2, 0) for dp in (2, 4))
    assert four["dp"] / two["dp"] == 1.5 and four["tp"] == two["tp"] / 2 and four["pp"] == two["pp"] / 2
    assert "goes from $1\\times$ to $1.5\\times$ of the gradients' size" in text06()


# -- 06 3D: LLaMA-3-70B at dp = 2, pp = 4, tp = 8 -------------------------------------------------------------
def test_06_tp_sends_71_times_the_pipeline_and_89_times_data_parallel():
    sent = layout_70b()["bytes_per_step"]
    assert layout_70b()["zero"] == 1 and layout_70b()["data_parallel"] == "fsdp"  # the planner's default with pp
    text = text06()
    assert f"about **{sent['tp'] / sent['pp']:.0f}×** what the pipeline sends" in text
    assert f"**{sent['tp'] / sent['dp']:.0f}×** what data parallel sends" in text
    assert "ZeRO-1 over dp" in text and "see the end of the chapter" not in text
    assert sent["pp"] > sent["dp"] and "the pipeline now sends more than data parallel" in text
    summary = f"tp sends {sent['tp'] / sent['pp']:.0f}× what pp sends and {sent['tp'] / sent['dp']:.0f}× what dp sends"
    assert summary in text and "On the tiny model dp sends the most and pp the fewest" in text


def test_06_parameters_of_a_middle_and_a_first_stage_rank():
    text = text06()
    assert f"A rank of a middle stage holds {params_70b(1) / 1e9:.2f} B parameters" in text
    assert f"one of the first stage {params_70b(0) / 1e9:.2f} B" in text
    assert params_70b(1) == params_70b(2) < params_70b(0)


def test_06_problem_1_dp_all_reduce_gb_and_seconds():
    sent = cost.collective_sent_bytes("all_reduce", 2 * params_70b(1), 2)  # bf16 gradients, a ring of 2
    seconds = cost.collective_time("all_reduce", 2 * params_70b(1), 2, H100.inter)
    text = text06()
    assert f"**{sent / 1e9:.1f} GB**, about {seconds:.2f} s over InfiniBand" in text
    # DDP's window with a pipeline: the last micro-batch's backward; the all-reduce fits in it
    ddp = cost.step_time(LLAMA3_70B, 64, 8192, 2, 8, 4, H100, 32, "ddp", sequence_parallel=True)
    assert ddp.dp_exposed_s == 0 and "hidden behind backward" in text


def test_06_problem_2_pipeline_seconds_and_the_ratio_to_tensor_parallel():
    activation = 8192 * LLAMA3_70B.dim * 2  # one sequence's (S, D) in bf16
    sent = cost.pp_step_bytes(1, 8192, LLAMA3_70B.dim, 4, 1, 2) * 32  # 32 micro-batches, a middle stage
    assert sent == 2 * 32 * activation
    text = text06()
    seconds = sent / H100.inter.bytes_per_s
    assert f"$= {sent / 1e9:.1f}$ GB at {H100.inter.bytes_per_s / 1e9:.0f} GB/s: **{seconds:.2f} s**" in text
    assert f"messages of {activation / 1e6:.0f} MB each" in text
    middle = cost.threed_step_bytes(LLAMA3_70B, 64, 8192, 2, 8, 4, 1, data_parallel="ddp", activation_bytes=2,
                                    param_bytes=2, grad_bytes=2, sequence_parallel=True)
    assert middle["pp"] == sent
    assert f"about {middle['tp'] / sent:.0f} times as much ({middle['tp'] / 1e9:.0f} GB per step" in text
    assert round(middle["dp"] / sent, 2) == 0.5 and "and half as much over data parallel (Problem 1)" in text
    assert "The pipeline sends the fewest bytes of the three dimensions" not in text


def test_06_problem_3_zero1_states_of_the_first_stage():
    gib = params_70b(0) * (2 + 2 + 12 / 2) / GIB
    text = text06()
    assert f"**{gib:.1f} GiB**, the states the planner reports for this layout" in text
    assert layout_70b()["memory_states"] / GIB == pytest.approx(gib, rel=1e-3)
    assert layout_70b()["memory"]["activations"] > layout_70b()["memory_states"]  # "they are the larger part"


# -- 10 planning: memory --------------------------------------------------------------------------------------
def test_10_states_alone_and_nothing_fits_with_replicated_norms():
    text = text10()
    assert plan_70b() == []
    assert "**Nothing fits, as long as the norms' activations are replicated.**" in text
    assert round(layout_70b()["memory_states"] / GIB) == 21 and "(about 21 GiB at dp = 2, pp = 4, tp = 8)" in text


def test_10_layouts_that_fit_per_way_of_counting():
    text = text10()
    counts = {way: plan_70b(sequence_parallel=True, activations=way) for way in ("llama", "llama-regather", "gpt3")}
    llama, gpt3 = counts["llama"], counts["gpt3"]
    assert (len(llama), len(counts["llama-regather"]), len(gpt3)) == (3, 5, 6)
    assert f"GPT-3's count would accept {len(gpt3)} layouts; {len(gpt3) - len(llama)} of them" in text
    at_444 = plan.plan_layout(LLAMA3_70B, 4, 4, 4, 64, 8192, sequence_parallel=True, activations="gpt3")
    assert at_444["memory_total"] <= H100.memory_bytes  # fits, by GPT-3's count
    assert (4, 4, 4) in {(r["dp"], r["pp"], r["tp"]) for r in gpt3} - {(r["dp"], r["pp"], r["tp"]) for r in llama}
    assert f"dp = 4, pp = 4, tp = 4 among them, at {at_444['memory_total'] / GIB:.0f} GiB by that count" in text
    assert layout_70b(4, 4, 4)["memory_total"] > H100.memory_bytes  # minitp's block: it does not fit
    assert all(r["tp"] == 8 for r in llama)
    assert {(r["dp"], r["pp"]) for r in llama} <= {(r["dp"], r["pp"]) for r in gpt3}
    assert f"the {len(llama)} that fit either way, all at tp = 8" in text
    assert f"in {len(llama)} layouts, all at tp = 8" in text  # the summary


def test_10_llama_block_against_gpt3s_count():
    text = text10()
    more = {}
    for name, kw in (("replicated", {}), ("sp", {"sequence_parallel": True})):
        gpt3 = cost.block_activation_bytes(LLAMA3_70B, 1, 8192, tp=8, **kw)
        more[name] = cost.llama_block_activation_bytes(LLAMA3_70B, 1, 8192, tp=8, repeat_kv=False, **kw) / gpt3 - 1
    assert round(more["replicated"], 1) == 0.2 and "about a quarter more than GPT-3's count" in text  # +24 %
    assert 1 < more["sp"] < 1.5 and "more than twice as much" in text  # +113 %
    assert LLAMA3_70B.ffn_hidden / LLAMA3_70B.dim == 3.5 and "$F = 3.5D$" in text
    assert (LLAMA3_70B.kv_heads, LLAMA3_70B.n_heads) == (8, 64)
    assert f"the {LLAMA3_70B.kv_heads} shared key/value heads" in text
    assert f"the {LLAMA3_70B.n_heads} query heads" in text


def test_10_gathering_the_inputs_again_costs_a_quarter_more_tp_bytes():
    text, tp = text10(), 8
    act = 8192 * LLAMA3_70B.dim * 2  # one (S, D) bf16 activation
    block = cost.tp_block_bytes(1, 8192, LLAMA3_70B.dim, tp, sequence_parallel=True, dtype_bytes=2)
    again = 2 * cost.collective_sent_bytes("all_gather", act, tp)  # the attention's and the MLP's inputs
    assert again / block == pytest.approx(0.25, rel=1e-3)  # the norms' weight gradients are the rest
    assert "a quarter more tensor-parallel bytes" in text
    regather = cost.llama_block_activation_bytes(LLAMA3_70B, 1, 8192, tp=tp, sequence_parallel=True,
                                                 repeat_kv=False, regather=True)
    gpt3 = cost.block_activation_bytes(LLAMA3_70B, 1, 8192, tp=tp, sequence_parallel=True)
    assert f"what is left above GPT-3's count (+{percent(regather / gpt3 - 1)})" in text


def test_10_full_recomputation_repeats_forwards_two_collectives_per_block():
    args = (1, 8192, LLAMA3_70B.dim, 8)
    assert cost.tp_block_bytes(*args, recompute=True) / cost.tp_block_bytes(*args) == 6 / 4
    assert "6 per block instead of 4" in text10()
    extra = cost.recompute_flops_per_token(LLAMA3_70B, 8192, "full") / cost.training_flops_per_token(LLAMA3_70B, 8192)
    assert extra == pytest.approx(1 / 3, abs=0.02) and "a third more compute" in text10()


# -- 10 planning: dp = 2, pp = 4, tp = 8, time and MFU ----------------------------------------------------------
def test_10_the_layouts_memory_step_and_mfu():
    row, text = layout_70b(), text10()
    assert f"{row['memory_total'] / GIB:.1f} GiB" == "66.5 GiB" and "66.5 GiB" in text
    assert f"predicted {row['step_s']:.2f} s" == "predicted 8.60 s" and "in the predicted 8.60 s" in text
    assert f"predicted {row['step_s']:.1f} s per step, MFU {percent(row['mfu'])}" in text  # the summary: 8.6 s, 47 %
    assert f"{row['time']['tp_s']:.2f} s of the {row['step_s']:.2f} s step" in text
    t = row["time"]
    window = t["compute_s"] * 2 / 3 / row["microbatches"]  # ZeRO-1's: the last micro-batch's backward
    assert t["dp_exposed_s"] == pytest.approx(t["dp_s"] - window) and 0 < t["dp_exposed_s"] < 0.01  # it nearly fits
    assert "reduce-scatter and all-gather count as hidden when they fit in the last micro-batch's backward" in text
    assert t["step_s"] == pytest.approx(t["compute_s"] + t["bubble_s"] + t["tp_s"] + t["pp_s"] + t["dp_exposed_s"])
    assert t["bubble_s"] == pytest.approx(t["compute_s"] * (4 - 1) / row["microbatches"])


def test_10_mfu_by_hand_is_47_percent():
    """MFU counts attention's FLOPs whole (PaLM's convention); the step a causal kernel takes runs half."""
    tokens = 64 * 8192
    by_hand = tokens * (6 * 70.6e9 + 12 * 80 * 8192 * 8192) / (8.60 * 64 * 989e12)
    assert round(by_hand, 2) == round(layout_70b()["mfu"], 2) == 0.47
    assert (LLAMA3_70B.n_layers, LLAMA3_70B.dim, round(LLAMA3_70B.num_params() / 1e9, 1)) == (80, 8192, 70.6)
    assert "over $8.60 \\cdot 64 \\cdot 989$ TFLOP/s, about 47 %" in text10()


def test_10_tensor_parallel_bandwidth_and_latency():
    row, link, text = layout_70b(), H100.intra, text10()
    sent = row["bytes_per_step"]["tp"]
    ring_steps = row["microbatches"] * (4 * LLAMA3_70B.n_layers // 4 + 3) * 2 * (8 - 1)
    assert f"The bandwidth is {sent / link.bytes_per_s:.2f} s of it and the rings' latency the other " \
           f"{ring_steps * link.alpha_s:.2f} s" in text
    assert f"the $\\alpha$ of {link.alpha_s * 1e6:.0f} µs is an assumed" in text
    assert link.bytes_per_s / H100.inter.bytes_per_s == 9
    assert f"the bytes alone would take nine times as long, {sent / H100.inter.bytes_per_s:.1f} s" in text


def test_10_less_tensor_parallel_does_not_fit_with_sequence_parallel_alone():
    rows = plan_70b(sequence_parallel=True, include_unfit=True)
    less = [r for r in rows if r["tp"] < 8]
    assert not any(r["fits"] for r in less)
    text = text10()
    assert f"need over {int(min(r['memory_total'] for r in less) / GIB // 10 * 10)} GiB per GPU" in text
    fastest = min(less, key=lambda r: r["step_s"])
    assert (fastest["dp"], fastest["pp"], fastest["tp"]) == (32, 1, 2) and fastest["step_s"] < layout_70b()["step_s"]
    assert f"(dp = 32, pp = 1, tp = 2: {fastest['step_s']:.1f} s, no bubble)" in text


# -- 10 planning: when communication dominates ------------------------------------------------------------------
def test_10_overlap_budget_and_the_ridge():
    text = text10()
    per_block = (LLAMA3_70B.num_params() - 2 * LLAMA3_70B.vocab_size * LLAMA3_70B.dim - LLAMA3_70B.dim) // 80
    flops = 2 * per_block / 8 * 8192 + 2 * 8192 * 8192 * LLAMA3_70B.dim / 8  # a causal kernel: half the scores
    forward = cost.compute_time(flops, H100)
    sent = cost.tp_block_bytes(1, 8192, LLAMA3_70B.dim, 8, dtype_bytes=2) / 2
    inside, across = (sent / cost.overlap_budget_bytes(forward, link) for link in (H100.intra, H100.inter))
    assert round(inside, 2) == 0.33 and "cost about a third of the compute" in text
    assert round(across, 2) == 2.95 and "nearly three times as long as the compute" in text
    ridge = H100.flops_per_s / H100.memory_bytes_per_s
    assert f"(about {ridge:.0f} on an H100: 989 TFLOP/s over HBM3's 3.35 TB/s)" in text
    assert cost.arithmetic_intensity(1, LLAMA3_70B.dim, LLAMA3_70B.ffn_hidden // 8) == pytest.approx(1, abs=0.01)
    assert "moves a byte per FLOP" in text


def test_10_problem_2_fewest_tokens_for_a_compute_bound_matmul():
    ridge = H100.flops_per_s / H100.memory_bytes_per_s
    k, n = LLAMA3_70B.dim, LLAMA3_70B.ffn_hidden // 8
    m = next(m for m in range(1, 8192) if cost.arithmetic_intensity(m, k, n) >= ridge)
    assert m == 335 and 256 < m < 512
    text = text10()
    assert f"$m$ = **{m}** tokens" in text and f"a batch of about {m} sequences" in text
    assert f"compute-bound from {m} tokens up" in text  # the summary


# -- 10 planning: recomputation ----------------------------------------------------------------------------------
def test_10_recomputation_bytes_step_and_mfu():
    sp, rc, text = layout_70b(), layout_70b(sequence_parallel=False, recompute=True), text10()
    fits = plan_70b(recompute=True)
    assert f"Recomputation fits more layouts ({len(fits)} instead of {len(plan_70b(sequence_parallel=True))})" in text
    assert (f"it sends {rc['bytes_per_step']['tp'] / GIB:.0f} GiB over tp instead of "
            f"{sp['bytes_per_step']['tp'] / GIB:.0f}") in text
    assert f"grows from {sp['step_s']:.1f} s to {rc['step_s']:.1f} s" in text
    assert f"its MFU falls from {percent(sp['mfu'])} to {percent(rc['mfu'])}" in text
    fastest, sp_fastest = fits[0], plan_70b(sequence_parallel=True)[0]
    assert (fastest["dp"], fastest["pp"], fastest["tp"]) == (32, 1, 2)
    assert f"dp = 32, pp = 1, tp = 2 at {fastest['step_s']:.1f} s" in text
    assert f"the fastest sequence-parallel one ({sp_fastest['step_s']:.1f} s)" in text
    pure = next(r for r in fits if r["dp"] == 64)
    assert pure["zero"] == 3 and f"sends {pure['bytes_per_step']['dp'] / GIB:.0f} GiB per step per GPU" in text


# -- 10 planning: context and expert parallel --------------------------------------------------------------------
def test_10_context_parallel_at_128k_tokens():
    def best(cp, recompute=True):
        return plan.plan(LLAMA3_70B, 64, HBM_GIB, seq_len=131072, batch_size=8, cp=cp, sequence_parallel=True,
                         recompute=recompute)

    rows = {cp: best(cp) for cp in (1, 2, 4, 8)}
    assert [rows[cp][0]["tp"] for cp in (1, 2, 4, 8)] == [8, 4, 2, 1]  # each doubling of cp halves tp
    text = text10()
    ring = rows[8][0]["bytes_per_step"]["cp"] / GIB
    assert rows[8][0]["bytes_per_step"]["tp"] == 0 and f"the ring's {ring:.0f} GiB per step" in text
    gain = 1 - rows[8][0]["step_s"] / rows[1][0]["step_s"]
    assert f"improves by about {percent(gain)} from cp = 1 to cp = 8" in text
    assert all(best(cp, recompute=False) == [] for cp in (1, 2, 4, 8))
    assert "Without recomputation no layout fits at any cp here" in text
    steps = [plan.plan(LLAMA3_70B, 64, HBM_GIB, seq_len=131072, batch_size=8, cp=8, sequence_parallel=True,
                       recompute=True, cp_attention=kind)[0]["step_s"] for kind in ("ring", "ulysses", "allgather")]
    assert max(steps) - min(steps) < 1 and f"differ by a fraction of a second in {round(steps[0])}." in text


def test_10_mixtral_parameters_held_and_active():
    mixtral, text = MOE_PRESETS["mixtral-8x7b"], text10()
    held, active = mixtral.num_params() / 1e9, cost.active_params(mixtral) / 1e9
    assert (round(held, 1), round(active, 1)) == (46.7, 12.9)
    assert (mixtral.top_k, mixtral.n_experts) == (2, 8)
    assert f"holds about {held:.0f} B and uses about {active:.0f} B per token (2 of 8 experts)" in text
    assert f"the {held:.0f} B parameters held cost memory, the {active:.0f} B active ones cost compute" in text


# -- 10 planning: exercises and worked problems --------------------------------------------------------------------
def test_10_exercise_1_states_need_16_ways_of_model_parallelism():
    worst = max(16 * cost.threed_params_per_rank(LLAMA3_70B, 8, 2, s) for s in range(2))
    assert worst <= H100.memory_bytes < min(16 * cost.threed_params_per_rank(LLAMA3_70B, 8, 1, 0), 16 * 70.6e9 / 8)
    assert f"16 bytes / 16 ≈ {worst / GIB:.0f} GiB per GPU" in text10()
    assert "The optimizer's 12 bytes are three quarters of the total" in text10() and 12 / 16 == 0.75


def test_10_problem_1_days_for_15t_tokens():
    step = layout_70b()["step_s"]
    rate = 32 * 64 * 8192 / step
    text = text10()
    assert f"{rate / 1e6:.2f}$ M tokens/s" in text
    assert f"${15e12 / rate / 1e6:.1f} \\cdot 10^6$ s, about **{15e12 / rate / 86400:.0f} days**" in text
    assert f"at 16,384 the same rate per GPU gives about {15e12 / (rate * 16384 / 2048) / 86400:.0f} days" in text


def test_10_problem_3_first_stage_activations():
    per_block = cost.llama_block_activation_bytes(LLAMA3_70B, 1, 8192, tp=8, sequence_parallel=True, repeat_kv=False)
    in_flight = cost.pp_peak_microbatches_in_flight(4, 32, 0, "1f1b")
    assert in_flight == 4 and cost.pp_peak_microbatches_in_flight(4, 32, 3, "1f1b") == 1
    total = per_block * 20 * in_flight
    row = layout_70b()
    assert total == row["memory"]["activations"] and row["worst_stage"] == 0
    text = text10()
    assert f"About {per_block / GIB:.2f} GiB per block, times 20 blocks, times 4 micro-batches in flight: " \
           f"**{total / GIB:.0f} GiB**, which with {row['memory_states'] / GIB:.0f} GiB of states is the " \
           f"{row['memory_total'] / GIB:.1f} GiB the planner printed" in text
    # the last stage: one micro-batch's blocks, and its final norm, output layer and loss (an fp32 copy of V/8 logits)
    logits = 4 * 8192 * LLAMA3_70B.vocab_size // 8
    last = (per_block * 20 + cost.output_activation_bytes(LLAMA3_70B, 1, 8192, 8, sequence_parallel=True))
    assert last == cost.activation_bytes_per_rank(LLAMA3_70B, 1, 8192, 8, 4, 3, 32, sequence_parallel=True,
                                                  formula="llama") + cost.output_activation_bytes_per_rank(
        LLAMA3_70B, 1, 8192, 8, 4, 3, sequence_parallel=True)
    assert round(4 * last / total) == 1 and f"and its loss's fp32 logits ({logits / GIB:.2f} GiB), a quarter in all" in text


def test_10_a_moe_layer_moves_its_tokens_in_four_all_to_alls_and_its_counts_in_one():
    rows = cost.moe_all_to_all_bytes(1024, 64, 2, 8)  # dispatch, combine, and the two gradients
    assert rows["total"] == 4 * rows["dispatch"]
    sizes = {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 8}
    steps = cost.time._ring_steps(1, 1, sizes, "ddp", 3, "none", 0.0, None)["ep"]  # one block, one micro-batch
    assert steps == 5 * (8 - 1)  # five all-to-alls of ep-1 steps each: the counts' one too
    text = text10()
    assert "out and back in four all-to-alls, after a small one of the counts, and nothing hides them" in text
    assert "paying five all-to-alls per MoE layer (one of counts)" in text
