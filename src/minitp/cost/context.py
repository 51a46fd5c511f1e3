"""Context parallel (ring attention): what a rank of a cp group sends and holds.

Part of ``minitp.cost`` (re-exported there; builds on its strategies, activations and threed); the
notation is the package's, plus c = cp (the ranks the sequence is split over), S the sequence, b the
bytes of an element. A rank holds S/c positions; its keys or its values for one attention call are

    KV = B · Hkv · (S/c) · Dh · b   bytes.

Per attention call each rank sends, on the ring (to rank + 1):

    forward    (c-1) · 2KV           its keys and values travel c-1 hops (the last block stays)
    backward   (c-1) · 2KV + c · 2KV  the blocks go round again; their gradients dK, dV travel
                                      with them and one more hop brings each rank's own home
    in all     (3c-2) · 2KV           what ``minitp.cp.ring_attention`` sends, traced

Then per step one all-reduce of the gradients, 2(c-1)/c · Ψ · 4 (every rank holds the whole model
and saw S/c of the tokens). Memory of parameters, gradients and AdamW state is DDP's: nothing is
sharded but the sequence. Activations are what shrinks: each rank keeps those of S/c positions,
and the ring's online softmax never forms the S × S scores.

The two other ways (``attention="ulysses"`` or ``"allgather"``, as ``minitp.cp.Context`` takes it)
send other bytes per attention call (``ulysses_attention_bytes``, ``allgather_attention_bytes``) and
keep other activations inside attention (``cp_attention_activation_bytes``); the mesh formulas
(``cp3d_step_bytes``, ``cp_mesh_step_bytes``) take the same ``attention`` argument.
"""

from __future__ import annotations

from minitp.cost.activations import (
    activation_bytes_per_rank,
    block_activation_bytes,
    recompute_mode,
)
from minitp.cost.strategies import (
    collective_sent_bytes,
    memory_per_rank,
    pp_peak_microbatches_in_flight,
)
from minitp.cost.threed import rank_num_blocks, threed_step_bytes
from minitp.grid import check_cp_attention, check_ulysses_heads
from minitp.layout import CP_ATTENTIONS, CP_TILE, check_divisible, cp_chunks, stage_num_blocks

__all__ = ["cp_kv_block_bytes", "cp_attention_bytes", "cp_step_bytes", "cp_run_bytes",
           "cp_memory_per_rank", "cp_activation_bytes_per_rank", "cp_attention_flops_per_rank",
           "cp3d_step_bytes", "cp_mesh_step_bytes", "ulysses_attention_bytes",
           "allgather_attention_bytes", "CP_ATTENTIONS", "check_cp_attention",
           "check_ulysses_heads", "cp_kind_attention_bytes", "cp_attention_activation_bytes",
           "cp_attention_activation_bytes_per_rank"]


def cp_kv_block_bytes(batch: int, seq: int, kv_heads: int, head_dim: int, cp: int,
                      dtype_bytes: int = 4) -> float:
    """KV: the bytes of one rank's keys (or values) for one attention call, B·Hkv·(S/c)·Dh·b."""
    return batch * kv_heads * seq / cp * head_dim * dtype_bytes


def cp_attention_bytes(batch: int, seq: int, kv_heads: int, head_dim: int, cp: int,
                       dtype_bytes: int = 4, backward: bool = True) -> float:
    """Bytes one rank sends around the ring for one attention call: (c-1)·2KV forward, and with
    ``backward`` (c-1)·2KV + c·2KV more (the blocks again, and their gradients): (3c-2)·2KV in
    all."""
    if cp == 1:
        return 0.0
    kv2 = 2 * cp_kv_block_bytes(batch, seq, kv_heads, head_dim, cp, dtype_bytes)
    return (cp - 1) * kv2 + (((cp - 1) + cp) * kv2 if backward else 0.0)


def ulysses_attention_bytes(batch: int, seq: int, n_heads: int, kv_heads: int, head_dim: int,
                            cp: int, dtype_bytes: int = 4, backward: bool = True) -> float:
    """Bytes one rank sends for one attention call under Ulysses (``minitp.cp.UlyssesAttend``): four
    all-to-alls forward, q, k, v heads to sequence and the output back, each of a tensor of
    B·(S/c)·Hx·Dh elements (Hx = H for q and the output, Hkv for k and v), of which (c-1)/c leaves
    the rank; backward sends each transposed once more."""
    if cp == 1:
        return 0.0
    elements = batch * (seq / cp) * head_dim * (2 * n_heads + 2 * kv_heads)
    return elements * dtype_bytes * (cp - 1) / cp * (2 if backward else 1)


