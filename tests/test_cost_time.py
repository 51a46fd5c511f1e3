"""minitp.cost's time model: FLOPs, α–β collectives, overlap, step time and MFU; recomputation's traffic."""

import json

import pytest

from minitp import cost, plan
from minitp.measure import calibrate
from minitp.models import LLAMA3_8B, LLAMA3_70B, TINY
from minitp.models.moe import moe_config
from minitp.models.train import TrainConfig

MIB, GIB = 2**20, 2**30
LINK = cost.Link("test", alpha_s=1e-6, bytes_per_s=1e3)
CPU = cost.Device("fixture", flops_per_s=1e9, intra=LINK, inter=cost.Link("slow", 1e-5, 1e2), gpus_per_node=4)


def test_a_ring_collective_takes_its_steps_of_alpha_and_its_bytes_over_beta():
    # all-reduce of 1000 bytes on 4 ranks: 2·3 steps of α, and 2·3/4·1000 = 1500 bytes sent at 1000 B/s
    assert cost.collective_time("all_reduce", 1000, 4, LINK) == pytest.approx(6e-6 + 1.5)
    assert cost.collective_time("all_gather", 1000, 4, LINK) == pytest.approx(3e-6 + 0.75)
    assert cost.collective_time("send", 1000, 2, LINK) == pytest.approx(1e-6 + 1.0)
    assert cost.collective_time("all_reduce", 1000, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        cost.collective_time("gather", 10, 2, LINK)


def test_training_costs_six_flops_per_parameter_and_token_plus_attention():
    psi = LLAMA3_8B.num_params()
    assert cost.training_flops_per_token(LLAMA3_8B, 8192) == 6 * psi + 12 * 32 * 4096 * 8192
    # attention is a fifth of the work at 8192 tokens for 8B: why long sequences cost more than 6Ψ says
    share = 12 * 32 * 4096 * 8192 / cost.training_flops_per_token(LLAMA3_8B, 8192)
    assert share == pytest.approx(0.211, abs=1e-3)


def test_full_recomputation_adds_a_forward_and_selective_only_attentions_scores():
    full = cost.recompute_flops_per_token(TINY, 16, "full")
    selective = cost.recompute_flops_per_token(TINY, 16, "selective")
    assert cost.recompute_flops_per_token(TINY, 16, False) == 0.0
    assert selective == 4 * TINY.n_layers * TINY.dim * 16 < full
    with pytest.raises(ValueError, match="recompute must be 'none', 'selective' or 'full', got 'some'"):
        cost.recompute_mode("some")


def test_one_device_computing_alone_reaches_its_efficiency_as_mfu():
    """MFU counts attention's FLOPs whole (PaLM's convention); a causal kernel (the GPU sheets) runs
    half of them, so alone on one device its MFU passes the matmuls' efficiency by exactly that share;
    a device that computes every score (this machine's calibration) reaches it."""
    import dataclasses

    t = cost.step_time(TINY, 8, 16, device=cost.H100)
    assert t.tp_s == t.pp_s == t.dp_s == t.bubble_s == 0.0
    assert t.step_s == pytest.approx(t.compute_s)
    whole = cost.training_flops_per_token(TINY, 16)
    run = whole - 6 * TINY.n_layers * TINY.dim * 16  # half of 12·L·D·S skipped
    assert t.mfu == pytest.approx(cost.H100.efficiency * whole / run)
    every = cost.step_time(TINY, 8, 16, device=dataclasses.replace(cost.H100, causal_skip=False))
    assert every.mfu == pytest.approx(cost.H100.efficiency) and every.compute_s > t.compute_s
    assert not cost.device_from_calibration({"flops_per_s": 1e11, "alpha_s": 1e-4,
                                             "bytes_per_s": 1e9}).causal_skip


def test_ddp_all_reduce_hides_behind_backward_and_tensor_parallel_never_does():
    hidden = cost.step_time(TINY, 8, 16, dp=2, device=CPU)
    exposed = cost.step_time(TINY, 8, 16, dp=2, device=CPU, overlap=False)
    assert hidden.dp_exposed_s == pytest.approx(max(0.0, hidden.dp_s - 2 / 3 * hidden.compute_s))
    assert exposed.dp_exposed_s == exposed.dp_s and exposed.step_s > hidden.step_s
    tp = cost.step_time(TINY, 8, 16, tp=2, device=CPU)
    assert tp.step_s == pytest.approx(tp.compute_s + tp.tp_s)  # all of g and f on the critical path


def test_the_pipeline_bubble_is_the_compute_times_p_minus_1_over_m():
    t = cost.step_time(TINY, 8, 16, pp=4, microbatches=8, device=CPU)
    assert t.bubble_s == pytest.approx(t.compute_s * 3 / 8)


def test_tp_stays_on_the_fast_link_and_dp_crosses_machines_once_the_layout_spans_them():
    links = cost.links_of_layout(dp=2, pp=2, tp=2, device=CPU)  # 4 GPUs per machine, 8 ranks
    assert links["tp"] is CPU.intra and links["pp"] is CPU.intra and links["dp"] is CPU.inter


def test_full_recomputation_repeats_forwards_two_all_reduces_per_block():
    plain = cost.tp_block_bytes(2, 16, 64, 2)
    assert cost.tp_block_bytes(2, 16, 64, 2, recompute=True) == pytest.approx(1.5 * plain)  # 6 instead of 4
    assert cost.tp_block_bytes(2, 16, 64, 2, recompute="selective") == plain  # no extra messages
    sp = cost.tp_block_bytes(2, 16, 64, 2, sequence_parallel=True)
    assert cost.tp_block_bytes(2, 16, 64, 2, True, recompute="full") == pytest.approx(
        sp + cost.tp_region_bytes(2, 16, 64, 2, True))


def test_llama3_70b_tensor_parallel_bytes_grow_from_567_to_847_gib_with_full_recomputation():
    none = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192)["bytes_per_step"]["tp"]
    full = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, recompute=True)["bytes_per_step"]["tp"]
    assert none / MIB == pytest.approx(580_614, abs=1)  # about 567 GiB
    assert full / GIB == pytest.approx(847.0, abs=0.1)  # "about 850": the blocks, not the embedding, again
    assert full - none == pytest.approx(20 * 32 * cost.collective_sent_bytes("all_reduce", 2 * 8192 * 8192 * 2, 8))


