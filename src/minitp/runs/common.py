"""What every runner shares: the checks made in the parent, the training loop, the report."""

from __future__ import annotations

import os
import statistics
import time

import torch

from minitp import cost
from minitp import trace as _trace
from minitp.launcher import RANK_MEMORY_BYTES, check_launch, progress
from minitp.launcher.guard import available_memory, env_flag
from minitp.measure import calibrate
from minitp.models import get_config, loss_fn
from minitp.models.moe import moe_config
from minitp.models.train import TrainConfig
from minitp.runs.references import full_batch, max_abs_diff
from minitp.runs.registry import OptionError, check_options
from minitp.runs.report import Report


def check_run(strategy: str, values: dict, data_parallel: int,
              tensor_parallel: int = 1) -> TrainConfig:
    """The checks every runner makes first, in the parent: each option's value, the sequence
    against the model, the run's memory against what this machine has. Returns the TrainConfig."""
    check_options(strategy, values)
    # the process cap too
    check_launch(values["nproc"], backend=values["backend"], timeout=values["timeout"])
    cfg = get_config(values["model"])
    if values["seq_len"] > cfg.max_seq_len:
        raise OptionError("seq_len", values["seq_len"],
                          f"an integer from 1 to {cfg.max_seq_len}, the model's "
                          f"max_seq_len")
    check_memory(built_config(strategy, cfg, values), values["nproc"],
                 values["batch_size"] // max(1, data_parallel), values["seq_len"], tensor_parallel)
    return TrainConfig(steps=values["steps"], batch_size=values["batch_size"],
                       seq_len=values["seq_len"], lr=values["lr"], seed=values["seed"])


def built_config(strategy: str, cfg, values: dict):
    """The model the run's ranks build from preset ``cfg``: its MoE variant (``values["experts"]``
    experts per block) for expert parallel, alone or in 3D (ep > 1), else ``cfg``."""
    if strategy == "ep" or values.get("ep", 1) > 1:
        experts = values["experts"]  # top_k only bounds its own check, made by the runner
        return moe_config(cfg, n_experts=experts, top_k=min(values.get("top_k", 2), experts))
    return cfg


def estimate_rank_bytes(cfg, local_batch: int, seq: int, tp: int = 1) -> float:
    """A generous estimate of what one rank needs: the whole model's parameters, gradients and AdamW
    state (16 bytes per parameter in fp32, unsharded: an upper bound for every strategy; every rank
    builds the whole model first, a MoE's experts included), the activations of its batch
    (``cost.activation_bytes_per_rank`` in fp32, attention scores stored; a MoE's,
    ``cost.moe_activation_bytes_per_rank``, and its routing's one-hot queues of k·S assignments over
    E experts, int64, three at once), and the logits with their softmax and gradient."""
    moe = hasattr(cfg, "n_experts")
    activation_bytes = cost.moe_activation_bytes_per_rank if moe else cost.activation_bytes_per_rank
    acts = activation_bytes(cfg, local_batch, seq, tp, 1, 0, 1, dtype_bytes=4,
                            flash_attention=False)
    logits = 4 * local_batch * seq * cfg.vocab_size * 4
    routing = 3 * 8 * local_batch * seq * cfg.top_k * cfg.n_experts if moe else 0
    return RANK_MEMORY_BYTES + 16 * cfg.num_params() + acts + logits + routing


SKIP_MEMORY_CHECK_ENV = "MINITP_SKIP_MEMORY_CHECK"  # 1: start the ranks whatever the estimate says


def check_memory(cfg, nproc: int, local_batch: int, seq: int, tp: int = 1) -> None:
    """Refuse a run whose ranks would need more memory than the machine has (before starting
    them)."""
    skip = env_flag(SKIP_MEMORY_CHECK_ENV)  # read (and checked) whatever the estimate says
    need = nproc * estimate_rank_bytes(cfg, local_batch, seq, tp)
    have = available_memory()
    if have is not None and need > have and not skip:
        moe = hasattr(cfg, "n_experts")
        n = cfg.num_params()
        model = (f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M") + " parameters"
        model += f" with {cfg.n_experts} experts per block" if moe else ""
        raise ValueError(
            f"this run needs about {need / 2**30:.1f} GiB ({nproc} rank{'s' * (nproc > 1)} x "
            f"{need / nproc / 2**30:.2f} GiB: each builds the whole model, {model}, and holds "
            f"batch {local_batch} x {seq} tokens) but {have / 2**30:.1f} GiB is available: use a "
            f"smaller batch_size, seq_len or nproc" + (", or fewer experts" if moe else "")
            + f" ({SKIP_MEMORY_CHECK_ENV}=1 runs it anyway)")


def train_steps(model, step_model, batches, shard, optimizer, loss=loss_fn,
                set_to_none: bool = False) -> tuple[list[float], list[float]]:
    """The training loop every strategy's worker shares: forward/backward on this rank's part of
    each global batch, optimizer step. Gradients are left in place after the last step so memory
    is measured with them held. ``loss(output, targets)``: tensor parallel passes its own.
    ``set_to_none``: gradients set to None before each step (``zero_grad()``'s default), where a
    parameter a step does not reach must keep none (a MoE's idle experts). Returns (local losses,
    step times)."""
    losses, times = [], []
    for tokens, targets in batches:
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=set_to_none)
        with _trace.span("forward"):
            value = loss(step_model(shard(tokens)), shard(targets))
        with _trace.span("backward"):
            value.backward()
        with _trace.span("optimizer"):
            optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(value.item())
        progress.step(len(times) - 1, len(batches) if hasattr(batches, "__len__") else None)
    return losses, times


def step_events(worker_result: dict, trace: _trace.Trace) -> list[_trace.Event]:
    """The events a worker recorded during its training steps only (it returns their index range as
    ``"steps_events"``): no start-up broadcast, no final gather of a state dict."""
    first, last = worker_result["steps_events"]
    return trace.events[first:last]


def build_report(strategy: str, layout: dict, per_rank: list[dict], results, model_name: str,
                 train: TrainConfig, expected_bytes: list[float], expected_memory: list[dict],
                 reference: tuple[list[float], dict] | None = None, **fields) -> Report:
    """Put a launched run's per-rank returns next to the one-process reference: (losses, state),
    by default the whole model trained on one process with the full batch. ``fields``: the
    Report's optional fields (``start_step``, ``comm_bytes_*_by_dim``, ``reference``...) and the
    strategy's own details."""
    cfg = get_config(model_name)
    ref_losses, ref_state = full_batch(cfg, train) if reference is None else reference
    losses = [statistics.fmean(r["losses"][s] for r in per_rank if r["losses"])
              for s in range(train.steps)]
    own = {k: fields.pop(k) for k in list(fields) if k in Report.__dataclass_fields__}
    predicted, note = predicted_step_s(strategy, layout, cfg, train, fields)
    if note:
        fields["predicted_step_note"] = note
    if hasattr(os, "getloadavg"):  # what else ran: the prediction assumes a quiet machine
        fields["load_average"] = os.getloadavg()[0]
    return Report(
        strategy=strategy, world_size=len(per_rank), layout=layout, model=model_name,
        num_params=own.pop("num_params", cfg.num_params()), steps=train.steps,
        batch_size=train.batch_size, loss=losses, reference_loss=ref_losses,
        max_abs_param_diff=max(max_abs_diff(r["state"], ref_state) for r in per_rank if r["state"]),
        comm_bytes_traced=_trace.sent_bytes_per_rank(results.traces),
        comm_bytes_expected=expected_bytes, memory=[r["memory"] for r in per_rank],
        memory_expected=expected_memory, wall_s=results.wall_s,
        step_s=[r["step_s"] for r in per_rank], predicted_step_s=predicted, details=fields,
        results=results, **own)


def predicted_step_s(strategy: str, layout: dict, cfg, train: TrainConfig, details: dict,
                     device: cost.Device | None = None) -> tuple[float | None, str | None]:
    """The time model's step for this run (``cost.step_time`` in fp32 on this machine's stored
    calibration, or ``device``), and why there is none when there is none. No calibration is made
    here: it takes seconds and would disturb the run it predicts; ``minitp calibrate`` stores one.
    A stored calibration the time model cannot use is set aside with its note ("ignored: ...")."""
    if device is None:
        cal, why = calibrate.read_calibration()
        if cal is None:
            path = calibrate.calibration_path()
            if why:  # what was stored cannot time a step: say so, and where it lies
                where = "" if path in why else f" (in {path})"
                return None, f"{why}{where}; minitp calibrate measures this machine again"
            return None, f"this machine is not calibrated (minitp calibrate; it reads {path})"
        device = cost.device_from_calibration(cal)
    if strategy == "swiglu":
        return None, "the MLP alone is not a whole model; the time model predicts whole models"
    ep = layout.get("ep", 1)
    # the MoE the run built from the dense preset: active FLOPs, all-to-alls
    if strategy == "ep" or ep > 1:
        from minitp.models.moe import moe_config

        cfg = moe_config(cfg, **{k: details[k] for k in ("top_k", "capacity_factor")
                                 if k in details},
                         n_experts=details["experts"])
    if strategy not in ("ddp", "fsdp", "tp", "pp", "3d", "cp", "ep"):
        return None, f"the time model (minitp.cost.step_time) does not cover {strategy} yet"
    zero = details.get("zero") or 3
    data_parallel = details.get("data_parallel") or ("fsdp" if strategy == "fsdp" else "ddp")
    time = cost.step_time(cfg, train.batch_size, train.seq_len, layout["dp"], layout["tp"],
                          layout["pp"], device, details.get("microbatches") or 1, data_parallel,
                          zero, "fp32", bool(details.get("sequence_parallel")),
                          buckets=details.get("num_buckets"), cp=layout.get("cp", 1),
                          virtual_stages=details.get("virtual_stages") or 1, ep=ep,
                          balanced=details.get("balanced", True),
                          cp_attention=details.get("attention") or "ring",
                          dp_shard=layout.get("dp_shard"))
    if layout.get("cp", 1) > 1 and details.get("attention") in ("ulysses", "allgather"):
        return time.step_s, (f"{details['attention']}'s messages are in the prediction, the small "
                             "operations it adds are not (minitp calibrate measured the ring's)")
    return time.step_s, None


WARM = 2  # steps left out of a measured step: the first ones build caches, buffers, connections


def steady_step_s(times: list[float]) -> float:
    """The median step after the first ``WARM`` (all of them in a run of ``WARM`` steps or fewer):
    what a step costs once running, which the time model predicts. On 2 ranks of the tiny model the
    first two steps take up to twice the later ones (a group's first message opens its
    connections)."""
    return statistics.median(times[WARM:] if len(times) > WARM else times)


def worker_summary(losses: list[float], times: list[float], memory: dict, **more) -> dict:
    """What a worker returns besides its strategy's own: rank, losses, the step's time once
    running (``steady_step_s``), memory."""
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "losses": losses, "step_s": steady_step_s(times),
            "memory": memory, **more}


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
