"""Real text without a download: the Python standard library's own source, as bytes.

**Tokens.** One token per byte (``VOCAB_SIZE = 256``): no tokenizer to train or ship, and any
sequence of tokens decodes. Files are joined in sorted order, each followed by the byte ``0``
(``SEPARATOR``), which Python source never contains, so the model can learn where a file ends.

**Split by file.** A file goes to validation when ``sha256(relative path) % 100 < val_percent``:
the same file lands on the same side on every machine and Python version, whatever else exists.

**Cache.** Built once into ``<cache>/corpus-py3.11-<key>-val5.bin`` (train bytes, then validation
bytes) with a ``.json`` beside it: the file list's digest, the byte counts and the SHA-256 of the
tokens. The key is a SHA-256 of the root and every file's path, size and modification time, so an
edited file means a new cache. Both files are written under a temporary name and renamed (atomic on
POSIX), so ranks building at once never see half a file. A load checks only the file list's digest
and the size (fast); ``verify=True`` re-hashes every byte. A cache that fails a check is rebuilt.

**The course's corpus.** ``COURSE_CORPUS`` is a ``.tar.gz`` shipped with minitp: its own source
(``src/minitp``'s 84 ``.py`` files at commit 751c0a6, 0.8 MB). The standard library differs from one
Python to the next (599 files here on 3.11, 583 on 3.10, 551 on 3.12), so what chapter 09 and the
tests store is trained on this one, the same bytes everywhere. ``load_corpus`` takes an archive
like a folder: it unpacks it once into the cache, under its SHA-256, and reads that folder.

**Sampling.** ``Sampler.batch(step)`` is a pure function of (seed, step): a run resumed at step k
sees exactly the batches an uninterrupted run would have, and ``rank_batch`` hands each
data-parallel rank its own disjoint rows of that one global batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 256
SEPARATOR = b"\x00"  # ends every file; never appears in Python source
MAX_FILE_BYTES = 200 * 1024  # larger files are mostly data tables, not code
SKIPPED_FOLDERS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
FORMAT = 1
COURSE_CORPUS = str(Path(__file__).parent / "data_files" / "minitp-source.tar.gz")


@dataclass(frozen=True, eq=False)  # eq=False: arrays do not compare to one bool
class Corpus:
    """The token arrays (read-only ``np.memmap`` of uint8) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    files: int
    train_files: int
    val_files: int
    source: str  # the folder the files were read from
    digest: str  # SHA-256 of all token bytes (train then validation)

    def describe(self) -> str:
        mb = lambda n: f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.0f} kB"
        return (f"{mb(self.train.size + self.val.size)} of Python from {self.files:,} files of "
                f"{self.source} (train {mb(self.train.size)}, validation {mb(self.val.size)})")


def list_files(root: str | Path) -> list[tuple[str, int, int]]:
    """(relative posix path, size, mtime_ns) of every ``*.py`` kept under ``root``, sorted by
    path."""
    root = Path(root)
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [s for s in subfolders if s not in SKIPPED_FOLDERS]
        for name in names:
            if name.endswith(".py"):
                stat = os.stat(os.path.join(folder, name))
                if stat.st_size <= MAX_FILE_BYTES:
                    found.append(((Path(folder) / name).relative_to(root).as_posix(), stat.st_size,
                                  stat.st_mtime_ns))
    return sorted(found)


def in_validation(path: str, val_percent: int) -> bool:
    """Whether a file (by its relative path) belongs to the validation split."""
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") % 100 < val_percent


def cache_folder(cache_dir: str | None = None) -> Path:
    """``cache_dir``, else ``$MINITP_CACHE``, else ``$XDG_CACHE_HOME/minitp``, else
    ``~/.cache/minitp``."""
    if cache_dir is None:
        cache_dir = os.environ.get("MINITP_CACHE") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minitp")
    return Path(cache_dir)


