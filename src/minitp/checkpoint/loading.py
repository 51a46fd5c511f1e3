"""Loading: a checkpoint saved at any layout, read back whole (``load_full``) or cut for this rank
of another layout (``load``), and every check made before anything is copied
(``check_before_launch``, in the parent, before any rank starts). Each file is checked against the
index (size, SHA-256, its steps) and read with ``torch.load(weights_only=True)``; the pieces of each
tensor are put back together, checking they cover it exactly once, then cut for the new layout:
copies only, bit for bit.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import re

import torch
import torch.nn as nn

from minitp import comm
from minitp.checkpoint.index import INDEX, KINDS, CheckpointError, check_fits, read_index
from minitp.fsdp_units import LocalPiece


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
                raise CheckpointError(f"{where} has {len(data)} bytes and SHA-256 "
                                      f"{digest[:12]}..., the index says {expected['bytes']} "
                                      f"bytes and {expected['sha256'][:12]}...: the file is torn "
                                      f"or was changed; refusing to load")
            self.files[name] = self._check(name, _load_tensors(where, data))
        return self.files[name].get("tensors")

    def _check(self, name: str, content) -> dict:
        """The file must say what the index says: the step, and each tensor's optimizer step."""
        where, index_path = os.path.join(self.path, name), os.path.join(self.path, INDEX)
        if not isinstance(content, dict) or content.get("step") != self.index["step"]:
            step = content.get("step") if isinstance(content, dict) else None
            raise CheckpointError(f"{where} was saved at step {step}, "
                                  f"{index_path} says step {self.index['step']}")
        for piece in (p for p in self.index["pieces"] if p["file"] == name):
            saved = content.get("optimizer_steps", {}).get(piece["key"], "none")
            if saved != piece["optimizer_step"]:
                raise CheckpointError(f"{where} holds {piece['key']} at optimizer step {saved}, "
                                      f"{index_path} says {piece['optimizer_step']}")
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
                raise CheckpointError(f"the pieces of {name} ({kind}, tp slice {t} of {tp}) "
                                      f"cover {covered}, not [0, {numel}) exactly once")
            flat = torch.cat([self._piece(p) for p in mine])
            slices.append(flat.view(shape))
        return slices[0] if dim is None else torch.cat(slices, dim=dim)

    def _piece(self, piece: dict) -> torch.Tensor:
        """One piece's elements, from its file: a flat tensor of stop - start elements."""
        tensors = self.file(piece["file"])
        t = tensors.get(piece["key"]) if isinstance(tensors, dict) else None
        if not torch.is_tensor(t) or t.numel() != piece["stop"] - piece["start"]:
            got = f"{t.numel()} elements" if torch.is_tensor(t) else "no tensor"
            raise CheckpointError(f"{os.path.join(self.path, piece['file'])} holds {got} "
                                  f"under {piece['key']}, {os.path.join(self.path, INDEX)} says "
                                  f"{piece['stop'] - piece['start']}")
        return t.reshape(-1)

    def optimizer_step(self, name: str) -> int | None:
        steps = {p["optimizer_step"] for p in self.pieces(name, "param")}
        if len(steps) != 1:
            raise CheckpointError(f"the pieces of {name} are at optimizer steps "
                                  f"{sorted(steps, key=str)}")
        return steps.pop()


def _load_tensors(where: str, data: bytes):
    """torch.load with weights_only=True; a refused object is the checkpoint's fault, named as
    such."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(f"{where} holds an object that is not a tensor or a plain "
                              f"container{what}: a checkpoint of minitp holds tensors only; "
                              f"refusing to load it") from None


def load_full(path: str) -> dict:
    """The whole checkpoint on one process, no process group needed: {"step", "optimizer_step",
    "config", "params": {name: tensor}, "exp_avg": {...}, "exp_avg_sq": {...}}."""
    index = read_index(path)
    reader = _Reader(path, index)
    out = {"step": index["step"], "optimizer_step": index["optimizer_step"],
           "config": index["config"]}
    for kind in KINDS:
        out["params" if kind == "param" else kind] = {name: reader.whole(name, kind)
                                                      for name in index["shapes"]
                                                      if reader.pieces(name, kind)}
    return out


def check_before_launch(path: str, config, whole_shapes: dict[str, tuple[int, ...]]) -> int:
    """Every check ``load`` makes, on one process, before any rank starts: the index (its checksum,
    the names it gives), that it fits a model of ``config`` with parameters ``whole_shapes`` (as the
    run will build it: ``Parallel3D.config`` and ``.whole_shapes``), every file's size and SHA-256,
    tensors only in each (``weights_only``), the steps, and that the pieces of every tensor cover it
    exactly once. Returns the step the checkpoint was saved at. Any refusal is a
    ``CheckpointError``."""
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
        raise CheckpointError(f"{os.path.join(path, INDEX)} is at step {index['step']}, "
                              f"expected step {expected_step}")
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
        pieces.append(LocalPiece(name, shape, 0, tensors["param"].numel(), tensors,
                                 reader.optimizer_step(name)))
    try:
        if par.fsdp is not None:
            par.fsdp.load_local_pieces(pieces, par.optimizer)
        else:
            load_module_pieces(par.module, pieces, par.optimizer)
    except ValueError as e:
        raise CheckpointError(f"{os.path.join(path, INDEX)} does not fit this rank: {e}") from None
    comm.barrier()
    return index["step"]


# -- a plain module (DDP, or no data parallel), set through torch's public optimizer state ---------
@torch.no_grad()
def load_module_pieces(module: nn.Module, pieces: list[LocalPiece],
                       optimizer: torch.optim.Optimizer) -> None:
    """Set every parameter of ``module`` (and its optimizer state, where the pieces carry one) from
    whole pieces, one per parameter, as ``module_pieces`` makes them."""
    by_name = {piece.name: piece for piece in pieces}
    for name, p in module.named_parameters():
        piece = by_name.get(name)
        if piece is None or ((piece.start, piece.stop, tuple(piece.shape))
                             != (0, p.numel(), tuple(p.shape))):
            got = ("nothing" if piece is None
                   else f"[{piece.start}, {piece.stop}) of {list(piece.shape)}")
            raise ValueError(f"expected {name} whole, {list(p.shape)}; got {got}")
        p.copy_(piece.tensors["param"].view_as(p))
        moments = {k: v.view_as(p).to(p.device).clone()
                   for k, v in piece.tensors.items() if k != "param"}
        if moments:
            optimizer.state[p] = {"step": torch.tensor(float(piece.step)), **moments}
