"""Checkpoints refused in one line, before any process starts, and never at the cost of a learner's files
(issue 24, items 1, 2 and the index part of 6).

A ``--save-to`` folder that holds anything minitp did not write is refused, and nothing in it removed.
A ``--resume-from`` checkpoint that does not fit the run (MoE into dense, another expert count) or whose
files are torn, changed, missing or hold pickled objects is refused in the parent: exit 2, one line,
no rank started. What a rank still meets (a full disk while saving, a file changed after the parent
looked) reaches the learner as one line naming the file; a failed save removes its own folder and
leaves the previous checkpoint whole. An index naming a file outside its own folder is refused.
"""

import errno
import hashlib
import io
import json
import os
import re
import shutil

import pytest
import torch

from minitp import checkpoint, cli, runs
from minitp.checkpoint import disk, saving
from minitp.checkpoint.index import digest
from minitp.launcher import RankError, launch
from minitp.models import build_model, get_config

TINY = get_config("tiny")
ONE_RANK = ["--dp", "1", "--tp", "1", "--pp", "1"]
TWO_EXPERT_RANKS = ["--dp", "2", "--ep", "2", "--tp", "1", "--pp", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dense checkpoint (one rank) and a MoE one (8 experts over ep = 2), each after one step."""
    root = tmp_path_factory.mktemp("refusals")
    runs.run_3d(dp=1, tp=1, pp=1, steps=1, save_to=str(root / "dense"))
    runs.run_3d(dp=2, ep=2, tp=1, pp=1, steps=1, save_to=str(root / "moe"))
    return root


def _minitp(args: list[str], capsys) -> tuple[int, list[str]]:
    """Exit code and the lines printed to stderr by ``minitp run 3d ARGS``."""
    code = cli.main(["run", "3d", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def _tree(path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder (None) under ``path``."""
    found = {}
    for folder, dirs, files in os.walk(path):
        for d in dirs:
            found[os.path.relpath(os.path.join(folder, d), path) + "/"] = None
        for f in files:
            with open(os.path.join(folder, f), "rb") as opened:
                found[os.path.relpath(os.path.join(folder, f), path)] = opened.read()
    return found


def _learners_folder(path) -> str:
    """A folder with a learner's files in it, named the way minitp names its own."""
    os.makedirs(os.path.join(path, "save-000001"))
    for name, text in (("save-000001/my_model.pt", "mine"), ("rank00001.pt", "mine too"), ("notes.txt", "notes"),
                       ("x.tmp-123", "a draft")):
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    return str(path)


def _rewrite_index(path: str, edit) -> None:
    """Edit the index and make its checksum match: what only the files' own checks can catch."""
    index_path = os.path.join(path, "index.json")
    with open(index_path) as f:
        index = json.load(f)
    edit(index)
    index["sha256"] = digest(index)
    with open(index_path, "w") as f:
        json.dump(index, f)


def _shard(path: str, rank: int = 0) -> str:
    return os.path.join(path, checkpoint.read_index(path)["folder"], f"rank{rank:05d}.pt")


# -- item 1: a --save-to folder with a learner's files --------------------------------------------------------
def test_save_to_a_folder_holding_a_learners_files_is_refused_in_one_line_and_nothing_is_deleted(
        tmp_path, no_launch, capsys):
    folder = _learners_folder(tmp_path / "work")
    before = _tree(folder)
    code, lines = _minitp([*ONE_RANK, "--steps", "1", "--save-to", folder], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"minitp: error: save_to={folder!r} holds notes.txt, rank00001.pt, save-000001/, "
                               f"x.tmp-123, which minitp did not write")
    assert _tree(folder) == before


def test_a_save_from_the_library_into_a_learners_folder_removes_nothing(tmp_path):
    folder = _learners_folder(tmp_path / "work")
    before = _tree(folder)

    def save(path):
        from minitp.mesh import Mesh
        from minitp.parallel3d import Parallel3D

        checkpoint.save(Parallel3D(build_model(TINY, seed=0), Mesh(1, 1, 1)), path, step=1)

    with pytest.raises(RankError, match=r"CheckpointError: .*work holds notes.txt, .* which minitp did not write"):
        launch(save, 1, folder, echo=False)
    assert _tree(folder) == before


def test_saving_over_a_minitp_checkpoint_replaces_it_and_removes_only_what_minitp_left(saved, tmp_path):
    target = shutil.copytree(saved / "dense", tmp_path / "target")
    os.remove(os.path.join(target, "save-000001", checkpoint.MARK))  # an older minitp's: its index names it
    disk.make_save_folder(str(target), "save-000007")  # a save that crashed: marked, named by no index
    os.makedirs(os.path.join(target, "save-000009.minitp-tmp-42"))  # a save folder that was being born
    open(os.path.join(target, "index.json.minitp-tmp-17"), "w").close()  # an index that was being written
    runs.run_3d(dp=1, tp=1, pp=1, steps=2, resume_from=str(target), save_to=str(target))
    assert sorted(os.listdir(target)) == ["index.json", "save-000002"]
    assert sorted(os.listdir(os.path.join(target, "save-000002"))) == [checkpoint.MARK, "rank00000.json",
                                                                        "rank00000.pt"]
    assert checkpoint.load_full(str(target))["step"] == 2


# -- item 2: refused in the parent, before any rank starts ---------------------------------------------------
def _truncate(path):
    shard = _shard(path)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)


