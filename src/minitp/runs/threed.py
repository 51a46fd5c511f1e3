"""Checked runs of 3D parallelism: data × pipeline × tensor parallel on one mesh, checkpoints
too."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from minitp import checkpoint, cost, grid, layout
from minitp import trace as _trace
from minitp.cost.experts import idle_experts
from minitp.ep import full_state as ep_full_state
from minitp.launcher import launch
from minitp.mesh import Mesh
from minitp.models import build_model, get_config
from minitp.models.moe import MoEConfig, build_moe_model, moe_config, moe_layers
from minitp.models.train import TrainConfig, synthetic_batches
from minitp.parallel3d import Parallel3D, unshard_3d
from minitp.pp_schedules import RUNNER_SCHEDULES
from minitp.runs.common import build_report, check_run, step_events, worker_summary
from minitp.runs.context_parallel import ATTENTION
from minitp.runs.expert_parallel import moe_reference
from minitp.runs.references import full_batch
from minitp.runs.registry import COMMON, MAX_EXPERTS, Option, Strategy, register
from minitp.runs.report import Report
from minitp.trainer import build, train_step


def _3d_worker(model_name: str, train: TrainConfig, shape: dict, options: dict, start_step: int,
               resume_from: str | None, save_to: str | None) -> dict:
    cfg = options.pop("moe", None) or get_config(model_name)
    mesh = Mesh(shape["dp"], shape["pp"], shape["tp"], cp=shape["cp"], ep=shape["ep"],
                dp_shard=shape["dp_shard"])
    par = Parallel3D(build(cfg, train.seed), mesh, lr=train.lr, **options)
    if resume_from:
        checkpoint.load(par, resume_from, expected_step=start_step)
    losses, times, auxes = [], [], []
    events = _trace.current().events
    first = len(events)
    for tokens, targets in synthetic_batches(cfg, train)[start_step:]:
        t0 = time.perf_counter()
        loss = train_step(par, tokens, targets).loss
        times.append(time.perf_counter() - t0)
        auxes.append(par.aux_per_step)  # a MoE in a pipeline: this stage's auxiliary loss
        if loss is not None:  # only the last stage computes the loss
            losses.append(loss)
    last = len(events)
    memory = par.held_bytes()  # before anything is gathered
    if save_to:
        checkpoint.save(par, save_to, step=train.steps)
    more = {}
    # the routing that happened: what the all-to-alls' bytes follow
    if par.expert_parallel is not None:
        # this stage's; each forward (a micro-batch) routed once per layer
        layers = moe_layers(par.module)
        m = len(layers[0].history) // len(times)
        more = {"kept": [[layer.history[s * m + i].tolist() for i in range(m) for layer in layers]
                         for s in range(len(times))],
                "aux": auxes, "num_tensors": len(list(par.module.parameters()))}
    return worker_summary(losses, times, memory, coords=[mesh.coords.dp, mesh.coords.pp,
                                                         mesh.coords.tp],
                          shards=par.local_shards(), steps_events=(first, last), **more)


def _bytes_by_dim(events) -> dict[str, float]:
    """Bytes sent over each mesh dimension (the dimension each event's process group was named)."""
    sent = {dim: row["sent_bytes"] for (dim,), row in _trace.totals(events, by=("dim",)).items()}
    more = tuple(d for d in ("cp", "ep", *layout.DP_HALVES) if d in sent)
    return {dim: sent.get(dim, 0.0) for dim in layout.AXES + more}


def _check_output_folder(name: str, path: str | None) -> None:
    """Refuse a checkpoint folder that cannot be written, before anything trains."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"{name}={path!r} is a file; expected a folder to save the checkpoint into")
    if not os.path.isdir(parent):
        raise ValueError(f"{name}={path!r}: its parent folder {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.isdir(path)
                                                    and not os.access(path, os.W_OK | os.X_OK)):
        raise ValueError(f"{name}={path!r} is not writable")
    # a folder holding anything else: refused, untouched
    checkpoint.check_save_folder(path, f"{name}={path!r}")


def run_3d(nproc: int | None = None, dp: int = 2, tp: int = 2, pp: int = 2, fsdp: bool = False,
           zero: int | None = None, steps: int = 4, microbatches: int | None = None,
           schedule: str = "1f1b", model: str = "tiny", batch_size: int = 8, seq_len: int = 16,
           lr: float = 3e-3, seed: int = 0, backend: str = "gloo", timeout: float = 300.0,
           resume_from: str | None = None, save_to: str | None = None, cp: int = 1, ep: int = 1,
           experts: int = 8, virtual_stages: int | None = None, attention: str = "ring",
           dp_shard: int | None = None) -> Report:
    """Train with ``minitp.parallel3d.Parallel3D`` on a dp × pp × tp mesh and report it against the
    three oracles, the bytes split by dimension too (``comm_bytes_*_by_dim``).

    nproc: dp · pp · tp (the default); another number is refused.
    microbatches: per step, when pp > 1 (default: one sequence each, B/dp).
    resume_from: a checkpoint (``minitp.checkpoint``, any layout) to start from, at the step it was
        saved; the run then trains up to ``steps`` and is checked against the reference at
        ``steps``.
    save_to: save a sharded checkpoint after the last step.
    cp: context parallel inside each replica (``minitp.cp``): the mesh's dp dimension holds dp·cp
        ranks, each replica's rows split over cp along the sequence, the model state averaged (DDP)
        or sharded (FSDP) over all dp·cp of them.
    attention: how attention crosses the cp group when cp > 1: "ring", "ulysses" (all-to-alls of
        each tp rank's heads: cp divides n_heads/tp and n_kv_heads/tp) or "allgather"; its bytes
        are checked against ``cost.cp3d_step_bytes(attention=)``.
    schedule: "gpipe", "1f1b", "zb", or "interleaved" with ``virtual_stages`` chunks per rank
        (default 2; DDP only).
    ep: expert parallel (``minitp.ep``): the MoE variant of ``model`` (``experts`` experts per
        block, top-2, capacity factor 1.25), each run of ep consecutive dp ranks sharing one set of
        experts, dp/ep copies of each expert; the rest data parallel over dp (tp = 1, DDP; with pp,
        each stage's experts over its stage's ep group, every stage adding its layers' auxiliary
        loss itself).
    dp_shard: HSDP (``minitp.hsdp``) over the dp axis: dp/dp_shard replicas of dp_shard shards
        each, every stage's tp slice FSDP-sharded (ZeRO ``zero``) over its shard group and its
        gradient shards all-reduced over its replicate group (with or without ``fsdp``); its bytes
        are checked per group ("dp_shard", "dp_replicate") against ``cost.threed_step_bytes``.
    """
    nproc = dp * cp * pp * tp if nproc is None else nproc
    train = check_run("3d", locals(), data_parallel=dp, tensor_parallel=tp)
    # named as they were given: the mesh's dp axis (dp·cp ranks) is no one's input
    if dp * cp * pp * tp != nproc:
        given = {"dp": dp, "cp": cp, "pp": pp,
                 "tp": tp} if cp > 1 else {"dp": dp, "pp": pp, "tp": tp}
        names, sizes = "*".join(given), "*".join(map(str, given.values()))
        raise ValueError(f"{names} = {sizes} = {dp * cp * pp * tp} but the world has {nproc} ranks "
                         f"(nproc={nproc}; leave it out and it is {names})")
    cfg = get_config(model)
    layout.check_batch(batch_size, dp)
    v = virtual_stages or (2 if schedule == "interleaved" else 1)
    kind = "hsdp" if dp_shard is not None else "fsdp" if fsdp else "ddp"
    dims = grid.ParallelDims(dp, pp, tp, cp, ep, kind, zero, schedule, v, attention, dp_shard)
    if dp_shard is not None and (save_to or resume_from):
        raise ValueError("--dp-shard with --save-to or --resume-from: minitp's checkpoints do not "
                         "take HSDP's replicated shards yet")
    moe = None
    if ep > 1:
        layout.check_divisible("experts", experts, "ep", ep,
                               ": every rank holds experts/ep of them")
        moe = moe_config(cfg, n_experts=experts)
    dims.check_model(moe or cfg, nproc, seq_len)
    data_parallel, zero = dims.data_parallel, dims.zero
    if microbatches is None:
        microbatches = batch_size // dp if pp > 1 else 1
    if pp > 1:
        layout.check_divisible(f"each replica's batch (batch_size={batch_size} / dp={dp})",
                               batch_size // dp, "microbatches", microbatches)
    _check_output_folder("save_to", save_to)
    start_step = 0
    if resume_from:  # every check a rank's load would make, here, on the model the ranks will build
        config = moe or cfg
        with torch.device("meta"):  # its shapes only: no memory, no initialisation
            plain = build_moe_model(config) if moe is not None else build_model(config)
        shapes = {name: tuple(p.shape) for name, p in plain.named_parameters()}
        start_step = checkpoint.check_before_launch(resume_from, config, shapes)
    if not start_step < steps:
        raise ValueError(
            f"the checkpoint is at step {start_step}, nothing left to train up to steps={steps}")
    options = dict(data_parallel=data_parallel, zero=zero, microbatches=microbatches,
                   schedule=schedule)
    if cp > 1:
        options["cp_attention"] = attention
    if v > 1:
        options["virtual_stages"] = v
    if moe is not None:
        options["moe"] = moe
    # the mesh's dp axis holds dp·cp ranks
    shape = {"dp": dp * cp, "pp": pp, "tp": tp, "cp": cp, "ep": ep, "dp_shard": dp_shard}
    results = launch(_3d_worker, nproc, model, train, shape, options, start_step, resume_from,
                     save_to, backend=backend, timeout=timeout, echo=False)
    ran = steps - start_step
    if moe is not None:
        return _ep_report(moe, dp, ep, pp, results, model, train, start_step, resume_from, save_to,
                          microbatches if pp > 1 else None, schedule if pp > 1 else None)
    by_dim = []
    for r in results:
        d, s, _ = r["coords"]
        if cp > 1:  # d: the rank's place among the dp·cp ranks that average its gradients
            by_dim.append(cost.cp3d_step_bytes(cfg, batch_size, seq_len, dp, cp, tp, d, steps=ran,
                                               start_up=True, pp=pp, stage=s, virtual_stages=v,
                                               data_parallel=data_parallel, zero=zero or 3,
                                               state_dict=True, attention=attention))
            continue
        sent = cost.threed_step_bytes(cfg, batch_size, seq_len, dp, tp, pp, s, d, data_parallel,
                                      zero or 3, steps=ran, start_up=True, state_dict=True,
                                      virtual_stages=v, dp_shard=dp_shard)
        if dp_shard is not None:  # HSDP: the dp axis's bytes are its two groups', "dp" their sum
            sent.pop("dp")
        by_dim.append(sent)
    expected_memory = [cost.threed_memory_per_rank(cfg, dp * cp, tp, pp, r["coords"][1],
                                                   data_parallel, zero or 3, virtual_stages=v,
                                                   dp_shard=dp_shard) for r in results]
    traced_by_dim = [_bytes_by_dim(t.events) for t in results.traces]
    # the training steps alone, without DDP's start-up broadcast and FSDP's final gather (the
    # planner's view)
    per_step_by_dim = [{dim: b / ran for dim, b in _bytes_by_dim(step_events(r, t)).items()}
                       for r, t in zip(results, results.traces)]
    # each replica's whole model, from its stages' tp slices
    replicas = []
    for d in range(dp * cp):  # with cp, each replica's cp ranks hold the same parameters
        shards = [[results[grid.rank_of(d, s, t, pp, tp)]["shards"] for t in range(tp)]
                  for s in range(pp)]
        replicas.append(unshard_3d(shards))
    per_rank = [{**{k: v for k, v in r.items() if k != "shards"}, "state": replicas[r["coords"][0]]}
                for r in results]
    ref_losses, ref_state = full_batch(cfg, train)
    return build_report(
        "3d", {"dp": dp, "tp": tp, "pp": pp, **({"cp": cp} if cp > 1 else {}),
               **({"dp_shard": dp_shard} if dp_shard is not None else {})}, per_rank, results,
        model, replace(train, steps=ran),
        [sum(b.values()) for b in by_dim], expected_memory,
        reference=(ref_losses[start_step:], ref_state), start_step=start_step,
        comm_bytes_traced_by_dim=traced_by_dim, comm_bytes_expected_by_dim=by_dim,
        data_parallel=data_parallel, zero=zero, microbatches=microbatches if pp > 1 else None,
        schedule=schedule if pp > 1 else None, virtual_stages=v if pp > 1 else None,
        end_step=steps, coords=[r["coords"] for r in results],
        comm_bytes_traced_per_step_by_dim=per_step_by_dim, resumed_from=resume_from,
        saved_to=save_to, **({"attention": attention} if cp > 1 else {}))


def _ep_report(cfg: MoEConfig, dp: int, ep: int, pp: int, results, model: str, train: TrainConfig,
               start_step: int, resume_from: str | None, save_to: str | None,
               microbatches: int | None, schedule: str | None) -> Report:
    """A dp × ep (× pp) run of the MoE model against one process, its bytes against
    ``cost.ep3d_run_bytes`` of the routing each ep group's ranks reported (plus the pipeline's
    sends), its memory against ``cost.ep_mesh_memory_per_rank``. With pp > 1 the last stage's loss
    is the cross-entropy; each stage reported its layers' auxiliary loss, added here to compare with
    one process."""
    steps = train.steps - start_step
    rows, by_rank, replicas = train.batch_size // dp, {}, [{} for _ in range(dp // ep)]
    for stage in range(pp):
        dense, experts = cost.ep_stage_unit_numels(cfg, 1, pp, stage, ep)
        pp_bytes = steps * cost.pp_step_bytes(rows, train.seq_len, cfg.dim, pp, stage)
        for first in range(0, dp, ep):  # one ep group: dp ranks first .. first+ep-1 of this stage
            ranks = [grid.rank_of(d, stage, 0, pp, 1) for d in range(first, first + ep)]
            group = [results[r] for r in ranks]
            counts = [[[g["kept"][s][j] for g in group] for j in range(len(group[0]["kept"][s]))]
                      for s in range(steps)]
            for i, r in enumerate(ranks):
                sent = cost.ep3d_run_bytes(counts, i, cfg.dim, sum(dense), sum(experts), dp, ep)
                by_rank[r] = {**sent, "pp": pp_bytes}
            replicas[first // ep].update(ep_full_state([{k: v for k, (v, _) in g["shards"].items()}
                                                        for g in group]))
    by_dim = [by_rank[r] for r in range(len(results))]
    # [step][layer]: (E,) kept assignments over every dp rank and micro-batch of the stage
    def stage_kept(stage):
        group = [results[grid.rank_of(d, stage, 0, pp, 1)] for d in range(dp)]
        layers = cost.rank_num_blocks(cfg.n_layers, pp, stage, 1)
        return [[[sum(g["kept"][s][i * layers + j][e] for g in group
                      for i in range(len(g["kept"][s]) // layers))
                  for e in range(cfg.n_experts)] for j in range(layers)] for s in range(steps)]

    # experts no token reached hold no gradient (or AdamW state)
    kept = [stage_kept(s) for s in range(pp)]
    expected_memory = [cost.ep_mesh_memory_per_rank(cfg, dp, 1, pp, r["coords"][1], ep,
                                                    idle=idle_experts(kept[r["coords"][1]], ep,
                                                                      r["coords"][0] % ep))
                       for r in results]
    per_rank = []
    for r in results:
        d, stage, _ = r["coords"]
        losses = r["losses"]
        # the cross-entropy, plus every stage's auxiliary loss of this replica
        if pp > 1 and losses:
            aux = [sum(results[grid.rank_of(d, q, 0, pp, 1)]["aux"][s] for q in range(pp))
                   for s in range(steps)]
            losses = [loss + cfg.aux_loss_coef * a for loss, a in zip(losses, aux)]
        per_rank.append({**{k: v for k, v in r.items() if k != "shards"}, "losses": losses,
                         "state": replicas[d // ep]})
    ref_losses, ref_state, _ = moe_reference(cfg, train)
    return build_report(
        "3d", {"dp": dp, "tp": 1, "pp": pp, "ep": ep}, per_rank, results, model,
        replace(train, steps=steps), [sum(b.values()) for b in by_dim], expected_memory,
        reference=(ref_losses[start_step:], ref_state), num_params=cfg.num_params(),
        start_step=start_step,
        comm_bytes_traced_by_dim=[_bytes_by_dim(t.events) for t in results.traces],
        comm_bytes_expected_by_dim=by_dim, data_parallel="ddp", end_step=train.steps,
        resumed_from=resume_from, saved_to=save_to, microbatches=microbatches, schedule=schedule,
        coords=[r["coords"] for r in results], experts=cfg.n_experts, top_k=cfg.top_k,
        params_per_rank=cost.ep_params_per_rank(cfg, ep))


register(Strategy("3d", run_3d,
                  "3D: data x pipeline x tensor parallel on one mesh of dp*pp*tp ranks", (
    Option("dp", int, 2, "data-parallel replicas", low=1),
    Option("tp", int, 2, "tensor-parallel ranks per stage", low=1),
    Option("pp", int, 2, "pipeline stages", low=1),
    Option("cp", int, 1, "context-parallel ranks per replica: the sequence split, attention a ring",
           low=1),
    ATTENTION,
    Option("ep", int, 1,
           "expert-parallel ranks: the MoE model's experts split over ep of the dp ranks "
           "(tp=1, DDP)", low=1),
    Option("experts", int, 8, "experts per MoE layer when ep > 1 (a multiple of ep)", low=1,
           high=MAX_EXPERTS),
    Option("fsdp", bool, False, "FSDP across replicas instead of DDP"),
    Option("dp_shard", int, None,
           "HSDP: FSDP inside groups of dp_shard dp ranks, all-reduce across them (divides dp)",
           low=1, optional=True),
    Option("zero", int, None, "FSDP's ZeRO stage (default 3 without a pipeline, 1 with one)",
           choices=(None, 1, 2, 3)),
    Option("microbatches", int, None, "micro-batches per step when pp > 1 (default batch_size/dp)",
           low=1, optional=True),
    Option("schedule", str, "1f1b", "pipeline schedule", choices=RUNNER_SCHEDULES),
    Option("virtual_stages", int, None, "chunks per rank with --schedule interleaved (default 2)",
           low=1, optional=True),
    Option("save_to", str, None, "save a sharded checkpoint into this folder after the last step",
           metavar="DIR"),
    Option("resume_from", str, None, "start from a checkpoint (any layout)", metavar="DIR"),
), common=tuple(replace(o, default=None, optional=True,
                        help="number of processes (default dp*pp*tp)")
                if o.name == "nproc" else o for o in COMMON)))
