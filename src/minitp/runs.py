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
                 wall_s: float, reference: tuple[list[float], dict] | None = None, **extra) -> dict:
    """Put a launched run's per-rank returns next to the one-process reference: (losses, state),
    by default the whole model trained on one process with the full batch."""
    cfg = get_config(model_name)
    if reference is None:
        ref_losses, ref_model = _train_reference(cfg, train)
        reference = (ref_losses, {k: v.detach() for k, v in ref_model.state_dict().items()})
    ref_losses, reference = reference
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


def check(report: dict, tolerance: float | None = None) -> list[str]:
    """What is wrong with a run, as sentences; an empty list when it matches every oracle.
    ``tolerance`` defaults to the report's own ``param_tolerance`` (bf16 runs), else 1e-5."""
    if tolerance is None:
        tolerance = report.get("param_tolerance", PARAM_TOLERANCE)
    problems = []
    if not report["max_abs_param_diff"] <= tolerance:
        problems.append(f"parameters differ from the one-process reference by "
                        f"{report['max_abs_param_diff']:.3g} > {tolerance:g}")
    for rank, (traced, expected) in enumerate(zip(report["comm_bytes_traced"], report["comm_bytes_expected"])):
        if not math.isclose(traced, expected, rel_tol=1e-9, abs_tol=1e-6):
            problems.append(f"rank {rank} sent {traced:,.1f} bytes, the formula says {expected:,.1f}")
    for rank, (traced, expected) in enumerate(zip(report.get("comm_bytes_traced_by_dim", []),
                                                  report.get("comm_bytes_expected_by_dim", []))):
        for dim, value in expected.items():  # 3d: each mesh dimension on its own
            if not math.isclose(traced[dim], value, rel_tol=1e-9, abs_tol=1e-6):
                problems.append(f"rank {rank} sent {traced[dim]:,.1f} bytes over {dim}, the formula says {value:,.1f}")
    for rank, (held, formula) in enumerate(zip(report["memory"], report["memory_expected"])):
        for kind in ("params", "grads", "optimizer"):
            if not math.isclose(held[kind], formula[kind], rel_tol=1e-9, abs_tol=1e-6):
                problems.append(f"rank {rank} holds {held[kind]:,} bytes of {kind}, "
                                f"the formula says {formula[kind]:,.0f}")
    for rank, (peak, formula) in enumerate(zip(report.get("gathered_peak", []),
                                               report.get("gathered_peak_expected", []))):
        if peak != formula:
            problems.append(f"rank {rank} held at most {peak:,} bytes of gathered parameters, "
                            f"the formula says {formula:,}")
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
    for s, (a, b) in enumerate(zip(report["loss"], report["reference_loss"]), start=report.get("start_step", 0)):
        lines.append(f"{s:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>9.2e}")
    diff, tol = report["max_abs_param_diff"], report.get("param_tolerance", PARAM_TOLERANCE)
    lines += ["", f"max |parameter - reference| = {diff:.2e}  "
                  f"({'OK' if diff <= tol else 'FAIL'}, tolerance {tol:g})", ""]
    if "reference" in report:
        lines[-1:-1] = [f"  reference: {report['reference']}"]
    lines.append(f"{'rank':>4}  {'sent (traced)':>14}  {'sent (formula)':>14}  "
                 f"{'params':>10}  {'grads':>10}  {'optimizer':>10}  {'step':>9}")
    for r in range(report["world_size"]):
        m = report["memory"][r]
        lines.append(f"{r:>4}  {report['comm_bytes_traced'][r]:>14,.0f}  {report['comm_bytes_expected'][r]:>14,.0f}  "
                     f"{m['params']:>10,}  {m['grads']:>10,}  {m['optimizer']:>10,}  "
                     f"{report['step_s'][r] * 1e3:>6.1f} ms")
    if "gathered_peak" in report:
        lines += ["", "peak gathered parameters per rank (bytes): "
                  + ", ".join(f"{p:,}" for p in report["gathered_peak"])
                  + f"  (formula {report['gathered_peak_expected'][0]:,})"]
    if "comm_bytes_traced_by_dim" in report:  # 3d: the bytes split by mesh dimension
        lines += ["", f"{'rank':>4}  {'(dp,pp,tp)':>10}  "
                      + "  ".join(f"{dim + ' traced':>12}  {dim + ' formula':>12}" for dim in ("tp", "pp", "dp"))]
        for r, (t, e) in enumerate(zip(report["comm_bytes_traced_by_dim"], report["comm_bytes_expected_by_dim"])):
            coords = "(" + ",".join(str(c) for c in report["coords"][r]) + ")"
            lines.append(f"{r:>4}  {coords:>10}  "
                         + "  ".join(f"{t[dim]:>12,.0f}  {e[dim]:>12,.0f}" for dim in ("tp", "pp", "dp")))
    if "bubble_fraction_measured" in report:
        lines += ["", f"schedule {report['schedule']}, {report['microbatches']} micro-batches; "
                      f"bubble (idle share of the step) measured {report['bubble_fraction_measured']:.3f}, "
                      f"expected (p-1)/(m+p-1) = {report['bubble_fraction_expected']:.3f}; per rank "
                  + ", ".join(f"{b:.3f}" for b in report["bubble_fraction_measured_per_rank"]),
                  "peak micro-batches in flight per rank: "
                  + ", ".join(str(p) for p in report["peak_microbatches_in_flight"])
                  + "  (formula " + ", ".join(str(p) for p in report["peak_microbatches_in_flight_expected"]) + ")"]
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


