"""The numbers chapter 08 (expert parallel) states in its prose, recomputed with ``minitp.cost`` and
``minitp.models``: a changed formula, default or sheet that the text does not follow fails here. Each test
recomputes a number (or checks a claim on the library) and asserts the prose says it as written. The
numbers tests/test_chapter_numbers.py and tests/test_problems_ch08.py already pin are not repeated."""

import inspect
import json
import math
from functools import cache

import pytest
import torch
from test_chapter_numbers import NOTEBOOKS, prose

from minitp import cost
from minitp.exercises import ch08
from minitp.models import TINY
from minitp.models.moe import (
    MIXTRAL_8X7B,
    MoEConfig,
    capacity_mask,
    load_balancing_loss,
    moe_config,
    route,
)
from minitp.runs import run_ep

NOTEBOOK = "08_expert_parallel.ipynb"
H100 = cost.H100
# section 4: DeepSeek-V3's layer (D, k, E, ep, routed experts' width, layers, MoE layers) and our 4096 tokens
D, K, E, EP, FE, LAYERS, MOE_LAYERS, TOKENS, MAX_NODES = 7168, 8, 256, 64, 2048, 61, 58, 4096, 4
NODES = EP // H100.gpus_per_node


@cache
def text() -> str:
    return prose(NOTEBOOK)


