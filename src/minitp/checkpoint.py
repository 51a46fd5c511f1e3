"""Sharded checkpoints of a 3D run that load into any other layout, and that a crash cannot destroy.

**What is saved.** Every rank writes only what it holds (nothing is gathered), as pieces of
parameters (``minitp.fsdp_units.LocalPiece``): elements [start, stop) of one flattened tp slice, with
AdamW's two moments for them. Under FSDP the wrapper lists them (``fsdp.local_pieces``); a plain
stage is read through PyTorch's public optimizer state (``module_pieces``). Data-parallel replicas
under DDP hold the same tensors, so only the first replica writes; replicated (norm) weights are
written by the first tp rank only.

**The folder**, switched atomically::

    ckpt/index.json                  names the save folder below; checked by its own SHA-256
    ckpt/save-000002/rank00000.pt    each rank's pieces (and rank00000.json, its note to rank 0)
    ckpt/save-000002/minitp-save.json  the mark: minitp made this folder (written first)

A save writes a new ``save-N`` folder beside the current one; once every file is on disk (fsync),
rank 0 writes the new index under a temporary name and renames it over ``index.json`` (atomic on
POSIX). So ``index.json`` always names a whole checkpoint: the old one until the rename, the new one
after. A crash at any moment leaves one of the two. The old folder is removed after the switch;
what a crashed save left at the start of the next. A save that fails with an error (a full disk)
removes its own new folder and says which file it could not write.

**Only what minitp wrote is removed.** Each ``save-N`` folder is born with its mark
(``save-N/minitp-save.json``, written under a temporary folder name that is then renamed), and every
temporary name ends in ``.minitp-tmp-<pid>``. Clean-up removes a marked folder no index names and
those temporary names, nothing else. A folder to save into must be new, empty or a minitp
checkpoint: one that holds anything else (a learner's files) is refused before anything is written
(``check_save_folder``; ``minitp run`` asks it in the parent, before any process starts).

**The index** holds the model config, the layout (dp, pp, tp, data_parallel, zero), the step and
AdamW's step, every parameter's whole shape, every piece, each file's size and SHA-256, and the
SHA-256 of all that. **Loading** into a ``Parallel3D`` on any mesh checks, before it copies
anything: the index's checksum, every shape, the config, that every tensor of the model is in the
checkpoint and every saved tensor is taken by the model; then each file's checksum and that the
file agrees with the index on the steps. The index may name only plain file names inside its own
save folder (never ``../x`` or ``/x``). Any mismatch is a ``CheckpointError`` naming the file
("checkpoint ckpt/index.json was saved from n_layers=4, this model has n_layers=2"). The pieces
of each tensor are put back together (checking they cover it exactly once), then cut for the new
layout: copies only, bit for bit. Files are read with ``torch.load(weights_only=True)``: tensors and
plain containers, never pickled code. ``load_full`` does the same on one process, and
``check_before_launch`` all the checks, in the parent, before any rank starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil

import torch
import torch.nn as nn

from minitp import comm
from minitp.fsdp_units import LocalPiece

FORMAT = "minitp-checkpoint/2"
INDEX = "index.json"
KINDS = ("param", "exp_avg", "exp_avg_sq")  # a parameter and its AdamW moments
SAVE_FOLDER = re.compile(r"save-(\d{6})")
MARK = "minitp-save.json"  # in every save folder minitp made: only a marked folder is ever removed
TEMPORARY = re.compile(r"(index\.json|save-\d{6})\.minitp-tmp-\d+")  # a new index; a save folder born or removed
PLAIN_NAME = re.compile(r"[^/\\\x00]+")  # a file name inside the save folder: no separator, no NUL


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, torn or does not fit the model: refused (bad input,
    so ``minitp run`` says it in one line)."""