def _flip(path):
    shard = _shard(path)
    with open(shard, "rb") as f:
        data = bytearray(f.read())
    data[-100] ^= 0x01  # one bit, same size
    with open(shard, "wb") as f:
        f.write(bytes(data))


def _remove(path):
    os.remove(_shard(path))


class _Payload:
    """An object a pickle would rebuild by calling a function: what weights_only refuses."""

    def __reduce__(self):
        return (os.getcwd, ())


def _pickle(path):
    name = os.path.relpath(_shard(path), path)
    buffer = io.BytesIO()
    torch.save({"step": 1, "tensors": {}, "payload": _Payload()}, buffer)
    data = buffer.getvalue()
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)
    _rewrite_index(path, lambda index: index["files"][name].update(bytes=len(data),
                                                                   sha256=hashlib.sha256(data).hexdigest()))


CASES = {  # id: (the checkpoint, what is done to a copy of it, the run's arguments, the one line)
    "moe-into-dense": ("moe", None, ONE_RANK,
                       r"checkpoint .*/index.json was saved from .*n_experts=8.*, this model has .*no n_experts"),
    "dense-into-moe": ("dense", None, TWO_EXPERT_RANKS,
                       r"checkpoint .*/index.json was saved from .*no n_experts.*, this model has .*n_experts=8"),
    "8-experts-into-4": ("moe", None, [*TWO_EXPERT_RANKS, "--experts", "4"],
                         r"router.weight is \[8, 64\] in .*/index.json, the model's is \[4, 64\]"),
    "truncated": ("dense", _truncate, ONE_RANK, r"/save-000001/rank00000.pt has \d+ bytes .* torn or was changed"),
    "bit-flipped": ("dense", _flip, ONE_RANK, r"/save-000001/rank00000.pt has .* torn or was changed"),
    "missing": ("dense", _remove, ONE_RANK, r"/save-000001/rank00000.pt is missing; refusing to load"),
    "pickle-payload": ("dense", _pickle, ONE_RANK, r"/save-000001/rank00000.pt holds an object that is not a tensor "
                                                   r"or a plain container \(posix.getcwd\)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_that_cannot_resume_the_run_is_refused_in_one_line_before_any_process_starts(
        saved, tmp_path, no_launch, capsys, case):
    source, damage, args, message = CASES[case]
    path = shutil.copytree(saved / source, tmp_path / "ckpt")
    if damage is not None:
        damage(str(path))
    code, lines = _minitp([*args, "--steps", "2", "--resume-from", str(path)], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("minitp: error: ") and str(path) in lines[0]
    assert re.search(message, lines[0]), lines[0]


def test_check_before_launch_passes_a_whole_checkpoint_and_returns_its_step(saved):
    shapes = {name: tuple(p.shape) for name, p in build_model(TINY).named_parameters()}
    assert checkpoint.check_before_launch(str(saved / "dense"), TINY, shapes) == 1


# -- item 2: what a rank meets, in one line ------------------------------------------------------------------
def test_a_checkpoint_error_inside_a_rank_reaches_the_learner_in_one_line(saved, tmp_path, monkeypatch, capsys):
    path = shutil.copytree(saved / "dense", tmp_path / "changed")
    _flip(str(path))  # as if the file changed after the parent looked: the rank's own check refuses it
    monkeypatch.setattr(checkpoint, "check_before_launch", lambda path, *args: checkpoint.read_index(path)["step"])
    code, lines = _minitp([*ONE_RANK, "--steps", "2", "--resume-from", str(path)], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"minitp: error: rank 0: {path}/save-000001/rank00000.pt has ")
    assert lines[0].endswith("the file is torn or was changed; refusing to load")


def test_a_save_that_fills_the_disk_removes_its_folder_leaves_the_previous_checkpoint_and_says_which_file(
        saved, tmp_path, monkeypatch, capsys):
    target = str(shutil.copytree(saved / "dense", tmp_path / "target"))
    before = _tree(target)
    write = disk.write_atomic

    def disk_full(path, data):  # the ranks are forked: they write through this too
        if path.endswith(".pt"):
            with open(f"{path}.minitp-tmp-{os.getpid()}", "wb") as f:
                f.write(data[: len(data) // 2])  # half of it went to disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(path, data)

    monkeypatch.setattr(saving, "write_atomic", disk_full)
    code, lines = _minitp([*ONE_RANK, "--steps", "2", "--resume-from", target, "--save-to", target], capsys)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0] == (f"minitp: error: rank 0: [Errno 28] No space left on device while writing "
                        f"{target}/save-000002/rank00000.pt: the unfinished save save-000002 was removed; "
                        f"{target} still holds the previous checkpoint")
    assert _tree(target) == before  # the old checkpoint, whole; nothing of the new one
    assert checkpoint.load_full(target)["step"] == 1


def test_a_write_that_fails_removes_its_temporary_file_and_names_the_file(tmp_path, monkeypatch):
    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    where = str(tmp_path / "rank00000.pt")
    with pytest.raises(OSError) as failed:
        disk.write_atomic(where, b"some bytes")
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == where
    assert os.listdir(tmp_path) == []


# -- item 6 (the index part): an index naming a file outside its folder --------------------------------------
@pytest.mark.parametrize("outside", ["../outside.pt", "save-000001/../../outside.pt", "ABSOLUTE"])
def test_an_index_naming_a_file_outside_its_folder_is_refused_naming_it(saved, tmp_path, outside):
    path = str(shutil.copytree(saved / "dense", tmp_path / "ckpt"))
    shutil.copy(_shard(path), tmp_path / "outside.pt")  # a whole, valid file: only its place is wrong
    outside = str(tmp_path / "outside.pt") if outside == "ABSOLUTE" else outside

    def elsewhere(index):
        (entry,) = index["files"].values()  # one rank, one file
        index["files"] = {outside: entry}
        for piece in index["pieces"]:
            piece["file"] = outside

    _rewrite_index(path, elsewhere)
    with pytest.raises(checkpoint.CheckpointError,
                       match=re.escape(f"ckpt/index.json names the file '{outside}', expected a plain file name "
                                       f"inside its save folder")):
        checkpoint.load_full(path)


def test_an_index_naming_a_save_folder_outside_its_checkpoint_is_refused(saved, tmp_path):
    path = str(shutil.copytree(saved / "dense", tmp_path / "ckpt"))
    _rewrite_index(path, lambda index: index.update(folder=".."))
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt/index.json names the save folder '\.\.', expected"):
        checkpoint.read_index(path)
