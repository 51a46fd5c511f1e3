"""Checked runs of context parallelism: the sequence split over the ranks, attention as a ring."""

from __future__ import annotations

import time

from minitp import cost, cp, layout
from minitp import trace as _trace
from minitp.launcher import launch
from minitp.measure.memory import held_bytes
from minitp.models import build_model, get_config, loss_fn
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches
from minitp.runs.common import build_report, check_run, state_of, worker_summary
from minitp.runs.references import full_batch
from minitp.runs.registry import Option, Strategy, register
from minitp.runs.report import Report


def _cp_worker(model_name: str, train: TrainConfig, balanced: bool, attention: str) -> dict:
    cfg = get_config(model_name)
    model = build_model(cfg, seed=train.seed)  # the same on every rank: no start-up broadcast
    step_model = cp.parallelize(model, None, balanced, attention)  # the world is the cp group
    optimizer = make_optimizer(model.parameters(), train.lr)
    # (B, S) -> (B, S/cp), this rank's positions
    shard = lambda t: cp.shard_sequence(t, None, balanced)
    losses, times = [], []
    for tokens, targets in synthetic_batches(cfg, train):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        with _trace.span("forward"):
            # the mean over this rank's S/cp
            value = loss_fn(step_model(shard(tokens)), shard(targets))
        with _trace.span("backward"):
            # ends with the mean of the ranks' gradients over cp: the global mean's
            value.backward()
        with _trace.span("optimizer"):
            optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(value.item())
    # the attention's messages: the ring's sends and receives, Ulysses' all-to-alls or the keys' and
    # values' all-gathers and reduce-scatters (the gradients' mean over cp is the one all-reduce)
    attention_ops = ("send", "recv", "all_to_all", "all_gather", "reduce_scatter")
    ring = [e for e in _trace.current().comm() if e.op in attention_ops]
    return worker_summary(losses, times, held_bytes(model.parameters(), optimizer),
                          state=state_of(model), ring_bytes=sum(e.sent_bytes for e in ring))


def run_cp(nproc: int = 4, steps: int = 4, balanced: bool = True, model: str = "tiny",
           batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
           backend: str = "gloo", timeout: float = 300.0, attention: str = "ring") -> Report:
    """Train the whole model with ``minitp.cp`` over ``nproc`` ranks (every rank the whole batch,
    S/nproc of each sequence; attention as a ring, or ``attention="ulysses"``: all-to-alls of the
    heads, or ``"allgather"``: the keys and values all-gathered) and report it against the oracles:
    one process and the formulas (PyTorch's own
    ``context_parallel`` needs CUDA's SDPA kernels, so it is not one here). ``ring_bytes``: the
    attention's messages (the ring's, Ulysses' all-to-alls or the all-gathers)."""
    train = check_run("cp", locals(), data_parallel=1)
    cfg = get_config(model)
    if attention == "ulysses":
        for name, heads in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads)):
            layout.check_divisible(name, heads, "nproc", nproc,
                                   ": Ulysses splits the heads over the cp ranks")
    if nproc > 1:
        # refuse a sequence that does not split, in the parent
        layout.cp_chunks(seq_len, nproc, 0, balanced)
    # the one-process reference first: building its optimizer imports what AdamW needs once, here,
    # rather than in every rank at once (seconds each on a small machine)
    reference = full_batch(cfg, train)
    results = launch(_cp_worker, nproc, model, train, balanced, attention, backend=backend,
                     timeout=timeout, echo=False)
    n_tensors = len(list(build_model(cfg).parameters()))
    expected_bytes = [cost.cp_run_bytes(cfg, batch_size, seq_len, nproc, steps,
                                        attention=attention)] * nproc
    expected_memory = [cost.cp_memory_per_rank(cfg, nproc, num_tensors=n_tensors)] * nproc
    ring_expected = steps * cost.cp_step_bytes(cfg, batch_size, seq_len, nproc,
                                               attention=attention)["ring"]
    return build_report("cp", {"dp": 1, "tp": 1, "pp": 1, "cp": nproc}, list(results), results,
                        model, train, expected_bytes, expected_memory, reference=reference,
                        balanced=balanced, attention=attention,
                        ring_bytes=[r["ring_bytes"] for r in results],
                        ring_bytes_expected=[ring_expected] * nproc,
                        positions=[layout.cp_positions(seq_len, nproc, r, balanced and nproc > 1)
                                   for r in range(nproc)])


# how attention crosses the cp ranks: run cp's, run 3d's and train's option (plan's is cp_attention)
ATTENTION = Option("attention", str, "ring",
                   "with cp > 1, ring: keys and values passed round; ulysses: all-to-alls "
                   "of the heads; allgather: every rank gathers all keys and values",
                   choices=cp.ATTENTIONS)

register(Strategy("cp", run_cp,
                  "context parallel: the sequence split over the ranks, attention as a ring", (
    Option("balanced", bool, True, "contiguous slices instead of load-balanced chunks i and 2n-1-i",
           negate=True),
    ATTENTION,
)))