def test_llama3_70b_fits_64_gpus_of_80_gib_with_sequence_parallel_and_no_recomputation():
    row = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    assert row["memory_total"] / GIB == pytest.approx(66.5, abs=0.1)  # about 21 GiB states + 45 activations
    # GPT-3's count (Korthikanti et al.) says 21 GiB of activations: a LLaMA block, its gathered inputs kept, twice that
    gpt3 = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True, activations="gpt3")
    assert gpt3["memory_total"] / GIB == pytest.approx(42.4, abs=0.1)
    rows = plan.plan(LLAMA3_70B, 64, 80, sequence_parallel=True)
    assert rows and all(r["fits"] and r["recompute"] == "none" for r in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)  # fastest first
    assert all(0 < r["mfu"] < cost.H100.efficiency for r in rows)
    assert plan.plan(LLAMA3_70B, 64, 80) == []  # without it, nothing fits (chapter 10)


def test_korthikanti_activations_per_block():
    s, b, d, h = 8192, 1, 8192, 64
    assert cost.block_activation_bytes(LLAMA3_70B, b, s, 8) == s * b * d * (10 + 24 / 8)
    assert cost.block_activation_bytes(LLAMA3_70B, b, s, 8, sequence_parallel=True) == s * b * d * 34 / 8
    assert cost.block_activation_bytes(LLAMA3_70B, b, s, 8, flash_attention=False) == pytest.approx(
        s * b * d * (10 + 24 / 8) + 5 * h * s * s * b / 8)
    assert cost.block_activation_bytes(LLAMA3_70B, b, s, 8, flash_attention=False, recompute="selective") == \
        s * b * d * (10 + 24 / 8)
    assert cost.block_activation_bytes(LLAMA3_70B, b, s, 8, recompute="full") == 2 * s * b * d
    assert cost.block_activation_bytes(LLAMA3_70B, b, s, 8, True, recompute="full") == 2 * s * b * d / 8


# -- this machine: a fixture calibration, never the stored one -----------------------------------------
FIXTURE = {"name": "fixture", "flops_per_s": 5e10, "alpha_s": 5e-5, "bytes_per_s": 1e9, "cores": 2,
           "step_overhead_s": 0.01}


@pytest.fixture
def calibration(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(FIXTURE))
    monkeypatch.setenv("MINITP_CALIBRATION", str(path))
    return path


def test_this_machine_is_read_from_the_calibration_the_environment_names(calibration):
    device = calibrate.this_machine()
    assert device.flops_per_s == 5e10 and device.intra.alpha_s == 5e-5 and device.inter.bytes_per_s == 1e9
    assert calibrate.calibration_path() == str(calibration)


def test_no_or_broken_calibration_reads_as_none(tmp_path, monkeypatch):
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "absent.json"))
    assert calibrate.this_machine() is None
    (tmp_path / "bad.json").write_text('{"flops_per_s": "fast"}')
    assert calibrate.load_calibration(str(tmp_path / "bad.json")) is None


def test_minitp_train_prints_its_measured_step_beside_the_predicted_one(calibration, tmp_path, monkeypatch):
    from minitp import trainer
    from minitp.runs import training

    s = trainer.Settings(dp=2)
    results = [{"seconds": [0.5, 0.3, 0.21, 0.20, 0.22]}, {"seconds": [0.5, 0.3, 0.20, 0.23, 0.20]}]
    predicted = training.predicted_step_s(s, calibrate.this_machine())
    assert predicted == cost.step_time(s.config, 16, 128, 2, device=calibrate.this_machine(),
                                       precision="fp32").step_s
    # the slower rank's step, after the first two: 0.21, 0.23, 0.22
    assert training.measured_and_predicted(s, results) == (
        f"step: measured 220 ms (median of 3 steps after 2), predicted {predicted * 1e3:.0f} ms "
        f"(minitp.cost.step_time on this machine's calibration): {0.22 / predicted:.2f}x")
    assert training.measured_and_predicted(s, [{"seconds": [0.5, 0.3]}]) is None  # nothing warm yet
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "none.json"))
    assert training.measured_and_predicted(s, results) is None  # nothing to predict with


def test_ranks_beyond_the_cores_share_them(calibration):
    device = calibrate.this_machine()
    assert cost.compute_time(1e9, device, ranks_on_machine=4) == pytest.approx(2 * cost.compute_time(1e9, device))


