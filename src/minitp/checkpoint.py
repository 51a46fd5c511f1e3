"""Sharded checkpoints of a 3D run that load into any other layout.

**Saving.** Every rank writes only what it holds (nothing is gathered): its tp slice of each parameter
of its stage, with AdamW's two moments, or under FSDP its flat shard of each unit, cut at the
parameter boundaries. Data-parallel replicas under DDP hold the same tensors, so only the first
replica writes; replicated (norm) weights are written by the first tp rank only. Each piece is
described by where it sits in the whole tensor: the tp split (dim, rank, size) and a range of the
flattened tp slice. Rank 0 then writes ``index.json``: the layout, the step, every parameter's
whole shape, every piece, and each file's size and SHA-256.

**Atomic.** Each file is written under a temporary name, flushed to disk (fsync) and renamed; the
index is written last, after every rank's files are in place, and an old index is removed before
any new file is written. So a save that crashes midway leaves no index, and a file that was cut short
or changed after the save fails its checksum: either way ``load`` refuses, rather than loading
something wrong. (Which file a crash leaves half-written does not matter: nothing reads it.)

**Loading** into a ``Parallel3D`` on any mesh: for each tensor this rank needs, the pieces are put
back together into the whole tensor (checking they cover it exactly once), then cut again for the
new layout, tp slice, and FSDP shard. Copies only, no arithmetic: parameters and optimizer state come
back bit for bit. Files are read with ``torch.load(weights_only=True)``: tensors and plain containers,
never arbitrary pickled objects. ``load_full`` does the same on one process, without a process group.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import torch

FORMAT = "minitp-checkpoint/1"
INDEX = "index.json"
KINDS = ("param", "exp_avg", "exp_avg_sq")  # a parameter and its AdamW moments


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, torn or does not fit the model: refused (bad input,
    so ``minitp run`` says it in one line)."""


