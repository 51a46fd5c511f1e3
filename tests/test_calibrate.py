"""minitp calibrate: this machine's figures for the time model, measured, fitted and stored."""

import json

import pytest

from minitp import cli, cost
from minitp.measure import calibrate, collectives, elements, sharing
from minitp.models import BYTE, TINY
from minitp.models.moe import moe_config
from minitp.models.train import TrainConfig
from minitp.runs import measuring
from minitp.runs.common import predicted_step_s
from minitp.runs.report import Report, format_report


def test_alpha_and_beta_are_recovered_from_all_reduce_times_on_a_line():
    alpha, beta = 40e-6, 2e9  # 2 ranks: T = 2α + B/β
    times = {b: 2 * alpha + b / beta for b in (4, 2**14, 2**20, 2**22)}
    fitted = calibrate.fit_alpha_beta(times, 2)
    assert fitted == (pytest.approx(alpha), pytest.approx(beta))
    with pytest.raises(ValueError, match="do not grow with size"):
        calibrate.fit_alpha_beta({4: 1e-3, 2**20: 1e-4}, 2)


# Recorded on this project's 2-core machine (quiet): all-reduce {bytes: (mean s, fastest s)} per rank and the
# mean of the matmul bursts every rank ran at once, on 2 ranks and on 4. No test measures the machine: a fit on
# live timings failed a loaded CI run ("times do not grow with size").
RECORDED = [{"all_reduce": {4: (6.1e-4, 9.0e-5), 2**16: (7.4e-4, 1.4e-4), 2**20: (1.40e-3, 6.2e-4)},
             "compute_s": 0.0231},
            {"all_reduce": {4: (6.3e-4, 9.5e-5), 2**16: (7.1e-4, 1.3e-4), 2**20: (1.38e-3, 6.0e-4)},
             "compute_s": 0.0229}]
RECORDED_4 = [{"all_reduce": {4: (7.2e-4, 1.1e-4), 2**16: (8.0e-4, 1.9e-4), 2**20: (2.1e-3, 9.0e-4)},
               "compute_s": 0.0462 + 0.0004 * r} for r in range(4)]
# the same machine, 2 ranks: mean seconds of all-gathers and reduce-scatters per size of the full buffer
# and a 4-byte all-reduce's mean seconds after a burst of 8 and of 400 matmuls: (the burst's, the call's)
RECORDED_KINDS = [{"all_gather": {4: 4.9e-4, 2**16: 9.7e-4, 2**20: 1.91e-3},
                   "reduce_scatter": {4: 1.60e-3, 2**16: 2.28e-3, 2**20: 3.01e-3},
                   "waits": {8: (0.11e-3, 0.30e-3), 400: (5.2e-3, 1.05e-3)}},
                  {"all_gather": {4: 4.8e-4, 2**16: 9.4e-4, 2**20: 1.93e-3},
                   "reduce_scatter": {4: 1.61e-3, 2**16: 2.23e-3, 2**20: 2.89e-3},
                   "waits": {8: (0.10e-3, 0.33e-3), 400: (5.0e-3, 1.25e-3)}}]
# the tiny model's fastest step at 1 and at 8 micro-batches, and the operations of one forward+backward
RECORDED_STEPS = {1: 8.5e-3, 8: 34.1e-3}
RECORDED_BYTE_STEP = {1: 118e-3}  # the byte model at 8 x 128, one micro-batch
RECORDED_OPS = 1165
# one rank: the median step plain and under each strategy, the collectives each step called, a bare call
# one rank: the median forward+backward plain, under ring attention and as a MoE, and their operations
RECORDED_OP_COSTS = {"fb_s": {"plain": 7.84e-3, "cp": 11.14e-3, "ep": 21.02e-3},
                     "ops": {"plain": 1173, "cp": 1763, "ep": 3087}}
RECORDED_OWN = {"step_s": {"plain": 9.59e-3, "ddp": 10.92e-3, "fsdp": 12.69e-3, "tp": 14.49e-3},
                "calls": {"plain": 0, "ddp": 3, "fsdp": 14, "tp": 20}, "call_s": 81e-6}


