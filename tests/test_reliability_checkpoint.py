"""Checkpoints that survive a crash and refuse what does not fit (issue 11, items 5, 6 and 10).

A save killed with SIGKILL at a random moment leaves the folder loading as the previous checkpoint
or the new one, whole: never a mix, never neither. A checkpoint of another model (a config field, a
missing or an extra tensor), an edited index and a file holding pickled objects are each refused with
a ``CheckpointError`` that names the file and what does not match.
"""

import hashlib
import io
import json
import multiprocessing
import os
import random
import signal
import tempfile
import time

import pytest
import torch

from minitp import checkpoint
from minitp.checkpoint.index import digest
from minitp.launcher import RankError, launch
from minitp.models import build_model, get_config
from minitp.trainer import train_step

TINY = get_config("tiny")
KILLS = 20


# -- a save killed at random moments ------------------------------------------------------------------------
def _save_again_and_again(path: str, ready: str):
    """Two FSDP ranks (ZeRO-3) save step 1, 2, 3, ... into ``path`` until killed; every value saved at
    step k (parameters, both moments, AdamW's step) is k, so a mix of two saves shows."""
    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D

    par = Parallel3D(build_model(TINY, seed=0), Mesh(2, 1, 1), "fsdp")
    for k in range(1, 10**6):
        pieces = par.fsdp.local_pieces(par.optimizer)
        for piece in pieces:
            piece.step = k
            piece.tensors = {kind: torch.full_like(piece.tensors["param"], float(k)) for kind in checkpoint.KINDS}
        par.fsdp.load_local_pieces(pieces, par.optimizer)
        checkpoint.save(par, path, step=k)
        if k == 1 and par.mesh.rank == 0:
            open(ready, "w").close()  # a whole checkpoint is there: from now on every kill hits a save


def _saver(path: str, ready: str, workdir: str):
    """The process the test kills: its own process group, so one SIGKILL takes it and its ranks."""
    os.setpgid(0, 0)
    tempfile.tempdir = workdir  # what launch leaves behind when killed stays in the test's folder
    launch(_save_again_and_again, 2, path, ready, echo=False, timeout=120)


def _assert_one_whole_save(path: str) -> int:
    """The folder loads, and every value in it is the step its index names. Returns that step."""
    full = checkpoint.load_full(path)
    k = full["step"]
    assert full["optimizer_step"] == k
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        assert full[kind].keys() == dict(build_model(TINY).named_parameters()).keys()
        for name, t in full[kind].items():
            assert torch.all(t == k), (kind, name, k)
    return k


def test_a_save_killed_at_random_moments_leaves_the_old_or_the_new_checkpoint(tmp_path):
    path, rng, outcomes = str(tmp_path / "ckpt"), random.Random(0), []
    context = multiprocessing.get_context("fork")
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its first use imports for 1.5 s: once, here
    for kill in range(KILLS):
        ready = str(tmp_path / f"ready{kill}")
        saver = context.Process(target=_saver, args=(path, ready, str(tmp_path)))
        saver.start()
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            assert saver.is_alive() and time.monotonic() < deadline, "the saver died or never saved"
            time.sleep(0.005)
        before = checkpoint.read_index(path)["step"]  # whole, or the kill test could not tell old from new
        time.sleep(rng.uniform(0.0, 0.25))
        os.killpg(saver.pid, signal.SIGKILL)  # the saver and both ranks, at once: the machine went down
        saver.join()
        outcomes.append((before, _assert_one_whole_save(path)))
    assert all(after >= before >= 1 for before, after in outcomes)  # a kill never goes back past a whole save
    print("steps loaded after each kill:", [after for _, after in outcomes])

    def save_once(path):  # the next save cleans up what the kills left behind
        from minitp.mesh import Mesh
        from minitp.parallel3d import Parallel3D

        checkpoint.save(Parallel3D(build_model(TINY, seed=0), Mesh(1, 1, 1)), path, step=99)

    launch(save_once, 1, path, echo=False)
    assert sorted(os.listdir(path)) == ["index.json", checkpoint.read_index(path)["folder"]]


# -- a checkpoint that does not fit is refused ---------------------------------------------------------------
def _model(changes: dict, extra: bool):
    model = build_model(TINY.with_(**changes), seed=0)
    if extra:  # a tensor the plain model has not
        model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    return model


