"""Chapter 13's graduation exercise: chapter 09's training run written in PyTorch's own API.

``check_torch_run(parallelize, clip, save, load)``, four functions of the learner's:

* ``parallelize(model, mesh)``: ``mesh`` is a 2-D ``DeviceMesh`` named ("dp", "tp"). Tensor
  parallel over ``mesh["tp"]`` with ``parallelize_module`` (the logits left sharded over the
  vocabulary, as a DTensor, for ``loss_parallel``), then ``fully_shard`` of each block and of the
  model over ``mesh["dp"]``; returns the model.
* ``clip(model, max_norm) -> float``: the global norm of every gradient, DTensors on whatever mesh,
  and every gradient scaled as ``torch.nn.utils.clip_grad_norm_`` scales them on one process.
* ``save(model, optimizer, folder)`` and ``load(model, optimizer, folder)``: the model's and
  AdamW's state through ``torch.distributed.checkpoint`` (DCP), loaded into any layout.

Run on 4 processes: dp2×tp2 trains two steps (clipping at 0.5, so every step clips) and saves; a
fresh model on dp4 (no tensor parallel) loads and trains two more. The four losses and norms must
be one process's (``train_one_process`` with the same clipping, ≤ 1e-5), the loaded parameters the
saved ones bit for bit. A mistake is named: nothing split over tp or sharded over dp, the order
of the two, PyTorch's own ``clip_grad_norm_`` refusing two meshes, a norm of this rank's shards
only, a checkpoint without the optimizer, a load that leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from minitp.exercises import ExerciseError, passed, refuse_own_deep, run_answer, wrong

NAME = "the run in PyTorch's API"
MAX_NORM = 0.5  # below every step's norm: each step clips
LR = 3e-3
STEPS = 4  # two on dp2×tp2, then the load on dp4 and two more (the second shows AdamW's state)
SAVED_AT = 2
_HINT = ("parallelize: tensor parallel first (parallelize_module over mesh['tp']: the logits "
         "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)), then fully_shard of "
         "each block and of the model over mesh['dp']. clip: torch.nn.utils.clip_grad_norm_ stacks "
         "every gradient's norm, and here they live on two meshes (the norms' weights are sharded "
         "over dp only, the split matrices over dp and tp): add each gradient's squares as a "
         "full_tensor(), then scale each gradient by min(1, max_norm / (norm + 1e-6)).")


def _batches():
    from minitp.models import TINY
    from minitp.models.train import TrainConfig, synthetic_batches

    return TINY, synthetic_batches(TINY, TrainConfig(steps=STEPS, batch_size=8, seq_len=16,
                                                     seed=5))


def _held(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered: a collective every rank joins)."""
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()}


def _layout_of(model, mesh) -> dict[str, tuple[str, ...]]:
    """{parameter: the mesh dimensions its placements shard it over}: what the learner built."""
    out = {}
    for name, p in model.named_parameters():
        if not hasattr(p, "placements"):
            out[name] = ()
            continue
        dims = p.device_mesh.mesh_dim_names or ()
        out[name] = tuple(d for d, place in zip(dims, p.placements)  # Shard, _StridedShard
                          if "Shard" in type(place).__name__)
    return out


def _worker(parallelize, clip, save, load, folder):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from minitp.models import build_model
    from minitp.models.train import make_optimizer

    cfg, batches = _batches()
    out = {"losses": [], "norms": []}
    # DTensor logs from every rank when a gather takes two steps (a 2-D mesh's full_tensor)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    def build(dp, tp):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = parallelize(build_model(cfg, seed=0), mesh)
        return model, make_optimizer(model.parameters(), LR), mesh

    def step(model, optimizer, mesh, tokens, targets):
        n, r = mesh["dp"].size(), mesh["dp"].get_local_rank()
        rows = tokens.shape[0] // n
        x, y = tokens[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows]
        optimizer.zero_grad()
        logits = model(x)
        sharded = isinstance(logits, DTensor)
        with loss_parallel() if sharded else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
        norm = clip(model, MAX_NORM)
        optimizer.step()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        t = torch.tensor([value.item()])
        dist.all_reduce(t)  # the replicas' mean: one process's loss of the whole batch
        out["losses"].append(t.item() / dist.get_world_size())
        out["norms"].append(float(norm))

    model, optimizer, mesh = build(2, 2)
    out["layout"] = _layout_of(model, mesh)
    for tokens, targets in batches[:SAVED_AT]:
        step(model, optimizer, mesh, tokens, targets)
    saved = _held(model)
    save(model, optimizer, folder)
    dist.barrier()
    moved, moved_optimizer, moved_mesh = build(4, 1)
    load(moved, moved_optimizer, folder)
    loaded = _held(moved)
    out["same_after_load"] = all(torch.equal(saved[k], loaded[k]) for k in saved)
    out["moments"] = sum(len(s) for s in moved_optimizer.state.values())
    for tokens, targets in batches[SAVED_AT:]:
        step(moved, moved_optimizer, moved_mesh, tokens, targets)
    return out


