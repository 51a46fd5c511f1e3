"""Activation offload and op-level selective checkpointing, counted: what a block keeps on the
device, what crosses the host link and when it hides, and what backward computes again.

Part of ``minitp.cost`` (re-exported there); builds on ``activations``, ``devices`` and ``time``.
The mechanisms are ``minitp.offload``'s; ``tests/test_offload.py`` measures them against these.

Notation as in ``activations``: N = b·s tokens of a micro-batch, D, F, H heads, H_kv·Dh the key and
value width, t = tp, p = t under sequence parallel (else 1), in ``dtype_bytes`` per element.

* ``block_saved_tensors``: what a block saves for backward, tensor by tensor; its sum is
  ``llama_block_activation_bytes``. **Offload** moves every one of them at least ``min_bytes`` long
  (``offloaded_block_bytes``): out once in forward, in once in backward, so per step and rank the
  link carries, each way, the stage's blocks' sum for each of its micro-batches
  (``host_link_bytes_per_step``). What stays is what is under the threshold (in the tiny model the
  two 1/rms vectors and the causal mask) and, at a time, the blocks in transit.
* ``selective_block_tensors``: what op-level selective checkpointing keeps (PyTorch's
  ``create_selective_checkpoint_contexts`` with ``minitp.offload.keep_matmuls``, torchtitan's
  "selective, op" mode): the block's input, held to run it again, and the outputs of its matmuls,
  x·W_Q (N·D/t), x·W_K and x·W_V (N·H_kv·Dh/t each), x·W1 and x·W3 (N·F/t each), W_O's and W2's
  outputs (N·D/p each: under tensor parallel the collective's output is what is kept, the reduced
  sum or its reduce-scattered slice, as torchtitan keeps its reduce-scatters', not the partial sums
  before it), and attention's: written out, the scores q·k^T (b·(H/t)·s²) and the weighted sum
  (N·D/t); a fused kernel, its output (N·D/t) and log-sum-exp (b·(H/t)·s fp32). Under sequence
  parallel the column-parallel linears' all-gathered inputs are kept too, (N, D) each, so that
  recomputation sends nothing again.
* Recomputation's FLOPs (``recompute_matmul_flops_per_token``): full recomputation runs every
  matmul of the blocks' forward again (2·Ψ_linears + 4·L·D·S per token: about a third of a
  training step's 6Ψ); selective none (taken from the cache), only the cheap operations
  (``cheap_recompute_flops_per_token``, an estimate: a few FLOPs per element of the norms, RoPE,
  SwiGLU's gate and written-out softmax).
"""

from __future__ import annotations

from minitp.cost.activations import activation_bytes_per_rank, recompute_mode
from minitp.cost.devices import Device
from minitp.cost.strategies import pp_peak_microbatches_in_flight
from minitp.cost.time import training_flops_per_token
from minitp.layout import stage_num_blocks

__all__ = ["ACTIVATION_MODES", "activation_mode", "block_saved_tensors",
           "tiny_block_saved_tensors", "offloaded_block_bytes", "selective_block_tensors",
           "tiny_selective_block_bytes", "recompute_matmul_flops_per_token",
           "cheap_recompute_flops_per_token", "recompute_share", "OFFLOAD_BLOCKS_ON_DEVICE",
           "device_activation_bytes_per_rank", "host_link_bytes_per_step", "host_link_time"]

# how a block's activations are held: recompute_mode's three (Korthikanti's "selective" recomputes
# attention's scores), op-level selective checkpointing, and offload to the host
ACTIVATION_MODES = ("none", "selective", "full", "selective-op", "offload")


def activation_mode(mode) -> str:
    """``mode`` as one of ``ACTIVATION_MODES`` (False / True / None read as none / full / none)."""
    if mode in ("selective-op", "offload"):
        return mode
    try:
        return recompute_mode(mode)
    except ValueError:
        raise ValueError(f"activation mode must be one of {', '.join(map(repr, ACTIVATION_MODES))},"
                         f" got {mode!r}") from None


