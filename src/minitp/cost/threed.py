"""3D: data × pipeline × tensor parallel: what a rank at mesh position (d, s, t) holds and sends.

Part of ``minitp.cost`` (re-exported there); the notation is the package's. It builds on
``minitp.cost.strategies`` alone. The whole model's tensor-parallel bytes (``tp_step_bytes``) are
its formula with one stage.
"""

from __future__ import annotations

from minitp.cost.strategies import (
    collective_sent_bytes,
    ddp_run_bytes,
    fsdp_memory_per_rank,
    fsdp_run_bytes,
    hsdp_memory_per_rank,
    hsdp_step_bytes,
    memory_per_rank,
    pp_step_bytes,
    tp_block_bytes,
)
from minitp.layout import check_divisible, stage_num_blocks

__all__ = ["rank_num_blocks", "stage_unit_numels", "stage_num_tensors", "threed_params_per_rank",
           "threed_step_bytes", "threed_memory_per_rank", "check_hsdp_shard", "tp_step_bytes",
           "tp_run_bytes"]


# -- 3D: data × pipeline × tensor parallel, and the layout planner ---------------------------------
# A rank at mesh position (d, s, t) holds stage s's blocks, each matrix split over tp (the RMSNorm
# weights replicated), the first stage also the embedding (V/tp rows), the last the final norm and
# the output layer (V/tp rows). It reads B/dp sequences of the global batch, cut into m
# micro-batches when pp > 1. Per step it sends, in each dimension (A = (B/dp)·S·D·b, the activations
# of its whole share):
#
#   tp   its stage's part of tp_step_bytes at batch B/dp: 4 all-reduces of A per block, 1 for the
#        embedding (first stage), 1 for the output layer and the loss's (B/dp)·S·12 bytes (last
# stage)
#   pp   pp_step_bytes at batch B/dp: A forward unless last, A backward unless first
#   dp   DDP: an all-reduce of its Ψ_rank gradients; FSDP: fsdp_step_bytes of its units over dp;
#        HSDP (dp = R replicas × S shards): fsdp_step_bytes over the S ranks of its shard group
#        ("dp_shard") and the all-reduce of its 1/S of the gradients over R ("dp_replicate")
#
# A dimension of size 1 sends nothing (every formula above gives 0 at n = 1).

def rank_num_blocks(n_layers: int, pp: int, stage: int, virtual_stages: int = 1) -> int:
    """Blocks the rank at pipeline position ``stage`` holds: its stage's, or with ``virtual_stages``
    v > 1 (interleaved 1F1B) those of its v pieces stage, stage + pp, ... of the pp·v pieces."""
    return sum(stage_num_blocks(n_layers, pp * virtual_stages, c * pp + stage)
               for c in range(virtual_stages))


