"""The numbers chapter 12 (FP8, activation offload, selective checkpointing) states in its prose and
prints in its stored outputs, recomputed with ``minitp.cost``, ``minitp.plan`` and the models: a
changed formula, planner or sheet that the text does not follow fails here."""

import json
import re
from pathlib import Path

import pytest
from test_chapter_numbers import prose
from test_cost_time import _chapter_text, _figures_off_the_sheet

from minitp import cost, plan
from minitp.exercises import ch12
from minitp.models import LLAMA3_8B, LLAMA3_70B, TINY
from minitp.viz.explore import stored_twins, twin_texts

GIB = 2**30
NAME = "12_memory"
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
B, S = 2, 16


def text() -> str:
    return prose(f"{NAME}.ipynb")


def test_12_quotes_only_the_hardware_sheets_figures():
    assert _figures_off_the_sheet(_chapter_text(NAME)) == []


def test_12_the_tiny_blocks_kept_bytes_and_the_shares_said():
    none = cost.tiny_block_activation_bytes(TINY, B, S)
    selective = cost.tiny_selective_block_bytes(TINY, B, S)
    full = cost.tiny_block_activation_bytes(TINY, B, S, recompute=True)
    out = _chapter_text(NAME)
    for way, kept in (("none", none), ("selective-op", selective), ("full", full)):
        assert f"{way:<13} kept {kept:>7,} B per block (formula {kept:>7,})" in out
    assert round(selective / none, 1) == 0.6 and "about three fifths of what the plain block keeps" in text()
    assert round(none / full) == 20 and "(1/20 of the plain block)" in text()
    assert f"formula {TINY.n_layers} blocks × {none:,} = {TINY.n_layers * none:,}" in out


def _row(model, dp, pp, tp, **kw):
    return plan.plan_layout(model, dp, pp, tp, 64, 8192, **kw)


def test_12_offload_at_8b_as_said():
    row, keep = _row(LLAMA3_8B, 8, 1, 8, recompute="offload"), _row(LLAMA3_8B, 8, 1, 8)
    full = _row(LLAMA3_8B, 8, 1, 8, recompute="full")
    host, t = row["host"], text()
    assert round(host["out"] / 1e9) == 139 and "About 139 GB each way per step, 2.2 s at 64 GB/s" in t
    assert round(host["out_s"], 1) == 2.2 and round(host["forward_s"], 2) == 0.25
    assert round(host["backward_s"], 1) == 0.5 and "a backward of 0.5 s" in t
    assert round(keep["step_s"], 1) == 1.0 and round(row["step_s"], 1) == 4.6
    assert "grows from about 1.0 s to 4.6 s" in t
    assert round(full["step_s"] - keep["step_s"], 2) == 0.36 and "about 0.36 s more" in t
    assert ch12.PROBLEMS[2].want() == pytest.approx(2.16, abs=0.005) and "**2.16 s**" in t
    assert round(host["out_s"] / host["forward_s"]) == 9 and "about nine times faster" in t


def test_12_selective_at_70b_as_said():
    rows = {way: _row(LLAMA3_70B, 2, 4, 8, sequence_parallel=True, recompute=way)
            for way in ("none", "selective-op", "full")}
    act = {way: (r["memory_total"] - r["memory_states"]) / GIB for way, r in rows.items()}
    t = text()
    assert (round(act["none"], 1), round(act["selective-op"], 1), round(act["full"], 1)) == (45.3, 35.3, 1.2)
    assert "**35.3 GiB**, against 45.3 GiB keeping everything and 1.2 GiB" in t
    assert round(act["none"] - act["selective-op"]) == 10 and "Selective keeps 10 GiB less" in t
    assert rows["selective-op"]["step_s"] == rows["none"]["step_s"]
    assert round(100 * (rows["full"]["step_s"] / rows["none"]["step_s"] - 1)) == 35
    assert t.count("35 % more time") == 2
    assert ch12.PROBLEMS[3].want() == pytest.approx(act["selective-op"], abs=0.01)


def test_12_fp8_gathers_at_70b_as_said():
    fp8_gib = ch12.PROBLEMS[1].want()
    bf16_gib = 2 * cost.collective_sent_bytes("all_gather", LLAMA3_70B.num_params() * 2, 64) / GIB
    t = text()
    assert round(fp8_gib) == 129 and round(bf16_gib) == 259 and "about **129 GiB**, against 259 GiB" in t
    seconds = [g * GIB / cost.H100.inter.bytes_per_s for g in (fp8_gib, bf16_gib)]
    assert [round(x, 1) for x in seconds] == [2.8, 5.6] and "2.8 s a step against 5.6 s" in t


def test_12_the_fp8_all_gather_bytes_printed():
    numel = 256 * 64
    out = _chapter_text(NAME)
    want = cost.float8_all_gather_bytes(numel, 2)
    assert f"bytes each rank sent: ['{want:,.0f}', '{want:,.0f}']; formula {want:.0f}" in out
    assert f"a bf16 gather sends {cost.collective_sent_bytes('all_gather', numel * 2, 2):,.0f}" in out


# -- the stored twins of the two live controls -----------------------------------------------------
def _twins() -> list[list[str]]:
    notebook = json.loads((NOTEBOOKS / f"{NAME}.ipynb").read_text(encoding="utf-8"))
    return [twin_texts(t) for t in stored_twins(notebook)]


def test_12_stores_two_twins_with_every_setting():
    assert [len(t) for t in _twins()] == [4, 9]  # recipe × gradients; sequences × positions


def test_12_every_stored_fp8_run_says_its_verdict_truly():
    for text in _twins()[0]:
        val, ref, said, gap = re.search(r"validation ([\d.]+) nats/byte, fp32's ([\d.]+): (within|beyond) "
                                        r"0.05 of it \(([-+][\d.]+)\)", text).groups()
        assert said == ("within" if abs(float(gap)) <= 0.05 else "beyond")
        assert abs(float(val) - float(ref) - float(gap)) <= 0.0015


def test_12_every_stored_setting_kept_what_the_formula_says():
    settings = [(b, s) for b in (1, 2, 4) for s in (8, 16, 32)]
    wants = {(b, s): {"none": cost.tiny_block_activation_bytes(TINY, b, s),
                      "selective-op": cost.tiny_selective_block_bytes(TINY, b, s),
                      "full": cost.tiny_block_activation_bytes(TINY, b, s, recompute=True),
                      "offload": 0} for b, s in settings}
    seen = set()
    for text in _twins()[1]:
        rows = re.findall(r"^(\S+)\s+measured\s+([\d,]+) B, formula\s+([\d,]+) B, (\d+) matmuls in backward, "
                          r"gradients <= 1e-06: OK$", text, re.M)
        assert [r[0] for r in rows] == ["none", "selective-op", "full", "offload"], text
        kept = {way: int(measured.replace(",", "")) for way, measured, formula, _ in rows}
        assert all(measured == formula for _, measured, formula, _ in rows)
        match = [setting for setting, want in wants.items() if want == kept]
        assert len(match) == 1, kept
        seen.add(match[0])
        matmuls = {way: int(n) for way, *_, n in rows}
        assert matmuls["selective-op"] == matmuls["none"] == matmuls["offload"] < matmuls["full"]
    assert seen == set(settings)