# -- writing ------------------------------------------------------------------------------------------
def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` never holds a part of it: a temporary file, fsync,
    rename (atomic on POSIX), then fsync of the folder so the rename itself is on disk."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pieces(par) -> tuple[dict[str, torch.Tensor], list[dict], int]:
    """What this rank writes: {key: 1-D tensor}, the description of each piece, and AdamW's step."""
    from minitp import comm

    mesh = par.mesh
    tp_rank = mesh.coords.tp
    tensors, pieces, steps = {}, [], set()

    def add(name: str, kind: str, flat: torch.Tensor, local_shape, start: int) -> None:
        dim = par.split_dims[name]
        if dim is None and tp_rank != 0:  # replicated over tp: the first tp rank writes it
            return
        key = f"{name}/{kind}/{start}"
        tensors[key] = flat.detach().clone().contiguous()
        pieces.append({"key": key, "name": name, "kind": kind, "tp_dim": dim,
                       "tp_rank": tp_rank if dim is not None else 0, "tp": mesh.tp if dim is not None else 1,
                       "local_shape": list(local_shape), "start": start, "stop": start + flat.numel()})

    opt = par.optimizer
    if par.fsdp is not None:  # this rank's shard [r·s, (r+1)·s) of each unit's flat buffer
        fsdp = par.fsdp
        r = comm.group_rank(fsdp.group)
        for unit in fsdp.units:
            s = unit.shard_numel
            state = opt.state.get(unit.master, {})
            flats = {"param": unit.master.detach(), **{k: state.get(k) for k in KINDS[1:]}}
            if "step" in state:
                steps.add(float(state["step"]))
            for slot in unit.plan.slots:
                lo, hi = max(slot.offset, r * s), min(slot.offset + slot.numel, (r + 1) * s)
                if lo >= hi:
                    continue
                for kind, flat in flats.items():
                    if flat is not None:
                        add(slot.name, kind, flat[lo - r * s:hi - r * s], slot.shape, lo - slot.offset)
    elif mesh.coords.dp == 0:  # DDP: every replica holds the same; the first one writes
        for name, p in par.module.named_parameters():
            state = opt.state.get(p, {})
            if "step" in state:
                steps.add(float(state["step"]))
            for kind, t in (("param", p), *((k, state.get(k)) for k in KINDS[1:])):
                if t is not None:
                    add(name, kind, t.reshape(-1), p.shape, 0)
    if len(steps) > 1:
        raise CheckpointError(f"the optimizer's tensors are at different steps {sorted(steps)}")
    return tensors, pieces, int(steps.pop()) if steps else 0


def save(par, path: str, step: int) -> None:
    """Save a ``Parallel3D`` (parameters and AdamW state) after ``step`` training steps into folder
    ``path``. Call on every rank at once; ranks must share the file system."""
    from minitp import comm

    mesh = par.mesh
    os.makedirs(path, exist_ok=True)
    comm.barrier()
    if mesh.rank == 0 and os.path.exists(os.path.join(path, INDEX)):
        os.remove(os.path.join(path, INDEX))  # from now on the folder is not a checkpoint until the end
        _fsync_dir(path)
    comm.barrier()
    tensors, pieces, optimizer_step = _pieces(par)
    name = f"rank{mesh.rank:05d}.pt"
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    data = buffer.getvalue()
    if pieces:  # a DDP replica past the first holds nothing new: it writes only its note below
        _write_atomic(os.path.join(path, name), data)
    meta = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pieces": pieces,
            "optimizer_step": optimizer_step, "shapes": _whole_shapes(par)}
    _write_atomic(os.path.join(path, f"rank{mesh.rank:05d}.json"), json.dumps(meta).encode())
    comm.barrier()  # every rank's files are in place
    if mesh.rank == 0:
        metas = []
        for r in range(mesh.world_size):
            with open(os.path.join(path, f"rank{r:05d}.json")) as f:
                metas.append(json.load(f))
        shapes = {k: v for m in metas for k, v in m["shapes"].items()}
        opt_steps = {m["optimizer_step"] for m in metas if m["pieces"]}
        index = {"format": FORMAT, "step": step, "optimizer_step": max(opt_steps, default=0),
                 "layout": mesh.shape, "world_size": mesh.world_size, "data_parallel": par.data_parallel,
                 "zero": par.zero, "shapes": shapes,
                 "files": {m["file"]: {"bytes": m["bytes"], "sha256": m["sha256"]} for m in metas if m["pieces"]},
                 "pieces": [{**p, "file": m["file"]} for m in metas for p in m["pieces"]]}
        _write_atomic(os.path.join(path, INDEX), json.dumps(index, indent=1).encode())
    comm.barrier()  # no rank goes on before the checkpoint is whole


def _whole_shapes(par) -> dict[str, list[int]]:
    """The whole (unsplit) shape of every parameter this rank holds a piece of."""
    shapes = {}
    for name, (shape, dim) in _local_meta(par).items():
        shapes[name] = [n * par.mesh.tp if d == dim else n for d, n in enumerate(shape)]
    return shapes


def _local_meta(par) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """{name: (this rank's tp-slice shape, tp split dim)} for the parameters of its stage."""
    if par.fsdp is not None:
        return {s.name: (tuple(s.shape), par.split_dims[s.name]) for u in par.fsdp.units for s in u.plan.slots}
    return {n: (tuple(p.shape), par.split_dims[n]) for n, p in par.module.named_parameters()}


# -- reading ------------------------------------------------------------------------------------------
def read_index(path: str) -> dict:
    """The checkpoint's index; refuses a folder whose save did not finish."""
    index_path = os.path.join(path, INDEX)
    if not os.path.exists(index_path):
        raise CheckpointError(f"no {INDEX} in {path}: not a finished checkpoint (a save that crashed midway "
                              f"leaves none); refusing to load it")
    with open(index_path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{index_path} has format {index.get('format')!r}, expected {FORMAT!r}")
    return index


class _Reader:
    """Reads the files of a checkpoint once each, checking every file against the index first."""

    def __init__(self, path: str, index: dict):
        self.path, self.index, self.files = path, index, {}

    def file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.files:
            expected = self.index["files"].get(name)
            if expected is None:
                raise CheckpointError(f"{name} is not listed in the index of {self.path}")
            try:
                with open(os.path.join(self.path, name), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise CheckpointError(f"{name} of {self.path} is missing; refusing to load") from None
            if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
                raise CheckpointError(f"{name} of {self.path} has {len(data)} bytes and SHA-256 "
                                      f"{hashlib.sha256(data).hexdigest()[:12]}..., the index says {expected['bytes']} "
                                      f"bytes and {expected['sha256'][:12]}...: the file is torn or was changed; "
                                      f"refusing to load")
            self.files[name] = torch.load(io.BytesIO(data), weights_only=True)
        return self.files[name]

    def whole(self, name: str, kind: str) -> torch.Tensor:
        """The whole tensor ``name`` (or its moment ``kind``), put together from its pieces."""
        pieces = [p for p in self.index["pieces"] if p["name"] == name and p["kind"] == kind]
        if not pieces:
            raise CheckpointError(f"the checkpoint has no {kind} of {name}")
        tp, dim = pieces[0]["tp"], pieces[0]["tp_dim"]
        slices = []
        for t in range(tp):
            mine = sorted((p for p in pieces if p["tp_rank"] == t), key=lambda p: p["start"])
            shape = mine[0]["local_shape"] if mine else None
            numel = 1
            for n in shape or [0]:
                numel *= n
            covered = [(p["start"], p["stop"]) for p in mine]
            expected = list(zip([0] + [b for _, b in covered[:-1]], [b for _, b in covered]))
            if not mine or covered != expected or covered[-1][1] != numel:
                raise CheckpointError(f"the pieces of {name} ({kind}, tp slice {t} of {tp}) cover {covered}, "
                                      f"not [0, {numel}) exactly once")
            flat = torch.cat([self.file(p["file"])[p["key"]] for p in mine])
            slices.append(flat.view(shape))
        return slices[0] if dim is None else torch.cat(slices, dim=dim)


def load_full(path: str) -> dict:
    """The whole checkpoint on one process, no process group needed:
    {"step", "optimizer_step", "params": {name: tensor}, "exp_avg": {...}, "exp_avg_sq": {...}}."""
    index = read_index(path)
    reader = _Reader(path, index)
    out = {"step": index["step"], "optimizer_step": index["optimizer_step"]}
    for kind in KINDS:
        out["params" if kind == "param" else kind] = {name: reader.whole(name, kind) for name in index["shapes"]}
    return out


def load(par, path: str, expected_step: int | None = None) -> int:
    """Load a checkpoint saved at any layout into a ``Parallel3D`` (every rank at once): parameters
    and AdamW state, cut for this rank. Returns the step it was saved at."""
    from minitp import comm

    index = read_index(path)
    if expected_step is not None and index["step"] != expected_step:
        raise CheckpointError(f"{path} is at step {index['step']}, expected step {expected_step}")
    reader = _Reader(path, index)
    mesh, opt = par.mesh, par.optimizer
    tp, tp_rank = mesh.tp, mesh.coords.tp
    meta = _local_meta(par)
    for name, (shape, dim) in meta.items():
        if name not in index["shapes"]:
            raise CheckpointError(f"{path} holds no parameter {name}: saved from another model?")
        whole = list(shape)
        if dim is not None:
            whole[dim] *= tp
        if whole != index["shapes"][name]:
            raise CheckpointError(f"{name} is {index['shapes'][name]} in {path}, the model's is {whole}")

    def local(name: str, kind: str) -> torch.Tensor:  # this rank's tp slice of the whole tensor
        t, dim = reader.whole(name, kind), meta[name][1]
        return t if dim is None else t.chunk(tp, dim=dim)[tp_rank]

    step = torch.tensor(float(index["optimizer_step"]))
    with torch.no_grad():
        if par.fsdp is not None:
            fsdp = par.fsdp
            r = comm.group_rank(fsdp.group)
            for unit in fsdp.units:
                s = unit.shard_numel
                flats = {k: torch.zeros(unit.padded) for k in KINDS}  # (P,), the padding zero as after init
                for slot in unit.plan.slots:
                    for kind in KINDS:
                        flats[kind][slot.offset:slot.offset + slot.numel] = local(slot.name, kind).reshape(-1)
                if fsdp.zero < 3:  # full parameters held; the master shard is a view of them
                    unit.full.data.copy_(flats["param"])
                else:
                    unit.master.data.copy_(flats["param"][r * s:(r + 1) * s])
                opt.state[unit.master] = {"step": step.clone(),
                                          **{k: flats[k][r * s:(r + 1) * s].clone() for k in KINDS[1:]}}
        else:
            for name, p in par.module.named_parameters():
                p.copy_(local(name, "param"))
                opt.state[p] = {"step": step.clone(), **{k: local(name, k).clone() for k in KINDS[1:]}}
    comm.barrier()
    return index["step"]