def stage_unit_numels(cfg, tp: int, pp: int, stage: int, virtual_stages: int = 1) -> list[int]:
    """Parameters a rank of stage ``stage`` holds, per FSDP unit (root first when it has any: the
    embedding on the first stage, final norm and output layer on the last), after the tp split;
    interleaved over ``virtual_stages`` chunks, the blocks of its pieces (``rank_num_blocks``)."""
    d, v = cfg.dim, cfg.vocab_size
    per_block = (cfg.num_params() - 2 * v * d - d) // cfg.n_layers  # its 2 norm weights included
    block = (per_block - 2 * d) // tp + 2 * d
    root = (v * d // tp if stage == 0 else 0) + (d + d * v // tp if stage == pp - 1 else 0)
    return ([root] if root else []) + [block] * rank_num_blocks(cfg.n_layers, pp, stage,
                                                                virtual_stages)


def stage_num_tensors(cfg, pp: int, stage: int, virtual_stages: int = 1) -> int:
    """Parameter tensors a rank of stage ``stage`` holds: 9 per block (wq wk wv wo w1 w2 w3 and two
    norms), the embedding on the first stage, the final norm and output layer on the last."""
    return 9 * rank_num_blocks(cfg.n_layers, pp, stage,
                               virtual_stages) + (stage == 0) + 2 * (stage == pp - 1)


def threed_params_per_rank(cfg, tp: int, pp: int, stage: int, virtual_stages: int = 1) -> int:
    """Ψ_rank: parameters a rank of stage ``stage`` holds under tp (before any data-parallel
    sharding)."""
    return sum(stage_unit_numels(cfg, tp, pp, stage, virtual_stages))


def threed_step_bytes(cfg, batch: int, seq: int, dp: int, tp: int, pp: int, stage: int,
                      dp_rank: int = 0, data_parallel: str = "ddp", zero: int = 3, steps: int = 1,
                      activation_bytes: int = 4, param_bytes: int = 4, grad_bytes: int = 4,
                      start_up: bool = False, state_dict: bool = False,
                      sequence_parallel: bool = False, recompute: bool | str = False,
                      virtual_stages: int = 1, dp_shard: int | None = None) -> dict[str, float]:
    """Bytes a rank at (dp_rank, stage, ·) sends over ``steps`` steps, per dimension:
    {"tp","pp","dp"}.

    data_parallel: "ddp" (an all-reduce of the gradients; with ``start_up`` the first rank's
    broadcast of the parameters), "fsdp" (ZeRO ``zero``; with ``state_dict`` the final all-gather
    of the full parameters) or "hsdp" (``hsdp_step_bytes``: FSDP over shard groups of ``dp_shard``
    ranks, the gradient shards all-reduced over dp/dp_shard replicas; "dp" is their sum, and
    "dp_shard", "dp_replicate" each group's; with ``state_dict`` the final all-gather inside the
    shard group). FSDP's parameter gathers use ``param_bytes``, its gradient sums 4 bytes.
    sequence_parallel / recompute: as in ``tp_block_bytes`` (sequence parallel turns each
    all-reduce into a reduce-scatter and an all-gather, same bytes, and adds the norm weights'
    gradients; full recomputation repeats forward's two collectives per block).
    """
    check_divisible("batch_size", batch, "dp", dp)
    b, d = batch // dp, cfg.dim
    a = b * seq * d * activation_bytes
    first, last = stage == 0, stage == pp - 1
    blocks = rank_num_blocks(cfg.n_layers, pp, stage, virtual_stages)
    tp_bytes = blocks * tp_block_bytes(b, seq, d, tp, sequence_parallel, activation_bytes,
                                       recompute)
    # the embedding's g (under sequence parallel: RS forward, AG backward, the same bytes)
    if first:
        tp_bytes += collective_sent_bytes("all_reduce", a, tp)
    if last:  # the output layer's f, and the loss's max and (sum of exps, target logit), fp32
        tp_bytes += collective_sent_bytes("all_reduce", a, tp)
        if sequence_parallel:  # the final norm's weight gradient
            tp_bytes += collective_sent_bytes("all_reduce", d * activation_bytes, tp)
        tp_bytes += collective_sent_bytes("all_reduce", b * seq * 4, tp)
        tp_bytes += collective_sent_bytes("all_reduce", 2 * b * seq * 4, tp)
    pp_bytes = pp_step_bytes(b, seq, d, pp, stage, activation_bytes, virtual_stages)
    numels = stage_unit_numels(cfg, tp, pp, stage, virtual_stages)
    if data_parallel == "ddp":
        dp_bytes = ddp_run_bytes(sum(numels), dp, steps, dp_rank, param_bytes, grad_bytes,
                                 start_up) / steps
    elif data_parallel == "fsdp":
        dp_bytes = fsdp_run_bytes(numels, dp, steps, zero, True, param_bytes, 4, stage == 0 or last,
                                  state_dict) / steps
    elif data_parallel == "hsdp":
        shard = check_hsdp_shard(dp, dp_shard)
        groups = {group: steps * sent for group, sent in hsdp_step_bytes(
            numels, dp // shard, shard, zero, True, param_bytes, 4, stage == 0 or last).items()}
        # the state dict: the fp32 master shards all-gathered inside the shard group
        groups["dp_shard"] += fsdp_run_bytes(numels, shard, 0, state_dict=state_dict)
        return {"tp": steps * tp_bytes, "pp": steps * pp_bytes,
                "dp": groups["dp_shard"] + groups["dp_replicate"], **groups}
    else:
        raise ValueError(f"data_parallel must be 'ddp', 'fsdp' or 'hsdp', got {data_parallel!r}")
    return {"tp": steps * tp_bytes, "pp": steps * pp_bytes, "dp": steps * dp_bytes}


def threed_memory_per_rank(cfg, dp: int, tp: int, pp: int, stage: int, data_parallel: str = "ddp",
                           zero: int = 3, precision: str = "fp32", virtual_stages: int = 1,
                           dp_shard: int | None = None) -> dict[str, float]:
    """Bytes a rank of stage ``stage`` holds in parameters, gradients and AdamW state: its own
    Ψ_rank, sharded over dp by FSDP (ZeRO ``zero``; units padded to a multiple of dp), over its
    shard group of ``dp_shard`` ranks by HSDP (``hsdp_memory_per_rank``: ZeRO-3, 16Ψ_rank/S in
    bf16, whatever the replicas), or whole under DDP."""
    v = virtual_stages
    if data_parallel == "hsdp":
        return hsdp_memory_per_rank(stage_unit_numels(cfg, tp, pp, stage, v),
                                    check_hsdp_shard(dp, dp_shard), zero, precision)
    if data_parallel == "fsdp" and dp > 1:
        return fsdp_memory_per_rank(stage_unit_numels(cfg, tp, pp, stage, v), dp, zero, precision)
    return memory_per_rank(threed_params_per_rank(cfg, tp, pp, stage, v), 1, zero=0,
                           precision=precision, num_tensors=stage_num_tensors(cfg, pp, stage, v))


def check_hsdp_shard(dp: int, dp_shard: int | None) -> int:
    """HSDP's shard group size: ``dp_shard``, which must divide the ``dp`` ranks (R = dp/S
    replicas of S shards each)."""
    if not isinstance(dp_shard, int) or dp_shard < 1:
        raise ValueError(f"HSDP needs dp_shard, an integer >= 1, got {dp_shard!r}")
    check_divisible("dp", dp, "dp_shard", dp_shard,
                    ": HSDP splits dp into replicas of dp_shard ranks each")
    return dp_shard


# -- tensor parallel alone: the whole model, one stage that is first and last ----------------------
def tp_step_bytes(cfg, batch: int, seq: int, tp: int, sequence_parallel: bool = False,
                  dtype_bytes: int = 4) -> float:
    """One training step of the whole model (``cfg``: a ``ModelConfig``) under tensor parallel:
    the blocks, the vocab-parallel embedding and output layer, and the vocab-parallel loss. The
    3D formula's tp part with one stage that is first and last (``threed_step_bytes``)."""
    return threed_step_bytes(cfg, batch, seq, 1, tp, 1, 0, activation_bytes=dtype_bytes,
                             sequence_parallel=sequence_parallel)["tp"]


def tp_run_bytes(cfg, batch: int, seq: int, tp: int, steps: int, sequence_parallel: bool = False,
                 dtype_bytes: int = 4) -> float:
    """Bytes each rank sends over ``steps`` training steps (no start-up messages: every rank builds
    the same model from the same seed and keeps its slices)."""
    return steps * tp_step_bytes(cfg, batch, seq, tp, sequence_parallel, dtype_bytes)
