"""Whole training runs of a strategy, checked against its oracles, as ``minitp run`` reports them.

A run trains the tiny model on N ranks with one strategy, trains the same model on one process
with the full batch, and returns a report (a plain dict, the same keys for every strategy):

    strategy, world_size, layout {"dp","tp","pp"}, steps, num_params,
    loss, reference_loss                per step (the loss over the whole global batch)
    max_abs_param_diff                  largest |parameter - reference| over every rank
    comm_bytes_traced, comm_bytes_expected   one number per rank: bytes it sent over the run
    memory                              per rank {"params","grads","optimizer"}, bytes held after the
                                        last optimizer step (gradients still held)
    memory_expected                     the same from minitp.cost
    wall_s                              the launched run, start-up included
    step_s                              per rank, median seconds of a training step
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from minitp import cost
from minitp import trace as _trace
from minitp.launch import launch
from minitp.memory import held_bytes
from minitp.models import TrainConfig, build_model, get_config, loss_fn, make_optimizer, synthetic_batches
from minitp.models import train_reference as _train_reference

PARAM_TOLERANCE = 1e-5  # fp32: max |parameter - reference| allowed after training


def max_abs_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts over the reference's keys."""
    missing = set(reference) - set(state)
    if missing:
        raise KeyError(f"parameters missing from the run's state: {sorted(missing)[:5]}")
    return max((state[k].float() - reference[k].float()).abs().max().item() for k in reference)


def build_report(strategy: str, layout: dict, per_rank: list[dict], traces, model_name: str,
                 train: TrainConfig, expected_bytes: list[float], expected_memory: list[dict],
                 wall_s: float, **extra) -> dict:
    """Put a launched run's per-rank returns next to the one-process reference."""
    cfg = get_config(model_name)
    ref_losses, ref_model = _train_reference(cfg, train)
    reference = {k: v.detach() for k, v in ref_model.state_dict().items()}
    losses = [statistics.fmean(r["losses"][s] for r in per_rank if r["losses"]) for s in range(train.steps)]
    return {
        "strategy": strategy,
        "world_size": len(per_rank),
        "layout": layout,
        "model": model_name,
        "num_params": cfg.num_params(),
        "steps": train.steps,
        "batch_size": train.batch_size,
        "loss": losses,
        "reference_loss": ref_losses,
        "max_abs_param_diff": max(max_abs_diff(r["state"], reference) for r in per_rank if r["state"]),
        "comm_bytes_traced": _trace.sent_bytes_per_rank(traces),
        "comm_bytes_expected": expected_bytes,
        "memory": [r["memory"] for r in per_rank],
        "memory_expected": expected_memory,
        "wall_s": wall_s,
        "step_s": [r["step_s"] for r in per_rank],
        **extra,
    }


def check(report: dict, tolerance: float = PARAM_TOLERANCE) -> list[str]:
    """What is wrong with a run, as sentences; an empty list when it matches every oracle."""
    problems = []
    if not report["max_abs_param_diff"] <= tolerance:
        problems.append(f"parameters differ from the one-process reference by "
                        f"{report['max_abs_param_diff']:.3g} > {tolerance:g}")
    for rank, (traced, expected) in enumerate(zip(report["comm_bytes_traced"], report["comm_bytes_expected"])):
        if not math.isclose(traced, expected, rel_tol=1e-9, abs_tol=1e-6):
            problems.append(f"rank {rank} sent {traced:,.1f} bytes, the formula says {expected:,.1f}")
    for rank, (held, formula) in enumerate(zip(report["memory"], report["memory_expected"])):
        for kind in ("params", "grads", "optimizer"):
            if not math.isclose(held[kind], formula[kind], rel_tol=1e-9, abs_tol=1e-6):
                problems.append(f"rank {rank} holds {held[kind]:,} bytes of {kind}, "
                                f"the formula says {formula[kind]:,.0f}")
    return problems


