"""Chapter 08's stored twin (the website's capacity-and-k control) is honest: in every stored run each
rank's traced bytes equal the formula fed that run's routing, and the drops follow the capacity."""

import json
import math
import re
from pathlib import Path

from minitp.viz.explore import stored_twins, twin_texts

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "08_expert_parallel.ipynb"


def settings() -> dict[tuple[float, int], str]:
    """(capacity factor, k) -> the text the panel shows, for the one stored twin of the notebook (the
    setting read from the text's first line, "c = 1.25, k = 2: ...", not from the caption)."""
    twins = stored_twins(json.loads(NOTEBOOK.read_text(encoding="utf-8")))
    assert len(twins) == 1, f"expected one stored twin in {NOTEBOOK.name}, found {len(twins)}"
    texts = twin_texts(twins[0])
    found = [re.match(r"c = ([\d.]+), k = (\d+):", t) for t in texts]
    assert all(found), [t.splitlines()[0] for t in texts]
    return {(float(m[1]), int(m[2])): t for m, t in zip(found, texts)}


def test_twin_stores_three_capacity_factors_at_k_1_and_2():
    assert set(settings()) == {(c, k) for c in (0.5, 1.25, 4.0) for k in (1, 2)}


def test_every_stored_run_sent_what_the_formula_of_its_routing_says():
    for setting, text in settings().items():
        rows = re.findall(r"^\s*(\d)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)$", text, re.M)
        assert [int(r[0]) for r in rows] == [0, 1, 2, 3], setting
        for rank, a2a, a2a_formula, total, total_formula in rows:
            assert a2a == a2a_formula and total == total_formula, (setting, rank)


def test_stored_drops_shrink_as_capacity_grows_and_vanish_when_it_holds_the_sequence():
    dropped, capacity = {}, {}
    for (c, k), text in settings().items():
        lost, routed = map(int, re.search(r"dropped (\d+) of (\d+) assignments", text).groups())
        assert routed == 8 * 16 * k, (c, k)  # B·S·k: every token chose k experts
        dropped[c, k] = lost
        capacity[c, k] = int(re.search(r"\) = (\d+) per sequence", text)[1])
        assert capacity[c, k] == min(16, math.ceil(c * 16 * k / 8)), (c, k)  # C = min(S, ceil(c·S·k/E))
    for k in (1, 2):
        assert dropped[0.5, k] >= dropped[1.25, k] >= dropped[4.0, k], dropped
        assert dropped[0.5, k] > 0, dropped
    # an expert that can take the whole sequence (C = S: c = 4 at k = 2, not at k = 1 where C = 8) drops nothing
    whole = [setting for setting, size in capacity.items() if size == 16]
    assert whole == [(4.0, 2)], capacity
    assert all(dropped[setting] == 0 for setting in whole), dropped
