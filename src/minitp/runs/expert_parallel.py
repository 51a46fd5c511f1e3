"""Checked runs of expert parallel: the MoE variant of the tiny model, its experts over the
ranks."""

from __future__ import annotations

from minitp import cost, ep, layout
from minitp.cost.experts import idle_experts
from minitp.launcher import launch
from minitp.measure.memory import held_bytes
from minitp.models import get_config
from minitp.models.moe import MoEConfig, build_moe_model, moe_config, moe_layers, moe_loss
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches, train_one_process
from minitp.runs.common import build_report, check_run, state_of, train_steps, worker_summary
from minitp.runs.registry import MAX_EXPERTS, Option, Strategy, register
from minitp.runs.report import Report


def moe_train_steps(model, step_model, batches, shard,
                    optimizer) -> tuple[list[float], list[float]]:
    """``runs.common.train_steps`` as one process trains a MoE, with ``zero_grad()``'s default: the
    gradients set to None before each step, so an expert no token reached in a step has none and
    AdamW leaves it alone (zeroed in place, its momentum and weight decay would move it), as the
    one-process reference (``train_one_process``) does. Returns (local losses, step times)."""
    return train_steps(model, step_model, batches, shard, optimizer, loss=moe_loss(model),
                       set_to_none=True)


def moe_reference(cfg: MoEConfig, train: TrainConfig) -> tuple[list[float], dict, dict]:
    """The same MoE model trained on one process with the whole batch (``train_one_process``):
    (losses, final parameters, {"routed", "kept"}: per step and layer, (E,) assignments per
    expert)."""
    model = build_moe_model(cfg, seed=train.seed)
    losses, _ = train_one_process(model, synthetic_batches(cfg, train), train.lr,
                                  loss=moe_loss(model))
    layers = moe_layers(model)
    load = {kind: [[getattr(layer, kind)[s].tolist() for layer in layers]
                   for s in range(train.steps)]
            for kind in ("routed", "history")}
    return losses, state_of(model), {"routed": load["routed"], "kept": load["history"]}


def _ep_worker(cfg: MoEConfig, train: TrainConfig) -> dict:
    import torch.distributed as dist

    n = dist.get_world_size()
    # named "ep", "dp"
    ep_group, dp_group = dist.new_group(list(range(n))), dist.new_group(list(range(n)))
    model = build_moe_model(cfg, seed=train.seed)
    parallel = ep.ExpertParallel(model, ep_group, dp_group)
    optimizer = make_optimizer(model.parameters(), train.lr)
    shard = lambda batch: batch.chunk(n)[dist.get_rank()]  # this rank's B/n sequences
    losses, times = moe_train_steps(model, parallel, synthetic_batches(cfg, train), shard,
                                    optimizer)
    layers = moe_layers(model)
    return worker_summary(losses, times, held_bytes(model.parameters(), optimizer),
                          state=ep.local_state(model), num_tensors=len(list(model.parameters())),
                          kept=[[layer.history[s].tolist() for layer in layers]
                                for s in range(train.steps)],
                          routed=[[layer.routed[s].tolist() for layer in layers]
                                  for s in range(train.steps)])


def run_ep(nproc: int = 4, steps: int = 4, experts: int = 8, top_k: int = 2,
           capacity_factor: float | None = 1.25, aux_loss_coef: float = 0.01, model: str = "tiny",
           batch_size: int = 8, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
           backend: str = "gloo", timeout: float = 300.0) -> Report:
    """Train the MoE variant of ``model`` (``experts`` SwiGLU experts per block, top-``top_k``
    routing, ``capacity_factor``) with its experts split over ``nproc`` ranks (``minitp.ep``; the
    rest data parallel over the same ranks) and report it against one process with the whole batch,
    the traced bytes against ``cost.ep_run_bytes`` of the routing that happened, and the memory
    formula."""
    train = check_run("ep", locals(), data_parallel=nproc)
    layout.check_batch(batch_size, nproc)
    layout.check_divisible("experts", experts, "ep", nproc, ": every rank holds experts/ep of them")
    if top_k > experts:
        raise ValueError(
            f"top_k={top_k} is more than the {experts} experts a token can choose from")
    cfg = moe_config(get_config(model), n_experts=experts, top_k=top_k,
                     capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef)
    results = launch(_ep_worker, nproc, cfg, train, backend=backend, timeout=timeout, echo=False)
    ref_losses, ref_state, ref_load = moe_reference(cfg, train)

    # counts[step][layer]: (nproc x E) kept assignments per rank and expert, as the ranks routed
    # them
    counts = [[[r["kept"][s][layer] for r in results] for layer in range(cfg.n_layers)]
              for s in range(steps)]
    replicated, _ = cost.moe_param_split(cfg)
    by_dim = [cost.ep_run_bytes(counts, rank, cfg.dim, replicated) for rank in range(nproc)]
    per_rank = [{**r, "state": ep.full_state([q["state"] for q in results])} for r in results]

    def total(kind: str) -> list[list[list[int]]]:  # [step][layer]: (E,) summed over the ranks
        return [[[sum(r[kind][s][layer][e] for r in results) for e in range(experts)]
                 for layer in range(cfg.n_layers)] for s in range(steps)]

    kept, routed = total("kept"), total("routed")
    # what AdamW really holds: an expert no token reached in the last step has no gradient, one no
    # token ever reached no moments either (as on one process with zero_grad()); the routing says
    # which
    idle = [idle_experts(kept, nproc, rank) for rank in range(nproc)]
    expected_memory = [cost.ep_memory_per_rank(cfg, nproc, num_tensors=r["num_tensors"], idle=i)
                       for r, i in zip(results, idle)]
    return build_report(
        "ep", {"dp": nproc, "tp": 1, "pp": 1, "ep": nproc}, per_rank, results, model, train,
        [sum(d.values()) for d in by_dim], expected_memory, reference=(ref_losses, ref_state),
        num_params=cfg.num_params(), coords=[(rank, 0, 0) for rank in range(nproc)],
        comm_bytes_traced_by_dim=[{dim: sum(e.sent_bytes for e in t.comm() if e.dim == dim)
                                   for dim in ("ep", "dp")}
                                  for t in sorted(results.traces, key=lambda t: t.rank)],
        comm_bytes_expected_by_dim=by_dim,
        experts=experts, top_k=top_k, capacity_factor=capacity_factor,
        capacity=cfg.capacity(seq_len), aux_loss_coef=aux_loss_coef,
        params_per_rank=cost.ep_params_per_rank(cfg, nproc), routing_counts=counts,
        load_per_expert=routed, kept_per_expert=kept,
        dropped=[[batch_size * seq_len * top_k - sum(layer) for layer in step] for step in kept],
        routing_matches_reference=kept == ref_load["kept"],
        idle_experts=[{"no_gradient": i[0], "never_stepped": i[1]} for i in idle])


register(Strategy("ep", run_ep, "expert parallel: a MoE model's experts over the ranks, tokens "
                                "sent by all-to-all", (
    Option("experts", int, 8, "experts per MoE layer (a multiple of nproc)", low=1,
           high=MAX_EXPERTS),
    Option("top_k", int, 2, "experts each token is sent to", low=1),
    Option("capacity_factor", float, 1.25,
           "an expert takes at most ceil(c·S·k/E) tokens of a sequence; "
           "experts/top_k or more drops nothing (None from Python: no limit)", above=0,
           high=MAX_EXPERTS, optional=True),
    Option("aux_loss_coef", float, 0.01, "weight of the load-balancing loss", low=0),
)))

__all__ = ["run_ep", "moe_reference", "moe_train_steps"]