def train_steps(model, step_model, batches, shard, optimizer, loss=loss_fn) -> tuple[list[float], list[float]]:
    """The training loop every strategy's worker shares: forward/backward on this rank's part of
    each global batch, optimizer step. Gradients are left in place after the last step so memory
    is measured with them held. ``loss(output, targets)``: tensor parallel passes its own.
    Returns (local losses, step times)."""
    losses, times = [], []
    for tokens, targets in batches:
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        with _trace.span("forward"):
            value = loss(step_model(shard(tokens)), shard(targets))
        with _trace.span("backward"):
            value.backward()
        with _trace.span("optimizer"):
            optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(value.item())
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


# -- fully sharded data parallel (ZeRO-1/2/3) --------------------------------------------------------
def train_reference_microbatched(cfg, train: TrainConfig, micro_batches: int,
                                 mixed_precision: torch.dtype | None = None,
                                 reverse_sum: bool = False) -> dict[str, torch.Tensor]:
    """One process, no sharding, the global batch cut into ``micro_batches`` slices whose gradients
    are averaged in fp32: the same arithmetic as data parallel over that many ranks, so the only
    difference left is the order of the sum. With ``mixed_precision=torch.bfloat16`` it is the
    recipe of ``minitp.fsdp``: a bf16 copy of the fp32 master weights computes, the averaged
    gradient is rounded to bf16, AdamW steps the fp32 master. Returns the final fp32 parameters.

    Used for bf16, whose recipe rounds the averaged gradient: the full-batch run has no such step.
    (fp32 runs are held to the full-batch run itself; ``make_optimizer`` says why AdamW's eps matters
    for that.) ``reverse_sum`` adds the micro-batches' gradients in the opposite order: how far that moves the
    result is the run's own sensitivity to the order of a sum.
    """
    master = build_model(cfg, seed=train.seed)
    work = build_model(cfg, seed=train.seed)
    dtype = mixed_precision or torch.float32
    for p in work.parameters():  # parameters only: the rotary tables stay fp32, as under FSDP
        p.data = p.data.to(dtype)
    optimizer = make_optimizer(master.parameters(), train.lr)
    for tokens, targets in synthetic_batches(cfg, train):
        total = [torch.zeros_like(p) for p in master.parameters()]
        slices = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)))
        for x, y in slices[::-1] if reverse_sum else slices:
            grads = torch.autograd.grad(loss_fn(work(x), y), list(work.parameters()))
            for t, g in zip(total, grads):
                t += g.float() / micro_batches
        for p, t in zip(master.parameters(), total):
            p.grad = t.to(dtype).float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w, p in zip(work.parameters(), master.parameters()):
                w.copy_(p)
    return {k: v.detach() for k, v in master.state_dict().items()}


