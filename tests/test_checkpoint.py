"""minitp.checkpoint: sharded saves that load into another layout bit for bit, resume exactly, and refuse
a save that did not finish or a file that changed."""

import os
import shutil

import pytest
import torch

from minitp import checkpoint, runs
from minitp.checkpoint import saving
from minitp.launcher import RankError, launch
from minitp.models import build_model, get_config, loss_fn
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches, train_reference

TINY = get_config("tiny")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dp2 × tp2 × pp2 run (DDP) saved after 2 of 4 steps, and the same run uninterrupted, saved at 4."""
    root = tmp_path_factory.mktemp("ckpt")
    half = runs.run_3d(nproc=8, dp=2, tp=2, pp=2, steps=2, save_to=str(root / "step2"))
    whole = runs.run_3d(nproc=8, dp=2, tp=2, pp=2, steps=4, save_to=str(root / "step4"))
    return root, half, whole


def _reshard_worker(src: str, dst: str, dp: int, pp: int, tp: int, fsdp: bool):
    """Load a checkpoint into a fresh model on another layout, then save it from there."""
    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D

    par = Parallel3D(build_model(TINY, seed=0), Mesh(dp, pp, tp), "fsdp" if fsdp else "ddp",
                     microbatches=8 // dp if pp > 1 else 1)
    step = checkpoint.load(par, src)
    checkpoint.save(par, dst, step)


def _assert_bit_identical(a: dict, b: dict):
    assert a["step"] == b["step"] and a["optimizer_step"] == b["optimizer_step"]
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        assert a[kind].keys() == b[kind].keys()
        for name in a[kind]:
            assert torch.equal(a[kind][name], b[kind][name]), (kind, name)


def test_a_saved_run_holds_the_whole_model_and_its_adamw_state(saved):
    root, half, _ = saved
    full = checkpoint.load_full(str(root / "step2"))
    assert full["step"] == 2 and full["optimizer_step"] == 2
    _, reference = train_reference(TINY, TrainConfig(steps=2))
    assert full["params"].keys() == reference.state_dict().keys()
    assert max((full["params"][k] - v).abs().max().item() for k, v in reference.state_dict().items()) <= 1e-5
    assert all(v.abs().sum() > 0 for v in full["exp_avg_sq"].values())  # the moments were written, not zeros
    index = checkpoint.read_index(str(root / "step2"))
    assert index["layout"] == {"dp": 2, "pp": 2, "tp": 2}
    assert len(index["files"]) == 4  # DDP: only the first replica writes


@pytest.mark.parametrize("dp,pp,tp,fsdp", [(1, 1, 4, False), (4, 2, 1, False), (2, 2, 2, True), (4, 1, 2, True)],
                         ids=["dp1xpp1xtp4", "dp4xpp2xtp1", "dp2xpp2xtp2-fsdp", "dp4xpp1xtp2-fsdp-zero3"])
def test_a_checkpoint_loads_into_another_layout_bit_for_bit(saved, tmp_path, dp, pp, tp, fsdp):
    root, _, _ = saved
    launch(_reshard_worker, dp * pp * tp, str(root / "step2"), str(tmp_path / "again"), dp, pp, tp, fsdp, echo=False)
    _assert_bit_identical(checkpoint.load_full(str(root / "step2")), checkpoint.load_full(str(tmp_path / "again")))


def test_resuming_continues_exactly_as_the_uninterrupted_run(saved, tmp_path):
    root, _, whole = saved
    resumed = runs.run_3d(nproc=8, dp=2, tp=2, pp=2, steps=4, resume_from=str(root / "step2"),
                          save_to=str(tmp_path / "resumed"))
    assert resumed["start_step"] == 2
    assert resumed["loss"] == whole["loss"][2:]  # exactly: the same arithmetic from the same state
    _assert_bit_identical(checkpoint.load_full(str(root / "step4")), checkpoint.load_full(str(tmp_path / "resumed")))


@pytest.mark.parametrize("dp,tp,pp,fsdp", [(1, 4, 2, False), (4, 1, 2, True)])
def test_resuming_in_another_layout_matches_the_reference(saved, dp, tp, pp, fsdp):
    root, _, _ = saved
    report = runs.run_3d(nproc=8, dp=dp, tp=tp, pp=pp, fsdp=fsdp, steps=4, resume_from=str(root / "step2"))
    assert runs.check(report) == []
    assert len(report["loss"]) == 2


def test_resuming_on_one_process_matches_the_reference(saved):
    root, _, _ = saved
    full = checkpoint.load_full(str(root / "step2"))
    model = build_model(TINY, seed=123)  # other weights: the checkpoint must replace all of them
    model.load_state_dict(full["params"])
    optimizer = make_optimizer(model.parameters(), 3e-3)
    for name, p in model.named_parameters():
        optimizer.state[p] = {"step": torch.tensor(float(full["optimizer_step"])),
                              "exp_avg": full["exp_avg"][name].clone(), "exp_avg_sq": full["exp_avg_sq"][name].clone()}
    for tokens, targets in synthetic_batches(TINY, TrainConfig(steps=4))[2:]:
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    _, reference = train_reference(TINY, TrainConfig(steps=4))
    assert max((p - reference.state_dict()[k]).abs().max().item() for k, p in model.state_dict().items()) <= 1e-5


def _copy(src, dst):
    shutil.copytree(src, dst)


def _shard(folder: str, name: str) -> str:
    """The path of a rank's file inside the save folder the index names."""
    return os.path.join(folder, checkpoint.read_index(folder)["folder"], name)


