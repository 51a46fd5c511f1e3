"""Checked runs of tensor parallelism: the whole model, and the SwiGLU MLP alone."""

from __future__ import annotations

import torch

from minitp import cost, layout, tp
from minitp.launcher import launch
from minitp.measure.memory import held_bytes
from minitp.models import build_model, get_config
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches
from minitp.runs.common import build_report, check_run, train_steps, worker_summary
from minitp.runs.references import swiglu, swiglu_batches
from minitp.runs.registry import Option, Strategy, register
from minitp.runs.report import Report


def _with_full_states(results) -> list[dict]:
    """Each rank's return with ``state``: the full parameters (the slices of every rank put
    together, the replicated ones as that rank holds them), under the plain model's names."""
    shards = [r["shards"] for r in results]
    return [{**{k: v for k, v in r.items() if k != "shards"}, "state": tp.unshard(shards, rank)}
            for rank, r in enumerate(results)]


# -- the whole model -------------------------------------------------------------------------------
def _tp_worker(model_name: str, train: TrainConfig, sequence_parallel: bool) -> dict:
    cfg = get_config(model_name)
    # (B, S, V/tp)
    loss = lambda logits, targets: tp.vocab_parallel_cross_entropy(logits, targets, None)
    # the world is the TP group; every rank reads the whole batch (TP splits the model, not the
    # data)
    model = tp.parallelize(build_model(cfg, seed=train.seed), None, sequence_parallel)
    optimizer = make_optimizer(model.parameters(), train.lr)
    losses, times = train_steps(model, model, synthetic_batches(cfg, train), lambda t: t, optimizer,
                                loss=loss)
    return worker_summary(losses, times, held_bytes(model.parameters(), optimizer),
                          shards=tp.local_shards(model))


def run_tp(nproc: int = 4, steps: int = 4, sequence_parallel: bool = False, model: str = "tiny",
           batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
           backend: str = "gloo", timeout: float = 300.0) -> Report:
    """Train the whole model with ``minitp.tp`` over ``nproc`` ranks (every rank the whole batch)
    and report it against the three oracles."""
    train = check_run("tp", locals(), data_parallel=1, tensor_parallel=nproc)
    cfg = get_config(model)
    if sequence_parallel:
        layout.check_divisible("seq_len", seq_len, "tp", nproc,
                               ": sequence parallel gives each rank seq_len/tp positions")
    layout.check_tp_config(cfg, nproc)  # refuse a bad split here, in the parent
    results = launch(_tp_worker, nproc, model, train, sequence_parallel, backend=backend,
                     timeout=timeout, echo=False)
    n_tensors = len(list(build_model(cfg).parameters()))
    expected_bytes = [cost.tp_run_bytes(cfg, batch_size, seq_len, nproc, steps,
                                        sequence_parallel)] * nproc
    expected_memory = [cost.tp_memory_per_rank(cfg, nproc, num_tensors=n_tensors)] * nproc
    return build_report("tp", {"dp": 1, "tp": nproc, "pp": 1}, _with_full_states(results), results,
                        model, train, expected_bytes, expected_memory,
                        sequence_parallel=sequence_parallel,
                        params_per_rank=cost.tp_params_per_rank(cfg, nproc))


register(Strategy("tp", run_tp,
                  "tensor parallel: the whole model split over the ranks (column/row, Megatron)", (
    Option("sequence_parallel", bool, False,
           "split the norms' positions over the ranks (reduce-scatter/all-gather)"),
)))


# -- the SwiGLU MLP alone --------------------------------------------------------------------------
def _swiglu_worker(model_name: str, train: TrainConfig) -> dict:
    cfg = get_config(model_name)
    mlp = tp.ParallelFeedForward(build_model(cfg, seed=train.seed).layers[0].feed_forward, None)
    optimizer = make_optimizer(mlp.parameters(), train.lr)
    losses, times = train_steps(mlp, mlp, swiglu_batches(cfg, train), lambda t: t, optimizer,
                                loss=torch.nn.functional.mse_loss)
    return worker_summary(losses, times, held_bytes(mlp.parameters(), optimizer),
                          shards=tp.local_shards(mlp))


def run_swiglu(nproc: int = 4, steps: int = 4, model: str = "tiny", batch_size: int = 8,
               seq_len: int = 16, lr: float = 3e-3, seed: int = 0, backend: str = "gloo",
               timeout: float = 300.0) -> Report:
    """Train the tensor-parallel SwiGLU MLP alone (the model's first block's, mean squared error
    to random targets) over ``nproc`` ranks and report it against the three oracles."""
    train = check_run("swiglu", locals(), data_parallel=1, tensor_parallel=nproc)
    cfg = get_config(model)
    layout.check_divisible("ffn_hidden", cfg.ffn_hidden, "tp", nproc)
    results = launch(_swiglu_worker, nproc, model, train, backend=backend, timeout=timeout,
                     echo=False)
    params = cost.tp_mlp_params_per_rank(cfg.dim, cfg.ffn_hidden, nproc)
    expected_bytes = [steps * cost.tp_mlp_bytes(batch_size, seq_len, cfg.dim, nproc)] * nproc
    expected_memory = [cost.memory_per_rank(params, num_tensors=3)] * nproc
    return build_report("swiglu", {"dp": 1, "tp": nproc, "pp": 1}, _with_full_states(results),
                        results, model, train, expected_bytes, expected_memory,
                        reference=swiglu(cfg, train), num_params=3 * cfg.dim * cfg.ffn_hidden,
                        params_per_rank=params)


register(Strategy("swiglu", run_swiglu,
                  "the tensor-parallel SwiGLU MLP alone (column then row parallel)"))