def test_a_run_report_carries_the_predicted_step_from_the_calibration(calibration, monkeypatch):
    from minitp.runs.common import predicted_step_s

    train = TrainConfig(steps=2, batch_size=8, seq_len=16)
    predicted, note = predicted_step_s("ddp", {"dp": 2, "tp": 1, "pp": 1}, TINY, train, {"num_buckets": 3})
    want = cost.step_time(TINY, 8, 16, dp=2, device=calibrate.this_machine(), precision="fp32", buckets=3).step_s
    assert note is None and predicted == pytest.approx(want)
    assert predicted_step_s("swiglu", {"dp": 1, "tp": 2, "pp": 1}, TINY, train, {})[0] is None
    monkeypatch.setenv("MINITP_CALIBRATION", "/nonexistent/calibration.json")
    predicted, note = predicted_step_s("ddp", {"dp": 2, "tp": 1, "pp": 1}, TINY, train, {})
    assert predicted is None and "minitp calibrate" in note


# -- numbers the chapters state ------------------------------------------------------------------------
def test_llama3_8b_grouped_query_attention_shapes_and_kv_cache():
    assert cost.attention_weight_shapes(LLAMA3_8B) == {"wq": (4096, 4096), "wk": (4096, 1024),
                                                       "wv": (4096, 1024), "wo": (4096, 4096)}
    assert cost.attention_weight_shapes(LLAMA3_8B, 8)["wk"] == (4096, 128)  # one KV head per rank
    with pytest.raises(ValueError, match="n_kv_heads=8 is not divisible by tp=16"):
        cost.attention_weight_shapes(LLAMA3_8B, 16)
    assert cost.kv_cache_bytes(LLAMA3_8B, 1) == 128 * 2**10  # 128 KiB per token in bf16
    assert cost.kv_cache_bytes(LLAMA3_8B, 8192) == GIB  # 1 GiB per sequence of 8192
    assert cost.kv_cache_bytes(LLAMA3_8B.with_(n_kv_heads=None), 8192) == 4 * GIB  # without GQA: 4x


def test_chapter_06_llama3_70b_tensor_parallel_sends_71_and_89_times_pipeline_and_data_parallel():
    b = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192)["bytes_per_step"]
    assert round(b["tp"] / b["pp"]) == 71 and round(b["tp"] / b["dp"]) == 89


def test_chapter_02_zero_1_in_bf16_sends_one_and_a_half_times_a_bf16_ddp_all_reduce():
    psi = LLAMA3_8B.num_params()
    ddp_bf16 = cost.ddp_step_bytes(psi, 8, grad_bytes=2)
    root = 2 * LLAMA3_8B.vocab_size * LLAMA3_8B.dim + LLAMA3_8B.dim
    units = [root] + [(psi - root) // 32] * 32
    zero1 = cost.fsdp_step_bytes(units, 8, zero=1, param_bytes=2, reduce_bytes=4)  # fp32 reduce-scatter
    assert round(ddp_bf16 / 1e9, 1) == 28.1 and round(zero1 / 1e9, 1) == 42.2
    assert zero1 / ddp_bf16 == pytest.approx(1.5)
    assert cost.fsdp_step_bytes(units, 8, zero=1, param_bytes=2, reduce_bytes=2) == pytest.approx(ddp_bf16)


def test_chapter_02_zero_3_messages_hide_inside_a_machine_and_not_across():
    import dataclasses

    inside = cost.step_time(LLAMA3_8B, 8, 8192, dp=8, data_parallel="fsdp", zero=3)
    across = cost.step_time(LLAMA3_8B, 8, 8192, dp=8, data_parallel="fsdp", zero=3,
                            device=dataclasses.replace(cost.H100, gpus_per_node=1))
    assert round(inside.compute_s, 2) == 0.75 and round(inside.dp_s, 2) == 0.12 and inside.dp_exposed_s == 0
    assert round(across.dp_s, 2) == 1.09 and round(across.dp_exposed_s, 2) == 0.34
    assert round(inside.mfu, 2) == 0.67  # above the 0.6 the matmuls reach: attention counted whole, run half


def test_chapter_10_sequence_parallel_against_full_recomputation_at_70b():
    sp = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    full = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, recompute=True)
    assert (round(sp["step_s"], 1), round(full["step_s"], 1)) == (8.6, 11.6)
    assert (round(sp["mfu"], 2), round(full["mfu"], 2)) == (0.47, 0.35)
    assert len(plan.plan(LLAMA3_70B, 64, 80, recompute=True)) == 18
    fit = {formula: len(plan.plan(LLAMA3_70B, 64, 80, sequence_parallel=True, activations=formula))
           for formula in ("llama", "llama-regather", "gpt3")}
    assert fit == {"llama": 3, "llama-regather": 5, "gpt3": 6}