def test_the_fixed_costs_are_fitted_per_micro_batch_per_step_and_per_operation():
    flops_s = 0.8e-3  # the tiny model's FLOPs at the measured rate
    fit = calibrate.fit_fixed_costs(8.5e-3, 34.1e-3, 8, flops_s, 1165)
    microbatch = (34.1e-3 - 8.5e-3) / 7  # each micro-batch added: 3.66 ms
    assert fit["microbatch_overhead_s"] == pytest.approx(microbatch)
    assert fit["step_overhead_s"] == pytest.approx(8.5e-3 - flops_s - microbatch)
    assert fit["op_s"] == pytest.approx(microbatch / 1165) and fit["microbatch_ops"] == 1165
    # noise that makes a cost negative stores 0
    assert calibrate.fit_fixed_costs(8.5e-3, 8.0e-3, 8, flops_s, 1165)["microbatch_overhead_s"] == 0.0


def test_a_calibration_is_fitted_from_recorded_timings_and_read_back_as_this_machine(tmp_path, monkeypatch):
    import minitp.launcher
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "cal.json"))
    monkeypatch.setattr(calibrate, "matmul_flops_per_s", lambda *a, **k: 9.0e10)
    monkeypatch.setattr(calibrate, "tiny_step_s",
                        lambda microbatches, *a, cfg=None, **k: RECORDED_STEPS if cfg is None else RECORDED_BYTE_STEP)
    monkeypatch.setattr(calibrate, "count_ops", lambda *a, **k: RECORDED_OPS)
    monkeypatch.setattr(calibrate.os, "sched_getaffinity", lambda pid: {0, 1})
    # per round, each rank's tiny step with both cores stepping at once and the first rank's alone
    busy = [[(10.2e-3, 8.0e-3), (10.3e-3, 7.9e-3), (10.2e-3, 8.0e-3)],
            [(10.6e-3, None), (10.9e-3, None), (10.6e-3, None)]]

    def recorded(fn, n, *a, **k):
        if fn is sharing._busy_step_worker:
            return busy
        if fn is collectives._kinds_worker:
            return RECORDED_KINDS
        if fn is measuring._own_work_worker:
            return [RECORDED_OWN]
        if fn is measuring._op_cost_worker:
            return [RECORDED_OP_COSTS]
        return RECORDED if n == 2 else RECORDED_4

    monkeypatch.setattr(minitp.launcher, "launch", recorded)
    cal = measuring.calibrate(repeats=3, sizes=(4, 2**16, 2**20))
    means = {b: max(r["all_reduce"][b][0] for r in RECORDED) for b in (4, 2**16, 2**20)}
    assert (cal["alpha_s"], cal["bytes_per_s"]) == calibrate.fit_alpha_beta(means, 2)  # the slower rank's mean
    shared = {b: max(r["all_reduce"][b][0] for r in RECORDED_4) for b in (4, 2**16, 2**20)}
    assert (cal["alpha_shared_s"], cal["bytes_per_s_shared"]) == calibrate.fit_alpha_beta(shared, 4)
    assert cal["shared_slowdown"] == pytest.approx(0.0468 / 0.0230)  # mean burst on 4 ranks over on 2
    assert cal["busy_slowdown"] == pytest.approx(10.4e-3 / 8.0e-3)  # both cores stepping against one alone
    # all-gathers and reduce-scatters against the ring model with the all-reduces' α and β (the slower rank's)
    kinds = {kind: {b: max(r[kind][b] for r in RECORDED_KINDS) for b in (4, 2**16, 2**20)}
             for kind in collectives.KINDS}
    assert {k: cal[k] for k in ("all_gather_factor", "reduce_scatter_factor")} == collectives.fit_kind_factors(
        kinds, cal["alpha_s"], cal["bytes_per_s"], 2)
    assert 1 < cal["all_gather_factor"] < cal["reduce_scatter_factor"] and cal["reduce_scatter_s"]["4"] == 1.61e-3
    # each rank's slope from 0.1 ms of compute to 5 ms, their mean: seconds of waiting per second of compute
    slopes = [(1.05e-3 - 0.30e-3) / (5.2e-3 - 0.11e-3), (1.25e-3 - 0.33e-3) / (5.0e-3 - 0.10e-3)]
    assert cal["wait_per_compute"] == pytest.approx(sum(slopes) / 2)
    assert f"a collective waits {cal['wait_per_compute']:.2f} s per s of compute" in calibrate.format_calibration(cal)
    assert (f"; all-gather {cal['all_gather_factor']:.2f}x, reduce-scatter {cal['reduce_scatter_factor']:.2f}x the "
            "ring model") in calibrate.format_calibration(cal)
    flops_s = 8 * 16 * cost.training_flops_per_token(TINY, 16) / 9.0e10
    assert {k: cal[k] for k in ("step_overhead_s", "microbatch_overhead_s", "op_s", "microbatch_ops")} == \
        calibrate.fit_fixed_costs(8.5e-3, 34.1e-3, 8, flops_s, RECORDED_OPS)
    assert cal["tp_own_s"] == pytest.approx(14.49e-3 - 9.59e-3 - 20 * 81e-6)  # beyond the plain step and 20 calls
    assert calibrate.check_calibration(cal) is None and device_own(cal) == (cal["ddp_own_s"], cal["fsdp_own_s"],
                                                                            cal["tp_own_s"])
    assert "own code per micro-batch, ms: ddp 1.1, fsdp 2.0, tp 3.3" in calibrate.format_calibration(cal)
    assert cal["cp_op_s"] == pytest.approx((11.14e-3 - 7.84e-3) / (1763 - 1173))  # 5.6 µs an operation
    moe_flops = 8 * 16 * (cost.training_flops_per_token(moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25),
                                                        16) - cost.training_flops_per_token(TINY, 16)) / 9.0e10
    assert cal["ep_op_s"] == pytest.approx((21.02e-3 - 7.84e-3 - moe_flops) / (3087 - 1173))
    device = cost.device_from_calibration(cal)
    assert (device.cp_op_s, device.ep_op_s) == (cal["cp_op_s"], cal["ep_op_s"])
    assert "ring attention's 5.6, a MoE's" in calibrate.format_calibration(cal)
    assert cal["flops_per_s"] == 9.0e10 and cal["cores"] == 2
    assert 0 < cal["alpha_s"] < 1e-3 and 1e8 < cal["bytes_per_s"] < 1e10
    assert calibrate.check_calibration(cal) is None
    path = calibrate.save(cal)
    assert path == str(tmp_path / "cal.json") and json.loads(open(path).read()) == cal
    # the byte model's step beside the tiny one's: what each activation element costs beyond the matmuls
    shapes = {"tiny": (TINY, 8, 16), "byte": (BYTE, 8, 128)}
    assert {k: cal[k] for k in ("element_s", "element_step_overhead_s")} == elements.fit_element_cost(
        {"tiny": 8.5e-3, "byte": 118e-3},
        {name: b * s * cost.training_flops_per_token(c, s) for name, (c, b, s) in shapes.items()},
        {name: cost.activation_elements(c, b * s, s) for name, (c, b, s) in shapes.items()},
        9.0e10, cal["microbatch_overhead_s"])
    assert cal["element_s"] > 0 and cal["byte_step_s"] == 118e-3
    assert "(the byte model's step at 8x128: 118 ms)" in calibrate.format_calibration(cal)
    device = calibrate.this_machine()
    assert device.flops_per_s == cal["flops_per_s_large"] and device.intra.bytes_per_s == cal["bytes_per_s"]
    assert device.element_s == cal["element_s"] and device.overhead_s == cal["element_step_overhead_s"]
    assert device.microbatch_overhead_s == cal["microbatch_overhead_s"] and device.op_s == cal["op_s"]
    assert device.shared_link.alpha_s == cal["alpha_shared_s"] and device.shared_slowdown == cal["shared_slowdown"]
    assert "per micro-batch" in calibrate.format_calibration(cal) and "at 4 ranks" in calibrate.format_calibration(cal)
    assert device.busy_slowdown == cal["busy_slowdown"] and "a step 1.30x slower" in calibrate.format_calibration(cal)
    assert (device.gather_factor, device.scatter_factor) == (cal["all_gather_factor"], cal["reduce_scatter_factor"])
    assert device.wait_per_compute == cal["wait_per_compute"] > 0