def _save(path: str, changes: dict, extra: bool = False):
    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D

    par = Parallel3D(_model(changes, extra), Mesh(1, 1, 1))
    train_step(par, *[torch.zeros(2, 4, dtype=torch.long)] * 2)  # AdamW's state exists: step 1
    checkpoint.save(par, path, step=1)


def _load(path: str, changes: dict, extra: bool = False):
    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D

    return checkpoint.load(Parallel3D(_model(changes, extra), Mesh(1, 1, 1)), path)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("refusals") / "ckpt")
    launch(_save, 1, path, {}, echo=False)
    assert launch(_load, 1, path, {}, echo=False)[0] == 1  # it loads into the model it came from
    return path


def _rewrite_index(path: str, edit, checksum: bool) -> None:
    index_path = os.path.join(path, "index.json")
    with open(index_path) as f:
        index = json.load(f)
    edit(index)
    if checksum:  # whoever edited it also knew to recompute the checksum
        index["sha256"] = digest(index)
    with open(index_path, "w") as f:
        json.dump(index, f)


def _copy(path: str, tmp_path) -> str:
    import shutil

    return shutil.copytree(path, str(tmp_path / "copy"))


@pytest.mark.parametrize("changes, message", [
    ({"n_layers": 2}, r"checkpoint .*ckpt/index.json was saved from n_layers=4, this model has n_layers=2"),
    ({"n_heads": 4, "n_kv_heads": 2},  # the same shapes: only the config tells them apart
     r"checkpoint .*ckpt/index.json was saved from n_heads=8, n_kv_heads=4, this model has n_heads=4, n_kv_heads=2"),
    ({"dim": 32}, r"tok_embeddings.weight is \[128, 64\] in .*ckpt/index.json, the model's is \[128, 32\]"),
], ids=["4-layers-into-2", "n_heads-8-into-4", "dim-64-into-32"])
def test_a_checkpoint_of_another_config_is_refused(four_layers, changes, message):
    with pytest.raises(RankError, match=f"CheckpointError: {message}"):
        launch(_load, 1, four_layers, changes, echo=False)


def test_a_missing_and_an_extra_tensor_are_refused(four_layers, tmp_path):
    with pytest.raises(RankError, match=r"checkpoint .*ckpt/index.json has no extra, which this model has"):
        launch(_load, 1, four_layers, {}, True, echo=False)
    with_extra = str(tmp_path / "with_extra")
    launch(_save, 1, with_extra, {}, True, echo=False)
    with pytest.raises(RankError, match=r"with_extra/index.json holds extra, which this model has not: every saved"):
        launch(_load, 1, with_extra, {}, echo=False)


def test_an_edited_index_is_refused(four_layers, tmp_path):
    path = _copy(four_layers, tmp_path)
    _rewrite_index(path, lambda index: index.update(step=5), checksum=False)
    with pytest.raises(checkpoint.CheckpointError, match=r"copy/index.json does not match its own SHA-256"):
        checkpoint.load_full(path)
    _rewrite_index(path, lambda index: None, checksum=True)  # the step edited, the checksum made to match
    with pytest.raises(checkpoint.CheckpointError, match=r"rank00000.pt was saved at step 1, .*index.json says step 5"):
        checkpoint.load_full(path)
    _rewrite_index(path, lambda index: index.update(step=1), checksum=True)
    checkpoint.load_full(path)  # as it was: loads

    def later(index):
        for piece in index["pieces"]:
            piece["optimizer_step"] = 7
    _rewrite_index(path, later, checksum=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"rank00000.pt holds .* at optimizer step 1, .* says 7"):
        checkpoint.load_full(path)


class _Payload:
    """An object a pickle would rebuild by calling a function: what weights_only refuses."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_a_file_with_pickled_objects_is_refused_naming_the_file(four_layers, tmp_path):
    path = _copy(four_layers, tmp_path)
    index = checkpoint.read_index(path)
    name = next(iter(index["files"]))
    buffer = io.BytesIO()
    torch.save({"step": 1, "tensors": {}, "payload": _Payload()}, buffer)
    data = buffer.getvalue()
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # made to pass the file's checksum
    _rewrite_index(path, lambda index: index["files"][name].update(entry), checksum=True)
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.load_full(path)
    message = str(refused.value)
    assert name in message and "not a tensor or a plain container" in message and "getcwd" in message
    assert "weights_only" not in message and refused.value.__cause__ is None and refused.value.__suppress_context__