def _fsdp_worker(model_name: str, train: TrainConfig, options: dict) -> dict:
    import torch.distributed as dist

    from minitp.ddp import split_batch
    from minitp.fsdp import FullyShardedDataParallel

    cfg = get_config(model_name)
    model = build_model(cfg, seed=train.seed)
    fsdp = FullyShardedDataParallel(model, **options)
    optimizer = fsdp.attach(make_optimizer(fsdp.parameters(), train.lr))
    losses, times = train_steps(model, fsdp, synthetic_batches(cfg, train), split_batch, optimizer)
    memory = fsdp.held_bytes()  # before the state dict is gathered (a transient)
    return {
        "rank": dist.get_rank(),
        "losses": losses,
        "step_s": statistics.median(times),
        "memory": memory,
        "gathered_peak": fsdp.gathered_peak,
        "state": fsdp.full_state_dict(),
    }


def run_fsdp(nproc: int = 4, steps: int = 4, zero: int = 3, mixed_precision: str | None = None,
             reshard_after_forward: bool = True, prefetch: bool = True, checkpoint: bool = False,
             model: str = "tiny", batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
             backend: str = "gloo", timeout: float = 300.0) -> dict:
    """Train with ``minitp.fsdp`` (ZeRO stage ``zero``) on ``nproc`` ranks and report it against
    the three oracles.

    fp32 is held to the one-process full-batch run (1e-5). bf16 (``mixed_precision="bf16"``) is held
    to the one-process run of the same bf16 recipe (``train_reference_microbatched``), within
    twice that recipe's own sensitivity to the order of the sum over micro-batches (measured by
    running it again with the order reversed), and never less than 1e-5. Why so loose where it is
    loose: a sum taken in another order can round to the neighbouring bf16 value (2^-8 relative),
    the next forward sees weights rounded differently, and after a few AdamW steps most elements
    differ (on 3 ranks, 4 steps: about 1e-2, in either order, FSDP or not). Where the order does not
    change the sum (1 or 2 ranks, and 4 here) the tolerance is 1e-5 and FSDP meets it exactly. The
    distance to the fp32 run, the price of bf16 itself, is reported as ``max_abs_param_diff_fp32``.
    """
    from minitp.fsdp import unit_numels

    if mixed_precision not in (None, "bf16"):
        raise ValueError(f"unsupported mixed precision {mixed_precision!r}; expected 'bf16' or none")
    check_batch(batch_size, nproc)
    cfg = get_config(model)
    train = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed)
    dtype = torch.bfloat16 if mixed_precision else None
    options = dict(zero=zero, mixed_precision=dtype, reshard_after_forward=reshard_after_forward,
                   prefetch=prefetch, checkpoint=checkpoint)
    numels = unit_numels(build_model(cfg), nproc)  # raises here, in the parent, for a bad plan
    results = launch(_fsdp_worker, nproc, model, train, options, backend=backend, timeout=timeout, echo=False)
    precision, param_bytes = ("bf16", 2) if mixed_precision else ("fp32", 4)
    expected_bytes = [cost.fsdp_run_bytes(numels, nproc, steps, zero, reshard_after_forward, param_bytes)] * nproc
    expected_memory = [cost.fsdp_memory_per_rank(numels, nproc, zero, precision)] * nproc
    peak = cost.fsdp_gathered_peak_bytes(numels, nproc, zero, reshard_after_forward, prefetch, param_bytes)
    ddp_bytes = cost.total_memory(cost.memory_per_rank(cfg.num_params(), nproc, zero=0, precision=precision,
                                                       num_tensors=len(list(build_model(cfg).parameters()))))
    report = build_report("fsdp", {"dp": nproc, "tp": 1, "pp": 1}, list(results), results.traces, model, train,
                          expected_bytes, expected_memory, results.wall_s,
                          zero=zero, mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
                          prefetch=prefetch, checkpoint=checkpoint, unit_numels=numels,
                          padded_num_params=sum(cost.padded_numel(p, nproc) for p in numels),
                          gathered_peak=[r["gathered_peak"] for r in results],
                          gathered_peak_expected=[peak] * nproc,
                          memory_fraction_of_ddp=[sum(r["memory"].values()) / ddp_bytes for r in results])
    if mixed_precision:
        reference = train_reference_microbatched(cfg, train, nproc, dtype)
        reordered = train_reference_microbatched(cfg, train, nproc, dtype, reverse_sum=True)
        report["max_abs_param_diff_fp32"] = report["max_abs_param_diff"]
        report["max_abs_param_diff"] = max(max_abs_diff(r["state"], reference) for r in results)
        report["order_sensitivity"] = max_abs_diff(reordered, reference)
        report["param_tolerance"] = max(PARAM_TOLERANCE, 2 * report["order_sensitivity"])
        report["reference"] = f"one process, the same bf16 recipe over {nproc} micro-batches"
    return report