def allgather_attention_bytes(batch: int, seq: int, kv_heads: int, head_dim: int, cp: int,
                              dtype_bytes: int = 4, backward: bool = True) -> float:
    """Bytes one rank sends for one attention call under all-gather context parallel
    (``minitp.cp.AllGatherAttend``): the all-gathers of keys and values, (c-1)·2KV, and with
    ``backward`` the reduce-scatters of their gradients, (c-1)·2KV more."""
    kv2 = 2 * cp_kv_block_bytes(batch, seq, kv_heads, head_dim, cp, dtype_bytes)
    return (cp - 1) * kv2 * (2 if backward else 1)


def cp_kind_attention_bytes(attention: str, batch: int, seq: int, n_heads: int, kv_heads: int,
                            head_dim: int, cp: int, dtype_bytes: int = 4,
                            backward: bool = True) -> float:
    """Bytes one rank sends for one attention call of the given way (``CP_ATTENTIONS``): the ring's
    (3c-2)·2KV, Ulysses' four all-to-alls and their transposes, or the all-gathers' (c-1)·2KV and
    their reduce-scatters'. ``n_heads``, ``kv_heads``: the heads this rank's attention holds (those
    of its tp rank under tensor parallel)."""
    if check_cp_attention(attention) == "ulysses":
        return ulysses_attention_bytes(batch, seq, n_heads, kv_heads, head_dim, cp, dtype_bytes,
                                       backward)
    if attention == "allgather":
        return allgather_attention_bytes(batch, seq, kv_heads, head_dim, cp, dtype_bytes, backward)
    return cp_attention_bytes(batch, seq, kv_heads, head_dim, cp, dtype_bytes, backward)


def cp_step_bytes(cfg, batch: int, seq: int, cp: int, dtype_bytes: int = 4, grad_bytes: int = 4,
                  attention: str = "ring") -> dict[str, float]:
    """Bytes one rank sends in one training step, by kind: {"ring": the attention of every layer
    (the ring's; with ``attention="ulysses"`` the all-to-alls', with "allgather" the all-gathers'),
    "grads": the all-reduce of every gradient over the cp group}."""
    per_layer = cp_kind_attention_bytes(attention, batch, seq, cfg.n_heads, cfg.kv_heads,
                                        cfg.head_dim, cp, dtype_bytes)
    return {"ring": cfg.n_layers * per_layer,
            "grads": collective_sent_bytes("all_reduce", cfg.num_params() * grad_bytes, cp)}


def cp_run_bytes(cfg, batch: int, seq: int, cp: int, steps: int, dtype_bytes: int = 4,
                 attention: str = "ring") -> float:
    """Bytes one rank sends over ``steps`` training steps of ``minitp run cp`` (no start-up
    broadcast: every rank builds the same model from the same seed)."""
    return steps * sum(cp_step_bytes(cfg, batch, seq, cp, dtype_bytes,
                                     attention=attention).values())


def cp_memory_per_rank(cfg, cp: int, precision: str = "fp32",
                       num_tensors: int = 0) -> dict[str, float]:
    """Parameters, gradients and AdamW state of one rank: the whole model's, whatever cp is."""
    return memory_per_rank(cfg.num_params(), cp, zero=0, precision=precision,
                           num_tensors=num_tensors)


def cp_activation_bytes_per_rank(cfg, batch: int, seq: int, cp: int, tp: int = 1,
                                 dtype_bytes: int = 2, flash_attention: bool = True,
                                 attention: str = "ring") -> float:
    """Activations one rank keeps for backward (Korthikanti's per-block estimate, every block) with
    S/c positions. Without ``flash_attention`` the scores count too: S/c queries against all S keys
    (5·H·(S/c)·S·b/t), which is what plain attention on S/c queries would keep. ``attention``
    "ulysses" or "allgather": plus what that way keeps inside attention
    (``cp_attention_activation_bytes``)."""
    local = seq / cp
    per_block = block_activation_bytes(cfg, batch, local, tp, False, "none", True, dtype_bytes)
    per_block += cp_attention_activation_bytes(cfg, batch, seq, cp, tp, attention, "none",
                                               dtype_bytes)
    if not flash_attention:
        per_block += 5 * cfg.n_heads * local * seq * batch / tp * dtype_bytes / 2
    return per_block * cfg.n_layers


