"""Checked runs of data parallelism: DDP (every rank the whole model), FSDP (ZeRO-1/2/3) and HSDP
(FSDP inside each replica, an all-reduce across them)."""

from __future__ import annotations

import torch

from minitp import cost, layout
from minitp.ddp import DistributedDataParallel, split_batch
from minitp.fsdp import FullyShardedDataParallel, unit_numels
from minitp.launcher import launch
from minitp.layout import check_divisible
from minitp.measure.memory import held_bytes
from minitp.models import build_model, get_config
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches
from minitp.runs.common import build_report, check_run, state_of, train_steps, worker_summary
from minitp.runs.references import max_abs_diff, microbatched
from minitp.runs.registry import Option, Strategy, register
from minitp.runs.report import BF16_LOSS_TOLERANCE, PARAM_TOLERANCE, Report


# -- DDP ------------------------------------------------------------------------------------------
def _ddp_worker(model_name: str, train: TrainConfig, bucket_mb: float) -> dict:
    cfg = get_config(model_name)
    model = build_model(cfg, seed=train.seed)
    ddp = DistributedDataParallel(model, bucket_mb=bucket_mb)
    optimizer = make_optimizer(model.parameters(), train.lr)
    losses, times = train_steps(model, ddp, synthetic_batches(cfg, train), split_batch, optimizer)
    return worker_summary(losses, times, held_bytes(model.parameters(), optimizer),
                          state=state_of(model), num_buckets=len(ddp.buckets))


def run_ddp(nproc: int = 4, steps: int = 4, bucket_mb: float = 0.25, model: str = "tiny",
            batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
            backend: str = "gloo", timeout: float = 300.0) -> Report:
    """Train with ``minitp.ddp`` on ``nproc`` ranks and report it against the three oracles."""
    train = check_run("ddp", locals(), data_parallel=nproc)
    layout.check_batch(batch_size, nproc)
    cfg = get_config(model)
    results = launch(_ddp_worker, nproc, model, train, bucket_mb, backend=backend, timeout=timeout,
                     echo=False)
    psi, n_tensors = cfg.num_params(), len(list(build_model(cfg).parameters()))
    expected_bytes = [cost.ddp_run_bytes(psi, nproc, steps, rank) for rank in range(nproc)]
    expected_memory = [cost.memory_per_rank(psi, nproc, zero=0, num_tensors=n_tensors)] * nproc
    return build_report("ddp", {"dp": nproc, "tp": 1, "pp": 1}, list(results), results, model,
                        train, expected_bytes, expected_memory, bucket_mb=bucket_mb,
                        num_buckets=results[0]["num_buckets"])


register(Strategy("ddp", run_ddp,
                  "data parallel: every rank the whole model, gradients all-reduced in buckets", (
    Option("bucket_mb", float, 0.25, "DDP bucket size in MiB", above=0),
)))


# -- FSDP / ZeRO ----------------------------------------------------------------------------------
def _fsdp_worker(model_name: str, train: TrainConfig, options: dict) -> dict:
    cfg = get_config(model_name)
    model = build_model(cfg, seed=train.seed)
    fsdp = FullyShardedDataParallel(model, **options)
    optimizer = fsdp.attach(make_optimizer(fsdp.parameters(), train.lr))
    losses, times = train_steps(model, fsdp, synthetic_batches(cfg, train), split_batch, optimizer)
    memory = fsdp.held_bytes()  # before the state dict is gathered (a transient)
    return worker_summary(losses, times, memory, gathered_peak=fsdp.gathered_peak,
                          state=fsdp.full_state_dict())


def run_fsdp(nproc: int = 4, steps: int = 4, zero: int = 3, mixed_precision: str | None = None,
             reshard_after_forward: bool = True, prefetch: bool = True, checkpoint: bool = False,
             model: str = "tiny", batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3,
             seed: int = 0, backend: str = "gloo", timeout: float = 300.0) -> Report:
    """Train with ``minitp.fsdp`` (ZeRO stage ``zero``) on ``nproc`` ranks and report it against
    the three oracles.

    fp32 is held to the one-process full-batch run (1e-5). bf16 (``mixed_precision="bf16"``) is held
    to the one-process run of the same bf16 recipe (``references.microbatched``), within
    twice that recipe's own sensitivity to the order of the sum over micro-batches (measured by
    running it again with the order reversed), and never less than 1e-5. Why so loose where it is
    loose: a sum taken in another order can round to the neighbouring bf16 value (2^-8 relative),
    the next forward sees weights rounded differently, and after a few AdamW steps most elements
    differ (on 3 ranks, 4 steps: about 1e-2, in either order, FSDP or not). Where the order does not
    change the sum (1 or 2 ranks, and 4 here) the tolerance is 1e-5 and FSDP meets it exactly. The
    distance to the fp32 run, the price of bf16 itself, is reported as ``max_abs_param_diff_fp32``.
    """
    train = check_run("fsdp", locals(), data_parallel=nproc)
    layout.check_batch(batch_size, nproc)
    cfg = get_config(model)
    dtype = torch.bfloat16 if mixed_precision else None
    options = dict(zero=zero, mixed_precision=dtype, reshard_after_forward=reshard_after_forward,
                   prefetch=prefetch, checkpoint=checkpoint)
    numels = unit_numels(build_model(cfg), nproc)  # raises here, in the parent, for a bad plan
    results = launch(_fsdp_worker, nproc, model, train, options, backend=backend, timeout=timeout,
                     echo=False)
    precision, param_bytes = ("bf16", 2) if mixed_precision else ("fp32", 4)
    expected_bytes = [cost.fsdp_run_bytes(numels, nproc, steps, zero, reshard_after_forward,
                                          param_bytes)] * nproc
    expected_memory = [cost.fsdp_memory_per_rank(numels, nproc, zero, precision)] * nproc
    peak = cost.fsdp_gathered_peak_bytes(numels, nproc, zero, reshard_after_forward, prefetch,
                                         param_bytes)
    ddp_bytes = cost.total_memory(cost.memory_per_rank(cfg.num_params(), nproc, zero=0,
                                                       precision=precision,
                                                       num_tensors=len(list(
                                                           build_model(cfg).parameters()))))
    report = build_report("fsdp", {"dp": nproc, "tp": 1, "pp": 1}, list(results), results, model,
                          train, expected_bytes, expected_memory,
                          zero=zero, mixed_precision=mixed_precision,
                          reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                          checkpoint=checkpoint, unit_numels=numels,
                          padded_num_params=sum(layout.padded_numel(p, nproc) for p in numels),
                          gathered_peak=[r["gathered_peak"] for r in results],
                          gathered_peak_expected=[peak] * nproc,
                          memory_fraction_of_ddp=[sum(r["memory"].values()) / ddp_bytes
                                                  for r in results])
    if mixed_precision:
        reference = microbatched(cfg, train, nproc, dtype)
        reordered = microbatched(cfg, train, nproc, dtype, reverse_sum=True)
        report.details["max_abs_param_diff_fp32"] = report.max_abs_param_diff
        report.max_abs_param_diff = max(max_abs_diff(r["state"], reference) for r in results)
        report.details["order_sensitivity"] = max_abs_diff(reordered, reference)
        report.param_tolerance = max(PARAM_TOLERANCE, 2 * report.details["order_sensitivity"])
        report.loss_tolerance = BF16_LOSS_TOLERANCE  # its losses stand beside the fp32 reference's
        report.reference = f"one process, the same bf16 recipe over {nproc} micro-batches"
    return report


