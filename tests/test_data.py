"""minitp.data: the standard library's source as byte tokens, split by file, cached once, sampled as a
pure function of the step."""

import os

import numpy as np
import pytest
import torch

from minitp import data


def write_tree(root, names, text=lambda name: f"# {name}\nx = 1\n"):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text(name))
    return root


def fake_corpus(tmp_path, n=40):
    """``n`` small modules plus files the corpus must skip."""
    root = write_tree(tmp_path / "lib", [f"pkg{i % 4}/mod{i:02d}.py" for i in range(n)])
    write_tree(root, ["test/test_x.py", "pkg0/tests/t.py", "idlelib/a.py", "lib2to3/b.py", "site-packages/c.py",
                      "pkg1/__pycache__/d.py", "notes.txt", "pkg2/data.pyc"])
    (root / "big.py").write_bytes(b"#" * (data.MAX_FILE_BYTES + 1))
    return root


def test_the_file_list_is_sorted_filtered_and_relative(tmp_path):
    root = fake_corpus(tmp_path)
    paths = [path for path, _, _ in data.list_files(root)]
    assert paths == sorted(paths) and len(paths) == 40
    assert all(p.startswith("pkg") and p.endswith(".py") and not p.startswith("/") for p in paths)


def test_the_split_is_by_file_and_deterministic(tmp_path):
    root = fake_corpus(tmp_path)
    corpus = data.load_corpus(str(root), val_percent=30, cache_dir=str(tmp_path / "cache"))
    paths = [path for path, _, _ in data.list_files(root)]
    expected_val = [p for p in paths if data.in_validation(p, 30)]
    assert corpus.val_files == len(expected_val) and corpus.train_files == 40 - len(expected_val)
    assert 0 < corpus.val_files < 40
    # every file is whole on one side: validation is exactly those files, each followed by the separator
    assert bytes(corpus.val) == b"".join((root / p).read_bytes() + data.SEPARATOR for p in expected_val)
    assert int((np.asarray(corpus.train) == 0).sum()) == corpus.train_files
    # the split of a file does not depend on which other files exist
    write_tree(root, ["pkg9/extra.py"])
    again = data.load_corpus(str(root), val_percent=30, cache_dir=str(tmp_path / "cache"))
    assert again.files == 41 and (again.val_files - corpus.val_files) == int(data.in_validation("pkg9/extra.py", 30))


def test_a_second_load_reuses_the_cache_and_gives_identical_arrays(tmp_path):
    root, cache = fake_corpus(tmp_path), tmp_path / "cache"
    first = data.load_corpus(str(root), val_percent=20, cache_dir=str(cache))
    (bin_path,) = cache.glob("*.bin")
    built = bin_path.stat().st_mtime_ns
    second = data.load_corpus(str(root), val_percent=20, cache_dir=str(cache))
    assert bin_path.stat().st_mtime_ns == built and sorted(p.name for p in cache.iterdir()) == sorted(
        [bin_path.name, bin_path.with_suffix(".json").name])  # no rebuild, no temporary file left
    assert isinstance(second.train, np.memmap) and second.digest == first.digest
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)