def test_the_cost_beyond_the_matmuls_is_a_line_in_the_activation_elements_through_two_models():
    # two steps made of a known line: 2 ns per element, 1 ms once, 0.5 ms per micro-batch, matmuls at 80 GFLOP/s
    flops, held = {"tiny": 3e8, "byte": 6e9}, {"tiny": 1.8e5, "byte": 2.4e6}
    steps = {name: flops[name] / 8e10 + 0.5e-3 + 1e-3 + 2e-9 * held[name] for name in flops}
    fit = elements.fit_element_cost(steps, flops, held, 8e10, 0.5e-3)
    assert fit["element_s"] == pytest.approx(2e-9) and fit["element_step_overhead_s"] == pytest.approx(1e-3)
    steps["byte"] = steps["tiny"]  # no growth with the elements (noise): no negative price, the rest once
    assert elements.fit_element_cost(steps, flops, held, 8e10, 0.5e-3)["element_s"] == 0.0


def device_own(cal: dict) -> tuple[float, float, float]:
    device = cost.device_from_calibration(cal)
    return device.ddp_own_s, device.fsdp_own_s, device.tp_own_s


def test_a_strategys_own_code_is_its_one_rank_step_beyond_the_plain_step_and_its_calls():
    fit = calibrate.fit_own_work(RECORDED_OWN["step_s"], RECORDED_OWN["calls"], RECORDED_OWN["call_s"])
    assert fit["ddp_own_s"] == pytest.approx(10.92e-3 - 9.59e-3 - 3 * 81e-6)
    assert fit["fsdp_own_s"] == pytest.approx(12.69e-3 - 9.59e-3 - 14 * 81e-6)
    assert set(fit) == {"ddp_own_s", "fsdp_own_s", "tp_own_s"}
    noisy = {**RECORDED_OWN["step_s"], "ddp": 9.5e-3}  # faster than the plain step: noise, stored as 0
    assert calibrate.fit_own_work(noisy, RECORDED_OWN["calls"], 81e-6)["ddp_own_s"] == 0.0