def format_report(report: dict) -> str:
    """The short table ``minitp run`` prints."""
    lay = report["layout"]
    lines = [
        f"minitp run {report['strategy']}: {report['world_size']} ranks "
        f"(dp={lay['dp']} tp={lay['tp']} pp={lay['pp']}), model {report['model']} "
        f"({report['num_params']:,} parameters), {report['steps']} steps, global batch {report['batch_size']}",
        "",
        f"{'step':>4}  {'loss':>10}  {'reference':>10}  {'|diff|':>9}",
    ]
    for s, (a, b) in enumerate(zip(report["loss"], report["reference_loss"])):
        lines.append(f"{s:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>9.2e}")
    diff = report["max_abs_param_diff"]
    lines += ["", f"max |parameter - reference| = {diff:.2e}  "
                  f"({'OK' if diff <= PARAM_TOLERANCE else 'FAIL'}, tolerance {PARAM_TOLERANCE:g})", ""]
    lines.append(f"{'rank':>4}  {'sent (traced)':>14}  {'sent (formula)':>14}  "
                 f"{'params':>10}  {'grads':>10}  {'optimizer':>10}  {'step ms':>8}")
    for r in range(report["world_size"]):
        m = report["memory"][r]
        lines.append(f"{r:>4}  {report['comm_bytes_traced'][r]:>14,.0f}  {report['comm_bytes_expected'][r]:>14,.0f}  "
                     f"{m['params']:>10,}  {m['grads']:>10,}  {m['optimizer']:>10,}  "
                     f"{report['step_s'][r] * 1e3:>8.1f}")
    lines += ["", "bytes: payload each rank sent (ring model) and bytes held after the last step",
              f"wall time {report['wall_s']:.2f} s (start-up included)"]
    problems = check(report)
    lines.append("check: " + ("matches the reference, the traced bytes and the memory formulas"
                              if not problems else "FAILED\n  " + "\n  ".join(problems)))
    return "\n".join(lines)


def check_batch(batch_size: int, data_parallel: int) -> None:
    """Refuse a global batch that does not split evenly over the data-parallel ranks."""
    if not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {data_parallel}")
    if batch_size % data_parallel:
        raise ValueError(f"batch_size={batch_size} is not divisible by nproc={data_parallel}")


def train_steps(model, step_model, batches, shard, optimizer) -> tuple[list[float], list[float]]:
    """The training loop every strategy's worker shares: forward/backward on this rank's part of
    each global batch, optimizer step. Gradients are left in place after the last step so memory
    is measured with them held. Returns (local losses, step times)."""
    losses, times = [], []
    for tokens, targets in batches:
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        with _trace.span("forward"):
            loss = loss_fn(step_model(shard(tokens)), shard(targets))
        with _trace.span("backward"):
            loss.backward()
        with _trace.span("optimizer"):
            optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


# -- data parallel -------------------------------------------------------------------------------------
def _ddp_worker(model_name: str, train: TrainConfig, bucket_mb: float) -> dict:
    import torch.distributed as dist

    from minitp.ddp import DistributedDataParallel, split_batch

    cfg = get_config(model_name)
    model = build_model(cfg, seed=train.seed)
    ddp = DistributedDataParallel(model, bucket_mb=bucket_mb)
    optimizer = make_optimizer(model.parameters(), train.lr)
    losses, times = train_steps(model, ddp, synthetic_batches(cfg, train), split_batch, optimizer)
    return {
        "rank": dist.get_rank(),
        "losses": losses,
        "step_s": statistics.median(times),
        "memory": held_bytes(model.parameters(), optimizer),
        "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "num_buckets": len(ddp.buckets),
    }


def run_ddp(nproc: int = 4, steps: int = 4, bucket_mb: float = 0.25, model: str = "tiny",
            batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
            backend: str = "gloo", timeout: float = 300.0) -> dict:
    """Train with ``minitp.ddp`` on ``nproc`` ranks and report it against the three oracles."""
    if not bucket_mb or bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    check_batch(batch_size, nproc)
    cfg = get_config(model)
    train = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed)
    results = launch(_ddp_worker, nproc, model, train, bucket_mb, backend=backend, timeout=timeout, echo=False)
    psi, n_tensors = cfg.num_params(), len(list(build_model(cfg).parameters()))
    expected_bytes = [cost.ddp_run_bytes(psi, nproc, steps, rank) for rank in range(nproc)]
    expected_memory = [cost.memory_per_rank(psi, nproc, zero=0, num_tensors=n_tensors)] * nproc
    return build_report("ddp", {"dp": nproc, "tp": 1, "pp": 1}, list(results), results.traces, model, train,
                        expected_bytes, expected_memory, results.wall_s,
                        bucket_mb=bucket_mb, num_buckets=results[0]["num_buckets"])