# -- tensor parallel ---------------------------------------------------------------------------------
def _tp_worker(model_name: str, train: TrainConfig, sequence_parallel: bool) -> dict:
    import torch.distributed as dist

    from minitp import tp

    cfg = get_config(model_name)
    loss = lambda logits, targets: tp.vocab_parallel_cross_entropy(logits, targets, None)  # (B, S, V/tp)
    # the world is the TP group; every rank reads the whole batch (TP splits the model, not the data)
    model = tp.parallelize(build_model(cfg, seed=train.seed), None, sequence_parallel)
    optimizer = make_optimizer(model.parameters(), train.lr)
    losses, times = train_steps(model, model, synthetic_batches(cfg, train), lambda t: t, optimizer, loss=loss)
    return {"rank": dist.get_rank(), "losses": losses, "step_s": statistics.median(times),
            "memory": held_bytes(model.parameters(), optimizer), "shards": tp.local_shards(model)}


def _with_full_states(results) -> list[dict]:
    """Each rank's return with ``state``: the full parameters (the slices of every rank put together,
    the replicated ones as that rank holds them), under the plain model's names."""
    from minitp import tp

    shards = [r["shards"] for r in results]
    return [{**{k: v for k, v in r.items() if not k.startswith("shards")}, "state": tp.unshard(shards, rank)}
            for rank, r in enumerate(results)]


def run_tp(nproc: int = 4, steps: int = 4, sequence_parallel: bool = False, model: str = "tiny",
           batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
           backend: str = "gloo", timeout: float = 300.0) -> dict:
    """Train the whole model with ``minitp.tp`` over ``nproc`` ranks (every rank the whole batch)
    and report it against the three oracles."""
    from minitp import tp

    cfg = get_config(model)
    if sequence_parallel and seq_len % nproc:
        raise ValueError(f"seq_len={seq_len} is not divisible by tp={nproc}: sequence parallel gives each "
                         f"rank seq_len/tp positions")
    tp.check_config(cfg, nproc)  # refuse a bad split here, in the parent
    train = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed)
    results = launch(_tp_worker, nproc, model, train, sequence_parallel, backend=backend, timeout=timeout,
                     echo=False)
    n_tensors = len(list(build_model(cfg).parameters()))
    expected_bytes = [cost.tp_run_bytes(cfg, batch_size, seq_len, nproc, steps, sequence_parallel)] * nproc
    expected_memory = [cost.tp_memory_per_rank(cfg, nproc, num_tensors=n_tensors)] * nproc
    return build_report("tp", {"dp": 1, "tp": nproc, "pp": 1}, _with_full_states(results), results.traces, model,
                          train, expected_bytes, expected_memory, results.wall_s, sequence_parallel=sequence_parallel,
                        params_per_rank=cost.tp_params_per_rank(cfg, nproc))


