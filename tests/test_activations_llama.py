"""The LLaMA block's activation formula (``cost.llama_block_activation_bytes``): the tiny model's
measured bytes are its special case (``tests/test_activations.py`` measures them), and at LLaMA's
shapes it keeps more than GPT-3's count (Korthikanti et al.), by how much and why."""

import pytest

from minitp import cost
from minitp.models import TINY, get_config

LLAMA3_70B = get_config("llama3-70b")


@pytest.mark.parametrize("tp, sequence_parallel, recompute", [(1, False, False), (2, True, False), (2, False, True)])
def test_the_tiny_model_as_it_runs_here_is_the_llama_formula_in_fp32_without_flash_attention(
        tp, sequence_parallel, recompute):
    assert cost.tiny_block_activation_bytes(TINY, 2, 16, tp, sequence_parallel, recompute) == \
        cost.llama_block_activation_bytes(TINY, 2, 16, tp, sequence_parallel, "full" if recompute else "none",
                                          flash_attention=False, dtype_bytes=4)


def test_each_tensor_of_a_70b_block_at_tp_8_by_hand():
    b, s, t = 1, 8192, 8
    n, d, f, kv_dim = b * s, LLAMA3_70B.dim, LLAMA3_70B.ffn_hidden, LLAMA3_70B.kv_heads * LLAMA3_70B.head_dim
    norms = 2 * (2 * n * d + n + n * d)  # input, normalised output, 1/rms; the linears' full input
    attention = 4 * n * d // t  # q, k and v repeated to 64 heads, the heads' output
    mlp = 4 * n * f // t
    assert cost.llama_block_activation_bytes(LLAMA3_70B, b, s, t) == 2 * (norms + attention + mlp)
    shared = cost.llama_block_activation_bytes(LLAMA3_70B, b, s, t, repeat_kv=False)
    assert cost.llama_block_activation_bytes(LLAMA3_70B, b, s, t) - shared == 2 * 2 * n * (d - kv_dim) // t
    # without FlashAttention the scores (bf16) and the causal mask (1 byte) come back; selective drops them
    plain = cost.llama_block_activation_bytes(LLAMA3_70B, b, s, t, flash_attention=False)
    assert plain - cost.llama_block_activation_bytes(LLAMA3_70B, b, s, t) == b * 64 // t * s * s * 2 + s * s
    assert cost.llama_block_activation_bytes(LLAMA3_70B, b, s, t, recompute="selective", flash_attention=False) \
        == cost.llama_block_activation_bytes(LLAMA3_70B, b, s, t)
    assert cost.llama_block_activation_bytes(LLAMA3_70B, b, s, t, True, "full") == n * d // t * 2


def test_a_llama_block_keeps_27_percent_more_than_gpt3s_count_at_70b_tp_8():
    b, s = 1, 8192
    llama = cost.llama_block_activation_bytes(LLAMA3_70B, b, s, 8)
    gpt3 = cost.block_activation_bytes(LLAMA3_70B, b, s, 8)
    assert llama / gpt3 == pytest.approx(1.27, abs=0.005)  # 16.5 against 13 bytes per token and dimension
    # the per-rank estimate takes either count; at scale the LLaMA count's attention reads the 8 shared
    # key/value heads instead of 64 repeated ones
    per_rank = {formula: cost.activation_bytes_per_rank(LLAMA3_70B, b, s, 8, 4, 0, 8, formula=formula)
                for formula in ("llama", "gpt3")}
    shared = cost.llama_block_activation_bytes(LLAMA3_70B, b, s, 8, repeat_kv=False)
    assert per_rank["llama"] / per_rank["gpt3"] == pytest.approx(shared / gpt3) == pytest.approx(1.236, abs=0.001)
    with pytest.raises(ValueError, match="formula must be one of 'llama', 'llama-regather', 'gpt3', got 'gpt4'"):
        cost.activation_bytes_per_rank(LLAMA3_70B, b, s, 8, 4, 0, 8, formula="gpt4")


def test_under_sequence_parallel_keeping_the_gathered_input_costs_twice_gpt3s_count_and_regathering_wins_it_back():
    b, s, t = 1, 8192, 8
    n, d, f = b * s, LLAMA3_70B.dim, LLAMA3_70B.ffn_hidden
    kept = {formula: cost.activation_bytes_per_rank(LLAMA3_70B, b, s, t, 1, 0, 1, sequence_parallel=True,
                                                    formula=formula) for formula in cost.activations.FORMULAS}
    # minitp keeps each column-parallel input whole, (N, D) twice per block: most of a block at tp = 8
    assert kept["llama"] == 80 * 2 * (2 * ((2 * n * d + n) // t + n * d) + 2 * n * d // t
                                       + 2 * n * LLAMA3_70B.kv_heads * LLAMA3_70B.head_dim // t + 4 * n * f // t)
    assert kept["llama"] / kept["gpt3"] == pytest.approx(2.13, abs=0.01)
    # Megatron-LM keeps its S/t slice and gathers it again in backward: every term is then divided by t,
    # and what is left above GPT-3's 34/t is the wider MLP
    kv = 2 * n * LLAMA3_70B.kv_heads * LLAMA3_70B.head_dim // t
    assert kept["llama-regather"] == 80 * 2 * (2 * (3 * n * d + n) // t + 2 * n * d // t + kv + 4 * n * f // t)
    assert kept["llama-regather"] / kept["gpt3"] == pytest.approx(1.31, abs=0.01)  # SwiGLU's 4·F/t = 14·D/t