def test_the_cache_folder_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MINITP_CACHE", str(tmp_path / "a"))
    assert data.cache_folder() == tmp_path / "a"
    monkeypatch.delenv("MINITP_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_folder() == tmp_path / "xdg" / "minitp"
    assert data.cache_folder(str(tmp_path / "b")) == tmp_path / "b"


@pytest.mark.parametrize("damage", ["truncate", "flip", "json"])
def test_a_damaged_cache_is_rebuilt(tmp_path, damage):
    root, cache = fake_corpus(tmp_path), tmp_path / "cache"
    good = data.load_corpus(str(root), val_percent=20, cache_dir=str(cache))
    expected = bytes(good.train) + bytes(good.val)
    del good
    (bin_path,) = cache.glob("*.bin")
    raw = bytearray(bin_path.read_bytes())
    if damage == "truncate":
        bin_path.write_bytes(raw[:-7])
    elif damage == "flip":
        raw[3] ^= 0xFF
        bin_path.write_bytes(raw)
    else:
        bin_path.with_suffix(".json").write_text("{not json")
    # a size or JSON problem is seen at every load; a flipped byte of the same size only when verifying
    again = data.load_corpus(str(root), val_percent=20, cache_dir=str(cache), verify=damage == "flip")
    assert bytes(again.train) + bytes(again.val) == expected
    assert bin_path.read_bytes() == expected


def test_the_sampler_is_a_pure_function_of_the_step():
    tokens = np.arange(1000, dtype=np.int64) % 256
    sampler = data.Sampler(tokens.astype(np.uint8), batch_size=8, seq_len=16, seed=3)
    x, y = sampler.batch(5)
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the tokens shifted by one
    sampler.batch(6)
    assert all(torch.equal(a, b) for a, b in zip((x, y), sampler.batch(5)))
    fresh = data.Sampler(tokens.astype(np.uint8), batch_size=8, seq_len=16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip((x, y), fresh.batch(5)))
    assert not torch.equal(x, sampler.batch(6)[0])
    assert not torch.equal(x, data.Sampler(tokens.astype(np.uint8), 8, 16, seed=4).batch(5)[0])


def test_rank_batches_are_disjoint_pieces_of_the_global_batch():
    sampler = data.Sampler(np.arange(5000, dtype=np.int64).astype(np.uint8), batch_size=12, seq_len=8)
    x, y = sampler.batch(7)
    pieces = [sampler.rank_batch(7, rank, 3) for rank in range(3)]
    assert all(p[0].shape == (4, 8) for p in pieces)
    assert torch.equal(torch.cat([p[0] for p in pieces]), x) and torch.equal(torch.cat([p[1] for p in pieces]), y)


def test_bad_corpus_input_names_what_was_wrong(tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        data.load_corpus(str(tmp_path / "nowhere"), cache_dir=cache)
    write_tree(tmp_path / "no_py", ["readme.txt", "test/test_a.py"])
    with pytest.raises(ValueError, match="found none: the corpus would be empty"):
        data.load_corpus(str(tmp_path / "no_py"), cache_dir=cache)
    root = fake_corpus(tmp_path)
    for bad in (0, 51, -5):
        with pytest.raises(ValueError, match=rf"val_percent must be an integer from 1 to 50, got {bad}"):
            data.load_corpus(str(root), val_percent=bad, cache_dir=cache)
    with pytest.raises(ValueError, match="max_files must be a positive integer or None, got 0"):
        data.load_corpus(str(root), max_files=0, cache_dir=cache)
    one = write_tree(tmp_path / "one", ["only.py"])
    side = "validation" if not data.in_validation("only.py", 1) else "train"
    with pytest.raises(ValueError, match=f"val_percent=1 leaves {side} empty: all 1 files"):
        data.load_corpus(str(one), val_percent=1, cache_dir=cache)
    assert not os.path.exists(cache)  # nothing was written for a refused corpus


def test_bad_sampler_input_names_what_was_wrong():
    tokens = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="seq_len=100 needs 101 tokens .* holds only 100"):
        data.Sampler(tokens, batch_size=2, seq_len=100)
    with pytest.raises(ValueError, match="seq_len must be at least 1, got 0"):
        data.Sampler(tokens, batch_size=2, seq_len=0)
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        data.Sampler(tokens, batch_size=0, seq_len=8)
    sampler = data.Sampler(tokens, batch_size=6, seq_len=99)  # exactly one window fits
    assert sampler.batch(0)[0].shape == (6, 99)
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by dp=4"):
        sampler.rank_batch(0, 0, 4)
    with pytest.raises(ValueError, match=r"dp_rank=3 is outside 0..2 \(dp=3\)"):
        sampler.rank_batch(0, 3, 3)
    with pytest.raises(ValueError, match="step must be 0 or more, got -1"):
        sampler.batch(-1)
    with pytest.raises(ValueError, match=r"sequence length 512 is longer than the model allows \(max_seq_len=256\)"):
        data.check_seq_len(512, 256)
    data.check_seq_len(256, 256)


def test_encode_and_decode_round_trip():
    text = "def f(x):\n    return x  # café ∑\n"
    tokens = data.encode(text)
    assert tokens.dtype == torch.long and int(tokens.max()) < data.VOCAB_SIZE
    assert data.decode(tokens) == text and data.decode(tokens.numpy()) == text and data.decode(tokens.tolist()) == text
    assert data.decode([0x63, 0xC3]) == "c\ufffd"  # a cut UTF-8 character does not raise
    with pytest.raises(ValueError, match="tokens must be bytes 0..255, got 0..300"):
        data.decode([0, 300])


def test_the_real_standard_library_gives_printable_python(tmp_path):
    corpus = data.load_corpus(max_files=30, val_percent=20, cache_dir=str(tmp_path))
    assert corpus.files == 30 and corpus.train.size > 0 and corpus.val.size > 0
    assert corpus.train_files + corpus.val_files == 30 and "MB of Python from 30 files of" in corpus.describe()
    text = data.decode(data.Sampler(corpus.train, batch_size=4, seq_len=256).batch(0)[0])
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    assert printable / len(text) > 0.95


def tar_of(root, archive, names=None, extra=()):
    """A .tar.gz of the .py files under ``root`` (relative names), plus ``extra`` (name, bytes) members."""
    import io
    import tarfile

    with tarfile.open(archive, "w:gz") as tar:
        for path, _, _ in data.list_files(root):
            tar.add(root / path, arcname=path)
        for name, blob in extra:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return archive


def test_an_archive_gives_the_same_corpus_as_its_folder(tmp_path):
    root = fake_corpus(tmp_path)
    archive = tar_of(root, tmp_path / "lib.tar.gz")
    folder = data.load_corpus(str(root), val_percent=30, cache_dir=str(tmp_path / "a"))
    packed = data.load_corpus(str(archive), val_percent=30, cache_dir=str(tmp_path / "b"))
    assert packed.digest == folder.digest and packed.val_files == folder.val_files and packed.files == 40
    assert packed.source == str(archive.resolve())
    again = data.load_corpus(str(archive), val_percent=30, cache_dir=str(tmp_path / "b"))
    assert again.digest == packed.digest and len(list((tmp_path / "b").glob("lib-*"))) == 1  # unpacked once


@pytest.mark.parametrize("name", ["../escape.py", "/abs.py"])
def test_an_archive_with_a_path_outside_its_folder_is_refused(tmp_path, name):
    root = fake_corpus(tmp_path)
    archive = tar_of(root, tmp_path / "bad.tar.gz", extra=[(name, b"x = 1\n")])
    with pytest.raises(ValueError, match="expected plain files with relative paths"):
        data.load_corpus(str(archive), cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "escape.py").exists()


def test_the_course_corpus_is_the_same_bytes_on_every_python(tmp_path):
    """Chapter 09 and the trainer's tests read it: its tokens, split and digest are pinned."""
    corpus = data.load_corpus(data.COURSE_CORPUS, cache_dir=str(tmp_path))
    assert (corpus.files, corpus.train_files, corpus.val_files) == (84, 82, 2)
    assert (corpus.train.size, corpus.val.size) == (1_129_102, 24_396)
    assert corpus.digest == "87b757c07af355bdaf75ea7e082f0752f2e4f2fc2dc73f7dde0d7ec109d188ef"