def _swiglu_batches(cfg, train: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) pairs, each (B, S, D), from ``train.seed``. The input requires a gradient, as
    the activation of an earlier layer would, so backward sends its gradient (f's all-reduce)."""
    g = torch.Generator().manual_seed(train.seed + 1)
    shape = (train.batch_size, train.seq_len, cfg.dim)
    return [(torch.randn(shape, generator=g).requires_grad_(), torch.randn(shape, generator=g))
            for _ in range(train.steps)]


def _swiglu_reference(cfg, train: TrainConfig) -> tuple[list[float], dict]:
    """The plain SwiGLU MLP (the model's first block's) trained on one process: (losses, state)."""
    mlp = build_model(cfg, seed=train.seed).layers[0].feed_forward
    optimizer = make_optimizer(mlp.parameters(), train.lr)
    losses = []
    for x, y in _swiglu_batches(cfg, train):
        loss = torch.nn.functional.mse_loss(mlp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in mlp.state_dict().items()}


def _swiglu_worker(model_name: str, train: TrainConfig) -> dict:
    import torch.distributed as dist

    from minitp import tp

    cfg = get_config(model_name)
    mlp = tp.ParallelFeedForward(build_model(cfg, seed=train.seed).layers[0].feed_forward, None)
    optimizer = make_optimizer(mlp.parameters(), train.lr)
    losses, times = train_steps(mlp, mlp, _swiglu_batches(cfg, train), lambda t: t, optimizer,
                                loss=torch.nn.functional.mse_loss)
    return {
        "rank": dist.get_rank(),
        "losses": losses,
        "step_s": statistics.median(times),
        "memory": held_bytes(mlp.parameters(), optimizer),
        "shards": tp.local_shards(mlp),
    }


def run_swiglu(nproc: int = 4, steps: int = 4, model: str = "tiny", batch_size: int = 8, seq_len: int = 16,
               lr: float = 3e-3, seed: int = 0, backend: str = "gloo", timeout: float = 300.0) -> dict:
    """Train the tensor-parallel SwiGLU MLP alone (the model's first block's, mean squared error
    to random targets) over ``nproc`` ranks and report it against the three oracles."""
    cfg = get_config(model)
    if cfg.ffn_hidden % nproc:
        raise ValueError(f"ffn_hidden={cfg.ffn_hidden} is not divisible by tp={nproc}")
    train = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed)
    results = launch(_swiglu_worker, nproc, model, train, backend=backend, timeout=timeout, echo=False)
    params = cost.tp_mlp_params_per_rank(cfg.dim, cfg.ffn_hidden, nproc)
    expected_bytes = [steps * cost.tp_mlp_bytes(batch_size, seq_len, cfg.dim, nproc)] * nproc
    expected_memory = [cost.memory_per_rank(params, num_tensors=3)] * nproc
    return build_report("swiglu", {"dp": 1, "tp": nproc, "pp": 1}, _with_full_states(results), results.traces,
                        model, train, expected_bytes, expected_memory, results.wall_s,
                        reference=_swiglu_reference(cfg, train), num_params=3 * cfg.dim * cfg.ffn_hidden,
                        params_per_rank=params)


# -- pipeline parallel -------------------------------------------------------------------------------
def _pp_worker(model_name: str, train: TrainConfig, schedule: str, microbatches: int) -> dict:
    import torch.distributed as dist

    from minitp.pp import Pipeline

    cfg = get_config(model_name)
    pipe = Pipeline(build_model(cfg, seed=train.seed), None, schedule, microbatches)  # the world is the pipeline
    optimizer = make_optimizer(pipe.parameters(), train.lr)
    losses, times, timelines, peaks = [], [], [], []
    for tokens, targets in synthetic_batches(cfg, train):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        record = pipe.forward_backward(tokens, targets)
        with _trace.span("optimizer"):
            optimizer.step()
        times.append(time.perf_counter() - t0)
        if record.loss is not None:
            losses.append(record.loss)
        timelines.append(record.timeline)
        peaks.append(record.peak_in_flight)
    return {
        "rank": dist.get_rank(),
        "losses": losses,  # only the last stage computes the loss
        "step_s": statistics.median(times),
        "memory": held_bytes(pipe.parameters(), optimizer),
        "stage_state": pipe.state_dict(),
        "timelines": timelines,
        "peak_in_flight": max(peaks),
    }


