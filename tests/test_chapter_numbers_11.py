"""The numbers chapter 11 (the collective matmul, HSDP and the V) states in its prose and prints in
its stored outputs, recomputed with ``minitp.cost``, ``minitp.pp_schedules`` and the models: a changed
formula, schedule or sheet that the text does not follow fails here."""

import json
import re
from pathlib import Path

import pytest
from test_chapter_numbers import prose
from test_cost_time import _chapter_text, _figures_off_the_sheet

from minitp import cost, hsdp
from minitp.exercises import ch11
from minitp.fsdp_units import unit_numels
from minitp.models import LLAMA3_8B, TINY, build_model
from minitp.pp_schedules import V_SHAPE, make_schedule
from minitp.viz.explore import stored_twins, twin_texts

GIB = 2**30
NAME = "11_overlap"
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def text() -> str:
    return prose(f"{NAME}.ipynb")


def test_11_quotes_only_the_hardware_sheets_figures():
    assert _figures_off_the_sheet(_chapter_text(NAME)) == []


def test_11_the_mlp_messages_bytes_are_the_formula_printed():
    tokens, dim, n = 2048, 512, 2  # the chapter's MLP: TOKENS, DIM at tp = 2
    formula = 4 * cost.collective_sent_bytes("all_gather", tokens * dim * 4, n)
    out = _chapter_text(NAME)
    assert out.count(f"formula 4 (n-1)/n A = {formula:,.0f}") == 2
    assert f"['{formula:,.0f}', '{formula:,.0f}']" in out


def test_11_hsdp_bytes_per_group_and_the_ratio_said():
    numels = unit_numels(build_model(TINY), 2)
    step = cost.hsdp_step_bytes(numels, 2, 2)
    shard = 2 * step["dp_shard"] + cost.fsdp_run_bytes(numels, 2, 0)  # 2 steps, then the state dict
    replicate = 2 * step["dp_replicate"]
    out = _chapter_text(NAME)
    assert f"dp_shard {shard:,.0f} B (formula {shard:,.0f}), dp_replicate {replicate:,.0f} B" in out
    assert 3 < shard / replicate < 4 and "more than three times the replicate group's bytes" in text()


def test_11_the_v_and_its_tables_printed_are_minitps():
    out = _chapter_text(NAME)
    assert f"rank  : {[V_SHAPE.holder(4, k)[0] for k in range(8)]} (V)" in out
    for name in ("zbv", "dualpipev"):
        for rank, actions in enumerate(make_schedule(name, 2, 4)):
            row = " ".join(f"{a.kind}{a.microbatch}{'ʹ' if a.chunk else ''}" for a in actions)
            assert f"rank {rank}: {row}" in out, (name, rank)


@pytest.mark.parametrize("p, m, name, said", [
    (2, 4, "zbv", "1/25"), (8, 32, "dualpipev", "7/199 = 3.5\\%"), (8, 32, "zb", "7/103 = 6.8\\%"),
    (8, 32, "1f1b", "(p-1)/(m+p-1) = 18\\%")])
def test_11_idle_shares_said(p, m, name, said):
    share = cost.pp_bubble_fraction(p, m, name)
    assert said in text()
    numbers = re.findall(r"(\d+)/(\d+)", said)
    if numbers and "p-1" not in said:
        a, b = map(int, numbers[0])
        assert share == pytest.approx(a / b)
    percent = re.search(r"([\d.]+)\\%", said)
    if percent:
        assert 100 * share == pytest.approx(float(percent.group(1)), abs=0.05 if "." in said else 0.5)


def test_11_worked_problems_as_the_solutions_say():
    t = text()
    assert ch11.PROBLEMS[1].want() == pytest.approx(4.8, abs=0.05) and "About **4.8 times**" in t
    chunk_s = 2 * 1024 * 8192 * 7168 / (cost.H100.flops_per_s * cost.H100.efficiency)
    assert round(chunk_s * 1e6) == 203 and "203 µs" in t
    message_s = cost.collective_time("send", 1024 * 8192 * 2, 2, cost.H100.intra)
    assert round(message_s * 1e6) == 42 and "42 µs" in t
    across = cost.collective_time("send", 1024 * 8192 * 2, 2, cost.H100.inter)
    assert round(across * 1e6, -1) == 350 and "would take about 350 µs" in t
    assert ch11.PROBLEMS[2].want() == pytest.approx(7.4, abs=0.05) and "**7.4 GiB**" in t
    seconds = ch11.PROBLEMS[2].want() * GIB / cost.H100.inter.bytes_per_s
    assert round(seconds, 2) == 0.16 and "0.16 s at 50 GB/s" in t
    fsdp = 3 * (1024 - 1) / 1024 * 4 * LLAMA3_8B.num_params() / GIB
    assert round(fsdp, -1) == 90 and "= 90 GiB per GPU" in t
    assert ch11.PROBLEMS[3].want() == pytest.approx(7 / 199) and "**3.5 %**" in t


def test_11_groups_printed_are_hsdps():
    assert f"groups: {hsdp.hsdp_group_ranks(2, 2)}" in _chapter_text(NAME)


# -- the stored twins of the three live controls --------------------------------------------------
def _twins() -> list[list[str]]:
    notebook = json.loads((NOTEBOOKS / f"{NAME}.ipynb").read_text(encoding="utf-8"))
    return [twin_texts(t) for t in stored_twins(notebook)]


def test_11_stores_three_twins_with_every_setting():
    assert [len(t) for t in _twins()] == [6, 3, 8]  # F × tokens; replicas; schedules × m


def test_11_the_mlp_twin_shows_both_sides_of_every_run():
    for text in _twins()[0]:
        sides = re.findall(r"^(unfused|overlapped)\s+step [\d.]+ ms, exposed communication [\d.]+ ms",
                           text, re.M)
        assert sides == ["unfused", "overlapped"], text


def test_11_every_stored_hsdp_grid_matched_its_oracles_and_holds_its_states():
    numels = {s: unit_numels(build_model(TINY), s) for s in (1, 2, 4)}
    for text in _twins()[1]:
        r, s = map(int, re.match(r"(\d) replica\(s\) of (\d) rank\(s\)", text).groups())
        assert "problems found none" in text
        held = sum(cost.hsdp_memory_per_rank(numels[s], s).values())
        assert f"each rank holds {held:,.0f} B" in text


def test_11_every_stored_schedule_states_its_formula():
    seen = set()
    for text in _twins()[2]:
        formula = float(re.search(r"formula ([\d.]+) \((B = 2F|F = B = W)\)", text)[1])
        seen.add(formula)
        assert formula in {round(cost.pp_bubble_fraction(2, m, name), 3)
                           for name in ("1f1b", "zb", "zbv", "dualpipev") for m in (4, 8)}
    assert len(seen) >= 5