def load_corpus(root: str | None = None, val_percent: int = 5, cache_dir: str | None = None,
                max_files: int | None = None, *, verify: bool = False) -> Corpus:
    """The corpus under ``root`` (default: this Python's standard library), built once then
    memory-mapped.

    ``root`` is a folder of ``.py`` files or a ``.tar.gz`` of them (``COURSE_CORPUS``).
    ``max_files`` keeps the first N files of the sorted list (quick tests); ``verify=True``
    re-hashes the cached tokens and rebuilds them if they changed."""
    try:
        return _load_corpus(root, val_percent, cache_dir, max_files, verify)
    except OSError as e:  # most often the cache (or an archive's folder in it) cannot be written
        if e.filename is None:  # one of ours, with its own message (a missing root)
            raise
        cache = cache_folder(cache_dir)
        if str(e.filename).startswith(str(cache)):
            raise ValueError(
                f"the corpus cache {cache} cannot be written ({e.strerror}: {e.filename}): set "
                f"MINITP_CACHE to a folder you can write") from None
        raise ValueError(f"the corpus could not be read ({e.strerror}: {e.filename})") from None


def _load_corpus(root, val_percent, cache_dir, max_files, verify) -> Corpus:
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"]).resolve()
    archive = None
    if root.is_file() and root.name.endswith((".tar.gz", ".tgz")):
        archive, root = root, unpack(root, cache_folder(cache_dir))
    if not root.is_dir():
        raise FileNotFoundError(
            f"expected a folder of .py files or a .tar.gz of them, but {str(root)!r} is "
            f"{'a file' if root.exists() else 'not there'}")
    if isinstance(val_percent, bool) or not isinstance(val_percent,
                                                       int) or not 1 <= val_percent <= 50:
        raise ValueError(f"val_percent must be an integer from 1 to 50, got {val_percent!r}")
    if max_files is not None and (isinstance(max_files, bool) or not isinstance(max_files, int)
                                  or max_files < 1):
        raise ValueError(f"max_files must be a positive integer or None, got {max_files!r}")
    files = list_files(root)[:max_files]
    if not files:
        raise ValueError(
            f"expected .py files under {root} (skipping {', '.join(sorted(SKIPPED_FOLDERS))} "
            f"and files over {MAX_FILE_BYTES // 1024} KB), found none: the corpus would be empty")
    val = [path for path, _, _ in files if in_validation(path, val_percent)]
    train = [path for path, _, _ in files if not in_validation(path, val_percent)]
    if not val or not train:
        empty = "validation" if not val else "train"
        raise ValueError(f"val_percent={val_percent} leaves {empty} empty: all {len(files)} files "
                         f"of {root} fell on the other side; use more files "
                         f"(max_files={max_files}) or another val_percent")

    listing = "".join(f"{path}\t{size}\t{mtime}\n" for path, size, mtime in files)
    list_digest = hashlib.sha256(f"{root}\n{listing}".encode()).hexdigest()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = f"corpus-py{version}-{list_digest[:16]}-val{val_percent}"
    bin_path = cache_folder(cache_dir) / f"{base}.bin"
    json_path = cache_folder(cache_dir) / f"{base}.json"

    meta = _read_meta(json_path, bin_path, list_digest)
    if meta is not None and verify and _sha256_file(bin_path) != meta["sha256"]:
        meta = None
    if meta is None:  # missing, stale or damaged: build it again
        meta = _build(root, train, val, list_digest, bin_path, json_path)
    tokens = np.memmap(bin_path, dtype=np.uint8, mode="r")
    n_train = meta["train_bytes"]
    return Corpus(train=tokens[:n_train], val=tokens[n_train:], files=len(files),
                  train_files=len(train), val_files=len(val), source=str(archive or root),
                  digest=meta["sha256"])


