"""Chapter 07's worked problems: the answers are the numbers worked by hand in the chapter, from the
hardware sheet (``cost.H100``) and LLaMA-3-70B's shapes, and each named slip is caught by name."""

import json
from pathlib import Path

import pytest
from hint_levels import first_then_second

from minitp import cost
from minitp.exercises import ExerciseError, ch07
from minitp.models import LLAMA3_70B


def test_the_answers_are_the_chapters_numbers_by_hand():
    h, cfg = cost.H100, LLAMA3_70B
    assert (cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.n_layers) == (64, 8, 128, 80)
    assert h.flops_per_s == 989e12 and h.efficiency == 0.6 and h.inter.bytes_per_s == 50e9
    # 1: send 2·1·Sl·128·2 bytes at 50 GB/s = compute 2·8·128·Sl² FLOPs at 0.6 × 989 TFLOP/s
    assert ch07.PROBLEMS[1].want() == 2967 == pytest.approx(512 / 50e9 / (2048 / (0.6 * 989e12)), abs=1e-6)
    assert 131072 // 2967 == 44  # the cp up to which a 128K sequence keeps the ring hidden
    # 2: ring (3·8-2)·2KV against Ulysses 2·(S/8)·128·(2·64 + 2·8)·2 bytes·7/8
    kv = 8 * 131072 / 8 * 128 * 2
    ring, ulysses = 22 * 2 * kv, 2 * 131072 / 8 * 128 * 144 * 2 * 7 / 8
    assert (ring, ulysses) == (1_476_395_008, 1_056_964_608)
    assert ch07.PROBLEMS[2].want() == pytest.approx(ring / ulysses) == pytest.approx(88 / 63)
    # 3: the gathered keys and values of 80 layers, one key/value head each at tp = 8: 5 GiB exactly
    assert ch07.PROBLEMS[3].want() == 2 * 80 * 1 * 128 * 2 * 131072 / 2**30 == 5.0


@pytest.mark.parametrize("number, factor, named", [
    (1, 0.5, "half of a full block"),
    (1, 2.0, "bf16: 2 bytes"),
    (1, 8.0, "the ratio of heads"),
    (1, 1 / 9, "that is NVLink's 450 GB/s"),
    (1, 1 / 0.6, r"0.6 × 989 TFLOP/s"),
    (2, 21 / 22, "cp hops, not cp-1"),
    (2, 7 / 8, r"\(cp-1\)/cp of each tensor"),
    (2, 144 / 256, "k and v carry Hkv = 8 heads"),
    (2, 7 / 22, "count backward for the ring too"),
    (2, 63 ** 2 / 88 ** 2, "that is Ulysses' bytes over the ring's"),
    (3, 8.0, "Hkv/tp = 1 of the key/value heads"),
    (3, 1 / 16, "what the ring keeps"),
    (3, 0.5, "keys AND values"),
    (3, 1 / 80, "that is one layer"),
])
def test_each_named_slip_is_caught_by_name(number, factor, named):
    with pytest.raises(ExerciseError, match=named):
        ch07.check_problem(number, lambda: ch07.PROBLEMS[number].want() * factor)


@pytest.mark.parametrize("number", [1, 2, 3])
def test_the_expected_value_shows_only_from_the_second_wrong_try(number):
    expected = {1: "2,967 tokens", 2: "1.397", 3: "5 GiB"}[number]
    first_then_second(ch07.check_problem, number, lambda: ch07.PROBLEMS[number].want() * 4, expected=expected)


# -- the numbers the chapter's prose states about them ------------------------------------------------
def prose() -> str:
    cells = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "07_context_parallel.ipynb")
                       .read_text(encoding="utf-8"))["cells"]
    return " ".join("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())


def test_problem_1s_solution_states_the_sheets_numbers():
    h, text, tokens = cost.H100, prose(), ch07.PROBLEMS[1].want()
    assert f"**{tokens:,}** positions per rank" in text
    assert f"hidden up to cp = {131072 // tokens}" in text
    assert f"a ninth, about {round(tokens * h.inter.bytes_per_s / h.intra.bytes_per_s, -1):.0f} positions" in text
    assert ch07._hidden_tokens_per_rank(tp=1) == tokens  # "tp and Dh cancel"


def test_a_causal_balanced_step_computes_half_a_block():
    # the premise of problem 1 and of "both limits halve": cp steps of half a full block each, on every rank
    seq, n, heads, dh = 8192, 4, 2, 8
    half_block = 4 * heads * dh * (seq // n) ** 2 / 2
    for rank in range(n):
        assert cost.cp_attention_flops_per_rank(seq, n, rank, heads, dh) == pytest.approx(n * half_block, rel=0.01)
    assert "under the causal mask a balanced step computes half of one, and both limits halve" in prose()


def test_problem_2s_solution_states_the_bytes_and_the_crossover():
    cfg, text = LLAMA3_70B, prose()
    kv = cost.cp_kv_block_bytes(1, 131072, cfg.kv_heads, cfg.head_dim, 8, 2)
    ring = cost.cp_attention_bytes(1, 131072, cfg.kv_heads, cfg.head_dim, 8, 2)
    ulysses = cost.ulysses_attention_bytes(1, 131072, cfg.n_heads, cfg.kv_heads, cfg.head_dim, 8, 2)
    assert f"= {kv / 1e6:.1f} MB, so {ring / 1e9:.2f} GB" in text and f"= {ulysses / 1e9:.2f} GB" in text
    assert f"88/63, **{ring / ulysses:.2f}**" in text
    wins = [n for n in range(2, 9) if ch07._ring_over_ulysses(n) > 1]
    assert wins == list(range(6, 9)) and "from cp = 6 on" in text


def test_ulysses_sends_less_than_the_ring_from_3_ranks_for_llama3_8b():
    from minitp.models import LLAMA3_8B as cfg

    ratio = {n: cost.cp_attention_bytes(1, 131072, cfg.kv_heads, cfg.head_dim, n, 2)
             / cost.ulysses_attention_bytes(1, 131072, cfg.n_heads, cfg.kv_heads, cfg.head_dim, n, 2) for n in (2, 3)}
    assert ratio[2] < 1 < ratio[3] and "for LLaMA-3-8B Ulysses sends less from n = 3 on" in prose()


def test_problem_3s_solution_states_the_bytes():
    cfg, text = LLAMA3_70B, prose()
    per_position = cost.kv_cache_bytes(cfg, 1, tp=8)
    assert f"= {per_position:,.0f} bytes per position" in text and "**5 GiB**" in text
    assert f"{cost.kv_cache_bytes(cfg, 131072 // 16, tp=8) / 2**20:.0f} MiB, 16 times less" in text
    without_gqa = cfg.with_(n_kv_heads=cfg.n_heads)  # one key/value head per query head
    gib = cost.kv_cache_bytes(without_gqa, 131072, tp=8) / 2**30
    assert f"with 64 key/value heads the all-gather's would be {gib:.0f} GiB" in text