def test_an_added_operation_costs_the_growth_over_the_plain_pass_per_operation_added():
    fit = calibrate.fit_op_costs(RECORDED_OP_COSTS["fb_s"], RECORDED_OP_COSTS["ops"], moe_flops_s=0.5e-3)
    assert fit["ep_op_s"] == pytest.approx((21.02e-3 - 7.84e-3 - 0.5e-3) / (3087 - 1173))
    slower_plain = {**RECORDED_OP_COSTS["fb_s"], "plain": 12e-3}  # noise: the plain pass slower than ring attention
    assert calibrate.fit_op_costs(slower_plain, RECORDED_OP_COSTS["ops"])["cp_op_s"] == 0.0
    nothing_added = {**RECORDED_OP_COSTS["ops"], "cp": 1173}
    assert calibrate.fit_op_costs(RECORDED_OP_COSTS["fb_s"], nothing_added)["cp_op_s"] is None
    assert calibrate.check_calibration({**GOOD, "cp_op_s": None}) is None  # stored as null: op_s is used
    assert "cp_op_s is -1" in calibrate.check_calibration({**GOOD, "cp_op_s": -1})


def test_the_operation_cost_measurement_counts_what_ring_attention_and_a_moe_add_at_one_rank():
    from minitp.launcher import launch
    result = launch(measuring._op_cost_worker, 1, 1, echo=False, timeout=120)[0]
    assert set(result["fb_s"]) == {"plain", "cp", "ep"} and all(t > 0 for t in result["fb_s"].values())
    assert result["ops"]["plain"] < result["ops"]["cp"] and result["ops"]["plain"] < result["ops"]["ep"]


def test_the_own_code_measurement_runs_each_strategy_at_one_rank_and_counts_its_calls():
    from minitp.cost.time import _ring_steps
    from minitp.launcher import launch
    result = launch(measuring._own_work_worker, 1, 2, echo=False, timeout=120)[0]
    assert set(result["step_s"]) == {"plain", *calibrate.OWN_STRATEGIES} and result["call_s"] > 0
    assert all(t > 0 for t in result["step_s"].values())  # what it measured, not how fast
    # the calls are counted, not timed: the plain model calls none; tensor parallel's are the 4 per block
    # and 4 at the ends the time model charges (one all-reduce is 2 message steps at 2 ranks)
    sizes = {"tp": 2, "pp": 1, "dp": 1}
    assert result["calls"]["plain"] == 0 and 2 * result["calls"]["tp"] == _ring_steps(TINY.n_layers, 1, sizes, "ddp",
                                                                                      3, "none", 0.0, None)["tp"]
    assert result["calls"]["ddp"] == 3  # the tiny model's gradients in 0.25 MiB buckets
    units = TINY.n_layers + 1  # a unit per block, and the root's
    assert result["calls"]["fsdp"] == 3 * units - 1  # gathers in forward and backward (the last unit's once), scatters