def block_saved_tensors(cfg, micro_batch: int, seq: int, tp: int = 1,
                        sequence_parallel: bool = False, flash_attention: bool = True,
                        dtype_bytes: int = 2, repeat_kv: bool = True,
                        log_sum_exp: bool = False) -> dict[str, int]:
    """The bytes of each tensor a block of ``minitp.models`` saves for backward on one rank, by
    name: ``llama_block_activation_bytes`` (recompute "none") tensor by tensor, its sum (the
    log-sum-exp of a fused kernel, b·(H/t)·s fp32, only with ``log_sum_exp``)."""
    n, d, f, p = micro_batch * seq, cfg.dim, cfg.ffn_hidden, tp if sequence_parallel else 1
    b = dtype_bytes
    kv = n * d // tp if repeat_kv else n * cfg.kv_heads * cfg.head_dim // tp
    out = {}
    for norm in ("attention_norm", "ffn_norm"):
        out[f"{norm}.input"] = n * d // p * b
        out[f"{norm}.normalised"] = n * d // p * b
        out[f"{norm}.inverse_rms"] = n // p * b
        out[f"{norm}.output"] = n * d * b  # the column-parallel linears' whole input
    out["attention.q"] = n * d // tp * b
    out["attention.k"] = kv * b
    out["attention.v"] = kv * b
    out["attention.heads_output"] = n * d // tp * b
    if not flash_attention:
        out["attention.softmax"] = micro_batch * (cfg.n_heads // tp) * seq * seq * b
        out["attention.causal_mask"] = seq * seq  # bool
    elif log_sum_exp:
        out["attention.log_sum_exp"] = n * cfg.n_heads // tp * 4
    for name in ("x_w1", "silu", "x_w3", "product"):
        out[f"feed_forward.{name}"] = n * f // tp * b
    return out


def tiny_block_saved_tensors(cfg, batch: int, seq: int, dtype_bytes: int = 4) -> dict[str, int]:
    """``block_saved_tensors`` of the tiny model as it runs here, on one rank in fp32
    (``tiny_block_activation_bytes``' sum): written-out attention with K and V repeated to every
    query head, or, with ``cfg.fused_attention``, the kernel and its log-sum-exp."""
    fused = getattr(cfg, "fused_attention", False)
    return block_saved_tensors(cfg, batch, seq, flash_attention=fused, dtype_bytes=dtype_bytes,
                               repeat_kv=not fused, log_sum_exp=fused)


def offloaded_block_bytes(tensors: dict[str, int], min_bytes: int = 0) -> dict[str, int]:
    """{"moved", "kept"}: of a block's saved tensors (``block_saved_tensors``), the bytes offload
    sends to the host (each of at least ``min_bytes``) and the bytes that stay on the device."""
    moved = sum(nbytes for nbytes in tensors.values() if nbytes >= min_bytes)
    return {"moved": moved, "kept": sum(tensors.values()) - moved}


def selective_block_tensors(cfg, micro_batch: int, seq: int, tp: int = 1,
                            sequence_parallel: bool = False, flash_attention: bool = True,
                            dtype_bytes: int = 2, log_sum_exp: bool = False) -> dict[str, int]:
    """The bytes of each tensor op-level selective checkpointing keeps for a block on one rank, by
    name (the module's docstring lists them; the log-sum-exp only with ``log_sum_exp``)."""
    n, d, f, p = micro_batch * seq, cfg.dim, cfg.ffn_hidden, tp if sequence_parallel else 1
    b, kvd = dtype_bytes, cfg.kv_heads * cfg.head_dim
    out = {"input": n * d // p * b, "x_wq": n * d // tp * b, "x_wk": n * kvd // tp * b,
           "x_wv": n * kvd // tp * b}
    if flash_attention:
        out["attention.output"] = n * d // tp * b
        if log_sum_exp:
            out["attention.log_sum_exp"] = n * cfg.n_heads // tp * 4
    else:
        out["attention.scores"] = micro_batch * (cfg.n_heads // tp) * seq * seq * b
        out["attention.weighted_sum"] = n * d // tp * b
    # W_O's and W2's as tensor parallel leaves them: the reduced sum (N·D), or under sequence
    # parallel its reduce-scattered slice (N·D/t); the partial sums before the collective are not
    # kept
    out["x_wo"] = n * d // p * b
    out["x_w1"] = n * f // tp * b
    out["x_w3"] = n * f // tp * b
    out["x_w2"] = n * d // p * b
    if tp > 1 and sequence_parallel:  # the column-parallel linears' gathered inputs, (N, D) each
        out["gathered_inputs"] = 2 * n * d * b
    return out


def tiny_selective_block_bytes(cfg, batch: int, seq: int, dtype_bytes: int = 4) -> int:
    """What ``minitp.offload.SelectiveCheckpoint`` keeps for one block of the tiny model on one
    rank, in fp32: ``selective_block_tensors``' sum, with the fused kernel's log-sum-exp."""
    fused = getattr(cfg, "fused_attention", False)
    return sum(selective_block_tensors(cfg, batch, seq, flash_attention=fused,
                                       dtype_bytes=dtype_bytes, log_sum_exp=fused).values())


def _linear_params_per_block(cfg) -> int:
    kvd = cfg.kv_heads * cfg.head_dim
    return 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kvd + 3 * cfg.dim * cfg.ffn_hidden


def recompute_matmul_flops_per_token(cfg, seq: int, mode="none") -> float:
    """The matmul FLOPs backward runs again per token: a full recomputation's, every block's
    forward, 2·Ψ_linears + 4·L·D·S (the linears, then q·k^T and the weighted sum, as written out);
    none for "none", "offload", and both kinds of selective recomputation but attention's scores
    under Korthikanti's "selective" (4·L·D·S)."""
    mode = activation_mode(mode)
    attention = 4 * cfg.n_layers * cfg.dim * seq
    if mode == "full":
        return float(2 * cfg.n_layers * _linear_params_per_block(cfg) + attention)
    return float(attention) if mode == "selective" else 0.0


def cheap_recompute_flops_per_token(cfg, seq: int, tp: int = 1,
                                    flash_attention: bool = True) -> float:
    """An estimate of what op-level selective checkpointing recomputes per token, on one rank: per
    block each RMSNorm's ~4 FLOPs per element (square, mean, scale, weight) of D, RoPE's 3 per
    element of q and k, SwiGLU's gate ~5 per element of F/t (SiLU's exp, add, divide, multiply and
    the product), the residual sum's D, and written-out attention's softmax ~5 per score (scale,
    mask, max, exp, divide) of S·H/t. Counts of this kind, not measured."""
    kvd = cfg.kv_heads * cfg.head_dim
    per_block = (2 * 4 * cfg.dim + 3 * (cfg.dim + kvd) / tp + 5 * cfg.ffn_hidden / tp + cfg.dim
                 + (0 if flash_attention else 5 * seq * cfg.n_heads / tp))
    return cfg.n_layers * per_block


def recompute_share(cfg, seq: int, mode="none", flash_attention: bool = True) -> float:
    """Recomputed FLOPs as a share of one token's training FLOPs (``training_flops_per_token``):
    full ≈ 1/3 (a forward again); op-level selective a few hundredths of a percent at LLaMA's
    shapes (``cheap_recompute_flops_per_token``, the whole token's)."""
    mode = activation_mode(mode)
    if mode == "selective-op":
        recomputed = cheap_recompute_flops_per_token(cfg, seq, 1, flash_attention)
    else:
        recomputed = recompute_matmul_flops_per_token(cfg, seq, mode)
    return recomputed / training_flops_per_token(cfg, seq)


# offload keeps on the device, at a time, the saved tensors of two blocks of one micro-batch: the
# one being computed (forward) or differentiated (backward), and the one on the link (copied out
# behind it in forward, fetched ahead of it in backward), as a double-buffered offload does
OFFLOAD_BLOCKS_ON_DEVICE = 2


def _llama_block_bytes(cfg, micro_batch, seq, tp, dtype_bytes, flash_attention,
                       sequence_parallel, formula) -> float:
    """One block's saved bytes as the planner counts them (``activation_bytes_per_rank``)."""
    every = activation_bytes_per_rank(cfg, micro_batch, seq, tp, 1, 0, 1, dtype_bytes,
                                      flash_attention, "none", sequence_parallel, formula)
    return every / cfg.n_layers


def device_activation_bytes_per_rank(cfg, micro_batch: int, seq: int, tp: int, pp: int,
                                     stage: int, microbatches: int, dtype_bytes: int = 2,
                                     flash_attention: bool = True, mode="offload",
                                     sequence_parallel: bool = False,
                                     formula: str = "llama") -> float:
    """The activations a rank of a 1F1B pipeline holds on the device under ``mode`` "offload"
    (``OFFLOAD_BLOCKS_ON_DEVICE`` blocks of one micro-batch, ``formula``'s count of a block) or
    "selective-op" (``selective_block_tensors`` per block, times the stage's blocks and the
    micro-batches in flight, min(pp - stage, m))."""
    mode = activation_mode(mode)
    if mode == "offload":
        return OFFLOAD_BLOCKS_ON_DEVICE * _llama_block_bytes(
            cfg, micro_batch, seq, tp, dtype_bytes, flash_attention, sequence_parallel, formula)
    if mode != "selective-op":
        raise ValueError(f"mode must be 'offload' or 'selective-op' here, got {mode!r}")
    per_block = sum(selective_block_tensors(cfg, micro_batch, seq, tp, sequence_parallel,
                                            flash_attention, dtype_bytes).values())
    in_flight = pp_peak_microbatches_in_flight(pp, microbatches, stage, "1f1b")
    return per_block * stage_num_blocks(cfg.n_layers, pp, stage) * in_flight


def host_link_bytes_per_step(cfg, micro_batch: int, seq: int, tp: int, pp: int, stage: int,
                             microbatches: int, dtype_bytes: int = 2, flash_attention: bool = True,
                             sequence_parallel: bool = False, formula: str = "llama") -> dict:
    """{"out", "in", "host"}: the bytes one rank sends to the host in a step (every block of its
    stage, every micro-batch), the same bytes back, and what the host holds at most for it (the
    micro-batches in flight of 1F1B)."""
    per_block = _llama_block_bytes(cfg, micro_batch, seq, tp, dtype_bytes, flash_attention,
                                   sequence_parallel, formula)
    blocks = stage_num_blocks(cfg.n_layers, pp, stage)
    in_flight = pp_peak_microbatches_in_flight(pp, microbatches, stage, "1f1b")
    moved = per_block * blocks * microbatches
    return {"out": moved, "in": moved, "host": per_block * blocks * in_flight}


def host_link_time(bytes_per_direction: float, device: Device, compute_s: float) -> dict:
    """How the host link's traffic of a step sits against compute: out during forward (a third of
    the compute: 2 of a token's 6 FLOPs per parameter), in during backward (two thirds), each way
    at the link's rate (PCIe is full duplex). {"out_s", "in_s", "forward_s", "backward_s",
    "exposed_s", "hidden"}: exposed is what exceeds its phase, added to the step."""
    if device.host_link is None:
        raise ValueError(f"{device.name} has no host link figure (Device.host_link): offload "
                         "cannot be timed on it")
    seconds = bytes_per_direction / device.host_link.bytes_per_s
    forward_s, backward_s = compute_s / 3, compute_s * 2 / 3
    exposed = max(0.0, seconds - forward_s) + max(0.0, seconds - backward_s)
    return {"out_s": seconds, "in_s": seconds, "forward_s": forward_s, "backward_s": backward_s,
            "exposed_s": exposed, "hidden": exposed == 0.0, "link": device.host_link.name}
