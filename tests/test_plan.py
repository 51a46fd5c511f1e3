"""minitp.plan: the layouts of N GPUs that fit, checked against measured runs of the tiny model."""

import pytest

from minitp import cli, plan, runs
from minitp.models import LLAMA3_8B, LLAMA3_70B, get_config
from minitp.viz.explore import plan_explorer

TINY = get_config("tiny")


def test_layouts_are_every_factorisation_of_the_world():
    assert sorted(plan.layouts(8)) == sorted([(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2),
                                              (1, 4, 2), (2, 1, 4), (1, 2, 4), (1, 1, 8)])
    assert all(dp * pp * tp == 12 for dp, pp, tp in plan.layouts(12))


def test_the_tiny_model_takes_the_eight_layouts_whose_tp_divides_its_heads_and_pp_its_blocks():
    rows = plan.plan(TINY, 8, 1.0, batch_size=8, seq_len=16, precision="fp32", data_parallel="ddp")
    got = sorted((r["dp"], r["pp"], r["tp"]) for r in rows)
    assert got == sorted([(8, 1, 1), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4)])


def _measured_layouts():
    rows = plan.plan(TINY, 8, 1.0, batch_size=8, seq_len=16, precision="fp32", data_parallel="ddp")
    return [(r["dp"], r["pp"], r["tp"]) for r in rows]


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("dp,pp,tp", _measured_layouts())
def test_planner_memory_and_bytes_equal_a_measured_run_of_the_tiny_model(dp, pp, tp, data_parallel):
    row = plan.plan_layout(TINY, dp, pp, tp, batch_size=8, seq_len=16, data_parallel=data_parallel,
                           precision="fp32")
    report = runs.run_3d(nproc=8, dp=dp, tp=tp, pp=pp, fsdp=data_parallel == "fsdp", steps=2)
    assert runs.check(report) == []
    measured = max(sum(m.values()) for m in report["memory"])  # the rank that holds the most
    assert measured == pytest.approx(row["memory_states"], rel=1e-9)  # asked: within 2%; it is exact
    for dim in ("tp", "pp", "dp"):
        traced = max(b[dim] for b in report["comm_bytes_traced_per_step_by_dim"])
        assert traced == pytest.approx(row["bytes_per_step"][dim], rel=1e-9, abs=1e-6), dim


def test_llama3_8b_fits_64_gpus_of_80_gib_and_sharding_cuts_the_states():
    rows = plan.plan(LLAMA3_8B, 64, 80)
    assert rows and all(r["fits"] for r in rows)
    assert all(r["tp"] <= 8 for r in rows)  # tensor parallel stays inside a machine
    ddp = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, data_parallel="ddp")
    zero3 = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, data_parallel="fsdp", zero=3)
    assert ddp["memory_states"] == pytest.approx(16 * LLAMA3_8B.num_params() / 8, rel=0.01)  # 16 bytes / param / tp
    assert zero3["memory_states"] == pytest.approx(ddp["memory_states"] / 8, rel=0.01)


def test_llama3_70b_needs_recomputation_on_64_gpus_of_80_gib_without_sequence_parallel():
    assert plan.plan(LLAMA3_70B, 64, 80) == []
    rows = plan.plan(LLAMA3_70B, 64, 80, recompute=True)
    assert rows and all(r["memory_total"] <= 80 * plan.GIB for r in rows)


