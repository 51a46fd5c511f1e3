"""Chapter 07's stored twin (the website's ranks-and-layout control) is honest: every stored run sent
what the formula says, its work per rank follows the layout, and 4-rank timings say they share 2 cores."""

import json
import re
from pathlib import Path

from minitp import cost
from minitp.viz.explore import stored_twins, twin_texts

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "07_context_parallel.ipynb"


def stored_panels(notebook: Path) -> dict[tuple[int, str], str]:
    """(ranks, layout) -> the text the panel shows, for the one stored twin of the notebook (the
    setting read from the text's first line, "4 ranks, contiguous: ...", not from the caption)."""
    twins = stored_twins(json.loads(notebook.read_text(encoding="utf-8")))
    assert len(twins) == 1, f"expected one stored twin in {notebook.name}, found {len(twins)}"
    texts = twin_texts(twins[0])
    settings = [re.match(r"(\d+) ranks, (contiguous|balanced):", t) for t in texts]
    assert all(settings), [t.splitlines()[0] for t in texts]
    return {(int(m[1]), m[2]): t for m, t in zip(settings, texts)}


def test_twin_stores_both_layouts_at_2_and_4_ranks():
    assert set(stored_panels(NOTEBOOK)) == {(n, layout) for n in (2, 4) for layout in ("contiguous", "balanced")}


def test_every_stored_run_sent_what_the_ring_formula_says():
    for setting, text in stored_panels(NOTEBOOK).items():
        n = setting[0]
        rows = re.findall(r"^\s*(\d+)\s+([\d.]+) MFLOP\s+[\d.]+ ms\s+([\d,]+)\s+([\d,]+)$", text, re.M)
        assert [int(r[0]) for r in rows] == list(range(n)), setting
        formula = cost.cp_attention_bytes(1, 1024, 4, 64, n)
        for rank, _, traced, expected in rows:
            assert float(traced.replace(",", "")) == float(expected.replace(",", "")) == formula, (setting, rank)


def test_stored_work_per_rank_is_even_only_when_balanced():
    for setting, text in stored_panels(NOTEBOOK).items():
        work = [float(w) for w in re.findall(r"^\s*\d+\s+([\d.]+) MFLOP", text, re.M)]
        assert (max(work) == min(work)) == (setting[1] == "balanced"), (setting, work)


def test_timings_at_4_ranks_say_they_are_oversubscribed():
    for setting, text in stored_panels(NOTEBOOK).items():
        assert ("oversubscribed: 4 ranks on 2 cores" in text) == (setting[0] == 4), setting


def test_every_stored_label_states_the_rings_3n_minus_2_hops():
    from minitp.viz.format import format_bytes

    for (n, _), text in stored_panels(NOTEBOOK).items():
        hop = 2 * cost.cp_kv_block_bytes(1, 1024, 4, 64, n)
        assert f"each rank sends n-1 = {n - 1} block" in text and f"of 2KV = {format_bytes(hop)} each" in text
        assert f"(3n-2)·2KV = {format_bytes((3 * n - 2) * hop)} in forward and backward" in text, text
        assert cost.cp_attention_bytes(1, 1024, 4, 64, n) == (3 * n - 2) * hop