def test_context_and_expert_parallel_runs_are_predicted_with_their_messages(calibration):
    from minitp.runs.common import predicted_step_s

    train = TrainConfig(steps=2, batch_size=8, seq_len=16)
    predicted, note = predicted_step_s("cp", {"dp": 1, "tp": 1, "pp": 1, "cp": 2}, TINY, train, {})
    want = cost.step_time(TINY, 8, 16, device=calibrate.this_machine(), precision="fp32", cp=2)
    assert note is None and predicted == pytest.approx(want.step_s) and want.cp_s > 0
    # minitp run ep --nprocs 2: the MoE of the tiny preset, experts over both ranks; per step and MoE layer
    # 4 all-to-alls (dispatch, combine, their gradients) of k·T·(ep-1)/ep rows of D fp32 values, T = 8/2·16
    details = {"experts": 8, "top_k": 2, "capacity_factor": 1.25}
    predicted, note = predicted_step_s("ep", {"dp": 2, "tp": 1, "pp": 1, "ep": 2}, TINY, train, details)
    moe = moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25)
    want = cost.step_time(moe, 8, 16, dp=2, device=calibrate.this_machine(), precision="fp32", ep=2)
    link = calibrate.this_machine().intra
    a2a_bytes = TINY.n_layers * 4 * (2 * 8 // 2 * 16 * 1 / 2) * TINY.dim * 4
    # and the dispatch's counts, a fifth all-to-all per layer: its α counted (the bytes leave it out)
    assert want.ep_s == pytest.approx(TINY.n_layers * 5 * link.alpha_s + a2a_bytes / link.bytes_per_s)
    assert note is None and predicted == pytest.approx(want.step_s)
    # against every expert on both ranks: the same compute, the all-to-alls added, the experts' gradients
    # no longer all-reduced (each has one copy)
    whole = cost.step_time(moe, 8, 16, dp=2, device=calibrate.this_machine(), precision="fp32")
    assert whole.ep_s == 0 and want.compute_s == whole.compute_s and want.dp_s < whole.dp_s
    assert want.step_s == pytest.approx(whole.step_s - whole.dp_exposed_s + want.dp_exposed_s + want.ep_s)


def test_with_no_core_to_spare_nothing_overlaps_on_a_cpu():
    import dataclasses

    spare = dataclasses.replace(CPU, cores=4)  # 2 ranks on 4 cores: gloo has cores of its own
    busy = dataclasses.replace(CPU, cores=2)  # 2 ranks on 2 cores: the compute's cores move the bytes
    hidden = cost.step_time(TINY, 8, 16, dp=2, device=spare)
    exposed = cost.step_time(TINY, 8, 16, dp=2, device=busy)
    assert hidden.dp_exposed_s == pytest.approx(max(0.0, hidden.dp_s - 2 / 3 * hidden.compute_s))
    assert hidden.dp_exposed_s < hidden.dp_s
    assert exposed.dp_exposed_s == exposed.dp_s == hidden.dp_s
    assert exposed.step_s == pytest.approx(cost.step_time(TINY, 8, 16, dp=2, device=spare, overlap=False).step_s)


def test_minitp_run_reports_its_predicted_step_next_to_the_measured_one(calibration):
    from minitp import runs

    report = runs.run_ddp(nproc=2, steps=2)
    assert report.predicted_step_s == pytest.approx(cost.step_time(
        TINY, 8, 16, dp=2, device=calibrate.this_machine(), precision="fp32", buckets=report["num_buckets"]).step_s)
    assert "predicted" in report.format() and report.to_dict()["predicted_step_s"] == report.predicted_step_s


def test_chapter_06_arithmetic_intensity_and_the_overlap_budget_of_a_70b_block():
    # a (m, k) @ (k, n) matmul in bf16: 2mkn FLOPs over (mk + kn + mn)·2 bytes
    one_token = 2 * 8192 * 3584 / ((8192 + 8192 * 3584 + 3584) * 2)
    assert cost.arithmetic_intensity(1, 8192, 3584) == pytest.approx(one_token)
    assert round(cost.arithmetic_intensity(8192, 8192, 3584), 1) == 1911.5
    assert cost.arithmetic_intensity(4096, 4096, 4096) == pytest.approx(4096 / 3)  # square: n/3 in bf16
    per_block = (LLAMA3_70B.num_params() - 2 * LLAMA3_70B.vocab_size * 8192 - 8192) // 80
    flops = 2 * per_block / 8 * 8192 + 4 * 8192 * 8192 * 8192 / 8
    t = cost.compute_time(flops, cost.H100)
    assert t == pytest.approx(flops / (989e12 * 0.6)) and round(t * 1e3, 1) == 3.4
    assert cost.overlap_budget_bytes(t, cost.H100.intra) == pytest.approx(t * 450e9)
    sent = cost.tp_block_bytes(1, 8192, 8192, 8, dtype_bytes=2) / 2  # forward: 2 all-reduces of (S, D) bf16
    assert sent == pytest.approx(2 * 2 * 7 / 8 * 8192 * 8192 * 2)
    assert round(sent / cost.overlap_budget_bytes(t, cost.H100.intra), 2) == 0.31
    assert round(sent / cost.overlap_budget_bytes(t, cost.H100.inter), 2) == 2.75


# -- the hardware sheet: one place for a GPU's figures, and the chapters that quote it -------------------------
def test_the_hardware_sheet_holds_each_gpus_datasheet_figures_per_direction():
    for device in cost.DEVICES.values():
        figures = (device.flops_per_s, device.memory_bytes, device.memory_bytes_per_s, device.intra.bytes_per_s,
                   device.inter.bytes_per_s, device.intra.alpha_s, device.inter.alpha_s)
        assert all(f > 0 for f in figures), device.name
        assert device.memory_bytes == 80 * GIB  # the datasheets' "80GB": five stacks of 16 GiB
    h100, a100 = cost.DEVICES["h100"], cost.DEVICES["a100"]
    assert h100 is cost.H100 and a100 is cost.A100
    assert (h100.flops_per_s, h100.memory_bytes_per_s) == (989e12, 3.35e12)  # dense BF16; HBM3
    assert (a100.flops_per_s, a100.memory_bytes_per_s) == (312e12, 2.039e12)  # dense BF16; HBM2e
    # links per direction: NVLink's 900 / 600 GB/s are both ways together; InfiniBand's NICs in bits
    assert (h100.intra.bytes_per_s, h100.inter.bytes_per_s) == (900e9 / 2, 400e9 / 8) == (450e9, 50e9)
    assert (a100.intra.bytes_per_s, a100.inter.bytes_per_s) == (600e9 / 2, 200e9 / 8) == (300e9, 25e9)
    # compute-bound above 295 FLOPs per byte on an H100 (chapter 06's ridge)
    assert round(h100.flops_per_s / h100.memory_bytes_per_s) == 295


def test_the_planner_times_its_layouts_on_the_sheets_h100():
    row = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    assert row["device"] == cost.H100.name
    assert row["step_s"] == cost.step_time(LLAMA3_70B, 64, 8192, 2, 8, 4, cost.H100, row["microbatches"], "fsdp", 1,
                                           sequence_parallel=True).step_s
    slower = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True, device=cost.A100)
    assert slower["device"] == cost.A100.name and slower["step_s"] > 2 * row["step_s"]


