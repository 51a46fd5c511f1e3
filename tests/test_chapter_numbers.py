"""The numbers chapters 05, 07 and 08 state in their prose, recomputed with ``minitp.cost`` and
``minitp.models``: a changed formula or sheet that the text does not follow fails here."""

import json
from pathlib import Path

import pytest

from minitp import cost
from minitp.models import LLAMA3_8B, LLAMA3_70B

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def prose(name: str) -> str:
    """Every Markdown cell of a notebook, joined, with line breaks as spaces."""
    cells = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return " ".join(text.split())


def block_params(cfg) -> int:
    return cost.pp_stage_params(cfg, 1, False, False)


# -- 05 pipeline ----------------------------------------------------------------------------------
def test_05_vocabulary_matrices_in_blocks_of_llama3():
    text = prose("05_pipeline.ipynb")
    per_matrix = {cfg: cfg.vocab_size * cfg.dim / block_params(cfg) for cfg in (LLAMA3_8B, LLAMA3_70B)}
    assert f"as big as {per_matrix[LLAMA3_8B]:.1f} blocks of LLaMA-3-8B" in text
    assert f"and {per_matrix[LLAMA3_70B]:.1f} blocks of LLaMA-3-70B" in text
    assert (f"({LLAMA3_70B.vocab_size * LLAMA3_70B.dim / 1e9:.2f} B parameters against a block's "
            f"{block_params(LLAMA3_70B) / 1e9:.2f} B)") in text
    # the first stage holds one such matrix more than a middle one
    first, middle = (cost.pp_stage_params(LLAMA3_70B, 10, s == 0, False) for s in (0, 1))
    assert first - middle == LLAMA3_70B.vocab_size * LLAMA3_70B.dim


@pytest.mark.parametrize("p, v, said", [(4, 2, "(7/3 at p = 4, v = 2)"), (8, 2, "15/7 ≈ 2.1 times the messages")])
def test_05_interleaving_message_factor(p, v, said):
    total = sum(cost.pp_step_bytes(8, 16, 8, p, s, virtual_stages=v) for s in range(p))
    plain = sum(cost.pp_step_bytes(8, 16, 8, p, s) for s in range(p))
    assert total / plain == pytest.approx((p * v - 1) / (p - 1))
    assert said in prose("05_pipeline.ipynb")


def test_05_interleaved_bytes_per_rank_are_3_2_2_3_times():
    ratios = [cost.pp_step_bytes(8, 16, 8, 4, s, virtual_stages=2) / cost.pp_step_bytes(8, 16, 8, 4, s)
              for s in range(4)]
    assert ratios == [3, 2, 2, 3]
    assert "3, 2, 2, 3 times in the bytes printed below" in prose("05_pipeline.ipynb")


def test_05_pytorch_pipelining_has_no_default_schedule():
    pipelining = pytest.importorskip("torch.distributed.pipelining")
    text = prose("05_pipeline.ipynb")
    assert "default schedule of Megatron-LM and PyTorch" not in text
    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"):
        assert hasattr(pipelining, name) and f"`{name}`" in text


# -- 07 context parallel ----------------------------------------------------------------------------
def test_07_ring_bytes_are_3cp_minus_2_hops_in_the_solution():
    text = prose("07_context_parallel.ipynb")
    assert "4cp − 3" not in text and "(3cp − 2)·2KV" in text
    kv2 = 2 * cost.cp_kv_block_bytes(1, 1024, 4, 64, 4)
    assert cost.cp_attention_bytes(1, 1024, 4, 64, 4) == 10 * kv2 and "(10·2KV at cp = 4)" in text


def test_07_crossovers_use_the_h100_sheet():
    cfg, seq, gpu = LLAMA3_8B, 131072, cost.H100
    compute = cost.compute_time(4 * cfg.n_heads * cfg.head_dim * seq**2, gpu)
    hop = 2 * cost.cp_kv_block_bytes(1, seq, cfg.kv_heads, cfg.head_dim, 1, 2)
    inside, between = (compute / (hop / link.bytes_per_s) for link in (gpu.intra, gpu.inter))
    text = prose("07_context_parallel.ipynb")
    assert round(inside, -2) == 400 and "(up to about 400)" in text
    assert f"comes near cp = {between:.0f} " in text
    assert gpu.intra.bytes_per_s / gpu.inter.bytes_per_s == 9 and "at a ninth of the bandwidth" in text


def test_07_ring_bytes_per_step_at_scale():
    cfg = LLAMA3_8B
    per_step = {n: cfg.n_layers * cost.cp_attention_bytes(1, 131072, cfg.kv_heads, cfg.head_dim, n, 2) / 1e9
                for n in (2, 32)}
    assert f"from {per_step[2]:.1f} GB at cp = 2 to {per_step[32]:.1f} GB at cp = 32" in prose(
        "07_context_parallel.ipynb")


# -- 08 expert parallel -----------------------------------------------------------------------------
def test_08_deepseek_v3_bytes_between_nodes():
    tokens, dim, k, n_experts, ep, gpu = 4096, 7168, 8, 256, 64, cost.H100
    layers = 58
    rows = cost.moe_all_to_all_bytes(tokens, dim, k, ep, dispatch_bytes=1, combine_bytes=2, grad_bytes=2)["total"]
    between = cost.experts.moe_internode_bytes(tokens, dim, k, n_experts, ep, gpu.gpus_per_node, 4,
                                               dispatch_bytes=1, combine_bytes=2, grad_bytes=2)["total"]
    nodes = ep // gpu.gpus_per_node
    remote = cost.experts.expected_nodes_per_token(n_experts, k, nodes, 4) * (nodes - 1) / nodes
    text = prose("08_expert_parallel.ipynb")
    assert f"about {rows / 2**30:.1f} GiB per GPU per MoE layer" in text
    assert f"{layers * rows / 2**30:.0f} GiB over the 58 layers" in text
    assert f"{layers * rows / gpu.inter.bytes_per_s:.1f} seconds if it all crossed" in text
    assert f"between nodes {remote:.1f} times on average" in text
    assert f"instead of {k * (ep - 1) / ep:.1f} rows: {rows / between:.1f} times fewer bytes" in text
    assert f"{layers * between / 2**30:.0f} GiB and about {layers * between / gpu.inter.bytes_per_s:.2f} s" in text
    assert "changes which links carry the bytes, not how many leave a GPU" not in text


def test_08_balancing_loss_limit_is_e_over_k():
    text = prose("08_expert_parallel.ipynb")
    assert "grows to E/k when every token goes to the same k experts (4 here" in text
    assert "grows to about E " not in text
