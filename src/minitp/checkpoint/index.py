"""The index of a checkpoint: the names minitp gives what it writes, the index's own checksum,
reading it back (refusing one that is torn, edited, or names a file outside its save folder), and
whether it fits a model. Everything else in ``minitp.checkpoint`` asks this file what a name means.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

FORMAT = "minitp-checkpoint/2"
INDEX = "index.json"
KINDS = ("param", "exp_avg", "exp_avg_sq")  # a parameter and its AdamW moments
SAVE_FOLDER = re.compile(r"save-(\d{6})")
MARK = "minitp-save.json"  # in every save folder minitp made: only a marked folder is ever removed
# a new index; a save folder born or removed
TEMPORARY = re.compile(r"(index\.json|save-\d{6})\.minitp-tmp-\d+")
PLAIN_NAME = re.compile(r"[^/\\\x00]+")  # a file name inside the save folder: no separator, no NUL


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, torn or does not fit the model: refused (bad input,
    so ``minitp run`` says it in one line)."""

    # its public name, the one a rank's traceback prints: the command line and the trainer
    # recognise a rank's refusal by it (``minitp.checkpoint.CheckpointError``)
    __module__ = "minitp.checkpoint"


def digest(index: dict) -> str:
    """SHA-256 of the index without its own checksum, in one canonical JSON spelling."""
    body = {k: v for k, v in index.items() if k != "sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def config_dict(config) -> dict:
    """The model's config as the index holds it: a plain dict of its fields."""
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))


def read_index(path: str) -> dict:
    """The checkpoint's index, checked against its own SHA-256; refuses a folder whose save never
    finished and an index that was edited or cut short."""
    index_path = os.path.join(path, INDEX)
    if not os.path.exists(index_path):
        raise CheckpointError(f"no {INDEX} in {path}: not a finished checkpoint (a save that "
                              f"crashed before its first switch leaves none); refusing to load it")
    with open(index_path, "rb") as f:
        data = f.read()
    try:
        index = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{index_path} is not valid JSON ({e}): torn or edited; "
                              "refusing to load") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{index_path} has format {found!r}, expected {FORMAT!r}")
    if index.get("sha256") != digest(index):
        said = str(index.get("sha256"))[:12]
        raise CheckpointError(f"{index_path} does not match its own SHA-256 (it says {said}..., "
                              f"its content hashes to {digest(index)[:12]}...): it was edited or "
                              f"torn; refusing to load")
    _check_names(index, index_path)
    return index


def _check_names(index: dict, index_path: str) -> None:
    """The index names its save folder (``save-NNNNNN``) and files inside it only: a name that leads
    elsewhere (``../outside.pt``, ``/etc/x``, ``save-000001/../../x``) is never read nor removed."""
    folder = index.get("folder")
    if not isinstance(folder, str) or not SAVE_FOLDER.fullmatch(folder):
        raise CheckpointError(f"{index_path} names the save folder {folder!r}, expected a name "
                              f"like save-000001 inside {os.path.dirname(index_path) or '.'}; "
                              f"refusing to load")
    files, pieces = index.get("files"), index.get("pieces")
    if (not isinstance(files, dict) or not isinstance(pieces, list)
            or not all(isinstance(p, dict) for p in pieces)):
        raise CheckpointError(f"{index_path} has no list of files and pieces; refusing to load")
    for name in [*files, *(p.get("file") for p in pieces)]:
        inside, _, base = name.partition("/") if isinstance(name, str) else ("", "", "")
        if inside != folder or not PLAIN_NAME.fullmatch(base) or base in (".", ".."):
            raise CheckpointError(f"{index_path} names the file {name!r}, expected a plain file "
                                  f"name inside its save folder ({folder}/NAME: no '/', no '..', "
                                  f"not absolute); refusing to read it")


def current_folder(path: str) -> str | None:
    """The save folder the index names, or None when there is no valid index."""
    try:
        return read_index(path)["folder"]
    except (CheckpointError, OSError, ValueError, KeyError):
        return None


def check_fits(index: dict, path: str, config, whole_shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a checkpoint that does not fit a model of ``config`` with parameters ``whole_shapes``:
    a shape, a field of the config, a tensor of the model not saved, a saved tensor the model has
    not."""
    index_path = os.path.join(path, INDEX)
    for name, shape in whole_shapes.items():
        saved = index["shapes"].get(name)
        if saved is not None and saved != list(shape):
            raise CheckpointError(f"{name} is {saved} in {index_path}, "
                                  f"the model's is {list(shape)}")
    mine, saved = config_dict(config), index.get("config") or {}
    differ = [k for k in sorted(set(mine) | set(saved)) if mine.get(k) != saved.get(k)]
    if differ:
        then, now = (", ".join(f"{k}={config[k]}" if k in config else f"no {k}" for k in differ)
                     for config in (saved, mine))
        raise CheckpointError(f"checkpoint {index_path} was saved from {then}, "
                              f"this model has {now}")
    missing = sorted(set(whole_shapes) - set(index["shapes"]))
    extra = sorted(set(index["shapes"]) - set(whole_shapes))
    if missing:
        raise CheckpointError(f"checkpoint {index_path} has no {', '.join(missing)}, "
                              f"which this model has")
    if extra:
        raise CheckpointError(f"checkpoint {index_path} holds {', '.join(extra)}, "
                              f"which this model has not: every saved tensor must be loaded")
