"""Saving: what each rank writes, and the switch that makes the new checkpoint whole at once.

Every rank writes only the pieces it holds (nothing is gathered) into a new save folder beside the
current one, with a note to rank 0 saying what its file holds; once every file is on disk, rank 0
writes the new index under a temporary name and renames it over ``index.json``. Until that rename
the previous checkpoint is the whole one, after it the new one; the previous folder is removed then.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os

import torch
import torch.nn as nn

from minitp import comm
from minitp.checkpoint.disk import (
    check_save_folder,
    fsync_dir,
    make_save_folder,
    naming,
    next_folder,
    remove_save_folder,
    remove_stale,
    write_atomic,
)
from minitp.checkpoint.index import (
    FORMAT,
    INDEX,
    CheckpointError,
    config_dict,
    current_folder,
    digest,
)
from minitp.fsdp_units import LocalPiece


# -- a plain module's pieces (DDP, or no data parallel), through torch's public optimizer state ----
def module_pieces(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[LocalPiece]:
    """Every parameter of ``module`` whole, as one piece each, with its per-element optimizer state
    (``optimizer.state[p]``; none before the first step), copied to the CPU."""
    pieces = []
    for name, p in module.named_parameters():
        state = optimizer.state.get(p, {})
        moments = {k: v for k, v in state.items()
                   if k != "step" and torch.is_tensor(v) and v.shape == p.shape}
        tensors = {k: v.detach().reshape(-1).clone().cpu()
                   for k, v in {"param": p, **moments}.items()}
        step = int(state["step"]) if "step" in state else None
        pieces.append(LocalPiece(name, tuple(p.shape), 0, p.numel(), tensors, step))
    return pieces


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
        remove_stale(path)
        make_save_folder(path, next_folder(current_folder(path)))
    comm.barrier()
    # the same on every rank: nobody changes the index before the end
    previous = current_folder(path)
    folder = next_folder(previous)
    try:
        _write_save_folder(par, path, folder, step)
    except OSError as e:
        # a full disk, a file system gone read-only: the new folder goes, the old stays
        with contextlib.suppress(OSError):
            remove_save_folder(path, folder)
        held = "still holds the previous checkpoint" if previous else "holds no checkpoint"
        said = (f"{e.strerror or e} while writing {e.filename or os.path.join(path, folder)}: "
                f"the unfinished save {folder} was removed; {path} {held}")
        raise (OSError(e.errno, said) if e.errno is not None else OSError(said)) from None
    if mesh.rank == 0:  # the switch is made: the checkpoint is whole, the previous one can go
        fsync_dir(path)
        remove_stale(path, previous)  # the previous save folder
    comm.barrier()  # no rank goes on before the checkpoint is whole


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
                              "tp_rank": tp_rank if dim is not None else 0,
                              "tp": mesh.tp if dim is not None else 1,
                              "local_shape": list(piece.shape),
                              "start": piece.start, "stop": piece.stop,
                              "optimizer_step": piece.step})
    name = f"{folder}/rank{mesh.rank:05d}.pt"
    steps = {d["key"]: d["optimizer_step"] for d in described}
    buffer = io.BytesIO()
    with naming(os.path.join(path, name)):
        torch.save({"step": step, "optimizer_steps": steps, "tensors": tensors}, buffer)
        data = buffer.getvalue()
        if described:  # a rank that holds nothing new writes only its note
            write_atomic(os.path.join(path, name), data)
    note = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "pieces": described}
    write_atomic(os.path.join(path, folder, f"rank{mesh.rank:05d}.json"),
                 json.dumps(note).encode())
    comm.barrier()  # every rank's files are on disk
    if mesh.rank == 0:
        fsync_dir(os.path.join(path, folder))
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
                 "config": config_dict(par.config),
                 "layout": mesh.shape, "world_size": mesh.world_size,
                 "data_parallel": par.data_parallel, "zero": par.zero,
                 "shapes": {k: list(v) for k, v in par.whole_shapes.items()},
                 "files": {n["file"]: {"bytes": n["bytes"], "sha256": n["sha256"]}
                           for n in notes if n["pieces"]},
                 "pieces": all_pieces}
        index["sha256"] = digest(index)
        write_atomic(os.path.join(path, INDEX), json.dumps(index, indent=1).encode())  # the switch