register(Strategy("fsdp", run_fsdp, "fully sharded data parallel: ZeRO-1/2/3 over every rank", (
    Option("zero", int, 3,
           "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters",
           choices=(1, 2, 3)),
    Option("mixed_precision", str, None,
           "bf16 compute and gathers, fp32 master shards and gradient sums",
           choices=(None, "bf16")),
    Option("reshard_after_forward", bool, True,
           "ZeRO-3: keep gathered parameters from forward to backward", negate=True),
    Option("prefetch", bool, True, "no early all-gather of the next unit", negate=True),
    Option("checkpoint", bool, False, "activation checkpointing of the blocks"),
)))


# -- HSDP -----------------------------------------------------------------------------------------
def _hsdp_worker(model_name: str, train: TrainConfig, replicate: int, shard: int) -> dict:
    from minitp.hsdp import HybridShardedDataParallel, hsdp_groups

    cfg = get_config(model_name)
    model = build_model(cfg, seed=train.seed)
    hsdp = HybridShardedDataParallel(model, *hsdp_groups(replicate, shard))
    optimizer = hsdp.attach(make_optimizer(hsdp.parameters(), train.lr))
    # every one of the R·S ranks its own rows of the batch, as DDP and FSDP
    losses, times = train_steps(model, hsdp, synthetic_batches(cfg, train), split_batch, optimizer)
    memory = hsdp.held_bytes()
    return worker_summary(losses, times, memory, state=hsdp.full_state_dict())


def run_hsdp(nproc: int = 4, replicate: int = 2, steps: int = 4, model: str = "tiny",
             batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
             backend: str = "gloo", timeout: float = 300.0) -> Report:
    """Train with ``minitp.hsdp`` on ``nproc`` = replicate × shard ranks (ZeRO-3 inside each shard
    group) and report it against the three oracles: one process, the bytes of each group
    (``cost.hsdp_step_bytes``, then the state dict's all-gather inside the shard group) and the
    memory (``cost.hsdp_memory_per_rank``)."""
    train = check_run("hsdp", locals(), data_parallel=nproc)
    layout.check_batch(batch_size, nproc)
    check_divisible("nproc", nproc, "replicate", replicate, ": HSDP's ranks are replicate × shard")
    shard = nproc // replicate
    cfg = get_config(model)
    numels = unit_numels(build_model(cfg), shard)  # raises here, in the parent, for a bad plan
    results = launch(_hsdp_worker, nproc, model, train, replicate, shard, backend=backend,
                     timeout=timeout, echo=False)
    per_step = cost.hsdp_step_bytes(numels, replicate, shard)
    gather = cost.fsdp_run_bytes(numels, shard, 0)  # the state dict's all-gather (none at S = 1)
    by_dim = {"dp_shard": steps * per_step["dp_shard"] + gather,
              "dp_replicate": steps * per_step["dp_replicate"]}
    traced = [{group: sum(e.sent_bytes for e in t.comm() if e.dim == group) for group in by_dim}
              for t in results.traces]  # each rank's bytes in its shard and replicate groups
    return build_report("hsdp", {"dp": nproc, "tp": 1, "pp": 1}, list(results), results, model,
                        train, [sum(by_dim.values())] * nproc,
                        [cost.hsdp_memory_per_rank(numels, shard)] * nproc, replicate=replicate,
                        shard=shard, unit_numels=numels, bytes_by_group_expected=by_dim,
                        bytes_by_group_traced=traced)


register(Strategy("hsdp", run_hsdp, "hybrid sharded data parallel: ZeRO-3 inside each of "
                  "replicate groups of ranks, the gradient shards all-reduced across them", (
    Option("replicate", int, 2, "replicas (each sharded over nproc / replicate ranks)", low=1),
)))