def cp_attention_activation_bytes(cfg, micro_batch: int, seq: int, cp: int, tp: int = 1,
                                  attention: str = "ring", recompute="none",
                                  dtype_bytes: int = 2) -> float:
    """Bytes one block keeps for backward inside attention, on one rank, beyond what a block of S/c
    positions keeps (``llama_block_activation_bytes``' count, its kernel reading the Hkv/t shared
    key/value heads, as a flash kernel at scale does), per way of attending (N = B·S/c tokens):

    * ring: nothing more; the kernel keeps the rank's own q, k, v, output and log-sum-exp, and
      backward passes the keys and values round again;
    * allgather: the keys and values of the whole sequence, gathered, kept for backward (what
      ``minitp.cp.AllGatherAttend`` keeps, there repeated to the H query heads; a kernel keeps the
      Hkv/t shared ones): 2·B·(Hkv/t)·S·Dh·b in place of the rank's own 2·B·(Hkv/t)·(S/c)·Dh·b,
      so 2·B·(Hkv/t)·(S - S/c)·Dh·b more;
    * ulysses: the kernel keeps q, k and v at all S positions of H/(c·t) and Hkv/(c·t) heads, as
      many bytes as the rank's own at S/c positions of H/t and Hkv/t heads, and its output (B,
      H/(c·t), S, Dh), a tensor of its own beside the one the all-to-all brings back to the rank's
      positions for W_O: N·(H/t)·Dh·b more.

    Full recomputation keeps only the block's input, whatever the way (the recomputed block's
    tensors during its own backward are not counted, as for any block)."""
    if recompute_mode(recompute) == "full" or cp == 1 or check_cp_attention(attention) == "ring":
        return 0.0
    if attention == "allgather":
        return 2 * micro_batch * (cfg.kv_heads // tp) * (
            seq - seq / cp) * cfg.head_dim * dtype_bytes
    return micro_batch * seq / cp * (cfg.n_heads // tp) * cfg.head_dim * dtype_bytes


def cp_attention_activation_bytes_per_rank(cfg, micro_batch: int, seq: int, cp: int, tp: int,
                                           pp: int, stage: int, microbatches: int,
                                           attention: str = "ring", dtype_bytes: int = 2,
                                           flash_attention: bool = True, recompute=False,
                                           sequence_parallel: bool = False,
                                           formula: str = "llama") -> float:
    """What a rank of stage ``stage`` keeps beyond ``activation_bytes_per_rank`` at S/c positions
    under 1F1B, for the way its attention crosses the cp group: ``cp_attention_activation_bytes``
    per block, and without ``flash_attention`` (no recomputation) the stored scores of the S/c
    queries against all S keys that all-gather and Ulysses form, c times those of S/c keys the count
    at S/c has (``formula``'s own score term; "moe" counts as "llama"). Times the stage's blocks and
    the micro-batches in flight."""
    if cp == 1 or check_cp_attention(attention) == "ring":
        return 0.0
    per_block = cp_attention_activation_bytes(cfg, micro_batch, seq, cp, tp, attention, recompute,
                                              dtype_bytes)
    in_flight = pp_peak_microbatches_in_flight(pp, microbatches, stage, "1f1b")
    kept = per_block * stage_num_blocks(cfg.n_layers, pp, stage) * in_flight
    if not flash_attention:
        counted = "llama" if formula == "moe" else formula
        args = (cfg, micro_batch, seq // cp, tp, pp, stage, microbatches, dtype_bytes)
        scores = (activation_bytes_per_rank(*args, False, recompute, sequence_parallel, counted)
                  - activation_bytes_per_rank(*args, True, recompute, sequence_parallel, counted))
        kept += (cp - 1) * scores
    return kept


def _diagonal_pairs(size: int, tile: int) -> int:
    """(query, key) pairs computed for a diagonal chunk pair of ``size`` positions, cut in tiles
    as ``minitp.cp`` does: the masked upper-right quarter skipped, the diagonal quarters
    recursing."""
    if size <= tile:
        return size * size
    low, high = size // 2, size - size // 2
    return _diagonal_pairs(low, tile) + high * low + _diagonal_pairs(high, tile)


def cp_attention_flops_per_rank(seq: int, cp: int, rank: int, heads: int, head_dim: int,
                                batch: int = 1, balanced: bool = True, causal: bool = True,
                                tile: int = CP_TILE) -> float:
    """Floating-point operations of one rank's attention forward (4·B·H·Dh per (query, key) pair:
    the two matmuls), counting the pairs ``minitp.cp`` computes: chunk pairs wholly in the past
    in full, diagonal ones in tiles of ``tile`` (about half), future ones not at all: how even the
    load is."""
    mine = cp_chunks(seq, cp, rank, balanced)
    keys = [c for r in range(cp) for c in cp_chunks(seq, cp, r, balanced)]
    pairs = 0
    for qc in mine:
        for kc in keys:
            if not causal or kc.stop <= qc.start:
                pairs += len(qc) * len(kc)
            elif qc == kc:
                pairs += _diagonal_pairs(len(qc), tile)
    return 4.0 * batch * heads * head_dim * pairs


def cp3d_step_bytes(cfg, batch: int, seq: int, dp: int, cp: int, tp: int, mesh_dp_rank: int = 0,
                    steps: int = 1, start_up: bool = False, dtype_bytes: int = 4, pp: int = 1,
                    stage: int = 0, virtual_stages: int = 1, data_parallel: str = "ddp",
                    zero: int = 3, state_dict: bool = False,
                    attention: str = "ring") -> dict[str, float]:
    """Bytes a rank of a dp × cp × pp × tp mesh at ``stage`` sends over ``steps`` steps, per
    dimension.

    A replica's B/dp rows are split over cp along the sequence, so tensor parallel's activations and
    the pipeline's are (B/dp)·(S/cp)·D: their bytes are those of 3D at sequence S/cp, over dp·cp
    replicas of B·cp rows. The ring carries this rank's key/value heads, Hkv/tp of them, for B/dp
    rows in each block of the stage. The dp·cp ranks that hold the same stage and tp slice average
    the gradients (DDP: one all-reduce; ``mesh_dp_rank``, the rank's place among them, for the
    start-up broadcast chain) or shard the state (FSDP, ZeRO ``zero``: ``threed_step_bytes``'s
    gathers and reduce-scatters over dp·cp ranks; ``state_dict``: the final gather). ``attention``:
    "ring", or "ulysses" / "allgather" in its place (``cp_kind_attention_bytes``, on the tp rank's
    H/tp and Hkv/tp heads)."""
    check_divisible("seq_len", seq, "cp", cp)
    check_divisible("batch_size", batch, "dp", dp)
    sent = threed_step_bytes(cfg, batch * cp, seq // cp, dp * cp, tp, pp, stage, mesh_dp_rank,
                             data_parallel, zero, steps=steps, activation_bytes=dtype_bytes,
                             start_up=start_up, state_dict=state_dict,
                             virtual_stages=virtual_stages)
    ring = rank_num_blocks(cfg.n_layers, pp, stage, virtual_stages) * cp_kind_attention_bytes(
        attention, batch // dp, seq, cfg.n_heads // tp, cfg.kv_heads // tp, cfg.head_dim, cp,
        dtype_bytes)
    return {**sent, "cp": steps * ring}


def cp_mesh_step_bytes(cfg, batch: int, seq: int, dp: int, cp: int, tp: int, pp: int, stage: int,
                       data_parallel: str = "ddp", zero: int = 3, activation_bytes: int = 4,
                       param_bytes: int = 4, grad_bytes: int = 4, sequence_parallel: bool = False,
                       recompute=False, virtual_stages: int = 1, attention: str = "ring",
                       dp_shard: int | None = None) -> dict[str, float]:
    """Bytes per training step of a rank at ``stage`` of a dp·cp·pp·tp mesh, per dimension
    {"tp", "pp", "dp", "cp"} (what the planner and the time model count; cp = 1:
    ``threed_step_bytes`` and no ring). A replica's B/dp rows at S/cp positions per rank move the
    activations of threed's B·cp rows over dp·cp replicas of sequences S/cp, and its gradients are
    averaged over those dp·cp ranks; the ring carries the stage's blocks' keys and values, Hkv/tp
    heads of B/dp rows (``attention``: "ulysses" or "allgather", that way's bytes instead,
    ``cp_kind_attention_bytes``). Full recomputation runs each block's forward again before its
    backward, messages included: tensor parallel's forward all-reduces, and the attention's forward
    messages (the ring's keys and values, Ulysses' four all-to-alls, the all-gathers), once more.
    data_parallel "hsdp": ``dp_shard`` of the dp replicas form a shard group with their cp ranks
    (FSDP over dp_shard·cp ranks), and dp/dp_shard such groups all-reduce the gradient shards."""
    check_divisible("seq_len", seq, "cp", cp)
    shard = None if dp_shard is None else dp_shard * cp
    sent = threed_step_bytes(cfg, batch * cp, seq // cp, dp * cp, tp, pp, stage, 0, data_parallel,
                             zero, activation_bytes=activation_bytes, param_bytes=param_bytes,
                             grad_bytes=grad_bytes, sequence_parallel=sequence_parallel,
                             recompute=recompute, virtual_stages=virtual_stages, dp_shard=shard)
    blocks = rank_num_blocks(cfg.n_layers, pp, stage, virtual_stages)
    heads = (cfg.n_heads // tp, cfg.kv_heads // tp, cfg.head_dim, cp, activation_bytes)
    sent["cp"] = blocks * cp_kind_attention_bytes(attention, batch // dp, seq, *heads)
    if recompute_mode(recompute) == "full":  # the recomputed forward's messages
        sent["cp"] += blocks * cp_kind_attention_bytes(attention, batch // dp, seq, *heads,
                                                        backward=False)
    return sent
