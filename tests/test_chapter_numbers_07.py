"""The numbers chapter 07 (context parallel) states in its prose, recomputed with ``minitp.cost``,
``minitp.layout`` and ``minitp.models``: a changed formula, layout or sheet that the text does not
follow fails here. Each test recomputes a number and asserts the prose says it as written (those
already pinned by test_chapter_numbers.py and test_problems_ch07.py are not repeated)."""

import ast
import inspect
import math

import pytest
import torch
from test_chapter_numbers import prose

from minitp import cost, cp, layout
from minitp.cost.context import check_ulysses_heads
from minitp.exercises import ch07
from minitp.models import LLAMA3_8B, LLAMA3_70B, TINY, build_model, loss_fn

SEQ = 131072  # the chapter's 128K tokens
GIB = 2**30


def text() -> str:
    return prose("07_context_parallel.ipynb")


def pairs_per_rank(seq: int, n: int, balanced: bool) -> list[float]:
    """(query, key) pairs each rank computes under the causal mask, the diagonal counted as a
    triangle (tiles of one position): the squares of the chapter's figure."""
    return [cost.cp_attention_flops_per_rank(seq, n, r, 1, 1, balanced=balanced, tile=1) / 4 for r in range(n)]


# -- the memory wall, measured --------------------------------------------------------------------------
def test_the_tiny_models_shape_as_the_chapter_gives_it():
    assert (TINY.n_layers, TINY.dim, TINY.n_heads, TINY.kv_heads, TINY.head_dim) == (4, 64, 8, 4, 8)
    t = text()
    assert "(4 blocks, D = 64, 8 query heads sharing 4 key/value heads)" in t
    assert "8 query heads of 8 reading 4 key/value heads" in t


def test_plain_attention_keeps_132_s_squared_bytes_on_the_tiny_model():
    # per block: the softmax, H·S² fp32 numbers, and the causal mask, S² bytes (the s² terms of the count)
    seq = 512
    long = TINY.with_(max_seq_len=seq)
    per_block = (cost.llama_block_activation_bytes(long, 1, seq, flash_attention=False, dtype_bytes=4)
                 - cost.llama_block_activation_bytes(long, 1, seq, flash_attention=True, dtype_bytes=4))
    assert per_block == (TINY.n_heads * 4 + 1) * seq**2
    coefficient = TINY.n_layers * (TINY.n_heads * 4 + 1)
    assert coefficient == 132
    assert (f"{TINY.n_layers} · ({TINY.n_heads} · 4 + 1) · S² = {coefficient}·S² bytes here, "
            f"{coefficient * seq**2 / 1e6:.0f} MB of the 45 MB at S = {seq}") in text()


def test_the_45_mb_one_process_keeps_at_512_tokens_measured():
    long = TINY.with_(max_seq_len=512)
    tokens = torch.randint(0, long.vocab_size, (1, 513), generator=torch.Generator().manual_seed(0))
    model = build_model(long, seed=0)
    _, kept = cp.saved_activation_bytes(lambda: loss_fn(model(tokens[:, :-1]), tokens[:, 1:]),
                                        exclude=model.parameters())
    assert round(kept / 1e6) == 45 and "of the 45 MB at S = 512" in text()
    # the blocks' count explains all but 2 % of it (the rest: embedding, final norm, logits)
    blocks = long.n_layers * cost.tiny_block_activation_bytes(long, 1, 512)
    assert 0.98 < blocks / kept <= 1


# -- who computes what ----------------------------------------------------------------------------------
def test_contiguous_slices_give_the_last_rank_almost_6_times_the_first():
    contiguous = pairs_per_rank(16, 4, balanced=False)
    assert contiguous == [10, 26, 42, 58]
    assert round(contiguous[3] / contiguous[0]) == 6 > contiguous[3] / contiguous[0]
    assert (f"rank 3 computes almost 6 times rank 0's share of the triangle ({contiguous[3]:.0f} pairs "
            f"against {contiguous[0]:.0f};") in text()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_last_contiguous_rank_does_2n_minus_1_times_the_first_as_s_grows(n):
    work = pairs_per_rank(4096 * n, n, balanced=False)
    assert work[-1] / work[0] == pytest.approx(2 * n - 1, rel=1e-3)
    assert "with n ranks the last does about 2n − 1 times the first's work as S grows" in text()


def test_the_balanced_chunks_give_every_rank_the_same_share():
    assert pairs_per_rank(16, 4, balanced=True) == [34] * 4
    assert "and the shares are equal" in text()


def test_rank_1_of_4_holds_positions_2_3_and_12_13():
    assert layout.cp_positions(16, 4, 1, True) == [2, 3, 12, 13]
    assert "(rank 1 of 4 holds positions 2–3 and 12–13 of 16)" in text()


def test_two_contiguous_ranks_do_2_8_times_the_work_and_3_without_tiles():
    tiled = [cost.cp_attention_flops_per_rank(1024, 2, r, 4, 64, balanced=False) for r in range(2)]
    whole = pairs_per_rank(1024, 2, balanced=False)  # the diagonal as an exact triangle
    assert round(tiled[1] / tiled[0], 1) == 2.8 and round(whole[1] / whole[0]) == 3
    assert "2.8 times the work by the formula (not 3: the diagonal blocks are cut in tiles" in text()