def _reference() -> tuple[list[float], list[float]]:
    from minitp.models import build_model
    from minitp.models.train import train_one_process

    cfg, batches = _batches()
    return train_one_process(build_model(cfg, seed=0), batches, LR, clip=MAX_NORM)


def check_torch_run(parallelize, clip, save, load, timeout: float = 90.0) -> None:
    """See the module: the learner's four functions, on 4 processes, against one process."""
    import tempfile

    from minitp.runs import pytorch

    for fn in (parallelize, clip, save, load):  # minitp's own PyTorch plan is the answer's half
        refuse_own_deep(NAME, fn, pytorch.torch_tp, pytorch.tp_plan, pytorch.run_torch)
    with tempfile.TemporaryDirectory(prefix="minitp-graduate-") as folder:
        r = run_answer(_worker, 4, (parallelize, clip, save, load, folder), NAME, timeout,
                       hint=_HINT)[0]
    layout = r["layout"]
    split = [n for n, dims in layout.items() if "tp" in dims]
    if not split:
        raise wrong(NAME, f"{NAME}: on dp2×tp2 no parameter is split over mesh['tp']: apply "
                          "parallelize_module(model, mesh['tp'], plan) first, ColwiseParallel for "
                          "wq, wk, wv, w1, w3 and the output layer, RowwiseParallel for wo, w2 and "
                          "the embedding.")
    whole = [n for n, dims in layout.items() if "dp" not in dims]
    if whole:
        raise wrong(NAME, f"{NAME}: on dp2×tp2, {len(whole)} parameters (first {whole[0]}) are not "
                          "sharded over mesh['dp']: fully_shard each block, then the model, over "
                          "mesh['dp'], after tensor parallel.")
    losses, norms = _reference()
    lost = (" The weights came back, so AdamW's state did not: save and load the optimizer's too "
            "(get_state_dict(model, optimizer)); without its moments the step after the load is a "
            "first step again.")
    for k in range(STEPS):
        if k == SAVED_AT and not r["same_after_load"]:  # the steps before it were right
            raise ExerciseError(
                f"{NAME}: after load, the dp4 model's parameters are not the ones saved on "
                "dp2×tp2: load the checkpoint into this model's own state dict (get_state_dict, "
                "then torch.distributed.checkpoint.load, then set_state_dict).")
        where = (f"step {k + 1} (on dp2×tp2)" if k < SAVED_AT else
                 f"step {k + 1} (on dp4, after the load)")
        if not math.isclose(r["norms"][k], norms[k], rel_tol=1e-5, abs_tol=1e-6):
            why = (lost if k > SAVED_AT else " It looks like this rank's shards only: a DTensor's "
                   "norm is whole once you ask for full_tensor()." if r["norms"][k] < norms[k]
                   else "")
            raise wrong(NAME, f"{NAME}: {where}: clip returned the norm {r['norms'][k]:.6f}, not "
                              f"one process's.{why}", f"{norms[k]:.6f}")
        if not math.isclose(r["losses"][k], losses[k], rel_tol=1e-5, abs_tol=1e-6):
            raise wrong(NAME, f"{NAME}: {where}: the loss is {r['losses'][k]:.6f}, not one "
                              f"process's.{lost if k > SAVED_AT else ''}", f"{losses[k]:.6f}")
    if r["moments"] == 0:
        raise ExerciseError(f"{NAME}: the optimizer holds no state after the load: save and load "
                            "AdamW's state too (get_state_dict(model, optimizer)).")
    passed(NAME, f"{STEPS} steps equal one process: two on dp2×tp2 ({len(split)} parameters split "
                 "over tp, all sharded over dp), saved, loaded on dp4 bit for bit, two more; every "
                 "norm clipped at 0.5")