def test_a_torn_or_changed_file_is_refused(saved, tmp_path):
    root, _, _ = saved
    torn, changed = str(tmp_path / "torn"), str(tmp_path / "changed")
    _copy(str(root / "step2"), torn)
    _copy(str(root / "step2"), changed)
    shard = _shard(torn, "rank00002.pt")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(checkpoint.CheckpointError, match="rank00002.pt .* torn or was changed"):
        checkpoint.load_full(torn)
    shard = _shard(changed, "rank00000.pt")
    data = bytearray(open(shard, "rb").read())
    data[-100] ^= 0xFF  # one bit pattern changed, same size
    open(shard, "wb").write(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="torn or was changed"):
        checkpoint.load_full(changed)
    os.remove(os.path.join(torn, "index.json"))
    with pytest.raises(checkpoint.CheckpointError, match="not a finished checkpoint"):
        checkpoint.load_full(torn)


def _crash_while_saving(src: str, dst: str):
    """Load a checkpoint and save it again into ``dst`` (which holds one already), but rank 3 dies
    while writing its file."""
    import torch.distributed as dist

    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D

    par = Parallel3D(build_model(TINY, seed=0), Mesh(2, 2, 2), "ddp", microbatches=4)
    step = checkpoint.load(par, src)
    if dist.get_rank() == 3:
        def die_midway(path, data):
            with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                f.write(data[: len(data) // 2])
            os._exit(1)  # the machine went down mid-save

        saving.write_atomic = die_midway
    checkpoint.save(par, dst, step + 100)


def test_a_save_that_crashed_midway_leaves_the_previous_checkpoint_whole(saved, tmp_path):
    root, _, _ = saved
    target = str(tmp_path / "target")
    _copy(str(root / "step2"), target)  # a finished checkpoint is there; the crashing save replaces it
    with pytest.raises(RankError):  # rank 3 died; which rank is reported first depends on timing
        launch(_crash_while_saving, 8, str(root / "step2"), target, echo=False, timeout=60)
    leftovers = sorted(os.listdir(target))
    assert len(leftovers) == 3 and "index.json" in leftovers  # the old save folder, and the half-written new one
    _assert_bit_identical(checkpoint.load_full(target), checkpoint.load_full(str(root / "step2")))  # still step 2
    resumed = runs.run_3d(nproc=8, steps=4, resume_from=target, save_to=target)
    assert resumed["start_step"] == 2
    assert checkpoint.load_full(target)["step"] == 4
    assert sorted(os.listdir(target)) == ["index.json", checkpoint.read_index(target)["folder"]]  # no leftovers


def test_loading_into_another_model_is_refused(saved):
    root, _, _ = saved

    def worker():
        from minitp.mesh import Mesh
        from minitp.parallel3d import Parallel3D

        par = Parallel3D(build_model(TINY.with_(dim=32), seed=0), Mesh(8, 1, 1))
        checkpoint.load(par, str(root / "step2"))

    with pytest.raises(RankError, match=r"tok_embeddings.weight is \[128, 64\] in .*, the model's is \[128, 32\]"):
        launch(worker, 8, echo=False)
