"""The three ways context parallel attends (ring, Ulysses, all-gather) in the mesh formulas, the time
model, the planner, the command line and the 3D run: each way's bytes are its own formula's, traced."""

import pytest

from minitp import cli, cost, plan, runs
from minitp.cost.context import cp_attention_activation_bytes, cp_kind_attention_bytes
from minitp.data import COURSE_CORPUS
from minitp.models import LLAMA3_8B, TINY, get_config

KINDS = ("ring", "ulysses", "allgather")
LLAMA3_70B = get_config("llama3-70b")
# chapter 10's long-sequence plan: 64 H100s, 8 sequences of 128K tokens, sequence parallel, full recomputation
LONG = dict(gpus=64, gpu_memory_gib=80.0, seq_len=131072, batch_size=8, sequence_parallel=True, recompute=True)


@pytest.mark.parametrize("attention", KINDS)
def test_mesh_bytes_per_kind_are_that_kinds_formula_on_the_tp_ranks_heads(attention):
    cfg, B, S, dp, cp, tp = LLAMA3_8B, 8, 8192, 2, 4, 2
    sent = cost.cp_mesh_step_bytes(cfg, B, S, dp, cp, tp, 1, 0, activation_bytes=2, attention=attention)
    per_call = {"ring": cost.cp_attention_bytes(B // dp, S, cfg.kv_heads // tp, cfg.head_dim, cp, 2),
                "ulysses": cost.ulysses_attention_bytes(B // dp, S, cfg.n_heads // tp, cfg.kv_heads // tp,
                                                        cfg.head_dim, cp, 2),
                "allgather": cost.allgather_attention_bytes(B // dp, S, cfg.kv_heads // tp, cfg.head_dim, cp, 2)}
    assert sent["cp"] == cfg.n_layers * per_call[attention] > 0
    ring = cost.cp_mesh_step_bytes(cfg, B, S, dp, cp, tp, 1, 0, activation_bytes=2)
    # only the cp dimension changes with the way of attending
    assert {k: v for k, v in sent.items() if k != "cp"} == {k: v for k, v in ring.items() if k != "cp"}
    three = cost.cp3d_step_bytes(cfg, B, S, dp, cp, tp, dtype_bytes=2, attention=attention)
    assert three["cp"] == sent["cp"]


def test_each_kinds_bytes_by_hand():
    # one sequence of 8 positions, 4 heads of which 2 key/value heads of 2 dims, fp32, over 2 ranks:
    # KV = 1·2·4·2·4 = 64 bytes (a rank's keys, or its values)
    kv = 64
    assert cp_kind_attention_bytes("ring", 1, 8, 4, 2, 2, 2) == (3 * 2 - 2) * 2 * kv  # 512
    assert cp_kind_attention_bytes("allgather", 1, 8, 4, 2, 2, 2) == 2 * (2 - 1) * 2 * kv  # 256
    # Ulysses: q, k, v and the output, (4 + 2 + 2 + 4)·4·2 elements at a rank's 4 positions, half of it leaves,
    # forward and backward: 96·4 bytes · 1/2 · 2 = 384
    assert cp_kind_attention_bytes("ulysses", 1, 8, 4, 2, 2, 2) == 384
    with pytest.raises(ValueError, match="attention must be one of ring, ulysses, allgather, got 'star'"):
        cp_kind_attention_bytes("star", 1, 8, 4, 2, 2, 2)


def test_only_the_ring_hides_behind_attention():
    times = {a: cost.step_time(LLAMA3_70B, 8, 131072, dp=8, cp=8, data_parallel="fsdp", sequence_parallel=True,
                               recompute="full", cp_attention=a) for a in KINDS}
    assert times["ring"].cp_s > 0 and times["ring"].cp_exposed_s == 0.0
    for a in ("ulysses", "allgather"):
        assert times[a].cp_exposed_s == times[a].cp_s > 0
        # the rest of the step is the ring's: only the cp messages differ
        assert times[a].step_s == pytest.approx(times["ring"].step_s + times[a].cp_s)
    assert times["ring"] == cost.step_time(LLAMA3_70B, 8, 131072, dp=8, cp=8, data_parallel="fsdp",
                                           sequence_parallel=True, recompute="full")


def test_cp_time_is_alpha_steps_plus_bytes_over_the_link():
    # dp = 1, cp = 8, tp = 1: 8 GPUs of one machine, NVLink; per block 8 all-to-alls of 7 steps (Ulysses),
    # 2 all-gathers and 2 reduce-scatters of 7 (all-gather), 3·8 - 2 hops (the ring)
    link = cost.H100.intra
    for attention, steps in (("ulysses", 8 * 7), ("allgather", 4 * 7), ("ring", 3 * 8 - 2)):
        t = cost.step_time(LLAMA3_8B, 1, 65536, cp=8, cp_attention=attention)
        sent = cost.cp_mesh_step_bytes(LLAMA3_8B, 1, 65536, 1, 8, 1, 1, 0, activation_bytes=2, attention=attention)
        assert t.cp_s == pytest.approx(LLAMA3_8B.n_layers * steps * link.alpha_s + sent["cp"] / link.bytes_per_s)


def test_allgather_keeps_the_whole_sequences_keys_and_values_and_ulysses_its_kernels_output():
    cfg, b, S, cp, tp = LLAMA3_70B, 1, 131072, 8, 2
    # all-gather: 2·b·(Hkv/t)·(S - S/c)·Dh·2 bytes more per block = 2·4·114688·128·2 = 234,881,024
    assert cp_attention_activation_bytes(cfg, b, S, cp, tp, "allgather") == 2 * 4 * (S - S // cp) * 128 * 2
    assert cp_attention_activation_bytes(cfg, b, S, cp, tp, "allgather") == 234_881_024
    # Ulysses: the output at S positions of H/(c·t) heads, b·(S/c)·(H/t)·Dh·2 = 16384·32·128·2 = 134,217,728
    assert cp_attention_activation_bytes(cfg, b, S, cp, tp, "ulysses") == 134_217_728
    assert cp_attention_activation_bytes(cfg, b, S, cp, tp, "ring") == 0.0
    for attention in KINDS:  # full recomputation keeps the block's input alone, whichever the way
        assert cp_attention_activation_bytes(cfg, b, S, cp, tp, attention, "full") == 0.0


def test_planner_rows_say_which_way_and_count_its_bytes_memory_and_time():
    rows = {a: plan.plan_layout(LLAMA3_70B, 2, 1, 4, 8, 131072, cp=8 if a != "ulysses" else 2,
                                sequence_parallel=True, cp_attention=a) for a in KINDS}
    for a, row in rows.items():
        assert row["cp_attention"] == a
        sent = cost.cp_mesh_step_bytes(LLAMA3_70B, 8, 131072, 2, row["cp"], 4, 1, 0, "fsdp", activation_bytes=2,
                                       param_bytes=2, grad_bytes=2, sequence_parallel=True, attention=a)
        assert row["bytes_per_step"]["cp"] == sent["cp"]
        assert row["time"]["cp_s"] > 0
    ring = plan.plan_layout(LLAMA3_70B, 2, 1, 4, 8, 131072, cp=8, sequence_parallel=True)
    assert ring["cp_attention"] == "ring"
    # without recomputation and without a pipeline (one micro-batch of B/dp = 4 sequences) the all-gather
    # keeps each of the 80 blocks' cp_attention_activation_bytes more than the ring
    extra = LLAMA3_70B.n_layers * cp_attention_activation_bytes(LLAMA3_70B, 4, 131072, 8, 4, "allgather")
    assert rows["allgather"]["memory"]["activations"] == ring["memory"]["activations"] + extra
    assert rows["allgather"]["time"]["cp_exposed_s"] == rows["allgather"]["time"]["cp_s"]


def test_llama3_70b_at_128k_the_allgather_sends_the_fewest_cp_bytes_yet_the_ring_is_fastest():
    best = {a: plan.plan(LLAMA3_70B, cp=8, cp_attention=a, **LONG)[0] for a in KINDS}
    for a, row in best.items():  # every way's fastest layout is dp = 8, tp = 1 (Ulysses can take no other)
        assert (row["dp"], row["pp"], row["tp"], row["cp_attention"]) == (8, 1, 1, a)
    cp_bytes = {a: row["bytes_per_step"]["cp"] for a, row in best.items()}
    # per block and sequence (B/dp = 1), with full recomputation's second forward: ring (3·8-2 + 7)·2KV,
    # all-gather (2·7 + 7)·2KV, KV = (S/8)·8·128·2 bytes = 32 MiB; Ulysses 3·(7/8)·(S/8)·(2·64 + 2·8)·128·2 bytes
    kv = 131072 / 8 * 8 * 128 * 2
    assert kv == 32 * 2**20
    assert cp_bytes["ring"] == 80 * 29 * 2 * kv == 145 * 2**30
    assert cp_bytes["allgather"] == 80 * 21 * 2 * kv == 105 * 2**30
    assert cp_bytes["ulysses"] == 80 * 3 * 7 / 8 * 131072 / 8 * 144 * 128 * 2 == 118.125 * 2**30
    # the ring's messages hide behind attention; the others' do not, so the ring's step is the fastest
    assert best["ring"]["step_s"] < best["allgather"]["step_s"] < best["ulysses"]["step_s"]


def test_ulysses_refuses_layouts_whose_tp_rank_heads_cp_does_not_divide():
    refused = []
    rows = plan.plan(LLAMA3_70B, cp=8, cp_attention="ulysses", include_unfit=True, refused=refused, **LONG)
    assert {r["tp"] for r in rows} == {1}  # 8 key/value heads: tp·cp at most 8
    why = {(dp, pp, tp): w for dp, pp, tp, w in refused}
    assert why[(4, 1, 2)] == ("Ulysses splits each tp rank's heads over cp: kv_heads/tp = 8/2 = 4 is not "
                              "divisible by cp=8")
    with pytest.raises(ValueError, match="kv_heads/tp = 8/4 = 2 is not divisible by cp=4"):
        plan.plan_layout(LLAMA3_70B, 2, 1, 4, 8, 131072, cp=4, cp_attention="ulysses")
    with pytest.raises(ValueError, match="attention must be one of ring, ulysses, allgather"):
        plan.plan(LLAMA3_70B, 64, 80.0, cp=8, cp_attention="tree")


def test_format_plan_and_the_markdown_table_show_the_way_when_cp_splits_sequences():
    rows = plan.plan(LLAMA3_70B, cp=8, cp_attention="allgather", **LONG)
    table = plan.format_plan(rows)
    assert "attention" in table.splitlines()[0] and " allgather " in table.splitlines()[1]
    md = plan.markdown_table(rows).splitlines()
    assert "| cp | cp attention |" in md[0] and "| 8 | allgather |" in md[2]
    assert md[0].count("|") == md[1].count("|") == md[2].count("|")
    plain = plan.plan(LLAMA3_8B, 64, 80.0)
    assert "attention" not in plan.format_plan(plain) and "cp attention" not in plan.markdown_table(plain)


def test_cli_plan_takes_cp_attention(capsys):
    argv = ["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu-memory", "80", "--seq-len", "131072",
            "--batch-size", "8", "--sequence-parallel", "--recompute", "--cp", "8"]
    assert cli.main(argv + ["--cp-attention", "allgather"]) == 0
    out = capsys.readouterr().out
    assert "cp = 8 (allgather attention)" in out and " allgather " in out
    assert cli.main(argv + ["--cp-attention", "star"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cp-attention" in err[0] and "star" in err[0]


def test_cli_plan_says_in_one_line_when_ulysses_can_take_no_layout(capsys):
    # the tiny model's 4 key/value heads cannot split over cp = 8
    argv = ["plan", "--model", "tiny", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "32", "--cp", "8",
            "--cp-attention", "ulysses"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_heads=8" not in err[0] and "kv_heads=4 is not divisible by cp=8" in err[0]


@pytest.mark.parametrize("attention", ["allgather", "ulysses"])
def test_3d_with_cp_attention_matches_one_process_and_its_formula(attention):
    # dp = 1, cp = 2, tp = 2 on 4 ranks: each tp rank's 4 heads (2 key/value heads) over the cp group
    report = runs.run_3d(dp=1, cp=2, tp=2, pp=1, steps=2, attention=attention)
    assert runs.check(report) == [] and report.max_abs_param_diff <= 1e-5
    assert report.details["attention"] == attention
    per_call = cp_kind_attention_bytes(attention, 8, 16, TINY.n_heads // 2, TINY.kv_heads // 2, TINY.head_dim, 2)
    for traced, expected in zip(report.comm_bytes_traced_by_dim, report.comm_bytes_expected_by_dim):
        assert traced == expected
        assert traced["cp"] == 2 * TINY.n_layers * per_call > 0


def test_run_3d_refuses_ulysses_where_cp_does_not_divide_the_heads():
    with pytest.raises(ValueError, match="kv_heads/tp = 4/2 = 2 is not divisible by cp=4"):
        runs.run_3d(dp=1, cp=4, tp=2, pp=1, steps=1, attention="ulysses", seq_len=16)


def _saved_by_each_way():
    import torch

    from minitp import cp
    from minitp.models.llama import causal_attention

    torch.manual_seed(0)
    B, H, Hkv, Sl, Dh = 1, 8, 2, 16, 4
    q = torch.randn(B, H, Sl, Dh, requires_grad=True)
    k, v = (torch.randn(B, Hkv, Sl, Dh, requires_grad=True) for _ in range(2))
    ways = {"ring": cp.RingAttend(None), "allgather": cp.AllGatherAttend(None)}
    return {name: cp.saved_activation_bytes(f, q, k, v)[1] for name, f in ways.items()} | {
        "plain": cp.saved_activation_bytes(causal_attention, q, k, v)[1]}


def test_what_the_ring_and_the_allgather_keep_for_backward_measured():
    import minitp

    saved = minitp.launch(_saved_by_each_way, 2, echo=False)[0]
    B, H, Hkv, Sl, S, Dh, b = 1, 8, 2, 16, 32, 4, 4  # fp32, 2 ranks
    # the ring keeps what a flash kernel keeps: q, its own k and v, the output and a log-sum-exp per row
    assert saved["ring"] == (2 * B * H * Sl * Dh + 2 * B * Hkv * Sl * Dh + B * H * Sl) * b
    # the all-gather keeps q, the keys and values of the whole sequence (repeated to the H query heads here),
    # the softmax of its Sl queries against all S keys and the (Sl, S) causal mask
    assert saved["allgather"] == (B * H * Sl * Dh + 2 * B * H * S * Dh + B * H * Sl * S) * b + Sl * S
    # a kernel at scale keeps neither the scores nor the repeated heads: of the above only q and the gathered
    # keys and values at their Hkv heads, 2·B·Hkv·S·Dh·b where the ring keeps 2·B·Hkv·Sl·Dh·b: the planner's
    # addition (cp_attention_activation_bytes)


@pytest.mark.parametrize("attention", ["allgather", "ulysses"])
def test_train_with_each_cp_attention_equals_one_process(attention):
    from dataclasses import replace

    from minitp import trainer
    from minitp.runs import training

    base = trainer.Settings(steps=2, batch_size=4, seq_len=32, corpus=COURSE_CORPUS, eval_every=0, warmup=1, clip=0.5)
    ref_losses, ref_norms, _ = trainer.reference(base)
    results = training.train(replace(base, cp=2, tp=2, cp_attention=attention), echo=False)
    losses = next(r["losses"] for r in results if r["losses"])
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert results[0]["norms"] == pytest.approx(ref_norms, rel=1e-5)


def test_train_refuses_a_bad_cp_attention_in_one_line(capsys):
    assert cli.main(["train", "--cp", "2", "--attention", "star"]) == 2
    assert "--attention" in capsys.readouterr().err
    assert cli.main(["train", "--cp", "4", "--tp", "2", "--attention", "ulysses", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv_heads/tp = 4/2 = 2 is not divisible by cp=4" in err[0]


def test_cp_activation_bytes_per_rank_adds_what_each_way_keeps():
    cfg, S, cp = LLAMA3_8B, 131072, 8
    ring = cost.cp_activation_bytes_per_rank(cfg, 1, S, cp)
    assert cost.cp_activation_bytes_per_rank(cfg, 1, S, cp, attention="ring") == ring
    for attention in ("ulysses", "allgather"):
        assert cost.cp_activation_bytes_per_rank(cfg, 1, S, cp, attention=attention) == (
            ring + cfg.n_layers * cp_attention_activation_bytes(cfg, 1, S, cp, 1, attention))