def test_the_all_reduce_measurement_runs_on_two_ranks_and_reports_every_size():
    from minitp.launcher import launch
    results = launch(calibrate._all_reduce_worker, 2, (4, 2**12), 2, echo=False, timeout=120)
    for r in results:  # what it measured, not how fast: no test depends on the machine's speed
        assert set(r["all_reduce"]) == {4, 2**12} and all(m >= f > 0 for m, f in r["all_reduce"].values())
        assert r["compute_s"] > 0


def test_the_busy_step_measurement_pairs_every_rank_at_once_with_one_alone_round_by_round():
    from minitp.launcher import launch
    rounds = launch(sharing._busy_step_worker, 2, 2, 3, echo=False, timeout=120)
    assert [len(r) for r in rounds] == [3, 3]  # per round: (together, alone), alone on the first rank only
    assert all(together > 0 and alone > 0 for together, alone in rounds[0])
    assert all(together > 0 and alone is None for together, alone in rounds[1])
    # per round the ranks' mean together over the lone rank's step; the median over the rounds
    assert sharing.busy_slowdown([[(10e-3, 8e-3)], [(12e-3, None)]]) == pytest.approx(11 / 8)
    drifting = [[(10e-3, 8e-3), (20e-3, 16e-3), (12e-3, 8e-3)], [(10e-3, None), (20e-3, None), (12e-3, None)]]
    assert sharing.busy_slowdown(drifting) == pytest.approx(1.25)  # a machine twice as slow in round 2: 1.25 still
    assert sharing.busy_slowdown([[(7e-3, 8e-3)], [(7.5e-3, None)]]) == 1.0  # a crowd faster than one alone is noise


def test_all_gathers_and_reduce_scatters_are_priced_against_the_ring_model_of_the_all_reduces():
    alpha, beta = 300e-6, 1e9  # 2 ranks: the ring model of an all-gather is α + B/2/β
    ring = {b: alpha + b / 2 / beta for b in (4, 2**16, 2**20)}
    assert cost.collective_time("all_gather", 2**20, 2, cost.Link("l", alpha, beta)) == pytest.approx(ring[2**20])
    means = {"all_gather": {b: 0.5 * t for b, t in ring.items()}, "reduce_scatter": {b: 2 * t for b, t in ring.items()}}
    assert collectives.fit_kind_factors(means, alpha, beta, 2) == {"all_gather_factor": pytest.approx(0.5),
                                                                   "reduce_scatter_factor": pytest.approx(2.0)}
    from minitp.launcher import launch
    results = launch(collectives._kinds_worker, 2, (4, 2**12), 2, (8, 4), echo=False, timeout=120)
    for r in results:  # what it measured, not how fast
        assert {k: set(v) for k, v in r.items()} == {"all_gather": {4, 2**12}, "reduce_scatter": {4, 2**12},
                                                      "waits": set(collectives.BURSTS)}
        assert all(t > 0 for kind in collectives.KINDS for t in r[kind].values())
        assert all(burst > 0 and call > 0 for burst, call in r["waits"].values())
    # a collective waits more after a longer burst: the slope per second of compute, never below 0
    assert collectives.fit_wait([{8: (1e-4, 3e-4), 400: (5.1e-3, 1.3e-3)}]) == pytest.approx(0.2)
    assert collectives.fit_wait([{8: (1e-4, 9e-4), 400: (5.1e-3, 4e-4)}]) == 0.0  # noise: no negative wait


def test_the_operations_of_the_tiny_models_forward_and_backward_are_counted_alike_each_time():
    ops = calibrate.count_ops(1, 16)  # a count, not a time: the same on every machine with this PyTorch
    assert ops == calibrate.count_ops(1, 16) and 500 < ops < 5000


def test_fit_alpha_beta_refuses_times_that_do_not_grow_with_size():
    with pytest.raises(ValueError, match="do not grow with size"):
        calibrate.fit_alpha_beta({4: 2e-3, 2**20: 1e-3}, 2)


