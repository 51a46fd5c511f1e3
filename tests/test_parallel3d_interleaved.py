"""Interleaved 1F1B on the 3D mesh: v chunks per rank under tensor and data parallel (DDP)."""

import pytest

from minitp import cost, runs
from minitp.models import TINY


def test_interleaved_3d_matches_one_process_and_sends_each_activation_across_every_chunk_boundary():
    report = runs.run_3d(dp=2, tp=2, pp=2, schedule="interleaved", steps=2)
    assert runs.check(report) == [] and report["virtual_stages"] == 2
    a = (8 // 2) * 16 * TINY.dim * 4  # one replica's activations (B/dp)·S·D in fp32, per step
    for (_, s, _), traced in zip(report["coords"], report.comm_bytes_traced_by_dim):
        # 2 chunks per rank, 4 pieces: every piece but the last sends on, every piece but the first sends back
        assert traced["pp"] == 2 * (2 * 2 - 1) * a
        assert traced["pp"] == 2 * cost.pp_step_bytes(8 // 2, 16, TINY.dim, 2, s, virtual_stages=2)
    # each rank holds blocks {s, s + 2}: as many parameters as 1F1B's two blocks, here the same count
    assert [m["params"] for m in report.memory] == [m["params"] for m in report.memory_expected]


def test_interleaved_3d_alone_on_the_pipeline_matches_one_process():
    report = runs.run_3d(dp=1, tp=1, pp=2, schedule="interleaved", virtual_stages=2, microbatches=4, steps=2)
    assert runs.check(report) == [] and report.layout == {"dp": 1, "tp": 1, "pp": 2}


@pytest.mark.parametrize("args, message", [
    (dict(schedule="interleaved", fsdp=True), "needs pp > 1 and DDP"),
    (dict(schedule="1f1b", virtual_stages=2), "virtual_stages=2 is for schedule='interleaved'"),
    (dict(schedule="interleaved", virtual_stages=1), "needs virtual_stages >= 2"),
    (dict(schedule="interleaved", virtual_stages=4), "4 blocks"),
])
def test_3d_refuses_an_interleaved_layout_it_cannot_run_before_starting(args, message):
    with pytest.raises(ValueError, match=message):
        runs.run_3d(**{"dp": 1, "tp": 1, "pp": 2, **args})


def test_the_time_model_divides_the_bubble_by_v_and_multiplies_the_pipeline_sends():
    one = cost.step_time(TINY, 8, 16, pp=2, microbatches=4, device=cost.H100)
    two = cost.step_time(TINY, 8, 16, pp=2, microbatches=4, device=cost.H100, virtual_stages=2)
    assert one.bubble_s == pytest.approx(one.compute_s / 4) and two.bubble_s == pytest.approx(two.compute_s / 8)
    assert two.pp_s > one.pp_s
