"""Analytic bytes and memory of expert parallel (``minitp.ep``).

Notation: n ranks in the ep group, E experts per MoE layer (E/n on each rank), k experts per token,
D the model dim, b bytes per element of the rows sent. ``counts[i][e]``: the assignments rank i
kept for expert e in one layer's forward (after capacity), the routing the trace came from. Rank j
holds experts j·E/n .. (j+1)·E/n - 1, so rank i sends rank j T[i][j] = Σ_{e on j} counts[i][e] rows.

Per MoE layer and training step, rank r sends (all-to-all: every row but those addressed to itself):

  forward   counts      E · 8 · (n-1)/n     (an int64 count per expert; its own share stays)
            dispatch    Σ_{j≠r} T[r][j] · D · b    its tokens to the experts' ranks
            combine     Σ_{j≠r} T[j][r] · D · b    the outputs back to their tokens' ranks
  backward  the same two, reversed: the combine's gradient Σ_{j≠r} T[r][j] · D · b, the dispatch's
            Σ_{j≠r} T[j][r] · D · b

so 2 · D · b · (out_r + in_r) + 8E(n-1)/n, with out_r and in_r the rows it sends and receives. Routing
that spreads k·T tokens evenly sends k·T·(n-1)/n rows each way: that is the at-scale estimate. Then the
replicated parameters' gradients, one all-reduce of 4 Ψ_replicated bytes: 2(n-1)/n of it.
"""

from __future__ import annotations

from minitp.cost import collective_sent_bytes, memory_per_rank
from minitp.layout import check_divisible

COUNT_BYTES = 8  # one int64 per expert in the counts all-to-all


def tokens_between_ranks(counts: list[list[int]], ep: int) -> list[list[int]]:
    """T[i][j]: rows rank i sends rank j in one dispatch, from ``counts`` (ep x E) per expert."""
    if len(counts) != ep:
        raise ValueError(f"counts has {len(counts)} rows, expected one per rank of ep={ep}")
    n_experts = len(counts[0])
    check_divisible("n_experts", n_experts, "ep", ep)
    per = n_experts // ep
    return [[sum(row[j * per:(j + 1) * per]) for j in range(ep)] for row in counts]


def ep_layer_bytes(counts: list[list[int]], rank: int, dim: int, dtype_bytes: int = 4,
                   backward: bool = True) -> float:
    """Bytes ``rank`` sends in one MoE layer's forward (and, with ``backward``, its backward), given
    the layer's routing ``counts`` (ep x E kept assignments per rank and expert)."""
    ep = len(counts)
    t = tokens_between_ranks(counts, ep)
    out_rows = sum(t[rank][j] for j in range(ep) if j != rank)
    in_rows = sum(t[i][rank] for i in range(ep) if i != rank)
    n_experts = len(counts[0])
    rows = (out_rows + in_rows) * (2 if backward else 1)
    return rows * dim * dtype_bytes + collective_sent_bytes("all_to_all", n_experts * COUNT_BYTES, ep)


def ep_run_bytes(layer_counts: list[list[list[list[int]]]], rank: int, dim: int, replicated_params: int,
                 dtype_bytes: int = 4, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes ``rank`` sends over a run: {"ep": the all-to-alls, "dp": the replicated gradients'
    all-reduces}. ``layer_counts[step][layer]``: that layer's routing counts (ep x E) in that step."""
    ep = len(layer_counts[0][0])
    a2a = sum(ep_layer_bytes(c, rank, dim, dtype_bytes) for step in layer_counts for c in step)
    dp = len(layer_counts) * collective_sent_bytes("all_reduce", replicated_params * grad_bytes, ep)
    return {"ep": a2a, "dp": dp}


def moe_param_split(cfg) -> tuple[int, int]:
    """(replicated parameters, expert parameters) of a ``MoEConfig`` model."""
    experts = cfg.n_layers * cfg.n_experts * cfg.expert_params()
    return cfg.num_params() - experts, experts


def ep_params_per_rank(cfg, ep: int) -> int:
    """Parameters one rank holds: every replicated one, and E/ep experts of each layer."""
    check_divisible("n_experts", cfg.n_experts, "ep", ep)
    replicated, experts = moe_param_split(cfg)
    return replicated + experts // ep


def ep_memory_per_rank(cfg, ep: int, precision: str = "fp32", num_tensors: int = 0) -> dict[str, float]:
    """Bytes one rank holds in parameters, gradients and AdamW state: ``memory_per_rank`` of its own."""
    return memory_per_rank(ep_params_per_rank(cfg, ep), 1, zero=0, precision=precision, num_tensors=num_tensors)


def moe_all_to_all_bytes(tokens: int, dim: int, top_k: int, ep: int, dispatch_bytes: float = 2,
                         combine_bytes: float = 2, grad_bytes: float | None = None,
                         backward: bool = True) -> dict[str, float]:
    """Bytes one rank sends in one MoE layer for ``tokens`` tokens of its own, routing spread evenly
    over the ep ranks (no drops): k·tokens rows, (ep-1)/ep of which leave the rank, each way.
    dispatch_bytes, combine_bytes: bytes per element of the rows each way (DeepSeek-V3: FP8 dispatch,
    BF16 combine); with ``backward`` the two gradient all-to-alls, in ``grad_bytes`` (default:
    combine_bytes). Returns {"dispatch", "combine", "backward", "total"} (counts left out: E·8 bytes)."""
    rows = top_k * tokens * (ep - 1) / ep
    out = {"dispatch": rows * dim * dispatch_bytes, "combine": rows * dim * combine_bytes, "backward": 0.0}
    if backward:
        out["backward"] = 2 * rows * dim * (combine_bytes if grad_bytes is None else grad_bytes)
    out["total"] = out["dispatch"] + out["combine"] + out["backward"]
    return out


__all__ = ["COUNT_BYTES", "tokens_between_ranks", "ep_layer_bytes", "ep_run_bytes", "moe_param_split",
           "ep_params_per_rank", "ep_memory_per_rank", "moe_all_to_all_bytes"]