# -- the ring's messages -----------------------------------------------------------------------------------
def test_the_rings_sends_per_rank_forward_and_backward():
    b, s, hkv, dh, n = 1, 64, TINY.kv_heads, TINY.head_dim, 4
    kv2 = 2 * cost.cp_kv_block_bytes(b, s, hkv, dh, n)
    forward = cost.cp_attention_bytes(b, s, hkv, dh, n, backward=False)
    backward = cost.cp_attention_bytes(b, s, hkv, dh, n) - forward
    assert forward == (n - 1) * kv2 and backward == ((n - 1) + n) * kv2
    t = text()
    assert f"Per rank: n − 1 = {n - 1} sends in forward, each the keys and values of one rank stacked" in t
    assert f"Backward: {n - 1} more for the blocks and {n} for their gradients" in t
    # only the key/value heads travel: half of what 8 query heads' own keys and values would be
    assert cost.cp_attention_bytes(b, s, TINY.n_heads, dh, n) == 2 * cost.cp_attention_bytes(b, s, hkv, dh, n)
    assert "each block is half of what it would be if each of the 8 query heads had its own" in t


def test_the_rings_bytes_per_call_stay_under_3_times_the_sequences_keys_and_values():
    cfg = LLAMA3_8B
    whole = 2 * cost.cp_kv_block_bytes(1, SEQ, cfg.kv_heads, cfg.head_dim, 1, 2)  # keys and values of all S
    ratios = [cost.cp_attention_bytes(1, SEQ, cfg.kv_heads, cfg.head_dim, n, 2) / whole for n in (2, 8, 64, 1024)]
    assert ratios == [pytest.approx((3 * n - 2) / n) for n in (2, 8, 64, 1024)]
    assert all(r < 3 for r in ratios) and ratios == sorted(ratios) and ratios[-1] > 2.99
    t = text()
    assert "towards three times the whole sequence's keys and values per call" in t
    assert "(3cp − 2)/cp times the whole sequence's keys and values per layer, always under 3 times" in t


# -- Ulysses and all-gather ---------------------------------------------------------------------------------
def test_ulysses_cp_must_divide_the_key_value_heads():
    for cfg, good, bad in ((LLAMA3_8B, 8, 3), (TINY, 4, 3), (LLAMA3_70B, 8, 16)):
        check_ulysses_heads(cfg, good)
        with pytest.raises(ValueError, match="not divisible"):
            check_ulysses_heads(cfg, bad)
    assert (LLAMA3_8B.kv_heads, TINY.kv_heads, LLAMA3_8B.n_heads) == (8, 4, 32)
    t = text()
    assert "n must divide their number (8 for LLaMA-3-8B, the tiny model's 4; `run_cp` refuses any other n)" in t
    assert "raises the limit to the query heads (32)" in t
    assert "But it stops at cp = 8, the key/value heads" in t  # LLaMA-3-70B: 8 of them


def test_the_allgather_sends_more_than_ulysses_from_4_ranks_on_the_tiny_model():
    b, s, h, hkv, dh = 8, 16, TINY.n_heads, TINY.kv_heads, TINY.head_dim
    ratio = {n: cost.allgather_attention_bytes(b, s, hkv, dh, n)
             / cost.ulysses_attention_bytes(b, s, h, hkv, dh, n) for n in (2, 3, 4, 8)}
    assert ratio == {n: pytest.approx(n * hkv / (h + hkv)) for n in ratio}  # n/3 here
    assert ratio[2] < 1 and ratio[3] == pytest.approx(1) and ratio[4] > 1
    for n in (2, 4, 8):  # and always fewer than the ring's
        assert cost.allgather_attention_bytes(b, s, hkv, dh, n) < cost.cp_attention_bytes(b, s, hkv, dh, n)
    assert ("The all-gather sends fewer bytes than the ring (and, on the tiny model, more than Ulysses from "
            "$n$ = 4 on)") in text()


def test_the_allgather_holds_n_over_2_times_the_rings_keys_and_values():
    b, s, n = 8, 16, 4
    ring = 2 * 2 * cost.cp_kv_block_bytes(b, s, TINY.kv_heads, TINY.head_dim, n)  # its block and the next
    gathered = 2 * cost.cp_kv_block_bytes(b, s, TINY.kv_heads, TINY.head_dim, 1)
    assert gathered / ring == n / 2 == 2
    assert "($n/2$ times what the ring holds: twice at $n$ = 4)" in text()
    assert "(LLaMA-3-8B: 8 key/value heads to 32 query heads)" in text()


def test_the_allgather_attend_is_14_lines_besides_its_docstring():
    source = inspect.getsource(cp.AllGatherAttend)
    docstring = ast.parse(source).body[0].body[0]  # its lines, not __doc__ (Python 3.13 dedents that)
    lines = [line for number, line in enumerate(source.splitlines(), start=1)
             if line.strip() and not docstring.lineno <= number <= docstring.end_lineno]
    assert len(lines) == 14 and "`cp.AllGatherAttend` is 14 lines besides its docstring" in text()