def unpack(archive: Path, cache: Path) -> Path:
    """The folder ``archive`` (a .tar.gz of .py files) unpacks into, once:
    ``<cache>/<name>-<sha256>``.

    Unpacked into a temporary folder and renamed, so two processes unpacking at once both end with
    one whole folder. Members are plain files with relative paths, checked before anything is
    written."""
    digest = _sha256_file(archive)[:16]
    folder = cache / f"{archive.name.split('.')[0]}-{digest}"
    if folder.is_dir():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f"{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for member in members:
            if not member.isfile() or member.name.startswith("/") or ".." in member.name.split("/"):
                raise ValueError(
                    f"{archive}: expected plain files with relative paths, found {member.name!r}")
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        tar.extractall(tmp, members=members, **safe)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process got there first: its folder holds the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _read_meta(json_path: Path, bin_path: Path, list_digest: str) -> dict | None:
    """The cache's JSON when it describes this file list and the token file has its size, else
    None."""
    try:
        meta = json.loads(json_path.read_text())
        ok = (meta["format"] == FORMAT and meta["list_digest"] == list_digest
              and bin_path.stat().st_size == meta["train_bytes"] + meta["val_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if ok else None


def _build(root: Path, train: list[str], val: list[str], list_digest: str, bin_path: Path,
           json_path: Path) -> dict:
    parts = {name: b"".join((root / path).read_bytes() + SEPARATOR for path in paths)
             for name, paths in (("train", train), ("val", val))}
    tokens = parts["train"] + parts["val"]
    meta = {"format": FORMAT, "list_digest": list_digest, "source": str(root),
            "train_bytes": len(parts["train"]), "val_bytes": len(parts["val"]),
            "sha256": hashlib.sha256(tokens).hexdigest(), "train_files": train, "val_files": val}
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    # the tokens first: a JSON on disk always describes a whole token file
    _write_atomic(bin_path, tokens)
    _write_atomic(json_path, json.dumps(meta, indent=1).encode())
    return meta


def _write_atomic(path: Path, data: bytes) -> None:
    # unique per rank and host
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class Sampler:
    """Random windows of ``seq_len + 1`` tokens; ``batch(step)`` depends only on (seed, step)."""

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if seq_len + 1 > len(data):
            raise ValueError(f"seq_len={seq_len} needs {seq_len + 1} tokens per row (inputs and "
                             f"the next token), but the data holds only {len(data)}")
        self.data, self.batch_size, self.seq_len, self.seed = data, batch_size, seq_len, seed

    def _starts(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be 0 or more, got {step}")
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % 2**63)
        starts = torch.randint(0, len(self.data) - self.seq_len, (self.batch_size,),
                               generator=generator)
        return starts.numpy()  # (B,)

    def _rows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # (b, S+1)
        windows = np.asarray(self.data[starts[:, None] + np.arange(self.seq_len + 1)],
                             dtype=np.int64)
        windows = torch.from_numpy(windows)
        # tokens (b, S), targets (b, S): the next token of each
        return windows[:, :-1], windows[:, 1:]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: (tokens, targets), both long (batch_size, seq_len)."""
        return self._rows(self._starts(step))

    def rank_batch(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [dp_rank*B/dp, (dp_rank+1)*B/dp) of ``batch(step)``: disjoint across data-parallel
        ranks."""
        if dp < 1 or self.batch_size % dp:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by dp={dp}")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp - 1} (dp={dp})")
        per_rank = self.batch_size // dp
        return self._rows(self._starts(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank])


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    """Refuse a sequence longer than the model's positions, before any step runs."""
    if seq_len > max_seq_len:
        raise ValueError(f"sequence length {seq_len} is longer than the model allows "
                         f"(max_seq_len={max_seq_len})")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a long tensor of tokens. Bytes that are not UTF-8 (a command
    line's argument in another encoding reaches Python as surrogates) become themselves: a byte
    model reads any."""
    return torch.tensor(list(text.encode("utf-8", errors="surrogateescape")), dtype=torch.long)


def decode(tokens) -> str:
    """Tokens (tensor, array or list of 0..255) back to text; broken UTF-8 becomes U+FFFD."""
    values = (tokens.reshape(-1) if isinstance(tokens, torch.Tensor)
              else np.asarray(tokens).reshape(-1)).tolist()
    if any(not 0 <= v < VOCAB_SIZE for v in values):
        raise ValueError(
            f"tokens must be bytes 0..{VOCAB_SIZE - 1}, got {min(values)}..{max(values)}")
    return bytes(values).decode("utf-8", errors="replace")
