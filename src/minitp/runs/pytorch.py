"""The same runs in PyTorch's own API, beside minitp's: ``minitp run STRATEGY --impl torch``.

Everything minitp builds from scratch, PyTorch ships, under the names a learner uses at work (each
strategy chapter ends with a table: minitp's name, PyTorch's, torchtitan's config key). For ddp,
fsdp, tp, pp and 3d, ``run_torch`` runs minitp's checked run of the strategy (its runner), then
PyTorch's own implementation of the same layout on the same model (``minitp.models``, the same
seed) and batches, and reports PyTorch's losses and parameters against the same one process
(``references.full_batch``) and its bytes per mesh dimension beside minitp's traced ones:

- ddp: ``torch.nn.parallel.DistributedDataParallel`` (buckets capped at ``bucket_mb``, no
  broadcast of buffers before each forward: minitp sends none);
- fsdp: ``fully_shard`` (FSDP2) on a 1-D ``DeviceMesh``, each block a unit, then the root; ZeRO-3
  frees the gathered weights after forward (``reshard_after_forward=True``), ZeRO-2 keeps them;
- tp: ``parallelize_module`` with ``ColwiseParallel`` (wq, wk, wv, w1, w3; the output layer, its
  logits sharded over the vocabulary) and ``RowwiseParallel`` (wo, w2; the embedding's vocabulary
  rows), ``PrepareModuleInput`` so that attention and the MLP all-reduce once each in backward, as
  minitp does, and the loss on the vocabulary shards under ``loss_parallel``;
- pp: ``torch.distributed.pipelining``: a ``PipelineStage`` around minitp's stage pieces,
  ``ScheduleGPipe`` or ``Schedule1F1B``;
- 3d: a 3-D ``DeviceMesh`` composed as torchtitan composes it: tensor parallel on the tp
  sub-mesh, the stage, then ``fully_shard`` of the stage on the dp sub-mesh.

The bytes of PyTorch's side are counted from the tensors it hands to ``torch.distributed``, never
from minitp's trace: a ``TorchDispatchMode`` (``CommCounter``) sees every collective and
point-to-point call on its way to the backend (``c10d`` ops, from Python or from C++ such as DDP's
reducer, and the functional collectives DTensor sends), with its tensors and its group; each
call's payload is the ring model minitp's trace uses (``trace.collective_sent_bytes``), so the two
columns compare. A call it cannot size stops the run rather than go uncounted. They count from the
wrapping of the model to the last step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from minitp import trace as _trace
from minitp.layout import AXES
from minitp.runs.common import steady_step_s

STRATEGIES = ("ddp", "fsdp", "tp", "pp", "3d")
# what each strategy's --impl torch run takes beyond the common options; the others are minitp's
OPTIONS = {"ddp": ("bucket_mb",), "fsdp": ("zero",), "tp": (), "pp": ("microbatches", "schedule"),
           "3d": (*AXES, "microbatches", "fsdp", "zero")}
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
OPS = {  # the dispatcher's names of what minitp's trace calls each operation
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "allgather_": "all_gather", "scatter_": "scatter",
    "send": "send", "recv_": "recv", "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}


FUNCTIONAL = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
NO_PAYLOAD = ("wait_tensor", "barrier", "monitored_barrier_", "_wrap_tensor_autograd")


class CommCounter(TorchDispatchMode):
    """Every collective and point-to-point call dispatched while it is on, as (op, group ranks,
    logical bytes, sent bytes): the bytes of the tensors handed to ``torch.distributed``."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...], int, float]] = []
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            # a mode sees an op before a tensor subclass does: let DTensor turn it into plain ops
            # and the collectives its placements need, which come back through here
            return NotImplemented
        namespace, name = func.namespace, func.__name__.split(".")[0]
        if namespace in FUNCTIONAL + ("c10d",):
            if name in OPS:
                self._count(OPS[name], name, args, kwargs)
            elif name not in NO_PAYLOAD:  # a call this counter cannot size: said, never dropped
                self.unknown.add(f"{namespace}.{name}")
        return func(*args, **kwargs)

    def _count(self, op: str, name: str, args, kwargs) -> None:
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                   if isinstance(t, torch.Tensor)]
        ranks = _group_ranks(args)
        n = len(ranks)
        if name in ("_allgather_base_", "_reduce_scatter_base_", "alltoall_base_"):
            whole = tensors[0 if op == "all_gather" else 1]  # (output, input): the whole side
            nbytes = _nbytes(whole)
        elif name in ("all_gather_into_tensor", "allgather_"):  # this rank's piece, n of them
            inputs = tensors[:1] if name == "all_gather_into_tensor" else tensors
            nbytes = sum(_nbytes(t) for t in inputs) * n
        elif name == "scatter_":  # (this rank's piece, [the pieces] on the root): n pieces
            nbytes = _nbytes(tensors[0]) * n
        else:  # the tensor (or the list of them) a call hands over: all of it
            nbytes = sum(_nbytes(t) for t in tensors)
        me = dist.get_rank()
        if op == "scatter":  # the root sends every piece but its own; the others send nothing
            root = ranks[next(a for a in args if isinstance(a, int) and not isinstance(a, bool))]
            sent = nbytes * (n - 1) / n if me == root else 0.0
        elif op in ("send", "recv"):
            sent = float(nbytes) if op == "send" else 0.0
        else:
            sent = _trace.collective_sent_bytes(op, nbytes, n, ranks.index(me))
        self.calls.append((op, ranks, nbytes, sent))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_ranks(args) -> tuple[int, ...]:
    """The global ranks of the call's group: a ``ProcessGroup`` argument (c10d ops) or a group's
    name (the functional collectives); the world's when neither is given."""
    from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks

    for a in args:
        if isinstance(a, torch.ScriptObject):  # a c10d op's group, boxed for the dispatcher
            a = dist.ProcessGroup.unbox(a)
        if isinstance(a, dist.ProcessGroup):
            return tuple(get_process_group_ranks(a))
        if isinstance(a, str):
            try:
                return tuple(get_process_group_ranks(_resolve_process_group(a)))
            except (KeyError, RuntimeError, ValueError):
                continue
    return tuple(range(dist.get_world_size()))