def run_pp(nproc: int = 4, steps: int = 4, microbatches: int = 8, schedule: str = "1f1b", model: str = "tiny",
           batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
           backend: str = "gloo", timeout: float = 300.0) -> dict:
    """Train with ``minitp.pp`` (``nproc`` stages, ``microbatches`` per step, GPipe or 1F1B) and report
    it against the three oracles, plus the bubble: measured (``minitp.pp.bubble_fraction``, the mean
    over ranks, the median over the steps after the first) and expected ((p-1)/(m+p-1))."""
    from minitp import pp

    cfg = get_config(model)
    blocks = pp.stage_blocks(cfg.n_layers, nproc)  # refuse a bad split here, in the parent
    pp.make_schedule(schedule, nproc, microbatches)
    pp.split_microbatches(torch.empty(batch_size), microbatches)
    train = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed)
    results = launch(_pp_worker, nproc, model, train, schedule, microbatches, backend=backend, timeout=timeout,
                     echo=False)
    full = {k: v for r in results for k, v in r["stage_state"].items()}  # the stages put together
    per_rank = [{**{k: v for k, v in r.items() if k != "stage_state"}, "state": full} for r in results]
    first_last = [(s == 0, s == nproc - 1) for s in range(nproc)]
    expected_bytes = [cost.pp_run_bytes(batch_size, seq_len, cfg.dim, nproc, s, steps) for s in range(nproc)]
    n_tensors = [len(list(pp.PipelineStage(build_model(cfg), s, nproc).parameters())) for s in range(nproc)]
    expected_memory = [cost.pp_memory_per_rank(cfg, len(blocks[s]), *first_last[s], num_tensors=n_tensors[s])
                       for s in range(nproc)]
    per_step = [pp.bubble_fraction([r["timelines"][k] for r in results]) for k in range(steps)]
    timed = per_step[1:] or per_step  # the first step also warms up (allocations, first messages)
    last = [r["timelines"][-1] for r in results]
    t0 = min(t[0][1] for t in last)
    return build_report(
        "pp", {"dp": 1, "tp": 1, "pp": nproc}, per_rank, results.traces, model, train, expected_bytes,
        expected_memory, results.wall_s, schedule=schedule, microbatches=microbatches,
        stage_blocks=[[b.start, b.stop] for b in blocks],
        bubble_fraction_measured=statistics.median(statistics.fmean(b) for b in timed),
        bubble_fraction_measured_per_rank=[statistics.median(b[s] for b in timed) for s in range(nproc)],
        bubble_fraction_expected=cost.pp_bubble_fraction(nproc, microbatches),
        peak_microbatches_in_flight=[r["peak_in_flight"] for r in results],
        peak_microbatches_in_flight_expected=[cost.pp_peak_microbatches_in_flight(nproc, microbatches, s, schedule)
                                              for s in range(nproc)],
        last_step_timeline=[[[a.kind, a.microbatch, s - t0, e - t0] for a, s, e in t] for t in last])


# -- 3D: data × pipeline × tensor parallel -----------------------------------------------------------
def _3d_worker(model_name: str, train: TrainConfig, layout: dict, options: dict, start_step: int,
               resume_from: str | None, save_to: str | None) -> dict:
    import torch.distributed as dist

    from minitp import checkpoint
    from minitp.mesh import Mesh, Parallel3D

    cfg = get_config(model_name)
    mesh = Mesh(layout["dp"], layout["pp"], layout["tp"])
    par = Parallel3D(build_model(cfg, seed=train.seed), mesh, lr=train.lr, **options)
    if resume_from:
        checkpoint.load(par, resume_from, expected_step=start_step)
    losses, times = [], []
    for tokens, targets in synthetic_batches(cfg, train)[start_step:]:
        t0 = time.perf_counter()
        loss = par.train_step(tokens, targets)
        times.append(time.perf_counter() - t0)
        if loss is not None:  # only the last stage computes the loss
            losses.append(loss)
    memory = par.held_bytes()  # before anything is gathered
    if save_to:
        checkpoint.save(par, save_to, step=train.steps)
    return {"rank": dist.get_rank(), "coords": [mesh.coords.dp, mesh.coords.pp, mesh.coords.tp],
            "losses": losses, "step_s": statistics.median(times), "memory": memory,
            "shards": par.local_shards()}