def test_cli_calibrate_stores_unless_dry_run(tmp_path, monkeypatch, capsys):
    fixture = {"name": "fixture", "flops_per_s": 5e10, "flops_per_s_large": 6e10, "matmul_shape": [1, 2, 3],
               "step_overhead_s": 0.01, "alpha_s": 5e-5, "bytes_per_s": 1e9, "cores": 2}
    monkeypatch.setattr(measuring, "calibrate", lambda: dict(fixture))
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "sub" / "cal.json"))
    assert cli.main(["calibrate", "--dry-run"]) == 0
    assert "50.00 GFLOP/s per rank" in capsys.readouterr().out and not (tmp_path / "sub").exists()
    assert cli.main(["calibrate", "--json", str(tmp_path / "out.json")]) == 0
    assert calibrate.load_calibration() == fixture == json.loads((tmp_path / "out.json").read_text())
    assert cli.main(["calibrate", "--json", str(tmp_path)]) == 2  # a folder: refused before measuring


# -- a stored calibration the time model cannot use: set aside with a note, never an exception -------------
GOOD = {"name": "fixture", "flops_per_s": 5e10, "alpha_s": 5e-5, "bytes_per_s": 1e9, "cores": 2,
        "step_overhead_s": 0.01}
BAD_FIGURES = [  # (what replaces a good figure, the note's start)
    ({"bytes_per_s": 0}, "ignored: bytes_per_s is 0"),
    ({"flops_per_s": 0}, "ignored: flops_per_s is 0"),
    ({"cores": "two"}, 'ignored: cores is "two"'),
    ({"alpha_s": float("nan")}, "ignored: alpha_s is NaN"),
    ({"bytes_per_s": float("inf")}, "ignored: bytes_per_s is Infinity"),
    ({"flops_per_s": -5e10}, "ignored: flops_per_s is -50000000000.0"),
    ({"bytes_per_s": -1}, "ignored: bytes_per_s is -1"),
    ({"alpha_s": -1e-6}, "ignored: alpha_s is -1e-06"),
    ({"step_overhead_s": -0.01}, "ignored: step_overhead_s is -0.01"),
    ({"microbatch_overhead_s": -0.01}, "ignored: microbatch_overhead_s is -0.01"),
    ({"op_s": "fast"}, 'ignored: op_s is "fast"'),
    ({"bytes_per_s_shared": 0}, "ignored: bytes_per_s_shared is 0"),
    ({"shared_slowdown": -2}, "ignored: shared_slowdown is -2"),
    ({"reduce_scatter_factor": 0}, "ignored: reduce_scatter_factor is 0"),
    ({"cores": True}, "ignored: cores is true"),
    ({"flops_per_s": True}, "ignored: flops_per_s is true"),
    ({"alpha_s": False}, "ignored: alpha_s is false"),
    ({"cores": 2.0}, "ignored: cores is 2.0"),
    ({"cores": 0}, "ignored: cores is 0"),
    ({"bytes_per_s": "1e9"}, 'ignored: bytes_per_s is "1e9"'),
    ({"flops_per_s": [5e10]}, "ignored: flops_per_s is a list"),
    ({"flops_per_s": 10**400}, "ignored: flops_per_s is 1000000000"),
    ({"flops_per_s": None}, "ignored: flops_per_s is null"),
    ({"name": 7}, "ignored: name is 7"),
    ({"element_s": -1e-9}, "ignored: element_s is -1e-09"),
    ({"element_s": 1e-9}, "ignored: element_s is given without flops_per_s_large"),
    ({"element_s": 1e-9, "flops_per_s_large": 9e10}, "ignored: element_s is given without element_step_overhead_s"),
]


def _stored(tmp_path, monkeypatch, text: str):
    path = tmp_path / "cal.json"
    path.write_text(text)
    monkeypatch.setenv("MINITP_CALIBRATION", str(path))
    return path


