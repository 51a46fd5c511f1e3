"""Runs that build a strategy to measure it: ``minitp calibrate`` and the activations kept per rank.

``minitp.measure`` counts and times (memory held, activations saved, this machine's rates and their
fits) and imports no strategy; what builds a strategy in order to measure it is a runner, here:

* ``calibrate``: every measurement of ``minitp calibrate``, launched and fitted (each figure is
  explained in ``minitp.measure.calibrate``, which fits, stores and reads them). Two of them run
  strategies, at one rank, where a collective moves nothing: a strategy's own code
  (``_own_work_worker``: the tiny model's step plain and under DDP, FSDP and tensor parallel) and
  what one operation of ring attention and of a MoE costs (``_op_cost_worker``).
* ``measure_activations``: what each block saves for backward on each rank of tensor parallel,
  counted by the saved-tensor hooks of ``minitp.measure.activations``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from minitp.measure import calibrate as machine
from minitp.measure import collectives, sharing
from minitp.measure.activations import run_recomputed, saved_bytes_per_block
from minitp.measure.elements import SHAPES, element_costs
from minitp.models import BYTE


# -- minitp calibrate ------------------------------------------------------------------------------
def _own_work_worker(repeats: int) -> dict:
    """On one rank, where a collective is a call that moves nothing: the tiny model's median
    training step plain and under minitp's DDP (0.25 MiB buckets), FSDP (ZeRO-3) and tensor
    parallel, each built as ``minitp run`` builds it, taking turns step by step (the first three
    rounds warm up); how many collectives each step calls (counted in the trace every rank
    records); and the median of a bare ``dist.all_reduce`` of one element.
    {"step_s": {name: s}, "calls": {name: n}, "call_s": s}"""
    import torch.distributed as dist

    from minitp import tp
    from minitp import trace as _trace
    from minitp.ddp import DistributedDataParallel
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.models import TINY, build_model, loss_fn
    from minitp.models.train import make_optimizer

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, TINY.vocab_size, (8, 16), generator=g) for _ in range(2))
    plain, ddp, fsdp = (build_model(TINY, seed=0) for _ in range(3))
    sharded = FullyShardedDataParallel(fsdp)
    split = tp.parallelize(build_model(TINY, seed=0), None)
    steps = {  # name: (what steps, its optimizer, its loss)
        "plain": (plain, make_optimizer(plain.parameters(), 1e-3), loss_fn),
        "ddp": (DistributedDataParallel(ddp, bucket_mb=0.25),
                make_optimizer(ddp.parameters(), 1e-3), loss_fn),
        "fsdp": (sharded, sharded.attach(make_optimizer(sharded.parameters(), 1e-3)), loss_fn),
        "tp": (split, make_optimizer(split.parameters(), 1e-3),
               lambda logits, y: tp.vocab_parallel_cross_entropy(logits, y, None)),
    }
    times, calls = {name: [] for name in steps}, {}
    trace = _trace.current()  # a launched rank records
    for _ in range(repeats + 3):
        for name, (model, optimizer, loss) in steps.items():
            first = len(trace.events)
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            loss(model(tokens), targets).backward()
            optimizer.step()
            times[name].append(time.perf_counter() - t0)
            calls[name] = sum(e.kind == "comm" for e in trace.events[first:])
    one, bare = torch.zeros(1), []
    for _ in range(4 * repeats):
        t0 = time.perf_counter()
        dist.all_reduce(one)
        bare.append(time.perf_counter() - t0)
    return {"step_s": {name: statistics.median(t[3:]) for name, t in times.items()}, "calls": calls,
            "call_s": statistics.median(bare)}


def _op_cost_worker(repeats: int) -> dict:
    """On one rank: the median forward+backward of the tiny model plain, under ring attention and
    as a MoE under expert parallel (8 experts, top-2), taking turns (the first three rounds warm
    up), and the operations each dispatches. {"fb_s": {name: s}, "ops": {name: n}}"""
    from minitp import cp, ep
    from minitp.models import TINY, build_model, loss_fn
    from minitp.models.moe import build_moe_model, moe_config, moe_loss

    torch.set_num_threads(1)
    tokens = torch.randint(0, TINY.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    plain, dense = build_model(TINY, seed=0), build_model(TINY, seed=0)
    ring = cp.parallelize(dense, None, True, "ring")
    local = cp.shard_sequence(tokens, None, True)
    moe = build_moe_model(moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25), seed=0)
    experts, moe_loss_fn = ep.ExpertParallel(moe, None), moe_loss(moe)
    passes = {"plain": lambda: loss_fn(plain(tokens), tokens).backward(),
              "cp": lambda: loss_fn(ring(local), local).backward(),
              "ep": lambda: moe_loss_fn(experts(tokens), tokens).backward()}
    ops = {name: machine.count_dispatched(run) for name, run in passes.items()}
    times = {name: [] for name in passes}
    for _ in range(repeats + 3):
        for name, run in passes.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {"fb_s": {name: statistics.median(t[3:]) for name, t in times.items()}, "ops": ops}


def _slower_rank(results: list[dict], sizes) -> tuple[dict, dict]:
    """The slower rank's (mean, fastest) all-reduce times per size: the slower rank finishes the
    collective."""
    means = {b: max(r["all_reduce"][b][0] for r in results) for b in sizes}
    fastest = {b: max(r["all_reduce"][b][1] for r in results) for b in sizes}
    return means, fastest


def calibrate(repeats: int = 40, sizes: tuple[int, ...] = machine.SIZES) -> dict:
    """Measure this machine (several seconds): the figures ``minitp.cost.device_from_calibration``
    takes, as ``minitp.measure.calibrate.save`` stores them."""
    from minitp.launcher import launch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flops = machine.matmul_flops_per_s(*machine.TINY_SHAPE)
    large = machine.matmul_flops_per_s(512, 512, 512, repeats=5)
    fixed = machine.fixed_costs(flops)
    byte = machine.tiny_step_s((1,), *SHAPES["byte"], repeats=5, cfg=BYTE)[1]
    elements = element_costs(large, fixed, byte)
    own = launch(_own_work_worker, 1, repeats, echo=False, timeout=120)[0]
    op_costs = launch(_op_cost_worker, 1, repeats, echo=False, timeout=120)[0]
    results = launch(machine._all_reduce_worker, 2, tuple(sizes), repeats, echo=False, timeout=120)
    means, fastest = _slower_rank(results, sizes)
    alpha, beta = machine.fit_alpha_beta(means, 2)
    kinds = launch(collectives._kinds_worker, 2, tuple(sizes), repeats, machine.TINY_SHAPE[:2],
                   echo=False, timeout=120)
    kind_means = {kind: {b: max(r[kind][b] for r in kinds) for b in sizes}
                  for kind in collectives.KINDS}  # the slower rank's
    try:
        alpha_min, beta_min = machine.fit_alpha_beta(fastest, 2)
    except ValueError:  # only for comparison: a noisy fastest fit does not spoil the calibration
        alpha_min, beta_min = None, None
    shared = {"alpha_shared_s": None, "bytes_per_s_shared": None, "shared_slowdown": None,
              "busy_slowdown": None}
    if cores and 2 <= cores <= machine.SHARED_MAX_RANKS:  # what every core busy does to a step
        rounds = launch(sharing._busy_step_worker, cores, max(2, repeats // 4), echo=False,
                        timeout=120)
        shared["busy_slowdown"] = sharing.busy_slowdown(list(rounds))
    # what waiting for a core does to messages and to compute
    if cores and 2 <= cores and 2 * cores <= machine.SHARED_MAX_RANKS:
        crowded = launch(machine._all_reduce_worker, 2 * cores, tuple(sizes), repeats // 2,
                         echo=False, timeout=120)
        shared_means = _slower_rank(crowded, sizes)[0]
        shared["shared_slowdown"] = (statistics.fmean(r["compute_s"] for r in crowded)
                                     / statistics.fmean(r["compute_s"] for r in results))
        try:
            fit = machine.fit_alpha_beta(shared_means, 2 * cores)
            shared["alpha_shared_s"], shared["bytes_per_s_shared"] = fit
        except ValueError:  # a fit that failed leaves messages as at a core per rank
            pass
        shared["all_reduce_shared_s"] = {str(b): t for b, t in shared_means.items()}
    moe_flops_s = machine.moe_extra_flops_s(flops)
    return {
        "name": "gloo, 1 thread per rank", "flops_per_s": flops, "flops_per_s_large": large,
        "matmul_shape": list(machine.TINY_SHAPE), **fixed, **elements,
        **machine.fit_own_work(own["step_s"], own["calls"], own["call_s"]),
        "own_calls": own["calls"], "call_s": own["call_s"],
        **machine.fit_op_costs(op_costs["fb_s"], op_costs["ops"], moe_flops_s),
        "alpha_s": alpha, "bytes_per_s": beta,
        "alpha_min_s": alpha_min, "bytes_per_s_min": beta_min,
        "all_reduce_s": {str(b): t for b, t in means.items()},
        "all_reduce_fastest_s": {str(b): t for b, t in fastest.items()},
        **collectives.fit_kind_factors(kind_means, alpha, beta, 2),
        "wait_per_compute": collectives.fit_wait([r["waits"] for r in kinds]),
        **{f"{kind}_s": {str(b): t for b, t in times.items()}
           for kind, times in kind_means.items()},
        **shared, "cores": cores,
        "torch": torch.__version__,
    }


# -- activations kept for backward, per rank of tensor parallel ------------------------------------
def _activations_worker(model_name, batch: int, seq: int, sequence_parallel: bool,
                        recompute: bool, seed: int) -> dict:
    import torch.distributed as dist

    from minitp import tp as tensor_parallel
    from minitp.models import ModelConfig, build_model, get_config

    torch.set_num_threads(1)
    cfg = model_name if isinstance(model_name, ModelConfig) else get_config(model_name)
    model = build_model(cfg, seed=seed)
    if dist.get_world_size() > 1 or sequence_parallel:
        tensor_parallel.parallelize(model, dist.group.WORLD, sequence_parallel)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    recompute_with = run_recomputed if recompute else None
    per_block = saved_bytes_per_block(model, lambda: model(tokens, recompute=recompute_with))
    return {"rank": dist.get_rank(), "per_block": per_block}


def measure_activations(tp: int = 2, sequence_parallel: bool = False, recompute: bool = False,
                        model="tiny", batch: int = 2, seq: int = 16, seed: int = 0,
                        timeout: float = 120.0) -> list[list[int]]:
    """Launch ``tp`` ranks of tensor parallel, run one forward of ``model`` (a preset's name or a
    ``ModelConfig``), and return per rank the bytes each block saved for backward
    (``[[block 0, block 1, ...], ...]``), measured by saved-tensor hooks."""
    from minitp.launcher import launch

    results = launch(_activations_worker, tp, model, batch, seq, sequence_parallel, recompute, seed,
                     timeout=timeout, echo=False)
    return [r["per_block"] for r in results]