def test_cli_plan_answers_for_8b_and_70b(capsys):
    assert cli.main(["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b (8.03 B parameters) on 64 GPUs of 80 GiB" in out and " yes" in out
    assert cli.main(["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu-memory", "80"]) == 1
    assert "no layout fits" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu-memory", "80", "--recompute"]) == 0
    assert cli.main(["plan", "--model", "custom", "--dim", "128", "--n-layers", "2", "--gpus", "4",
                     "--gpu-memory", "1"]) == 0


def test_plan_refuses_bad_input():
    with pytest.raises(ValueError, match="gpus must be an integer >= 1"):
        plan.plan(TINY, 0, 80)
    with pytest.raises(ValueError, match="activations must be one of 'llama', 'llama-regather', 'gpt3', got 'gpt4'"):
        plan.plan(TINY, 8, 80, activations="gpt4")
    with pytest.raises(ValueError, match="tp=3 does not divide n_heads=8"):
        plan.plan_layout(TINY, 1, 1, 3, 8, 16)


def test_the_static_table_and_the_explorer_show_the_same_layouts():
    rows = plan.plan(LLAMA3_8B, 64, 80)
    table = plan.markdown_table(rows)
    assert len(table.splitlines()) == 2 + len(rows)
    assert f"| {rows[0]['dp']} | {rows[0]['pp']} | {rows[0]['tp']} |" in table
    ui = plan_explorer("llama3-8b", 64, 80)
    assert "llama3-8b: 8.03 B parameters" in ui.shown
    assert plan.format_plan(plan.plan(LLAMA3_8B, 64, 80, seq_len=8192, include_unfit=True)).splitlines()[1] in ui.shown
    assert ui.update(model="llama3-70b", activations="sequence parallel")  # the table follows the controls
    assert "llama3-70b: 70.55 B parameters" in ui.shown and "; 3 of " in ui.shown  # the 3 of chapter 10
    assert ui.update(activations="sequence parallel, gathered again") and "; 5 of " in ui.shown
    assert ui.update(gpus=2) and "; 0 of 3 layouts fit 80 GiB per GPU" in ui.shown  # 70 B on 2 GPUs: none fits


def test_the_planner_explorer_stores_a_static_twin_for_the_website(monkeypatch):
    monkeypatch.delenv("MINITP_LIVE", raising=False)
    ui = plan_explorer("llama3-70b", 64, 80)
    assert [(s["data_parallel"], s["activations"]) for s in ui.grid()] == [
        (dp, a) for dp in ("fsdp", "ddp") for a in plan.ACTIVATIONS]
    twin = ui.build_static()
    assert twin.count('class="mx-panel ') == 8 and "full recomputation" in twin
    assert "; 0 of " in twin and "; 18 of " in twin  # replicated norms: nothing fits; recomputation: 18 layouts


def test_cli_plan_70b_with_sequence_parallel_lists_layouts_with_step_time_and_mfu(capsys, tmp_path):
    args = ["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu-memory", "80", "--sequence-parallel"]
    assert cli.main(args + ["--json", str(tmp_path / "sp.json")]) == 0
    out = capsys.readouterr().out
    assert "step s" in out and "MFU" in out and "no layout fits" not in out
    import json

    rows = json.loads((tmp_path / "sp.json").read_text())["layouts"]
    assert rows and all(r["fits"] and r["recompute"] == "none" for r in rows)
    for key in ("memory", "memory_total", "bytes_per_step", "step_s", "mfu", "time"):
        assert all(key in r for r in rows), key
    assert cli.main(args + ["--recompute", "--json", str(tmp_path / "full.json")]) == 0
    full = {(r["dp"], r["pp"], r["tp"]): r for r in json.loads((tmp_path / "full.json").read_text())["layouts"]}
    for r in rows:  # the same layout sends more over tp: forward's collectives again
        assert full[(r["dp"], r["pp"], r["tp"])]["bytes_per_step"]["tp"] > r["bytes_per_step"]["tp"]
    assert cli.main(args + ["--recompute", "--selective-recompute"]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_selective_recomputation_keeps_the_memory_of_flash_attention_and_full_the_least():
    rows = {mode: plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, recompute=mode, flash_attention=False)
            for mode in ("none", "selective", "full")}
    flash = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192)
    act = {mode: r["memory"]["activations"] for mode, r in rows.items()}
    assert act["none"] > act["selective"] == flash["memory"]["activations"] > act["full"]
    assert rows["none"]["step_s"] < rows["selective"]["step_s"] < rows["full"]["step_s"]


def test_without_a_pipeline_the_replica_batch_is_one_micro_batch_and_with_one_micro_batches_of_one_sequence():
    from minitp import cost

    # chapter 10: 64 sequences of 8192 tokens; dp = 32 replicas of 2 sequences each
    flat = plan.plan_layout(LLAMA3_70B, 32, 1, 2, 64, 8192, recompute=True)
    assert flat["microbatches"] == 1 and flat["bubble_fraction"] == 0.0
    blocks = cost.activation_bytes_per_rank(LLAMA3_70B, 2, 8192, 2, 1, 0, 1, recompute=True, formula="llama")
    # the one stage is the last: its final norm, output layer and loss (not recomputed), one fp32 copy of V/tp logits
    assert flat["memory"]["activations"] == blocks + cost.output_activation_bytes(LLAMA3_70B, 2, 8192, 2)
    assert cost.output_activation_bytes(LLAMA3_70B, 2, 8192, 2) > 2 * 8192 * LLAMA3_70B.vocab_size // 2 * 4
    piped = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    assert piped["microbatches"] == 32  # B/dp micro-batches of micro_batch = 1 sequence
    assert piped["worst_stage"] == 0  # 4 micro-batches in flight, not the last stage's one and its logits
    assert piped["memory"]["activations"] == cost.activation_bytes_per_rank(
        LLAMA3_70B, 1, 8192, 8, 4, piped["worst_stage"], 32, sequence_parallel=True, formula="llama")
    assert piped["activation_formula"] == "llama"


def test_the_planner_reads_the_gpus_figures_from_the_hardware_sheet():
    from minitp import cost

    rows = plan.plan(LLAMA3_70B, 64, cost.H100.memory_bytes / 2**30, seq_len=8192, sequence_parallel=True)
    assert rows == plan.plan(LLAMA3_70B, 64, 80, seq_len=8192, sequence_parallel=True)  # 80 GiB
    assert {r["device"] for r in rows} == {cost.H100.name}
    assert all(r["memory_total"] <= cost.H100.memory_bytes for r in rows)


def test_an_hsdp_row_of_llama3_8b_on_1024_gpus_is_the_hand_computation():
    """dp = 1024 = 128 replicas × 8 shards (pp = tp = 1): a shard group is one machine of 8 GPUs."""
    from minitp import cost

    row = plan.plan_layout(LLAMA3_8B, 1024, 1, 1, 1024, 8192, data_parallel="hsdp")
    assert (row["dp_shard"], row["dp_replicate"], row["zero"]) == (8, 128, 3)  # 8 GPUs per machine // (tp·pp·cp)
    # FSDP's units: the root (embedding, final norm, output layer) and 32 blocks, each a multiple of 8: no padding
    root, block = 2 * 128256 * 4096 + 4096, 218_112_000
    assert root + 32 * block == LLAMA3_8B.num_params() == 8_030_261_248
    # shard group of 8: ZeRO-3 all-gathers bf16 parameters (blocks twice, the root once) and reduce-scatters fp32
    # gradients, each sending 7/8 of the unit
    shard = 7 / 8 * (root * (2 + 4) + 32 * block * (2 * 2 + 4))
    # replicate group of 128: one all-reduce of each unit's fp32 gradient shard, 1/8 of it, 2·127/128 of it sent
    replicate = 2 * 127 / 128 * (root + 32 * block) / 8 * 4
    sent = row["bytes_per_step"]
    assert (sent["dp_shard"], sent["dp_replicate"]) == (pytest.approx(shard), pytest.approx(replicate))
    assert sent["dp"] == pytest.approx(shard + replicate) and round(shard / 2**30, 1) == 50.6
    assert round(replicate / 2**30, 2) == 7.42
    # states: 16 bytes per parameter over the 8 ranks of the shard group, whatever the 128 replicas, and one
    # AdamW step counter per unit
    assert row["memory_states"] == 16 * LLAMA3_8B.num_params() / 8 + 4 * 33
    # time: the shard group on NVLink, 3 rings of 7 steps per unit; the replicas between machines, an all-reduce
    # of 2·127 steps per unit; ZeRO-3's prefetch hides both behind the compute
    nvlink, ib = cost.H100.intra, cost.H100.inter
    dp_s = (33 * 3 * 7 * nvlink.alpha_s + shard / nvlink.bytes_per_s
            + 33 * 2 * 127 * ib.alpha_s + replicate / ib.bytes_per_s)
    assert row["time"]["dp_s"] == pytest.approx(dp_s)
    assert row["time"]["dp_exposed_s"] == max(0.0, dp_s - row["time"]["compute_s"])
    fsdp = plan.plan_layout(LLAMA3_8B, 1024, 1, 1, 1024, 8192)  # ZeRO-3 over all 1024: 128 times less held
    assert fsdp["memory_states"] < row["memory_states"] / 100
    assert fsdp["bytes_per_step"]["dp"] > 7 * replicate  # all of it between machines, against 1/8 of a gradient


def test_hsdp_refuses_a_shard_that_does_not_divide_dp_and_a_shard_without_hsdp():
    with pytest.raises(ValueError, match="dp=1024 is not divisible by dp_shard=3: HSDP splits dp into replicas"):
        plan.plan_layout(LLAMA3_8B, 1024, 1, 1, 1024, 8192, data_parallel="hsdp", dp_shard=3)
    with pytest.raises(ValueError, match="dp_shard=4 is HSDP's shard group; pass data_parallel='hsdp'"):
        plan.plan(LLAMA3_8B, 64, 80, dp_shard=4)
    with pytest.raises(ValueError, match="data_parallel must be one of 'fsdp', 'ddp', 'hsdp', got 'zero3'"):
        plan.plan(LLAMA3_8B, 64, 80, data_parallel="zero3")
    refused = []
    assert plan.plan(LLAMA3_8B, 64, 80, data_parallel="hsdp", dp_shard=3, refused=refused) == []
    assert "is not divisible by dp_shard=3" in plan.why_no_layout(refused, 64, None)


def test_hsdp_shards_inside_a_machine_by_default_and_its_extremes_are_ddp_and_fsdp():
    assert plan.default_dp_shard(128, 1, 2, 1, 8) == 4 and plan.default_dp_shard(12, 1, 1, 1, 8) == 6
    assert plan.default_dp_shard(16, 2, 4, 1, 8) == 1  # tp·pp fills the machine: replicas only
    rows = plan.plan(LLAMA3_8B, 64, 80, data_parallel="hsdp", include_unfit=True)
    assert rows and all(r["dp_shard"] * r["pp"] * r["tp"] <= 8 or r["dp_shard"] == 1 for r in rows)
    # one shard group of all dp ranks is FSDP's bytes and memory; shards of one rank hold DDP's states
    whole = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, data_parallel="hsdp", dp_shard=8)
    fsdp = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192)
    assert whole["bytes_per_step"]["dp_replicate"] == 0 and whole["memory_states"] == fsdp["memory_states"]
    assert whole["bytes_per_step"]["dp"] == pytest.approx(fsdp["bytes_per_step"]["dp"])
    single = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, data_parallel="hsdp", dp_shard=1)
    ddp = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, data_parallel="ddp")
    assert single["memory_states"] == pytest.approx(ddp["memory_states"], rel=1e-6)
    # with context parallel a shard group holds its replicas' cp ranks too: states over dp_shard·cp
    cp = plan.plan_layout(LLAMA3_8B, 8, 1, 2, 16, 8192, cp=2, data_parallel="hsdp", recompute=True)
    assert cp["dp_shard"] == 2 and cp["memory_states"] == pytest.approx(16 * LLAMA3_8B.num_params() / 2 / 4, rel=1e-3)