CHAPTERS = ("00_collectives", "01_ddp", "02_fsdp", "03_tensor_parallel", "04_swiglu_attention", "05_pipeline", "06_3d",
            "07_context_parallel", "08_expert_parallel", "09_capstone", "10_planning", "11_overlap",
            "12_memory")
RATE = r"(\d[\d,]*(?:\.\d+)?)\s*(TFLOP/s|TB/s|GB/s|Gb/s)"


def _chapter_text(name: str) -> str:
    """A chapter's sources and stored text outputs, as one string."""
    from pathlib import Path

    notebook = json.loads((Path(__file__).parent.parent / "notebooks" / f"{name}.ipynb").read_text())
    parts = []
    for cell in notebook["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def _figures_off_the_sheet(text: str) -> list[str]:
    """Every hardware figure in ``text`` that no device of the sheet has, and every "80 GB" (decimal)
    said of a GPU's memory, which the sheet holds as 80 GiB (quoted, "80GB" is the datasheet's name)."""
    import re

    sheet = {"TFLOP/s": set(), "TB/s": set(), "GB/s": set(), "Gb/s": set()}
    for d in cost.DEVICES.values():
        sheet["TFLOP/s"].add(d.flops_per_s / 1e12)
        sheet["TB/s"].add(d.memory_bytes_per_s / 1e12)
        for link in (d.intra, d.inter, *([d.host_link] if d.host_link else [])):  # PCIe too
            sheet["GB/s"].add(link.bytes_per_s / 1e9)
            sheet["Gb/s"].add(link.bytes_per_s * 8 / 1e9)
    wrong = [f"{value} {unit}" for value, unit in re.findall(RATE, text)
             if not any(abs(float(value.replace(",", "")) - v) < 1e-9 for v in sheet[unit])]
    return wrong + re.findall(r'(?<!")\b80\s?GB\b(?!/)', text) + re.findall(r"\b80e9\b", text)


def test_the_checker_of_hardware_figures_catches_a_drifted_figure():
    assert _figures_off_the_sheet("NVLink 450 GB/s, InfiniBand 400 Gb/s = 50 GB/s, 989 TFLOP/s, 3.35 TB/s") == []
    assert _figures_off_the_sheet('its "80GB" is 80 GiB') == []
    assert _figures_off_the_sheet("NVLink 400 GB/s; 200 GB/s") == ["400 GB/s", "200 GB/s"]
    assert _figures_off_the_sheet("a GPU of 80 GB, hbm = 80e9") == ["80 GB", "80e9"]


ASSUMED = {"09_capstone": ["100 GB/s", "2 TB/s", "100 GB/s"]}  # a file system's rate, assumed; Llama 3's, quoted


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapters_quote_only_the_hardware_sheets_figures(chapter):
    assert _figures_off_the_sheet(_chapter_text(chapter)) == ASSUMED.get(chapter, [])
    if chapter in ASSUMED:
        assert "an assumption" in _chapter_text(chapter)


def test_chapter_01_ddp_traffic_on_nvlink_and_infiniband():
    psi = LLAMA3_8B.num_params()
    for n, link, seconds in ((8, cost.H100.intra, 0.06), (64, cost.H100.inter, 0.63)):
        assert cost.links_of_layout(n, 1, 1, cost.H100)["dp"] is link
        sent = cost.ddp_step_bytes(psi, n, grad_bytes=2)
        assert round(cost.collective_time("all_reduce", sent / (2 * (n - 1) / n), n, link), 2) == seconds
    assert round(cost.H100.memory_bytes / 1e9, 1) == 85.9  # 80 GiB


def _llama_block_listed_bytes(cfg, seq: int, tp: int) -> float:
    """minitp's block at ``cfg``'s shapes, tensor by tensor in bf16, without the scores and causal mask
    (FlashAttention keeps neither): chapters 02, 04 and 06."""
    scores = cfg.n_heads // tp * seq * seq * 2 + seq * seq
    return cost.tiny_block_activation_bytes(cfg, 1, seq, tp=tp, dtype_bytes=2) - scores


def test_a_llama_block_keeps_more_than_gpt3s_count_27_percent_at_tp_8():
    for cfg, tp, more in ((LLAMA3_70B, 8, 0.27), (LLAMA3_8B, 8, 0.27), (LLAMA3_8B, 1, 0.41)):
        gpt3 = cost.block_activation_bytes(cfg, 1, 8192, tp=tp)
        assert round(_llama_block_listed_bytes(cfg, 8192, tp) / gpt3 - 1, 2) == more
    # at tp = 1, per token and dimension in bytes: 48 against 34 (chapter 04)
    d = LLAMA3_8B.dim
    assert round(_llama_block_listed_bytes(LLAMA3_8B, 8192, 1) / (8192 * d), 2) == 48.0
    assert round(8 * LLAMA3_8B.ffn_hidden / d) == 28  # SwiGLU's 4F values of 2 bytes
    assert round(_llama_block_listed_bytes(LLAMA3_70B, 8192, 8) / GIB, 3) == 1.031  # against 0.8125 GiB


def test_chapter_02_one_8k_sequence_per_gpu_leaves_zero_1_no_room_and_zero_3_plenty():
    psi, hbm, seq = LLAMA3_8B.num_params(), cost.H100.memory_bytes, 8192
    gpt3 = cost.activation_bytes_per_rank(LLAMA3_8B, 1, seq, tp=1, pp=1, stage=0, microbatches=1)
    listed = LLAMA3_8B.n_layers * _llama_block_listed_bytes(LLAMA3_8B, seq, 1)
    recomputed = cost.activation_bytes_per_rank(LLAMA3_8B, 1, seq, 1, 1, 0, 1, recompute="full")
    logits = seq * LLAMA3_8B.vocab_size * 4
    assert [round(x / 1e9, 1) for x in (gpt3, listed, recomputed, logits)] == [36.5, 51.5, 2.1, 4.2]
    left = {z: [round((hbm - cost.total_memory(cost.memory_per_rank(psi, 8, zero=z, precision="bf16")) - a - logits)
                      / 1e9, 1) for a in (gpt3, listed, recomputed)] for z in (1, 2, 3)}
    assert left == {1: [1.0, -14.0, 35.4], 2: [15.1, 0.0, 49.4], 3: [29.1, 14.1, 63.5]}


def test_chapter_06_tensor_parallels_1_54_s_are_1_35_s_of_bandwidth_and_0_19_s_of_alpha():
    row = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    bandwidth = row["bytes_per_step"]["tp"] / cost.H100.intra.bytes_per_s
    steps = row["microbatches"] * (4 * 20 + 3) * 2 * (8 - 1)  # 32 micro-batches, 20 blocks a stage
    assert (round(bandwidth, 2), steps, round(steps * cost.H100.intra.alpha_s, 2)) == (1.35, 37_184, 0.19)
    assert row["time"]["tp_s"] == pytest.approx(bandwidth + steps * cost.H100.intra.alpha_s)
    assert round(row["time"]["tp_s"], 2) == 1.54 and round(row["bytes_per_step"]["tp"] / 1e9) == 609
    assert round(row["bytes_per_step"]["tp"] / cost.H100.inter.bytes_per_s, 1) == 12.2  # over InfiniBand


def test_chapter_10_quotes_the_readmes_calibration_figures():
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    said = re.search(r"medians were DDP (\S+) ms against (\d+) predicted,\s+tensor parallel (\S+) against (\d+), "
                     r"FSDP (\S+) against (\d+) and the pipeline (\S+) against (\d+)", readme)
    chapter = re.search(r"predicted tensor parallel (\d+) ms against (\S+) measured", _chapter_text("10_planning"))
    assert said and chapter
    # tensor parallel, the one the chapter quotes: the same measured median and the same prediction
    assert (said.group(3), said.group(4)) == (chapter.group(2), chapter.group(1))


# -- the fixed costs of this machine: per step, per micro-batch, per small operation; ranks beyond the cores --
FREE = cost.Device("fixed costs only", flops_per_s=1e30, intra=LINK, inter=LINK, gpus_per_node=8,
                   overhead_s=0.004, microbatch_overhead_s=0.003, op_s=3e-6)  # FLOPs take no time here


def test_a_pipeline_pays_the_forward_backward_fixed_cost_per_micro_batch_and_the_optimizers_once():
    one = cost.step_time(TINY, 8, 16, device=FREE)
    assert one.compute_s == pytest.approx(0.004 + 0.003)
    # 2 stages of 8 micro-batches: each stage runs half the model, 8 forward+backward passes and one step
    piped = cost.step_time(TINY, 8, 16, pp=2, microbatches=8, device=FREE)
    assert piped.compute_s == pytest.approx((8 * 0.003 + 0.004) / 2)
    assert piped.bubble_s == pytest.approx(piped.compute_s / 8)


def test_each_activation_element_a_rank_works_through_costs_element_s_on_its_share_of_tokens_and_width():
    from minitp.trainer import BYTE

    priced = cost.Device("elements only", flops_per_s=1e30, intra=LINK, inter=LINK, element_s=2e-9)
    # per token: each block's D and its F/tp (+ H/tp·S scores when attention is written out), and V/tp
    assert cost.activation_elements(BYTE, 1024, 128) == 1024 * (4 * (128 + 384) + 256)
    assert cost.activation_elements(TINY, 128, 16, tp=2, pp=2) == 128 * (2 * (64 + (128 + 8 * 16) / 2) + 64)
    for layout in [dict(dp=2), dict(tp=2), dict(pp=2, microbatches=4)]:
        t = cost.step_time(BYTE, 16, 128, device=priced, **layout)
        dp, tp, pp = (layout.get(k, 1) for k in ("dp", "tp", "pp"))
        assert t.compute_s == pytest.approx(2e-9 * cost.activation_elements(BYTE, 16 * 128 / dp, 128, tp, pp))
    assert cost.step_time(BYTE, 16, 128, dp=2, device=FREE).compute_s == pytest.approx(0.004 + 0.003)  # none


def test_a_calibration_from_before_the_micro_batch_cost_charges_its_overhead_per_micro_batch():
    old = cost.device_from_calibration(FIXTURE)  # step_overhead_s only, as minitp calibrate stored it then
    assert (old.overhead_s, old.microbatch_overhead_s, old.op_s, old.shared_link) == (0.0, 0.01, 0.0, None)
    new = cost.device_from_calibration({**FIXTURE, "microbatch_overhead_s": 0.003, "op_s": 3e-6,
                                        "alpha_shared_s": 8e-5, "bytes_per_s_shared": 5e8, "shared_slowdown": 1.8})
    assert (new.overhead_s, new.microbatch_overhead_s, new.op_s) == (0.01, 0.003, 3e-6)
    assert (new.shared_link.alpha_s, new.shared_link.bytes_per_s, new.shared_slowdown) == (8e-5, 5e8, 1.8)


def test_ring_attention_adds_operations_per_piece_of_work_and_per_ring_step():
    from minitp.cost.time import RING_OPS, strategy_ops

    piece, masked, step, block = RING_OPS["piece"], RING_OPS["masked_piece"], RING_OPS["step"], RING_OPS["block"]
    # seq 16 on 2 ranks, load-balanced: rank 0 holds chunks 0 and 3 (of 4 positions). Against its own:
    # (0,0) and (3,3) masked, (3,0) whole, (0,3) nothing; against rank 1's chunks 1 and 2: (3,1), (3,2) whole
    assert strategy_ops(TINY, 16, cp=2) == TINY.n_layers * (3 * piece + 2 * masked + 2 * step + block)
    # contiguous halves: rank 1's queries see all of rank 0's keys and a masked diagonal of its own
    assert strategy_ops(TINY, 16, cp=2, balanced=False) == TINY.n_layers * (piece + masked + 2 * step + block)
    assert strategy_ops(TINY, 16) == 0  # the plain model: nothing added
    # a diagonal pair longer than a tile is cut in four: two masked quarters, one whole, one skipped
    from minitp.cost.time import _pieces
    assert _pieces(range(0, 128), range(0, 128)) == (1, 2) and _pieces(range(0, 64), range(0, 64)) == (0, 1)


def test_a_moe_adds_its_routing_each_local_experts_work_and_with_ep_the_dispatch():
    from minitp.cost.time import MOE_OPS, strategy_ops

    moe = moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25)
    routing, expert, dispatch = MOE_OPS["routing"], MOE_OPS["expert"], MOE_OPS["dispatch"]
    assert strategy_ops(moe, 16) == TINY.n_layers * (routing + 8 * expert)
    assert strategy_ops(moe, 16, ep=2) == TINY.n_layers * (routing + 4 * expert + dispatch)
    assert strategy_ops(moe, 16, ep=4) == TINY.n_layers * (routing + 2 * expert + dispatch)