# -- the pieces of a plain module (DDP, or no data parallel), through torch's public optimizer state ---------
def module_pieces(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[LocalPiece]:
    """Every parameter of ``module`` whole, as one piece each, with its per-element optimizer state
    (``optimizer.state[p]``; none before the first step), copied to the CPU."""
    pieces = []
    for name, p in module.named_parameters():
        state = optimizer.state.get(p, {})
        moments = {k: v for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.shape == p.shape}
        tensors = {k: v.detach().reshape(-1).clone().cpu() for k, v in {"param": p, **moments}.items()}
        step = int(state["step"]) if "step" in state else None
        pieces.append(LocalPiece(name, tuple(p.shape), 0, p.numel(), tensors, step))
    return pieces


@torch.no_grad()
def load_module_pieces(module: nn.Module, pieces: list[LocalPiece], optimizer: torch.optim.Optimizer) -> None:
    """Set every parameter of ``module`` (and its optimizer state, where the pieces carry one) from
    whole pieces, one per parameter, as ``module_pieces`` makes them."""
    by_name = {piece.name: piece for piece in pieces}
    for name, p in module.named_parameters():
        piece = by_name.get(name)
        if piece is None or (piece.start, piece.stop, tuple(piece.shape)) != (0, p.numel(), tuple(p.shape)):
            got = "nothing" if piece is None else f"[{piece.start}, {piece.stop}) of {list(piece.shape)}"
            raise ValueError(f"expected {name} whole, {list(p.shape)}; got {got}")
        p.copy_(piece.tensors["param"].view_as(p))
        moments = {k: v.view_as(p).to(p.device).clone() for k, v in piece.tensors.items() if k != "param"}
        if moments:
            optimizer.state[p] = {"step": torch.tensor(float(piece.step)), **moments}


# -- writing --------------------------------------------------------------------------------------------------
def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` never holds a part of it: a temporary file, fsync,
    rename (atomic on POSIX). A write that fails (a full disk) removes its temporary file."""
    tmp = f"{path}.minitp-tmp-{os.getpid()}"
    try:
        with _naming(path), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def _naming(path: str):
    """An ``OSError`` raised inside names ``path`` (a full disk's says only "No space left on device")."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or str(e), path) from None
        raise


def _fsync_dir(folder: str) -> None:
    """Put a folder's entries (a rename, a new file) on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(index: dict) -> str:
    """SHA-256 of the index without its own checksum, in one canonical JSON spelling."""
    body = {k: v for k, v in index.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _current_folder(path: str) -> str | None:
    """The save folder the index names, or None when there is no valid index."""
    try:
        return read_index(path)["folder"]
    except (CheckpointError, OSError, ValueError, KeyError):
        return None


def _is_marked(path: str, entry: str) -> bool:
    """Whether ``path/entry`` is a save folder minitp made (it carries minitp's mark)."""
    full = os.path.join(path, entry)
    return SAVE_FOLDER.fullmatch(entry) is not None and os.path.isdir(full) and os.path.isfile(os.path.join(full, MARK))


def check_save_folder(path: str, what: str | None = None) -> None:
    """Refuse to save into a folder that holds anything minitp did not write there: a save cleans up
    behind itself, and must never remove a learner's files. New, empty and minitp checkpoints pass.
    ``what`` names the folder in the message (default: its path)."""
    if not os.path.isdir(path):
        return
    current = _current_folder(path)
    if current is None and os.path.isfile(os.path.join(path, INDEX)) and any(
            _is_marked(path, entry) for entry in os.listdir(path)):
        try:  # minitp's own save folders beside an index that no longer reads: a damaged checkpoint
            read_index(path)
        except CheckpointError as e:
            raise CheckpointError(f"{what or path} is a damaged minitp checkpoint: {e}; move it away to keep it, "
                                  f"or remove it to start again") from None
    foreign = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if entry == INDEX and current is not None and os.path.isfile(full):
            continue  # a minitp index (format and checksum checked)
        if entry == current or _is_marked(path, entry) or TEMPORARY.fullmatch(entry):
            continue
        foreign.append(entry + ("/" if os.path.isdir(full) else ""))
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise CheckpointError(f"{what or path} holds {shown}, which minitp did not write: a checkpoint folder must "
                              f"be new, empty or a minitp checkpoint (a save removes what it left behind, so it "
                              f"refuses a folder with anything else); choose another folder")


def _remove_stale(path: str, previous: str | None = None) -> None:
    """Remove what minitp wrote and no valid index names: marked save folders a crash left
    half-written, temporary names, and ``previous`` (the folder the index named before the switch,
    marked or, from an older minitp, not). Nothing else in ``path`` is touched."""
    keep = _current_folder(path)
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if entry == keep:
            continue
        if entry == previous or _is_marked(path, entry):
            _remove_save_folder(path, entry)
        elif TEMPORARY.fullmatch(entry) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif TEMPORARY.fullmatch(entry) and os.path.isfile(full):
            os.remove(full)


def _remove_save_folder(path: str, folder: str) -> None:
    """Remove a save folder minitp wrote: renamed to a temporary name first (atomic), so a crash
    while its files go never leaves a save folder without its mark."""
    doomed = os.path.join(path, f"{folder}.minitp-tmp-{os.getpid()}")
    shutil.rmtree(doomed, ignore_errors=True)  # a leftover of the same name (a reused pid)
    with contextlib.suppress(FileNotFoundError):
        os.rename(os.path.join(path, folder), doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _make_save_folder(path: str, folder: str) -> None:
    """Create ``path/folder`` with minitp's mark already in it: the mark is written into a temporary
    folder that is then renamed, so no save folder ever exists unmarked."""
    tmp = os.path.join(path, f"{folder}.minitp-tmp-{os.getpid()}")
    try:
        os.makedirs(tmp)
        _write_atomic(os.path.join(tmp, MARK), json.dumps({"format": FORMAT, "folder": folder}).encode())
        os.rename(tmp, os.path.join(path, folder))  # refuses a folder already there that is not empty
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _local_pieces(par) -> list[LocalPiece]:
    """What this rank writes: its pieces; none for a DDP replica past the first, and no replicated
    (tp-split None) parameter past the first tp rank. Under expert parallel the first ep group's
    ranks hold every expert between them: each writes its own, the first also the rest. (Under
    context parallel the dp·cp ranks of a tp slice hold the same tensors: the first writes.)"""
    ep = par.mesh.ep
    if par.fsdp is not None:
        pieces = par.fsdp.local_pieces(par.optimizer)
    elif par.mesh.coords.dp == 0:
        pieces = module_pieces(par.module, par.optimizer)
    elif par.mesh.coords.dp < ep:
        pieces = [p for p in module_pieces(par.module, par.optimizer) if ".experts." in p.name]
    else:
        return []
    return [p for p in pieces if par.split_dims[p.name] is not None or par.mesh.coords.tp == 0]


def save(par, path: str, step: int) -> None:
    """Save a ``Parallel3D`` (parameters and AdamW state) after ``step`` training steps into folder
    ``path``. Call on every rank at once; ranks must share the file system."""
    mesh = par.mesh
    if mesh.rank == 0:
        os.makedirs(path, exist_ok=True)
        check_save_folder(path)  # a folder with a learner's files in it: refused, nothing removed
        _remove_stale(path)
        _make_save_folder(path, _next_folder(_current_folder(path)))
    comm.barrier()
    previous = _current_folder(path)  # the same on every rank: nobody changes the index before the end
    folder = _next_folder(previous)
    try:
        _write_save_folder(par, path, folder, step)
    except OSError as e:  # a full disk, a file system gone read-only: the new folder goes, the old stays
        with contextlib.suppress(OSError):
            _remove_save_folder(path, folder)
        held = "still holds the previous checkpoint" if previous else "holds no checkpoint"
        said = (f"{e.strerror or e} while writing {e.filename or os.path.join(path, folder)}: the unfinished "
                f"save {folder} was removed; {path} {held}")
        raise (OSError(e.errno, said) if e.errno is not None else OSError(said)) from None
    if mesh.rank == 0:  # the switch is made: the checkpoint is whole, the previous one can go
        _fsync_dir(path)
        _remove_stale(path, previous)  # the previous save folder
    comm.barrier()  # no rank goes on before the checkpoint is whole


def _next_folder(current: str | None) -> str:
    return f"save-{int(current[5:]) + 1 if current else 1:06d}"


def _write_save_folder(par, path: str, folder: str, step: int) -> None:
    """Write this rank's files into ``path/folder``; then rank 0 switches the index to it."""
    mesh = par.mesh
    pieces = _local_pieces(par)
    tp_rank = mesh.coords.tp
    tensors, described = {}, []
    for piece in pieces:
        dim = par.split_dims[piece.name]
        for kind, t in piece.tensors.items():
            key = f"{piece.name}/{kind}/{piece.start}"
            tensors[key] = t
            described.append({"key": key, "name": piece.name, "kind": kind, "tp_dim": dim,
                              "tp_rank": tp_rank if dim is not None else 0, "tp": mesh.tp if dim is not None else 1,
                              "local_shape": list(piece.shape), "start": piece.start, "stop": piece.stop,
                              "optimizer_step": piece.step})
    name = f"{folder}/rank{mesh.rank:05d}.pt"
    steps = {d["key"]: d["optimizer_step"] for d in described}
    buffer = io.BytesIO()
    with _naming(os.path.join(path, name)):
        torch.save({"step": step, "optimizer_steps": steps, "tensors": tensors}, buffer)
        data = buffer.getvalue()
        if described:  # a rank that holds nothing new writes only its note
            _write_atomic(os.path.join(path, name), data)
    note = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pieces": described}
    _write_atomic(os.path.join(path, folder, f"rank{mesh.rank:05d}.json"), json.dumps(note).encode())
    comm.barrier()  # every rank's files are on disk
    if mesh.rank == 0:
        _fsync_dir(os.path.join(path, folder))
        notes = []
        for r in range(mesh.world_size):
            with open(os.path.join(path, folder, f"rank{r:05d}.json")) as f:
                notes.append(json.load(f))
        all_pieces = [{**p, "file": n["file"]} for n in notes for p in n["pieces"]]
        missing = sorted(set(par.whole_shapes) - {p["name"] for p in all_pieces})
        if missing:
            raise CheckpointError(f"no rank saved {', '.join(missing)}")
        index = {"format": FORMAT, "folder": folder, "step": step,
                 "optimizer_step": max((p["optimizer_step"] or 0 for p in all_pieces), default=0),
                 "config": _config_dict(par.config), "layout": mesh.shape, "world_size": mesh.world_size,
                 "data_parallel": par.data_parallel, "zero": par.zero,
                 "shapes": {k: list(v) for k, v in par.whole_shapes.items()},
                 "files": {n["file"]: {"bytes": n["bytes"], "sha256": n["sha256"]} for n in notes if n["pieces"]},
                 "pieces": all_pieces}
        index["sha256"] = _digest(index)
        _write_atomic(os.path.join(path, INDEX), json.dumps(index, indent=1).encode())  # the switch


def _config_dict(config) -> dict:
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))


# -- reading --------------------------------------------------------------------------------------------------
def read_index(path: str) -> dict:
    """The checkpoint's index, checked against its own SHA-256; refuses a folder whose save never
    finished and an index that was edited or cut short."""
    index_path = os.path.join(path, INDEX)
    if not os.path.exists(index_path):
        raise CheckpointError(f"no {INDEX} in {path}: not a finished checkpoint (a save that crashed before "
                              f"its first switch leaves none); refusing to load it")
    with open(index_path, "rb") as f:
        data = f.read()
    try:
        index = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{index_path} is not valid JSON ({e}): torn or edited; refusing to load") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{index_path} has format {found!r}, expected {FORMAT!r}")
    if index.get("sha256") != _digest(index):
        said = str(index.get("sha256"))[:12]
        raise CheckpointError(f"{index_path} does not match its own SHA-256 (it says {said}..., its content hashes "
                              f"to {_digest(index)[:12]}...): it was edited or torn; refusing to load")
    _check_names(index, index_path)
    return index


def _check_names(index: dict, index_path: str) -> None:
    """The index names its save folder (``save-NNNNNN``) and files inside it only: a name that leads
    elsewhere (``../outside.pt``, ``/etc/x``, ``save-000001/../../x``) is never read nor removed."""
    folder = index.get("folder")
    if not isinstance(folder, str) or not SAVE_FOLDER.fullmatch(folder):
        raise CheckpointError(f"{index_path} names the save folder {folder!r}, expected a name like save-000001 "
                              f"inside {os.path.dirname(index_path) or '.'}; refusing to load")
    files, pieces = index.get("files"), index.get("pieces")
    if not isinstance(files, dict) or not isinstance(pieces, list) or not all(isinstance(p, dict) for p in pieces):
        raise CheckpointError(f"{index_path} has no list of files and pieces; refusing to load")
    for name in [*files, *(p.get("file") for p in pieces)]:
        inside, _, base = name.partition("/") if isinstance(name, str) else ("", "", "")
        if inside != folder or not PLAIN_NAME.fullmatch(base) or base in (".", ".."):
            raise CheckpointError(f"{index_path} names the file {name!r}, expected a plain file name inside its "
                                  f"save folder ({folder}/NAME: no '/', no '..', not absolute); refusing to read it")


class _Reader:
    """Reads the files of a checkpoint once each, checking every file against the index first."""

    def __init__(self, path: str, index: dict):
        self.path, self.index, self.files = path, index, {}

    def file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.files:
            where, expected = os.path.join(self.path, name), self.index["files"].get(name)
            if expected is None:
                raise CheckpointError(f"{name} is not listed in {os.path.join(self.path, INDEX)}")
            try:
                with open(where, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise CheckpointError(f"{where} is missing; refusing to load") from None
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != expected["bytes"] or digest != expected["sha256"]:
                raise CheckpointError(f"{where} has {len(data)} bytes and SHA-256 {digest[:12]}..., the index says "
                                      f"{expected['bytes']} bytes and {expected['sha256'][:12]}...: the file is torn "
                                      f"or was changed; refusing to load")
            self.files[name] = self._check(name, _load_tensors(where, data))
        return self.files[name].get("tensors")

    def _check(self, name: str, content) -> dict:
        """The file must say what the index says: the step, and each tensor's optimizer step."""
        where, index_path = os.path.join(self.path, name), os.path.join(self.path, INDEX)
        if not isinstance(content, dict) or content.get("step") != self.index["step"]:
            step = content.get("step") if isinstance(content, dict) else None
            raise CheckpointError(f"{where} was saved at step {step}, {index_path} says step {self.index['step']}")
        for piece in (p for p in self.index["pieces"] if p["file"] == name):
            saved = content.get("optimizer_steps", {}).get(piece["key"], "none")
            if saved != piece["optimizer_step"]:
                raise CheckpointError(f"{where} holds {piece['key']} at optimizer step {saved}, {index_path} says "
                                      f"{piece['optimizer_step']}")
        return content

    def pieces(self, name: str, kind: str) -> list[dict]:
        return [p for p in self.index["pieces"] if p["name"] == name and p["kind"] == kind]

    def whole(self, name: str, kind: str) -> torch.Tensor:
        """The whole tensor ``name`` (or its moment ``kind``), put together from its pieces."""
        pieces = self.pieces(name, kind)
        if not pieces:
            raise CheckpointError(f"{os.path.join(self.path, INDEX)} has no {kind} of {name}")
        tp, dim = pieces[0]["tp"], pieces[0]["tp_dim"]
        slices = []
        for t in range(tp):
            mine = sorted((p for p in pieces if p["tp_rank"] == t), key=lambda p: p["start"])
            shape = mine[0]["local_shape"] if mine else [0]
            numel = math.prod(shape)
            covered = [(p["start"], p["stop"]) for p in mine]
            expected = list(zip([0] + [b for _, b in covered[:-1]], [b for _, b in covered]))
            if not mine or covered != expected or covered[-1][1] != numel:
                raise CheckpointError(f"the pieces of {name} ({kind}, tp slice {t} of {tp}) cover {covered}, "
                                      f"not [0, {numel}) exactly once")
            flat = torch.cat([self._piece(p) for p in mine])
            slices.append(flat.view(shape))
        return slices[0] if dim is None else torch.cat(slices, dim=dim)

    def _piece(self, piece: dict) -> torch.Tensor:
        """One piece's elements, from its file: a flat tensor of stop - start elements."""
        tensors = self.file(piece["file"])
        t = tensors.get(piece["key"]) if isinstance(tensors, dict) else None
        if not torch.is_tensor(t) or t.numel() != piece["stop"] - piece["start"]:
            got = f"{t.numel()} elements" if torch.is_tensor(t) else "no tensor"
            raise CheckpointError(f"{os.path.join(self.path, piece['file'])} holds {got} under {piece['key']}, "
                                  f"{os.path.join(self.path, INDEX)} says {piece['stop'] - piece['start']}")
        return t.reshape(-1)

    def optimizer_step(self, name: str) -> int | None:
        steps = {p["optimizer_step"] for p in self.pieces(name, "param")}
        if len(steps) != 1:
            raise CheckpointError(f"the pieces of {name} are at optimizer steps {sorted(steps, key=str)}")
        return steps.pop()


def _load_tensors(where: str, data: bytes):
    """torch.load with weights_only=True; a refused object is the checkpoint's fault, named as such."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(f"{where} holds an object that is not a tensor or a plain container{what}: a "
                              f"checkpoint of minitp holds tensors only; refusing to load it") from None


def load_full(path: str) -> dict:
    """The whole checkpoint on one process, no process group needed:
    {"step", "optimizer_step", "config", "params": {name: tensor}, "exp_avg": {...}, "exp_avg_sq": {...}}."""
    index = read_index(path)
    reader = _Reader(path, index)
    out = {"step": index["step"], "optimizer_step": index["optimizer_step"], "config": index["config"]}
    for kind in KINDS:
        out["params" if kind == "param" else kind] = {name: reader.whole(name, kind) for name in index["shapes"]
                                                      if reader.pieces(name, kind)}
    return out


def check_fits(index: dict, path: str, config, whole_shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a checkpoint that does not fit a model of ``config`` with parameters ``whole_shapes``:
    a shape, a field of the config, a tensor of the model not saved, a saved tensor the model has not."""
    index_path = os.path.join(path, INDEX)
    for name, shape in whole_shapes.items():
        saved = index["shapes"].get(name)
        if saved is not None and saved != list(shape):
            raise CheckpointError(f"{name} is {saved} in {index_path}, the model's is {list(shape)}")
    mine, saved = _config_dict(config), index.get("config") or {}
    differ = [k for k in sorted(set(mine) | set(saved)) if mine.get(k) != saved.get(k)]
    if differ:
        then, now = (", ".join(f"{k}={config[k]}" if k in config else f"no {k}" for k in differ)
                     for config in (saved, mine))
        raise CheckpointError(f"checkpoint {index_path} was saved from {then}, this model has {now}")
    missing, extra = sorted(set(whole_shapes) - set(index["shapes"])), sorted(set(index["shapes"]) - set(whole_shapes))
    if missing:
        raise CheckpointError(f"checkpoint {index_path} has no {', '.join(missing)}, which this model has")
    if extra:
        raise CheckpointError(f"checkpoint {index_path} holds {', '.join(extra)}, which this model has not: "
                              f"every saved tensor must be loaded")


def check_before_launch(path: str, config, whole_shapes: dict[str, tuple[int, ...]]) -> int:
    """Every check ``load`` makes, on one process, before any rank starts: the index (its checksum,
    the names it gives), that it fits a model of ``config`` with parameters ``whole_shapes`` (as the
    run will build it: ``Parallel3D.config`` and ``.whole_shapes``), every file's size and SHA-256,
    tensors only in each (``weights_only``), the steps, and that the pieces of every tensor cover it
    exactly once. Returns the step the checkpoint was saved at. Any refusal is a ``CheckpointError``."""
    index = read_index(path)
    check_fits(index, path, config, whole_shapes)
    reader = _Reader(path, index)
    for name in index["files"]:
        reader.file(name)
    for name in index["shapes"]:
        for kind in KINDS:
            if kind == "param" or reader.pieces(name, kind):  # moments: none before the first step
                reader.whole(name, kind)
        reader.optimizer_step(name)
    return index["step"]


def load(par, path: str, expected_step: int | None = None) -> int:
    """Load a checkpoint saved at any layout into a ``Parallel3D`` (every rank at once): parameters
    and AdamW state, cut for this rank. Returns the step it was saved at."""
    index = read_index(path)
    if expected_step is not None and index["step"] != expected_step:
        raise CheckpointError(f"{os.path.join(path, INDEX)} is at step {index['step']}, expected step {expected_step}")
    check_fits(index, path, par.config, par.whole_shapes)
    reader = _Reader(path, index)
    tp, tp_rank = par.mesh.tp, par.mesh.coords.tp
    shapes = par.fsdp.param_shapes if par.fsdp is not None else {n: tuple(p.shape) for n, p in
                                                                  par.module.named_parameters()}
    pieces = []
    for name, shape in shapes.items():  # this rank's tp slice of each tensor, whole
        dim, tensors = par.split_dims[name], {}
        for kind in KINDS:
            if kind == "param" or reader.pieces(name, kind):  # moments: none before the first step
                t = reader.whole(name, kind)
                tensors[kind] = (t if dim is None else t.chunk(tp, dim=dim)[tp_rank]).reshape(-1)
        pieces.append(LocalPiece(name, shape, 0, tensors["param"].numel(), tensors, reader.optimizer_step(name)))
    try:
        if par.fsdp is not None:
            par.fsdp.load_local_pieces(pieces, par.optimizer)
        else:
            load_module_pieces(par.module, pieces, par.optimizer)
    except ValueError as e:
        raise CheckpointError(f"{os.path.join(path, INDEX)} does not fit this rank: {e}") from None
    comm.barrier()
    return index["step"]
