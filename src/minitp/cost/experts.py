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

so 2 · D · b · (out_r + in_r) + 8E(n-1)/n, with out_r and in_r the rows it sends and receives.
Routing that spreads k·T tokens evenly sends k·T·(n-1)/n rows each way: that is the at-scale
estimate. Then the replicated parameters' gradients, one all-reduce of 4 Ψ_replicated bytes:
2(n-1)/n of it.

For the planner (``minitp plan --ep``), the same at scale on a dp·cp·pp·tp mesh:
``ep_mesh_step_bytes``, ``ep_mesh_memory_per_rank`` and ``moe_activation_bytes_per_rank``; training
FLOPs count the ``active_params`` (k of the E experts per layer).

Part of ``minitp.cost`` (re-exported there); builds on its strategies, activations, threed and
context.
"""

from __future__ import annotations

import math

from minitp.cost.activations import block_activation_bytes, recompute_mode
from minitp.cost.context import cp_mesh_step_bytes
from minitp.cost.strategies import (
    collective_sent_bytes,
    ddp_step_bytes,
    fsdp_memory_per_rank,
    fsdp_step_bytes,
    memory_per_rank,
    pp_peak_microbatches_in_flight,
)
from minitp.cost.threed import rank_num_blocks, stage_num_tensors, stage_unit_numels
from minitp.layout import check_divisible, check_positive, stage_num_blocks

__all__ = ["COUNT_BYTES", "check_ep", "tokens_between_ranks", "ep_layer_bytes", "ep_run_bytes",
           "ep3d_run_bytes", "moe_param_split", "ep_params_per_rank", "idle_experts",
           "ep_memory_per_rank", "moe_all_to_all_bytes", "expected_nodes_per_token",
           "moe_internode_bytes", "active_params", "ep_stage_unit_numels",
           "ep_mesh_memory_per_rank", "ep_mesh_step_bytes", "moe_block_activation_bytes",
           "moe_activation_bytes_per_rank"]

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
    return rows * dim * dtype_bytes + collective_sent_bytes("all_to_all", n_experts * COUNT_BYTES,
                                                            ep)


def ep_run_bytes(layer_counts: list[list[list[list[int]]]], rank: int, dim: int,
                 replicated_params: int, dtype_bytes: int = 4,
                 grad_bytes: int = 4) -> dict[str, float]:
    """Bytes ``rank`` sends over a run: {"ep": the all-to-alls, "dp": the replicated gradients'
    all-reduces}. ``layer_counts[step][layer]``: that layer's routing counts (ep x E) in that
    step."""
    ep = len(layer_counts[0][0])
    a2a = sum(ep_layer_bytes(c, rank, dim, dtype_bytes) for step in layer_counts for c in step)
    dp = len(layer_counts) * collective_sent_bytes("all_reduce", replicated_params * grad_bytes, ep)
    return {"ep": a2a, "dp": dp}


# -- expert parallel on the mesh: a MoE model's experts over ep of the dp ranks --------------------
def ep3d_run_bytes(layer_counts: list[list[list[list[int]]]], rank: int, dim: int,
                   replicated_params: int, expert_params: int, dp: int, ep: int,
                   dtype_bytes: int = 4, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes a rank of a dp-rank mesh dimension sends over a run when its ep group (ep consecutive
    dp ranks) shares one set of experts (``minitp.mesh.Mesh`` with ``ep``), per dimension:

    * "ep": its group's all-to-alls, ``ep_layer_bytes`` of the routing that happened
      (``layer_counts[step][layer]``: ep x E kept assignments, one row per rank of its ep group;
      ``rank``: its place in the group);
    * "dp": per step, the replicated parameters' all-reduce over all dp ranks and its experts'
      (``expert_params`` of them) over their dp/ep copies.
    """
    check_divisible("dp", dp, "ep", ep)
    steps = len(layer_counts)
    a2a = sum(ep_layer_bytes(c, rank, dim, dtype_bytes) for step in layer_counts for c in step)
    per_step = (collective_sent_bytes("all_reduce", replicated_params * grad_bytes, dp)
                + collective_sent_bytes("all_reduce", expert_params * grad_bytes, dp // ep))
    return {"tp": 0.0, "pp": 0.0, "dp": steps * per_step, "ep": a2a}


def moe_param_split(cfg) -> tuple[int, int]:
    """(replicated parameters, expert parameters) of a ``MoEConfig`` model."""
    experts = cfg.n_layers * cfg.n_experts * cfg.expert_params()
    return cfg.num_params() - experts, experts


def ep_params_per_rank(cfg, ep: int) -> int:
    """Parameters one rank holds: every replicated one, and E/ep experts of each layer."""
    check_divisible("n_experts", cfg.n_experts, "ep", ep)
    replicated, experts = moe_param_split(cfg)
    return replicated + experts // ep


EXPERT_TENSORS = 3  # w1, w2, w3: one AdamW step counter each


def idle_experts(kept: list[list[list[int]]], ep: int, rank: int) -> tuple[int, int]:
    """How many of the experts ``rank`` holds (E/ep of every layer) held nothing, from the routing
    that happened: ``kept[step][layer]``, the (E,) assignments each expert kept, summed over every
    rank whose tokens reach this rank's experts or their copies. Returns (experts no token reached
    in the last step: no gradient after it, since ``zero_grad()`` set it to None; experts no token
    ever reached: never stepped, so no AdamW moments and no step counters)."""
    if not kept:
        raise ValueError("kept holds no step: the routing of at least one step is needed")
    n_experts = len(kept[0][0])
    check_divisible("n_experts", n_experts, "ep", ep)
    per = n_experts // ep
    mine = range(rank * per, (rank + 1) * per)
    last = sum(1 for layer in kept[-1] for e in mine if layer[e] == 0)
    never = sum(1 for j in range(len(kept[0])) for e in mine if all(step[j][e] == 0
                                                                    for step in kept))
    return last, never


def _without_idle(held: dict[str, float], cfg, idle: tuple[int, int], precision: str,
                  counters: bool) -> dict[str, float]:
    """``held`` less what ``idle`` experts do not hold (``idle_experts``): the gradients of the
    first count, the AdamW state (moments, and step counters when ``counters``) of the second."""
    no_grad, never = idle
    one = memory_per_rank(cfg.expert_params(), 1, zero=0, precision=precision,
                          num_tensors=EXPERT_TENSORS if counters else 0)
    return {"params": held["params"], "grads": held["grads"] - no_grad * one["grads"],
            "optimizer": held["optimizer"] - never * one["optimizer"]}


def ep_memory_per_rank(cfg, ep: int, precision: str = "fp32", num_tensors: int = 0,
                       idle: tuple[int, int] = (0, 0)) -> dict[str, float]:
    """Bytes one rank holds in parameters, gradients and AdamW state: ``memory_per_rank`` of its own
    (``num_tensors``: every tensor it holds). idle: (experts with no gradient after the last step,
    experts never stepped) of the rank, from the routing that happened (``idle_experts``): as on one
    process, an expert no token reached holds parameters only."""
    held = memory_per_rank(ep_params_per_rank(cfg, ep), 1, zero=0, precision=precision,
                           num_tensors=num_tensors)
    return _without_idle(held, cfg, idle, precision, counters=num_tensors > 0)


def moe_all_to_all_bytes(tokens: int, dim: int, top_k: int, ep: int, dispatch_bytes: float = 2,
                         combine_bytes: float = 2, grad_bytes: float | None = None,
                         backward: bool = True) -> dict[str, float]:
    """Bytes one rank sends in one MoE layer for ``tokens`` tokens of its own, routing spread evenly
    over the ep ranks (no drops): k·tokens rows, (ep-1)/ep of which leave the rank, each way.
    dispatch_bytes, combine_bytes: bytes per element of the rows each way (DeepSeek-V3: FP8
    dispatch, BF16 combine); with ``backward`` the two gradient all-to-alls, in ``grad_bytes``
    (default: combine_bytes). Returns {"dispatch", "combine", "backward", "total"} (counts left out:
    E·8 bytes)."""
    rows = top_k * tokens * (ep - 1) / ep
    out = {"dispatch": rows * dim * dispatch_bytes, "combine": rows * dim * combine_bytes,
           "backward": 0.0}
    if backward:
        out["backward"] = 2 * rows * dim * (combine_bytes if grad_bytes is None else grad_bytes)
    out["total"] = out["dispatch"] + out["combine"] + out["backward"]
    return out


def expected_nodes_per_token(n_experts: int, top_k: int, nodes: int,
                             max_nodes: int | None = None) -> float:
    """Expected number of distinct nodes a token's k experts sit on, E experts spread evenly over
    ``nodes`` nodes (E/nodes on each). Node-limited routing (DeepSeek-V3: ``max_nodes`` M = 4) first
    picks M nodes, then the k experts among theirs. Assumed: the M nodes are any M of the nodes with
    equal chance, and the k experts any k distinct ones of those M·E/nodes, with equal chance (even
    routing). A node is missed when all k come from the other M-1 nodes' experts:

        M · (1 - C((M-1)·E/nodes, k) / C(M·E/nodes, k)).

    Without a limit (``max_nodes`` None) M is every node."""
    check_divisible("n_experts", n_experts, "nodes", nodes)
    limit = nodes if max_nodes is None else min(max_nodes, nodes)
    per_node = n_experts // nodes
    if not 1 <= top_k <= limit * per_node:
        raise ValueError(f"top_k={top_k} must be between 1 and the {limit * per_node} experts on "
                         f"max_nodes={limit} nodes of {per_node} experts each")
    return limit * (1 - math.comb((limit - 1) * per_node,
                                  top_k) / math.comb(limit * per_node, top_k))


def moe_internode_bytes(tokens: int, dim: int, top_k: int, n_experts: int, ep: int,
                        gpus_per_node: int = 8, max_nodes: int | None = None,
                        dispatch_bytes: float = 2, combine_bytes: float = 2,
                        grad_bytes: float | None = None, backward: bool = True) -> dict[str, float]:
    """Bytes one GPU sends between nodes (InfiniBand) in one MoE layer for ``tokens`` tokens of its
    own, when a token crosses to each node that holds any of its k experts once and is forwarded to
    those experts' GPUs inside the node (NVLink), and the combine adds a node's outputs inside it
    before the one row goes back (DeepSeek-V3's dispatch and combine). Rows per token and
    all-to-all: the expected distinct nodes (``expected_nodes_per_token``) that are not the token's
    own, each node being the token's own with chance 1/nodes: (nodes-1)/nodes of them. Compare
    ``moe_all_to_all_bytes``: k·(ep-1)/ep rows, one per assignment. Returns {"dispatch", "combine",
    "backward", "total"} like it (counts left out)."""
    check_divisible("ep", ep, "gpus_per_node", gpus_per_node)
    nodes = ep // gpus_per_node
    rows = tokens * expected_nodes_per_token(n_experts, top_k, nodes,
                                             max_nodes) * (nodes - 1) / nodes
    out = {"dispatch": rows * dim * dispatch_bytes, "combine": rows * dim * combine_bytes,
           "backward": 0.0}
    if backward:
        out["backward"] = 2 * rows * dim * (combine_bytes if grad_bytes is None else grad_bytes)
    out["total"] = out["dispatch"] + out["combine"] + out["backward"]
    return out


def check_ep(cfg, ep: int) -> bool:
    """Refuse an ep the model cannot take (not a size; > 1 for a dense model; not dividing
    n_experts); True when ``cfg`` is a MoE."""
    check_positive("ep", ep)
    moe = hasattr(cfg, "n_experts")
    if ep > 1 and not moe:
        raise ValueError(
            f"ep={ep} needs a mixture-of-experts model (a MoEConfig, e.g. --model mixtral-8x7b), "
            f"got a dense {type(cfg).__name__}")
    if moe:
        check_divisible("n_experts", cfg.n_experts, "ep", ep)
    return moe


def active_params(cfg) -> int:
    """Parameters one token goes through: all of a dense model's; a MoE's replicated ones and k of
    the E experts of each layer (Mixtral 8x7B: 12.9 of 46.7 B). Training FLOPs count these (6 per
    token)."""
    if not hasattr(cfg, "n_experts"):
        return cfg.num_params()
    return cfg.num_params() - cfg.n_layers * (cfg.n_experts - cfg.top_k) * cfg.expert_params()


# -- expert parallel on a dp·cp·pp·tp mesh (the planner) -------------------------------------------
# ep consecutive ranks of the data-parallel dimension (dp·cp ranks hold the same dense weights) form
# an ep group, each holding E/ep of every layer's experts; the ranks at the same place in each group
# hold the same experts: dp·cp/ep copies (the expert-dp group), which average (or ZeRO-shard) their
# gradients and states among themselves, as the dense part does over all dp·cp. tp splits each
# expert like the dense MLP (Fe/tp of its width on each tp rank): a tp rank dispatches whole token
# rows (D) and combines its partial outputs before the MLP's usual all-reduce over tp, so tp's bytes
# are a dense model's and every tp rank sends the same all-to-all bytes (sequence parallel not
# exploited).

def ep_stage_unit_numels(cfg, tp: int, pp: int, stage: int, ep: int,
                         virtual_stages: int = 1) -> tuple[list[int], list[int]]:
    """(dense units, expert units) of a rank of stage ``stage``: ``stage_unit_numels`` with each
    block's E experts taken out of it (attention, router and norms stay: replicated over dp·cp), and
    per block the E/ep experts of its ep rank, Fe/tp of each one's width: (E/ep)·3·D·Fe/tp
    parameters."""
    check_divisible("n_experts", cfg.n_experts, "ep", ep)
    check_divisible("expert_hidden", cfg.expert_hidden, "tp", tp)
    units = stage_unit_numels(cfg, tp, pp, stage, virtual_stages)
    blocks = rank_num_blocks(cfg.n_layers, pp, stage, virtual_stages)
    # all E experts of a block, this tp rank's slice
    every = cfg.n_experts * cfg.expert_params() // tp
    head = units[:len(units) - blocks]  # the root unit, if this stage has one
    return head + [u - every for u in units[len(units) - blocks:]], [every // ep] * blocks


def ep_mesh_memory_per_rank(cfg, dp: int, tp: int, pp: int, stage: int, ep: int,
                            data_parallel: str = "ddp", zero: int = 3, precision: str = "fp32",
                            virtual_stages: int = 1, idle: tuple[int,
                                                                 int] = (0, 0)) -> dict[str, float]:
    """Bytes a rank holds in parameters, gradients and AdamW state when ``dp`` ranks share the dense
    weights and ep of them split the experts: the dense units as ``threed_memory_per_rank`` over dp,
    plus its E/ep experts, sharded by FSDP (ZeRO ``zero``) over their dp/ep copies, whole under DDP.
    DDP's step counters: per block 7 dense tensors (wq wk wv wo, router, two norms) and 3·E/ep
    expert ones. idle (DDP, tp = 1): what the rank's experts no token reached do not hold, as in
    ``ep_memory_per_rank`` (``idle_experts`` of the routing summed over every dp rank of the stage:
    the copies share gradients)."""
    check_divisible("dp", dp, "ep", ep,
                    ": the experts are split over ep of the data-parallel ranks")
    dense, experts = ep_stage_unit_numels(cfg, tp, pp, stage, ep, virtual_stages)
    blocks = rank_num_blocks(cfg.n_layers, pp, stage, virtual_stages)
    tensors = (stage_num_tensors(cfg, pp, stage, virtual_stages) - 2 * blocks,
               3 * cfg.n_experts // ep * blocks)
    held = []
    for units, n, count in ((dense, dp, tensors[0]), (experts, dp // ep, tensors[1])):
        if data_parallel == "fsdp" and n > 1:
            held.append(fsdp_memory_per_rank(units, n, zero, precision))
        else:
            held.append(memory_per_rank(sum(units), 1, zero=0, precision=precision,
                                        num_tensors=count))
    if idle != (0, 0):
        if data_parallel == "fsdp" or tp > 1:
            raise ValueError(f"idle experts are counted for DDP with tp=1 (whole experts), got "
                             f"data_parallel={data_parallel!r}, tp={tp}")
        held[1] = _without_idle(held[1], cfg, idle, precision, counters=True)
    return {k: held[0][k] + held[1][k] for k in held[0]}


def ep_mesh_step_bytes(cfg, batch: int, seq: int, dp: int, cp: int, tp: int, pp: int, stage: int,
                       ep: int, data_parallel: str = "ddp", zero: int = 3,
                       activation_bytes: int = 4, param_bytes: int = 4, grad_bytes: int = 4,
                       sequence_parallel: bool = False, recompute=False,
                       virtual_stages: int = 1) -> dict[str, float]:
    """Bytes per training step of a rank at ``stage`` of a MoE on a dp·cp·pp·tp mesh whose experts
    are split over ep of the dp·cp ranks, per dimension {"tp", "pp", "dp", "cp", "ep"}:

    * tp, pp, cp: ``cp_mesh_step_bytes`` (a MoE block moves the activations a dense one does);
    * ep: per MoE layer of the stage, ``moe_all_to_all_bytes`` of the rank's T = (B/dp)·(S/cp)
      tokens, forward and backward: 4·k·T·(ep-1)/ep·D·b (counts left out);
    * dp: the dense units' gradients over the dp·cp ranks, the experts' over their dp·cp/ep copies
      (DDP: all-reduces; FSDP: ZeRO ``zero``'s gathers and reduce-scatters, experts never the root).
    ep = 1: every rank holds every expert, ``cp_mesh_step_bytes`` and no all-to-all."""
    n = dp * cp
    check_divisible("dp·cp", n, "ep", ep,
                    ": the experts are split over ep of the data-parallel ranks")
    sent = cp_mesh_step_bytes(cfg, batch, seq, dp, cp, tp, pp, stage, data_parallel, zero,
                              activation_bytes, param_bytes, grad_bytes, sequence_parallel,
                              recompute, virtual_stages)
    blocks = rank_num_blocks(cfg.n_layers, pp, stage, virtual_stages)
    tokens = batch // dp * (seq // cp)
    sent["ep"] = blocks * moe_all_to_all_bytes(tokens, cfg.dim, cfg.top_k, ep, activation_bytes,
                                               activation_bytes)["total"]
    if ep > 1:
        dense, experts = ep_stage_unit_numels(cfg, tp, pp, stage, ep, virtual_stages)
        if data_parallel == "ddp":
            sent["dp"] = ddp_step_bytes(sum(dense), n, grad_bytes) + ddp_step_bytes(
                sum(experts), n // ep, grad_bytes)
        else:
            root = stage == 0 or stage == pp - 1
            sent["dp"] = (fsdp_step_bytes(dense, n, zero, True, param_bytes, 4, root)
                          + fsdp_step_bytes(experts, n // ep, zero, True, param_bytes, 4,
                                            root=False))
    return sent


def moe_block_activation_bytes(cfg, micro_batch: int, seq: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute="none",
                               flash_attention: bool = True, dtype_bytes: int = 2) -> float:
    """An estimate of what one MoE block keeps for backward, one micro-batch on one rank:
    Korthikanti's dense block (``block_activation_bytes``) with its MLP's tensor-parallel share,
    16·s·b·D/t bytes in 16-bit (two 4D-wide tensors), replaced by the MoE layer's. Each of the k·s·b
    assignments keeps its dispatched input row and its expert's output row (D each, whole on every
    tp rank: the weight's and the gate's gradients need them) and the expert's four Fe/t-wide
    tensors (x·W1, x·W3, SiLU, their product); each token the router's E probabilities in fp32:

        dense − s·b·8·D/t·b_a + s·b·(k·(2·D + 4·Fe/t)·b_a + 4·E)       (b_a: bytes per activation)

    Full recomputation keeps the block's input alone, as for a dense block."""
    dense = block_activation_bytes(cfg, micro_batch, seq, tp, sequence_parallel, recompute,
                                   flash_attention, dtype_bytes)
    if recompute_mode(recompute) == "full":
        return dense
    tokens, d, k, fe = micro_batch * seq, cfg.dim, cfg.top_k, cfg.expert_hidden
    return dense + tokens * (k * (2 * d + 4 * fe / tp) * dtype_bytes
                             + 4 * cfg.n_experts - 8 * d / tp * dtype_bytes)


def moe_activation_bytes_per_rank(cfg, micro_batch: int, seq: int, tp: int, pp: int, stage: int,
                                  microbatches: int, dtype_bytes: int = 2,
                                  flash_attention: bool = True, recompute=False,
                                  sequence_parallel: bool = False) -> float:
    """``activation_bytes_per_rank`` of a MoE: ``moe_block_activation_bytes`` times the stage's
    blocks, times the micro-batches 1F1B keeps in flight (min(pp - stage, m)). ep changes nothing
    here: a rank computes the assignments its experts receive, k·s·b of them when routing is
    even."""
    per_block = moe_block_activation_bytes(cfg, micro_batch, seq, tp, sequence_parallel, recompute,
                                           flash_attention, dtype_bytes)
    return per_block * stage_num_blocks(cfg.n_layers, pp, stage) * pp_peak_microbatches_in_flight(
        pp, microbatches, stage, "1f1b")