def _is_set_aside(note_start: str) -> None:
    """No calibration, the note, and a run's step-time line that shows it instead of a prediction."""
    cal, note = calibrate.read_calibration()
    assert cal is None and note.startswith(note_start), note
    assert calibrate.load_calibration() is None and calibrate.this_machine() is None
    train = TrainConfig(steps=2, batch_size=8, seq_len=16)
    predicted, why = predicted_step_s("ddp", {"dp": 2, "tp": 1, "pp": 1}, TINY, train, {"num_buckets": 3})
    assert predicted is None and why.startswith(note) and "minitp calibrate" in why
    report = Report("ddp", 1, {"dp": 1, "tp": 1, "pp": 1}, "tiny", 10, 1, 8, [1.0], [1.0], 0.0, [0.0], [0.0],
                    [{"params": 0, "grads": 0, "optimizer": 0}], [{"params": 0, "grads": 0, "optimizer": 0}],
                    1.0, [0.01], details={"predicted_step_note": why})
    line = next(li for li in format_report(report).splitlines() if li.startswith("step time"))
    assert line == f"step time: measured 10.0 ms (median rank); no prediction: {why}"


def test_a_good_calibration_is_read_with_no_note(tmp_path, monkeypatch):
    _stored(tmp_path, monkeypatch, json.dumps(GOOD))
    assert calibrate.read_calibration() == (GOOD, None)
    # the figures a noisy fastest fit leaves out are stored as null: still a calibration
    _stored(tmp_path, monkeypatch, json.dumps({**GOOD, "alpha_min_s": None, "bytes_per_s_min": None}))
    assert calibrate.read_calibration()[1] is None and calibrate.this_machine().flops_per_s == 5e10


def test_no_stored_calibration_is_no_calibration_and_no_note(tmp_path, monkeypatch):
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path / "absent.json"))
    assert calibrate.read_calibration() == (None, None)


@pytest.mark.parametrize("change,note", BAD_FIGURES, ids=[str(c) for c, _ in BAD_FIGURES])
def test_a_figure_the_time_model_cannot_use_sets_the_calibration_aside(tmp_path, monkeypatch, change, note):
    _stored(tmp_path, monkeypatch, json.dumps({**GOOD, **change}))
    _is_set_aside(note)


def test_a_missing_figure_sets_the_calibration_aside(tmp_path, monkeypatch):
    _stored(tmp_path, monkeypatch, json.dumps({k: v for k, v in GOOD.items() if k != "bytes_per_s"}))
    _is_set_aside("ignored: bytes_per_s is missing")


@pytest.mark.parametrize("text,why", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"flops_per_s": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("fast", "not JSON"),
    ("", "not JSON"),
    ("[1, 2, 3]", "a list, not a JSON object"),
    ("42", "42, not a JSON object"),
], ids=["100000 nested lists", "a nested figure", "not JSON", "empty", "a list", "a number"])
def test_a_file_that_is_not_a_calibration_is_set_aside(tmp_path, monkeypatch, text, why):
    path = _stored(tmp_path, monkeypatch, text)
    _is_set_aside(f"ignored: {path} is not a calibration file ({why}")


def test_a_file_that_cannot_be_read_as_text_or_at_all_is_set_aside(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    path.write_bytes(b"\xff\xfe\x00")
    monkeypatch.setenv("MINITP_CALIBRATION", str(path))
    _is_set_aside(f"ignored: {path} is not a calibration file (not text")
    monkeypatch.setenv("MINITP_CALIBRATION", str(tmp_path))  # a folder
    _is_set_aside(f"ignored: {tmp_path} is not a calibration file (")


@pytest.mark.parametrize("where", ["folder", "under_a_file", "unwritable"])
def test_calibrate_refuses_where_it_cannot_store_before_measuring(tmp_path, monkeypatch, capsys, where):
    measured = []
    monkeypatch.setattr(measuring, "calibrate", lambda: measured.append(1) or {})
    (tmp_path / "file").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    path = {"folder": tmp_path, "under_a_file": tmp_path / "file" / "cal.json",
            "unwritable": locked / "cal.json"}[where]
    if where == "unwritable":
        monkeypatch.setattr(calibrate.os, "access", lambda p, mode: not str(p).startswith(str(locked)))
    monkeypatch.setenv("MINITP_CALIBRATION", str(path))
    assert cli.main(["calibrate"]) == 2 and measured == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibration" in err[0]


def test_a_runs_measured_step_is_the_median_after_the_first_two_which_open_connections():
    from minitp.runs.common import steady_step_s
    assert steady_step_s([0.050, 0.040, 0.010, 0.012, 0.011]) == 0.011  # what the time model predicts
    assert steady_step_s([0.050, 0.010]) == pytest.approx(0.030)  # a run of two steps: all of it