def run_3d(nproc: int = 8, dp: int = 2, tp: int = 2, pp: int = 2, fsdp: bool = False, zero: int | None = None,
           steps: int = 4, microbatches: int | None = None, schedule: str = "1f1b", model: str = "tiny",
           batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0, backend: str = "gloo",
           timeout: float = 300.0, resume_from: str | None = None, save_to: str | None = None) -> dict:
    """Train with ``minitp.mesh.Parallel3D`` on a dp × pp × tp mesh of ``nproc`` ranks and report it
    against the three oracles, the bytes split by dimension too (``comm_bytes_*_by_dim``).

    microbatches: per step, when pp > 1 (default: one sequence each, B/dp).
    resume_from: a checkpoint (``minitp.checkpoint``, any layout) to start from, at the step it was
        saved; the run then trains up to ``steps`` and is checked against the reference at ``steps``.
    save_to: save a sharded checkpoint after the last step.
    """
    from dataclasses import replace

    from minitp import checkpoint
    from minitp.mesh import check_zero, unshard_3d

    cfg = get_config(model)
    cost.check_3d_layout(cfg, dp, pp, tp, nproc)
    check_batch(batch_size, dp)
    data_parallel = "fsdp" if fsdp else "ddp"
    zero = check_zero(data_parallel, zero, pp)
    if microbatches is None:
        microbatches = batch_size // dp if pp > 1 else 1
    if pp > 1 and (batch_size // dp) % microbatches:
        raise ValueError(f"each replica's batch of {batch_size // dp} (batch_size={batch_size} / dp={dp}) "
                         f"is not divisible by microbatches={microbatches}")
    start_step = checkpoint.read_index(resume_from)["step"] if resume_from else 0
    if not start_step < steps:
        raise ValueError(f"the checkpoint is at step {start_step}, nothing left to train up to steps={steps}")
    train = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed)
    options = dict(data_parallel=data_parallel, zero=zero, microbatches=microbatches, schedule=schedule)
    results = launch(_3d_worker, nproc, model, train, {"dp": dp, "pp": pp, "tp": tp}, options, start_step,
                     resume_from, save_to, backend=backend, timeout=timeout, echo=False)
    ran = steps - start_step
    by_dim = []
    for r in results:
        d, s, _ = r["coords"]
        by_dim.append(cost.threed_step_bytes(cfg, batch_size, seq_len, dp, tp, pp, s, d, data_parallel,
                                             zero or 3, steps=ran, start_up=True, state_dict=True))
    expected_memory = [cost.threed_memory_per_rank(cfg, dp, tp, pp, r["coords"][1], data_parallel, zero or 3)
                       for r in results]
    prefixes = {"tp": ("tp/",), "pp": ("pp/",), "dp": ("ddp/", "fsdp/")}
    traces = sorted(results.traces, key=lambda t: t.rank)
    traced_by_dim = [{dim: sum(t.sent_bytes(p) for p in ps) for dim, ps in prefixes.items()} for t in traces]
    # the training steps alone, without DDP's start-up broadcast and FSDP's final gather (the planner's view)
    per_step_by_dim = [{dim: sum(e.sent_bytes for e in t.comm() if e.label.startswith(ps)
                                 and e.label != "ddp/init" and not e.label.endswith("state_dict")) / ran
                        for dim, ps in prefixes.items()} for t in traces]
    # each replica's whole model, from its stages' tp slices
    replicas = []
    for d in range(dp):
        shards = [[results[(d * pp + s) * tp + t]["shards"] for t in range(tp)] for s in range(pp)]
        replicas.append(unshard_3d(shards))
    per_rank = [{**{k: v for k, v in r.items() if k != "shards"}, "state": replicas[r["coords"][0]]} for r in results]
    ref_losses, ref_model = _train_reference(cfg, train)
    reference = (ref_losses[start_step:], {k: v.detach() for k, v in ref_model.state_dict().items()})
    return build_report(
        "3d", {"dp": dp, "tp": tp, "pp": pp}, per_rank, results.traces, model, replace(train, steps=ran),
        [sum(b.values()) for b in by_dim], expected_memory, results.wall_s, reference=reference,
        data_parallel=data_parallel, zero=zero, microbatches=microbatches if pp > 1 else None,
        schedule=schedule if pp > 1 else None, start_step=start_step, end_step=steps,
        coords=[r["coords"] for r in results], comm_bytes_traced_by_dim=traced_by_dim,
        comm_bytes_expected_by_dim=by_dim, comm_bytes_traced_per_step_by_dim=per_step_by_dim,
        resumed_from=resume_from, saved_to=save_to)
