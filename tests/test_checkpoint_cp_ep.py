"""Checkpoints across the new mesh dimensions: saved under context or expert parallel, resumed in another layout."""

import pytest

from minitp import runs


def test_an_expert_parallel_checkpoint_resumes_with_the_experts_split_another_way(tmp_path):
    saved = runs.run_3d(dp=4, ep=2, tp=1, pp=1, steps=2, save_to=str(tmp_path / "ck"))
    assert runs.check(saved) == []
    for dp, ep in ((2, 2), (4, 4)):  # experts over 2 ranks once; 4 ranks, one copy each
        resumed = runs.run_3d(dp=dp, ep=ep, tp=1, pp=1, steps=3, resume_from=str(tmp_path / "ck"))
        assert runs.check(resumed) == [] and resumed.start_step == 2 and len(resumed.loss) == 1
        assert resumed.layout["ep"] == ep


def test_a_context_parallel_checkpoint_resumes_without_it_and_back(tmp_path):
    saved = runs.run_3d(dp=2, cp=2, tp=1, pp=1, steps=2, save_to=str(tmp_path / "cp"))
    resumed = runs.run_3d(dp=2, tp=2, pp=1, steps=3, resume_from=str(tmp_path / "cp"))
    assert runs.check(saved) == [] and runs.check(resumed) == [] and resumed.start_step == 2
    runs.run_3d(dp=2, tp=2, pp=1, steps=2, save_to=str(tmp_path / "tp"))
    back = runs.run_3d(dp=1, cp=2, tp=2, pp=1, steps=3, resume_from=str(tmp_path / "tp"))
    assert runs.check(back) == [] and back.layout == {"dp": 1, "tp": 2, "pp": 1, "cp": 2}


def test_a_checkpoint_saved_under_context_parallel_and_a_pipeline_resumes_on_one_stage(tmp_path):
    saved = runs.run_3d(dp=1, cp=2, tp=1, pp=2, steps=2, save_to=str(tmp_path / "cp_pp"))
    resumed = runs.run_3d(dp=2, tp=2, pp=1, steps=3, resume_from=str(tmp_path / "cp_pp"))
    assert runs.check(saved) == [] and runs.check(resumed) == [] and resumed.start_step == 2
    assert saved.layout == {"dp": 1, "tp": 1, "pp": 2, "cp": 2}
    sharded = runs.run_3d(dp=1, cp=2, tp=2, pp=1, fsdp=True, steps=4, resume_from=str(tmp_path / "cp_pp"))
    assert runs.check(sharded) == [] and sharded.start_step == 2  # FSDP over the cp ranks this time


def test_a_dense_checkpoint_does_not_load_into_the_moe_model(tmp_path):
    from minitp.checkpoint import CheckpointError

    runs.run_3d(dp=2, tp=1, pp=1, steps=1, save_to=str(tmp_path / "dense"))
    # refused in the parent, before any rank starts (it was a rank's RankError until issue 24)
    with pytest.raises(CheckpointError, match="saved from .*no n_experts.*this model has .*n_experts=8"):
        runs.run_3d(dp=2, ep=2, tp=1, pp=1, steps=2, resume_from=str(tmp_path / "dense"))