def test_the_added_operations_cost_op_s_each_on_the_stages_share_and_nothing_on_a_gpu():
    from minitp.cost.time import strategy_ops

    plain = cost.step_time(TINY, 8, 16, cp=2, device=FREE)
    assert plain.ops_s == pytest.approx(strategy_ops(TINY, 16, cp=2) * 3e-6)
    assert plain.compute_s == pytest.approx(0.004 + 0.003 + plain.ops_s)
    moe = moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25)
    piped = cost.step_time(moe, 8, 16, pp=2, microbatches=4, device=FREE)
    assert piped.ops_s == pytest.approx(4 * strategy_ops(moe, 16) * 3e-6 / 2)
    assert cost.step_time(moe, 8, 16, dp=2, ep=2, device=cost.H100).ops_s == 0.0  # op_s 0: hidden launches


def test_ring_attentions_and_a_moes_operations_cost_what_calibrate_measured_for_each():
    import dataclasses

    from minitp.cost.time import moe_ops, ring_ops, strategy_ops

    measured = dataclasses.replace(FREE, cp_op_s=6e-6, ep_op_s=7e-6)
    ring = cost.step_time(TINY, 8, 16, cp=2, device=measured)
    assert ring.ops_s == pytest.approx(ring_ops(TINY, 16, 2) * 6e-6)
    moe = moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25)
    assert cost.step_time(moe, 8, 16, dp=2, ep=2, device=measured).ops_s == pytest.approx(moe_ops(moe, 2) * 7e-6)
    both = cost.step_time(moe, 8, 16, cp=2, ep=2, device=measured)  # each part at its own cost
    assert both.ops_s == pytest.approx(ring_ops(moe, 16, 2) * 6e-6 + moe_ops(moe, 2) * 7e-6)
    assert strategy_ops(moe, 16, cp=2, ep=2) == ring_ops(moe, 16, 2) + moe_ops(moe, 2)
    assert moe_ops(TINY) == 0 and ring_ops(TINY, 16) == 0  # a dense model, one rank: nothing added