def by_dim(calls, dims: dict[tuple[int, ...], str]) -> dict[str, float]:
    """Sent bytes per mesh dimension: each call's group ranks looked up in ``dims`` (a group not in
    it, the world's: "world")."""
    out: dict[str, float] = {}
    for _, ranks, _, sent in calls:
        dim = dims.get(tuple(sorted(ranks)), "world")
        out[dim] = out.get(dim, 0.0) + sent
    return out


# -- PyTorch's side of one rank -----------------------------------------------------------------
def _held(params, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state this rank holds (a DTensor's local shard)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(params)
    return {"params": sum(_nbytes(local(p)) for p in params),
            "grads": sum(_nbytes(local(p.grad)) for p in params if p.grad is not None),
            "optimizer": sum(_nbytes(local(v)) for s in optimizer.state.values()
                             for v in s.values() if isinstance(v, torch.Tensor))}


def _rows(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Replica ``r``'s rows of a global batch, as ``minitp.ddp.split_batch`` cuts them."""
    rows = t.shape[0] // n
    return t[r * rows:(r + 1) * rows]


def tp_plan():
    """(the model-level plan, each block's plan) of ``parallelize_module``: the messages minitp's
    tensor parallel sends (attention's and the MLP's input laid out once, so their backward
    all-reduces once each)."""
    import inspect

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    from minitp.models.llama import Attention

    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),  # vocabulary rows
           # the logits (B, S, V/tp), for loss_parallel
           "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    shared = dict(desired_input_layouts=(Replicate(),), use_local_output=False)
    # attention(x, cos, sin, cache, attend): only x is laid out, one entry per argument
    inputs = (Replicate(),) + (None,) * (len(inspect.signature(Attention.forward).parameters) - 2)
    block = {"attention": PrepareModuleInput(input_layouts=inputs, desired_input_layouts=inputs,
                                             use_local_output=False),
             "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
             "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
             "feed_forward": PrepareModuleInput(input_layouts=(Replicate(),), **shared),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel()}
    return top, block


def torch_tp(model, mesh) -> None:
    """PyTorch's tensor parallel on ``model`` over a 1-D ``mesh``, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    top, block_plan = tp_plan()
    parallelize_module(model, mesh, top)
    for block in model.layers:
        parallelize_module(block, mesh, block_plan)
        for linear in (block.attention.wq, block.attention.wk, block.attention.wv):
            linear.out_features //= mesh.size()  # the plain forward reads its local heads off these


def _loss(logits, targets):
    """The mean cross-entropy; on vocabulary-sharded DTensor logits it runs under
    ``loss_parallel`` (the caller's)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _build(strategy: str, model, o: dict):
    """PyTorch's wrapping of ``model`` for this rank: (what the step calls, the module whose
    parameters this rank trains, this rank's replica and number of replicas, the schedule or
    None, whether the logits are vocabulary-sharded, the pp stage and stages)."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from minitp.grid import coordinates
    from minitp.pp import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    dp, pp, tp = ((o["dp"], o["pp"], o["tp"]) if strategy == "3d" else
                  {"ddp": (world, 1, 1), "fsdp": (world, 1, 1), "tp": (1, 1, world),
                   "pp": (1, world, 1)}[strategy])
    c = coordinates(rank, dp, pp, tp)
    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=AXES)
    if tp > 1:
        torch_tp(model, mesh["tp"])
    piece = PipelineStage(model, c.pp, pp) if pp > 1 else model
    call = piece
    if dp > 1 and strategy == "ddp":
        call = DistributedDataParallel(piece, bucket_cap_mb=o["bucket_mb"], broadcast_buffers=False,
                                       gradient_as_bucket_view=True)
    elif dp > 1:  # fsdp, and 3d's data parallel: each block a unit, then the rest
        reshard = strategy == "fsdp" and o["zero"] == 3
        for block in (piece.layers.values() if pp > 1 else piece.layers):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(piece, mesh=mesh["dp"], reshard_after_forward=reshard)
    schedule = None
    if pp > 1:
        stage = pipelining.PipelineStage(piece, c.pp, pp, torch.device("cpu"),
                                         group=mesh["pp"].get_group())
        schedule = getattr(pipelining, SCHEDULES[o.get("schedule", "1f1b")])(
            stage, o["microbatches"], loss_fn=_loss)
    return call, piece, (c.dp, dp), schedule, tp > 1, (c.pp, pp)


def _train(strategy: str, cfg, train, o: dict, counter: CommCounter | None):
    """Build PyTorch's side and train it on the run's batches: (losses, step times, the trained
    piece, its optimizer, this rank's replica, whether it is the last stage). ``counter``: on
    from the wrapping (its first messages: DDP's broadcast of the weights) to the last step."""
    from torch.distributed.tensor.parallel import loss_parallel

    from minitp.models import build_model
    from minitp.models.train import make_optimizer, synthetic_batches

    losses, times = [], []
    with counter if counter is not None else contextlib.nullcontext():
        call, piece, (replica, replicas), schedule, sharded, (stage, stages) = _build(
            strategy, build_model(cfg, seed=train.seed), o)
        optimizer = make_optimizer(piece.parameters(), train.lr)
        for tokens, targets in synthetic_batches(cfg, train):
            x, y = _rows(tokens, replicas, replica), _rows(targets, replicas, replica)
            t0 = time.perf_counter()
            optimizer.zero_grad()
            with loss_parallel() if sharded else contextlib.nullcontext():
                if schedule is None:
                    loss = _loss(call(x), y)
                    loss.backward()
                    loss = loss.item()
                else:
                    loss = pipeline_step(schedule, stage, stages, x, y)
            optimizer.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    return losses, times, piece, optimizer, replica, stage == stages - 1


def pipeline_step(schedule, stage: int, stages: int, tokens, targets) -> float | None:
    """One step of a ``torch.distributed.pipelining`` schedule on this rank: the first stage feeds
    the tokens, the last the targets (and gets each micro-batch's loss), the others neither.
    Returns the mean of the micro-batches' losses on the last stage, else None."""
    kept: list = []
    if stage == 0:
        schedule.step(tokens)
    elif stage == stages - 1:
        schedule.step(target=targets, losses=kept)
    else:
        schedule.step()
    return statistics.fmean(t.item() for t in kept) if kept else None


def _torch_worker(strategy: str, model_name: str, train, o: dict, timed: bool = True) -> dict:
    """PyTorch's run on this rank, twice from the same seed: counted (every call passes through
    ``CommCounter``, which slows each operator), then (``timed``) timed with nothing in the way."""
    from minitp.grid import group_lists
    from minitp.models import get_config

    cfg, world = get_config(model_name), dist.get_world_size()
    layout = _layout(strategy, o, world)
    lists = group_lists(layout["dp"], layout["pp"], layout["tp"])
    named = {tuple(g): dim for dim, groups in lists.items() for g in groups if len(g) > 1}
    # DTensor logs from every rank when a gather takes two steps (a 3-D mesh's full_tensor)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    counter = CommCounter()
    losses, _, piece, optimizer, replica, last = _train(strategy, cfg, train, o, counter)
    state = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for k, p in piece.named_parameters()}  # a sharded one gathered: a collective
    memory = _held(piece.parameters(), optimizer)
    times = _train(strategy, cfg, train, o, None)[1] if timed else [math.nan]
    return {"losses": losses, "step_s": steady_step_s(times),
            "sent_by_dim": by_dim(counter.calls, named), "memory": memory, "state": state,
            "replica": replica, "last_stage": last, "unknown": sorted(counter.unknown)}


def _layout(strategy: str, values: dict, world: int) -> dict[str, int]:
    if strategy == "3d":
        return {"dp": values["dp"], "pp": values["pp"], "tp": values["tp"]}
    dim = {"ddp": "dp", "fsdp": "dp", "tp": "tp", "pp": "pp"}[strategy]
    return {d: (world if d == dim else 1) for d in AXES}


# -- the run: minitp's, then PyTorch's, side by side -----------------------------------------------
@dataclass
class TorchRun:
    """PyTorch's run of a strategy beside minitp's (``minitp_report``, a checked ``Report``)."""

    strategy: str
    minitp_report: Any = field(repr=False)
    loss: list[float]
    max_abs_param_diff: float
    sent_by_dim: list[dict[str, float]]  # per rank, over the run, counted from PyTorch's calls
    minitp_sent_by_dim: list[dict[str, float]]  # per rank, minitp's traced bytes
    memory: list[dict[str, int]]
    step_s: list[float]
    tolerance: float = 1e-5

    def check(self) -> list[str]:
        """What is wrong: minitp's own run's problems, then PyTorch's distance to one process."""
        problems = [f"minitp: {p}" for p in self.minitp_report.check()]
        if not self.max_abs_param_diff <= self.tolerance:
            problems.append(f"PyTorch's parameters differ from the one-process reference by "
                            f"{self.max_abs_param_diff:.3g} > {self.tolerance:g}")
        worst = max(abs(a - b) for a, b in zip(self.loss, self.minitp_report.reference_loss))
        if not worst <= self.tolerance:
            problems.append(f"PyTorch's losses differ from one process's by {worst:.3g}")
        return problems

    def format(self) -> str:
        from minitp.runs.report import verdict

        r = self.minitp_report
        lines = [r.format(), "", f"the same in PyTorch ({TORCH_API[self.strategy]}):", "",
                 f"{'step':>4}  {'torch':>8}  {'reference':>9}  |loss - reference|"]
        for s, (a, b) in enumerate(zip(self.loss, r.reference_loss)):
            lines.append(f"{s:>4}  {a:>8.4f}  {b:>9.4f}  {verdict(abs(a - b), self.tolerance)}")
        lines += ["", "max |parameter - reference| "
                      f"{verdict(self.max_abs_param_diff, self.tolerance)}", ""]
        dims = [d for d in (*AXES, "world") if any(d in s for s in self.sent_by_dim
                                                   + self.minitp_sent_by_dim)]
        lines.append(f"{'rank':>4}  " + "  ".join(f"{d + ' torch':>12}  {d + ' minitp':>12}"
                                                  for d in dims)
                     + f"  {'params':>10}  {'grads':>10}  {'optimizer':>10}  {'step':>9}")
        for rank, (t, m) in enumerate(zip(self.sent_by_dim, self.minitp_sent_by_dim)):
            held = self.memory[rank]
            lines.append(f"{rank:>4}  " + "  ".join(f"{t.get(d, 0.0):>12,.0f}  "
                                                    f"{m.get(d, 0.0):>12,.0f}" for d in dims)
                         + f"  {held['params']:>10,}  {held['grads']:>10,}  "
                           f"{held['optimizer']:>10,}  {self.step_s[rank] * 1e3:>6.1f} ms"
                           .replace("   nan ms", "       -"))
        lines += ["(bytes each rank sent over the run, ring model: PyTorch's counted from the "
                  "tensors handed to torch.distributed, minitp's from its trace)"]
        return "\n".join(lines)

    def summary(self) -> str:
        """Both runs against one process and the bytes each rank sent per dimension, side by side:
        what a chapter prints (no times: they are the machine's)."""
        from minitp.runs.report import verdict

        r = self.minitp_report
        worst = max(abs(a - b) for a, b in zip(self.loss, r.reference_loss))
        mine = max(abs(a - b) for a, b in zip(r.loss, r.reference_loss))
        lay = ", ".join(f"{d}={n}" for d, n in r.layout.items() if n > 1)
        lines = [f"{self.strategy} on {r.world_size} ranks ({lay}), {r.steps} steps, against one "
                 "process:",
                 f"  minitp:  losses {verdict(mine, r.loss_tolerance)}, parameters "
                 f"{verdict(r.max_abs_param_diff, r.param_tolerance)}",
                 f"  PyTorch: losses {verdict(worst, self.tolerance)}, parameters "
                 f"{verdict(self.max_abs_param_diff, self.tolerance)}"
                 f"  ({TORCH_API[self.strategy]})",
                 "bytes each rank sent over the run (ring model):"]
        dims = [d for d in (*AXES, "world") if any(d in s for s in self.sent_by_dim
                                                   + self.minitp_sent_by_dim)]
        lines.append(f"{'rank':>6}" + "".join(f"  {d + ' minitp':>12}  {d + ' torch':>12}  "
                                               f"{'difference':>11}" for d in dims))
        for rank, (t, m) in enumerate(zip(self.sent_by_dim, self.minitp_sent_by_dim)):
            lines.append(f"{rank:>6}" + "".join(
                f"  {m.get(d, 0.0):>12,.0f}  {t.get(d, 0.0):>12,.0f}  "
                f"{t.get(d, 0.0) - m.get(d, 0.0):>+11,.0f}" for d in dims))
        return "\n".join(lines)

    def to_json(self, path: str | None = None) -> str:
        import json

        data = {"strategy": self.strategy, "impl": "torch", "loss": self.loss,
                "reference_loss": self.minitp_report.reference_loss,
                "max_abs_param_diff": self.max_abs_param_diff, "sent_by_dim": self.sent_by_dim,
                "minitp_sent_by_dim": self.minitp_sent_by_dim, "memory": self.memory,
                "step_s": self.step_s, "minitp": self.minitp_report.to_dict()}
        text = json.dumps(data, indent=2) + "\n"
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @property
    def traces(self) -> list:
        return self.minitp_report.traces


TORCH_API = {"ddp": "DistributedDataParallel", "fsdp": "fully_shard on a DeviceMesh",
             "tp": "parallelize_module, loss_parallel",
             "pp": "torch.distributed.pipelining", "3d": "a 3-D DeviceMesh: parallelize_module on "
             "tp, a pipelining stage, fully_shard on dp"}


def run_torch(strategy: str, *, timed: bool = True, **values) -> TorchRun:
    """minitp's checked run of ``strategy`` (``values``: its runner's keywords), then PyTorch's
    run of the same layout, model and batches, side by side. ``timed=False``: no second, timed run
    of PyTorch's side (its ``step_s`` are NaN; ``summary`` prints no times anyway)."""
    from minitp.launcher import launch
    from minitp.models import get_config
    from minitp.models.train import TrainConfig
    from minitp.runs.references import full_batch, max_abs_diff
    from minitp.runs.registry import STRATEGIES as RUNNERS

    if strategy not in STRATEGIES:
        raise ValueError(f"--impl torch runs {', '.join(STRATEGIES)}, not {strategy}")
    runner = RUNNERS[strategy]
    defaults = {op.name: op.default for op in runner.options}
    for option in runner.options:
        if option.name in values and option.name not in OPTIONS[strategy] \
                and values[option.name] != option.default:
            raise ValueError(f"{option.flag} is minitp's alone: --impl torch runs {strategy} with "
                             + (", ".join("--" + n.replace("_", "-") for n in OPTIONS[strategy])
                                or "the common options only"))
    o = {k: values.get(k, defaults[k]) for k in OPTIONS[strategy]}
    if strategy == "pp" and o["schedule"] not in SCHEDULES:
        raise ValueError(f"--impl torch runs pp with --schedule {' or '.join(SCHEDULES)}, not "
                         f"{o['schedule']}")
    if strategy == "fsdp" and o["zero"] not in (2, 3):
        raise ValueError(f"--impl torch runs fsdp with --zero 2 or 3 (fully_shard keeps or frees "
                         f"the gathered weights after forward), not {o['zero']}")
    report = runner.runner(**values)  # minitp's checked run
    if strategy == "3d":
        o["microbatches"] = report.get("microbatches") or 1
    world = report.world_size
    train = TrainConfig(steps=report.steps, batch_size=report.batch_size,
                        seq_len=values.get("seq_len", 16), lr=values.get("lr", 3e-3),
                        seed=values.get("seed", 0))
    results = launch(_torch_worker, world, strategy, report.model, train, o, timed,
                     backend=values.get("backend", "gloo"), timeout=values.get("timeout", 300.0),
                     echo=False)
    unknown = sorted({name for r in results for name in r["unknown"]})
    if unknown:
        raise RuntimeError(f"PyTorch's {strategy} called {', '.join(unknown)}, whose bytes "
                           "minitp.runs.pytorch.CommCounter does not count: add it to OPS")
    ref_losses, ref_state = full_batch(get_config(report.model), train)
    state = {}
    for r in results:
        state.update(r["state"])
    losses = [statistics.fmean(r["losses"][s] for r in results
                               if r["last_stage"] and r["losses"][s] is not None)
              for s in range(train.steps)]
    minitp_sent = report.comm_bytes_traced_by_dim or [
        {dim: sent} for sent in report.comm_bytes_traced
        for dim in [next(d for d, n in report.layout.items() if n > 1)]]
    return TorchRun(strategy, report, losses, max_abs_diff(state, ref_state),
                    [r["sent_by_dim"] for r in results], minitp_sent,
                    [r["memory"] for r in results], [r["step_s"] for r in results])


__all__ = ["STRATEGIES", "CommCounter", "TorchRun", "by_dim", "pipeline_step", "run_torch",
           "torch_tp", "tp_plan"]