def code() -> str:
    cells = json.loads((NOTEBOOKS / NOTEBOOK).read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def between_nodes_per_token(max_nodes: int | None) -> float:
    """Copies of a token that cross InfiniBand in one all-to-all, sent once per other node of its experts."""
    return cost.expected_nodes_per_token(E, K, NODES, max_nodes) * (NODES - 1) / NODES


# -- predict first, and section 2: even routing, then every token on experts 0 and 1 ----------------
def test_even_routing_of_the_prediction():
    tokens, dim, k, n = 512, 64, 2, 4
    rows = k * tokens * (n - 1) / n
    even = cost.moe_all_to_all_bytes(tokens=tokens, dim=dim, top_k=k, ep=n, dispatch_bytes=4, combine_bytes=4)
    assert even["dispatch"] == even["combine"] == rows * dim * 4 == 196608
    t = text()
    assert f"How many of its {k} × {tokens} assignments stay on the rank?" in t
    assert (f"a rank's {k * tokens} assignments split {k * tokens // n} per rank, {rows:.0f} leave it, and each way "
            f"costs {rows:.0f} × {dim} × 4 = {even['dispatch']:,.0f} bytes") in t


def test_every_token_on_experts_0_and_1_makes_rank_0_send_three_times_the_others():
    tokens, dim, n = 512, 64, 4
    counts = [[tokens, tokens] + [0] * 6 for _ in range(n)]  # kept assignments per rank and expert, none dropped
    counts_bytes = cost.collective_sent_bytes("all_to_all", 8 * cost.COUNT_BYTES, n)
    sent = [cost.ep_layer_bytes(counts, r, dim) - counts_bytes for r in range(n)]
    received = sum(row[0] for row in cost.tokens_between_ranks(counts, n)[1:])  # rows rank 0's experts get
    assert sent[0] == 2 * received * dim * 4 and received == 3 * 2 * tokens
    assert sent[1:] == [sent[0] / 3] * 3
    assert (f"rank 0 would compute all 2 × {n * tokens} assignments, receive 3/4 of them, and send those "
            f"{received:,} outputs back: three times the bytes of any other rank") in text()


# -- section 1: capacity and the balancing loss ------------------------------------------------------
def test_at_c_equal_e_over_k_the_capacity_is_the_whole_sequence():
    cfg = moe_config(TINY, n_experts=8, top_k=2, capacity_factor=8 / 2)
    assert all(cfg.capacity(s) == s for s in range(1, 200))
    assert cfg.with_(capacity_factor=3.5).capacity(16) == 14  # below E/k a sequence of 16 can drop
    assert "At c = E/k = 4 the capacity is the whole sequence and nothing drops" in text()


def test_the_batch_of_section_1_makes_256_assignments():
    batch, seq, k = 8, 16, 2
    assert f"(0, cfg.vocab_size, ({batch}, {seq})" in code() and "top_k=2" in code()
    assert f"{batch * seq * k} assignments ({batch * seq} tokens, {k} each) do not split evenly eight ways" in text()


def test_second_choices_drop_before_any_first_choice_at_an_expert():
    # expert 0: tokens 0..2 choose it second, tokens 3..5 first; room for 3
    expert = torch.tensor([[[1, 0], [2, 0], [3, 0], [0, 4], [0, 5], [0, 6]]])
    keep = capacity_mask(expert, 8, capacity=3)
    assert keep[0, 3:, 0].all() and not keep[0, :3, 1].any()
    assert "so at each expert the second choices drop before any first choice does" in text()


def test_the_balancing_loss_is_1_when_the_load_is_even_with_coefficient_0_01():
    logits = torch.zeros(1, 4, 8)
    for t in range(4):  # token t on experts 2t and 2t+1: every expert takes 1/8 of the assignments
        logits[0, t, 2 * t:2 * t + 2] = 1.0
    assert float(load_balancing_loss(route(logits, top_k=2, capacity=4))) == pytest.approx(1.0)
    assert MoEConfig.aux_loss_coef == 0.01 and inspect.signature(run_ep).parameters["aux_loss_coef"].default == 0.01
    t = text()
    assert "It is 1 when the load is even" in t and "`aux_loss_coef` (0.01)" in t


# -- section 2: the bytes of one layer ----------------------------------------------------------------
def test_the_layer_formula_is_the_rows_each_way_plus_8e_count_bytes():
    n, dim, b = 4, 64, 4
    counts = [[3, 0, 5, 1, 7, 2, 0, 4], [1, 1, 1, 1, 9, 0, 2, 6], [0, 3, 0, 8, 2, 2, 1, 1], [5, 4, 3, 2, 1, 0, 0, 7]]
    t = cost.tokens_between_ranks(counts, n)
    for r in range(n):
        out_rows = sum(t[r][j] for j in range(n) if j != r)
        in_rows = sum(t[i][r] for i in range(n) if i != r)
        assert cost.ep_layer_bytes(counts, r, dim, b) == 2 * dim * b * (out_rows + in_rows) + 8 * 8 * (n - 1) / n
    assert cost.COUNT_BYTES == 8  # one int64 per expert
    prose_ = text()
    assert "an all-to-all of the counts per expert (E int64 values)" in prose_
    assert "\\;+\\; 8E\\,\\tfrac{n-1}{n}" in prose_


def test_the_training_run_is_4_blocks_8_experts_top_2_capacity_1_25():
    defaults = {k: p.default for k, p in inspect.signature(run_ep).parameters.items()}
    assert TINY.n_layers == 4 and defaults["model"] == "tiny"
    said = f"({TINY.n_layers} blocks, {defaults['experts']} experts, top-{defaults['top_k']}, capacity " \
           f"{defaults['capacity_factor']})"
    assert said == "(4 blocks, 8 experts, top-2, capacity 1.25)" and said in text()


def test_the_mesh_sends_the_replicated_gradients_over_4_ranks_and_each_expert_over_its_2_copies():
    dp, ep = 4, 2
    replicated, experts = cost.moe_param_split(moe_config(TINY, n_experts=8))  # run_3d's MoE (4 blocks)
    counts = [[[[1] * 8, [1] * 8]]]  # one step, one layer: any routing (the dp bytes do not depend on it)
    got = cost.ep3d_run_bytes(counts, 0, 64, replicated, experts // ep, dp, ep)["dp"]
    assert got == (cost.collective_sent_bytes("all_reduce", 4 * replicated, 4)
                   + cost.collective_sent_bytes("all_reduce", 4 * experts // ep, 2))
    assert ("the dp column is the replicated gradients' all-reduce over four ranks plus each rank's experts' over "
            "their two copies") in text()
    said = f"with 64 replicas and 8 experts per layer, ep = 8 and each expert lives on 64 / 8 = {64 // 8} ranks"
    assert said in text()


# -- section 4: DeepSeek-V3 ---------------------------------------------------------------------------
def test_deepseek_v3_shapes_and_counts():
    t = text()
    assert LAYERS - 3 == MOE_LAYERS and f"all but the first 3 with an MoE feed-forward ({MOE_LAYERS} MoE layers)" in t
    assert f"any {MAX_NODES} of the {NODES}, and its {K} experts any {K} of those nodes' {MAX_NODES * E // NODES}," in t
    assert f"ep = {EP} over {NODES} nodes ({E // NODES} experts a node)" in t
    assert f"all {K} are among the other {E - E // NODES}" in t
    assert f"`cost.H100` ({H100.gpus_per_node} GPUs a node, one InfiniBand NIC per GPU)" in t
    assert f"{EP}-way expert parallelism across {NODES} nodes" in t


def test_deepseek_v3_rows_that_cross_nodes():
    per_assignment = K * (EP - 1) / EP  # rows leaving a GPU per token, one per assignment
    crossing = K * (NODES - 1) / NODES  # of them, to GPUs of other nodes
    remote = between_nodes_per_token(MAX_NODES)
    assert crossing == 7
    rows = cost.moe_all_to_all_bytes(TOKENS, D, K, EP, 1, 2, 2)["total"]
    between = cost.moe_internode_bytes(TOKENS, D, K, E, EP, H100.gpus_per_node, MAX_NODES, 1, 2, 2)["total"]
    assert rows / between == pytest.approx(per_assignment / remote)
    t = text()
    assert f"({crossing:.0f} of a token's {per_assignment:.1f} rows would; the others go to GPUs of its own node)" in t
    assert f"({crossing / remote:.1f} times fewer than those {crossing:.0f} rows)" in t
    assert H100.intra.bytes_per_s / H100.inter.bytes_per_s == 9 and "over NVLink at nine times the bandwidth" in t


def test_deepseek_v3_experts_per_gpu():
    assert E // EP == 4
    assert f"shrink {EP} ways: each GPU holds {E // EP} of every layer's {E} experts" in text()


def test_deepseek_v3_summary():
    rows = cost.moe_all_to_all_bytes(TOKENS, D, K, EP, 1, 2, 2)["total"]
    between = cost.moe_internode_bytes(TOKENS, D, K, E, EP, H100.gpus_per_node, MAX_NODES, 1, 2, 2)["total"]
    seconds = MOE_LAYERS * between / H100.inter.bytes_per_s
    assert (f"once per other node it needs ({between_nodes_per_token(MAX_NODES):.1f} on average, at most {MAX_NODES}), "
            f"{rows / between:.1f} times fewer bytes than one row per assignment, yet the {MOE_LAYERS} layers still "
            f"take about {seconds:.2f} s per micro-batch at {H100.inter.bytes_per_s / 1e9:.0f} GB/s") in text()
    assert "the reason for FP8 dispatch, node-limited routing" not in text()  # FP8 and the limit are in the 0.76 s


# -- the worked problems' prose -------------------------------------------------------------------------
def test_the_problems_quote_the_sheet_and_the_checkers_tolerances():
    t = text()
    assert (f"{H100.flops_per_s / 1e12:.0f} TFLOP/s of dense bf16 at about {H100.efficiency:.0%}".replace("%", " %")
            in t)
    assert (f"InfiniBand {H100.inter.bytes_per_s / 1e9:.0f} GB/s per GPU each way, NVLink "
            f"{H100.intra.bytes_per_s / 1e9:.0f} GB/s") in t
    rel = {n: p.rel for n, p in ch08.PROBLEMS.items()}
    assert rel == {1: 0.05, 2: 0.05, 3: 0.01}
    assert "Each checker accepts an answer within 5 % (problem 3 within 1 %)" in t


def _problem_1_ratio(tokens: int, dim: int, k: int, width: int, backward: bool = False) -> float:
    """The all-to-alls over InfiniBand against the experts' compute, as ``ch08.PROBLEMS[1]`` counts them."""
    sent = cost.moe_all_to_all_bytes(tokens, dim, k, 8, 2, 2, backward=backward)
    seconds = (sent["backward"] if backward else sent["dispatch"] + sent["combine"]) / H100.inter.bytes_per_s
    flops = k * tokens * 2 * 3 * dim * width * (2 if backward else 1)
    return seconds / cost.compute_time(flops, H100)


def test_problem_1_t_d_and_k_cancel_and_backward_halves_the_ratio():
    want = ch08.PROBLEMS[1].want()
    for tokens, dim, k in ((4096, 4096, 2), (1000, 7168, 8), (64, 512, 1)):
        assert _problem_1_ratio(tokens, dim, k, 14336) == pytest.approx(want)
    assert _problem_1_ratio(4096, 4096, 2, 14336, backward=True) == pytest.approx(want / 2)
    assert _problem_1_ratio(4096, 4096, 2, FE) > 1  # DeepSeek-V3's narrower experts send for longer
    t = text()
    assert "T, D and k cancel" in t and "Backward sends the same bytes for twice the FLOPs: half the ratio" in t
    assert f"Narrower experts send for longer than they compute. DeepSeek-V3's are {FE} wide" in t


def test_problem_2_share_of_nodes_and_the_rows_between_nodes():
    share = 1 - math.comb(E - E // NODES, K) / math.comb(E, K)
    assert abs(share - (1 - (7 / 8) ** 8)) < 0.01  # "by hand 1 - (7/8)^8 is close"
    crossing = K * (NODES - 1) / NODES * D  # one row per assignment, FP8: the rows to other nodes
    t = text()
    assert f"\\binom{{256}}{{8}} = {share:.2f}$ (by hand $1 - (7/8)^8$ is close)" in t
    assert f"{K * (NODES - 1) // NODES} rows of them ({crossing:,.0f}) between nodes" in t
    every_row = K * (EP - 1) / EP * D
    assert (f"saves {every_row / ch08.PROBLEMS[2].want():.1f} times on all rows, "
            f"{crossing / ch08.PROBLEMS[2].want():.1f} times between nodes") in t


def test_problem_3_tokens_with_no_expert():
    seq, capacity = 4096, MIXTRAL_8X7B.with_(capacity_factor=1.25).capacity(4096)
    assert capacity == 1280 and (seq - capacity) / seq == ch08.PROBLEMS[3].want()
    assert f"so {seq - capacity} tokens get neither" in text()
    assert "nears its limit E/k = 4 (section 1)" in text()