SHARED = cost.Link("4 ranks on 2 cores", alpha_s=3e-6, bytes_per_s=500.0)


def test_ranks_beyond_the_cores_slow_compute_and_messages_as_calibrate_measured_them():
    import dataclasses

    from minitp.cost.time import _shared_cores, link_on_machine

    even = dataclasses.replace(CPU, cores=2)
    assert [_shared_cores(even, r) for r in (1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 4.0]  # ranks/cores
    measured = dataclasses.replace(CPU, cores=2, shared_slowdown=1.8, shared_link=SHARED)
    assert [_shared_cores(measured, r) for r in (2, 3, 4, 6)] == pytest.approx([1.0, 1.4, 1.8, 2.6])
    # α and 1/β on the line through the figures at a core per rank and at twice as many ranks as cores
    assert link_on_machine(LINK, measured, 2) is LINK and link_on_machine(LINK, even, 8) is LINK
    at4, at6 = link_on_machine(LINK, measured, 4), link_on_machine(LINK, measured, 6)
    assert (at4.alpha_s, at4.bytes_per_s) == (pytest.approx(3e-6), pytest.approx(500.0))
    assert at6.alpha_s == pytest.approx(1e-6 + 2 * 2e-6) and 1 / at6.bytes_per_s == pytest.approx(1e-3 + 2 * 1e-3)
    # DDP on 4 ranks of 2 cores: the all-reduce at the shared link's figures, the compute 1.8x
    t = cost.step_time(TINY, 8, 16, dp=4, device=measured, buckets=1, precision="fp32")
    alone = cost.step_time(TINY, 8, 16, dp=4, device=dataclasses.replace(measured, cores=None), buckets=1,
                           precision="fp32")
    assert t.compute_s == pytest.approx(1.8 * alone.compute_s)
    assert t.dp_s == pytest.approx(cost.collective_time("all_reduce", 4 * TINY.num_params(), 4, SHARED))


def test_a_rank_on_every_core_runs_as_much_slower_as_calibrate_measured_it_busy():
    import dataclasses

    from minitp.cost.time import _shared_cores

    busy = dataclasses.replace(CPU, cores=4, busy_slowdown=1.3, shared_slowdown=1.8)
    # 1 alone, the line up to 1.3 at a rank per core, then 1.3 times the sharing of the cores beyond
    assert [_shared_cores(busy, r) for r in (1, 2, 3, 4, 6, 8)] == pytest.approx(
        [1.0, 1.1, 1.2, 1.3, 1.3 * 1.4, 1.3 * 1.8])
    two = dataclasses.replace(CPU, cores=2, busy_slowdown=1.3)
    t = cost.step_time(TINY, 8, 16, dp=2, device=two, buckets=1, precision="fp32")
    alone = cost.step_time(TINY, 8, 16, dp=2, device=dataclasses.replace(two, busy_slowdown=None), buckets=1,
                           precision="fp32")
    assert t.compute_s == pytest.approx(1.3 * alone.compute_s) and t.dp_s == alone.dp_s  # messages as they were
    assert cost.step_time(TINY, 8, 16, device=two, precision="fp32").compute_s == \
        cost.step_time(TINY, 8, 16, device=dataclasses.replace(two, busy_slowdown=None), precision="fp32").compute_s


def test_all_gathers_and_reduce_scatters_cost_their_measured_factors_of_the_ring_model():
    import dataclasses

    gloo = dataclasses.replace(CPU, gather_factor=1.5, scatter_factor=3.0)
    ring = {name: cost.step_time(TINY, 8, 16, device=CPU, overlap=False, precision="fp32", **layout)
            for name, layout in {"ddp": dict(dp=2), "fsdp": dict(dp=2, data_parallel="fsdp"),
                                 "zero2": dict(dp=2, data_parallel="fsdp", zero=2),
                                 "sp": dict(tp=2, sequence_parallel=True), "tp": dict(tp=2)}.items()}
    priced = {name: cost.step_time(TINY, 8, 16, device=gloo, overlap=False, precision="fp32", **layout)
              for name, layout in {"ddp": dict(dp=2), "fsdp": dict(dp=2, data_parallel="fsdp"),
                                   "zero2": dict(dp=2, data_parallel="fsdp", zero=2),
                                   "sp": dict(tp=2, sequence_parallel=True), "tp": dict(tp=2)}.items()}
    # ZeRO-3: two gathers per reduce-scatter, (2·1.5 + 3)/3 = 2; ZeRO-2: one each, 2.25; sequence parallel's pairs
    assert priced["fsdp"].dp_s == pytest.approx(2.0 * ring["fsdp"].dp_s)
    assert priced["zero2"].dp_s == pytest.approx(2.25 * ring["zero2"].dp_s)
    assert priced["sp"].tp_s == pytest.approx(2.25 * ring["sp"].tp_s)
    # all-reduces are what α and β were fitted to: DDP's and plain tensor parallel's stay
    assert priced["ddp"].dp_s == ring["ddp"].dp_s > 0 and priced["tp"].tp_s == ring["tp"].tp_s > 0
    assert (cost.H100.gather_factor, cost.H100.scatter_factor) == (1.0, 1.0)  # NCCL's rings: the ring model


def test_on_more_than_one_rank_the_collectives_wait_in_proportion_to_the_compute_before_them():
    import dataclasses

    waiting = dataclasses.replace(CPU, wait_per_compute=0.1)
    for layout in [dict(dp=2), dict(tp=2), dict(pp=2, microbatches=4), dict(cp=2)]:
        plain = cost.step_time(TINY, 8, 16, device=CPU, precision="fp32", **layout)
        t = cost.step_time(TINY, 8, 16, device=waiting, precision="fp32", **layout)
        assert t.wait_s == pytest.approx(0.1 * t.compute_s) and t.step_s == pytest.approx(plain.step_s + t.wait_s)
    alone = cost.step_time(TINY, 8, 16, device=waiting, precision="fp32")
    assert alone.wait_s == 0.0  # one rank waits for nobody
    assert cost.H100.wait_per_compute == 0.0  # the GPU sheets: no such waits counted