# -- at scale: LLaMA-3-8B at 128K tokens ---------------------------------------------------------------------
def test_llama3_8b_shapes_and_its_16_bytes_of_state_per_parameter():
    cfg = LLAMA3_8B
    assert (cfg.n_layers, cfg.kv_heads, cfg.head_dim) == (32, 8, 128)
    state = cost.cp_memory_per_rank(cfg, 16, precision="bf16")
    assert sum(state.values()) == 16 * cfg.num_params()  # whatever cp is
    t = text()
    assert "32 blocks, 8 key/value heads of 128" in t
    assert "fp32 AdamW and master copy: 16 bytes per parameter, unsharded by CP" in t


def test_the_activation_count_is_34_bytes_per_token_and_dimension_a_llama_block_a_third_more():
    cfg, local = LLAMA3_8B, SEQ // 16
    gpt3 = cost.block_activation_bytes(cfg, 1, local)
    assert gpt3 / (local * cfg.dim) == 34
    assert cost.cp_activation_bytes_per_rank(cfg, 1, SEQ, 16) == cfg.n_layers * gpt3
    llama = cost.activation_bytes_per_rank(cfg, 1, local, 1, 1, 0, 1, formula="llama")
    assert round(llama / (cfg.n_layers * gpt3) - 1, 1) == 0.3  # a third more
    assert ("(Korthikanti's count of a GPT-3 block, 34 bytes per token and model dimension; a LLaMA block "
            "keeps a third more)") in text()


def test_at_cp_16_the_activations_fit_beside_the_sharded_state():
    cfg, n, hbm = LLAMA3_8B, 16, cost.H100.memory_bytes
    whole = cost.cp_activation_bytes_per_rank(cfg, 1, SEQ, 1)
    acts = cost.cp_activation_bytes_per_rank(cfg, 1, SEQ, n)
    state = sum(cost.memory_per_rank(cfg.num_params(), n, zero=3, precision="bf16").values())
    assert 100e9 < whole < 1e12 and "the activations of one 128K sequence are hundreds of GB" in text()
    assert acts == whole / n and hbm == 80 * GIB
    llama = cost.activation_bytes_per_rank(cfg, 1, SEQ // n, 1, 1, 0, 1, formula="llama")
    assert acts + state < llama + state < hbm  # fits by either count
    assert (f"at cp = {n}, {acts / 1e9:.1f} GB per rank, which fits on an 80 GiB H100 beside the model state "
            f"sharded over the same {n} ranks ({state / 1e9:.1f} GB)") in text()


def test_the_sheets_figures_as_the_chapter_names_them():
    h = cost.H100
    assert (h.flops_per_s / 1e12, h.intra.name, h.intra.bytes_per_s / 1e9, h.inter.bytes_per_s * 8 / 1e9,
            h.efficiency) == (989, "NVLink 4", 450, 400, 0.6)
    assert ("(989 TFLOP/s dense bf16, NVLink 4 at 450 GB/s per direction, one 400 Gb/s InfiniBand NIC per GPU) "
            "and one assumption, that large bf16 matrix multiplies reach 60% of the peak") in text()


def test_fsdp_over_dp_times_cp_ranks_holds_a_quarter_of_the_moments():
    psi, dp, cp_ranks = TINY.num_params(), 2, 2
    sharded = cost.memory_per_rank(psi, dp * cp_ranks, zero=3)["optimizer"]
    assert sharded == cost.memory_per_rank(psi, 1)["optimizer"] / 4
    assert "(`--dp 2 --cp 2 --tp 1 --pp 1 --fsdp`: a quarter of AdamW's moments per rank)" in text()


# -- the worked problems -----------------------------------------------------------------------------------------
def test_the_problems_tolerances_as_the_chapter_states_them():
    rel = {n: ch07.PROBLEMS[n].rel for n in (1, 2, 3)}
    assert rel == {1: 0.05, 2: 0.02, 3: 0.05}
    assert (f"checked against `minitp.cost` within {rel[1]:.0%} (Problem 2: {rel[2]:.0%})".replace("%", " %")
            in text())


def test_problem_1_heads_per_gpu_and_the_threshold_without_gqa():
    cfg, tp = LLAMA3_70B, 8
    assert (cfg.n_heads // tp, cfg.kv_heads // tp) == (8, 1)
    assert "(per GPU 8 query heads, 1 key/value head)" in text()
    # Sl = Hkv·b·R / (H·β): one key/value head per query head makes it H/Hkv = 8 times higher
    h = cost.H100
    sl = cfg.kv_heads * 2 * h.flops_per_s * h.efficiency / (cfg.n_heads * h.inter.bytes_per_s)
    assert math.isclose(sl, ch07.PROBLEMS[1].want(), rel_tol=1e-3)
    without = cfg.n_heads * 2 * h.flops_per_s * h.efficiency / (cfg.n_heads * h.inter.bytes_per_s)
    assert round(without / sl) == 8 and "without grouped-query attention, 8 times higher" in text()
