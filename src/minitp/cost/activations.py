"""Activation memory: what autograd keeps for backward, per block, per rank.

Part of ``minitp.cost`` (re-exported there); builds on ``minitp.cost.strategies``. Two formulas:

* ``llama_block_activation_bytes``: what a LLaMA block (RMSNorm, RoPE, grouped-query attention,
  SwiGLU) keeps, tensor by tensor, as ``minitp.models`` builds it. With
  ``flash_attention=False`` and fp32 it is exactly what the tiny model saves
  (``tiny_block_activation_bytes``, checked against saved-tensor hooks by
  ``minitp.measure.activations``).

* ``block_activation_bytes``: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", Table 2), in 16-bit, per block and micro-batch of b sequences of s tokens,
  D = hidden size, H = heads, t = tp:

  ==============================  ==============================
  tensor parallel                 s·b·D·(10 + 24/t) + 5·H·s²·b/t
  + sequence parallel             s·b·D·34/t + 5·H·s²·b/t
  selective recomputation         drops 5·H·s²·b/t (the scores, softmax and its dropout mask)
  full recomputation              2·s·b·D (the block's input; /t under sequence parallel)
  ==============================  ==============================

  The 34 counts what a GPT-3 block keeps (LayerNorm, biases, dropout masks, GeLU, a 4D MLP). A LLaMA
  block keeps more: SwiGLU's MLP is 3.5D wide with four saved tensors of it, and minitp's RMSNorm
  keeps its normalised output beside its input, none of it divided by t without sequence parallel
  (about 27 % more for LLaMA-3-70B at t = 8). FlashAttention never stores the scores: it recomputes
  them, so it is itself selective recomputation.
"""

from __future__ import annotations

from minitp.cost.strategies import pp_peak_microbatches_in_flight
from minitp.layout import check_tp_config, stage_num_blocks

__all__ = ["recompute_mode", "block_activation_bytes", "llama_block_activation_bytes",
           "activation_bytes_per_rank", "tiny_block_activation_bytes", "kv_cache_bytes",
           "attention_weight_shapes", "output_activation_bytes", "output_activation_bytes_per_rank"]


def recompute_mode(recompute) -> str:
    """``recompute`` as one of "none", "selective", "full" (False and True read as none and
    full)."""
    mode = {False: "none", True: "full", None: "none"}.get(recompute, recompute)
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    return mode


def block_activation_bytes(cfg, micro_batch: int, seq: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute="none",
                           flash_attention: bool = True, dtype_bytes: int = 2) -> float:
    """Korthikanti's bytes one block keeps for one micro-batch on one rank (table above), scaled by
    ``dtype_bytes``/2. recompute: "none", "selective" or "full" (False / True read as none /
    full)."""
    recompute = recompute_mode(recompute)
    s, b, d = seq, micro_batch, cfg.dim
    if recompute == "full":
        per_block = 2 * s * b * d / (tp if sequence_parallel else 1)
    else:
        per_block = s * b * d * (34 / tp if sequence_parallel else 10 + 24 / tp)
        if recompute == "none" and not flash_attention:
            per_block += 5 * cfg.n_heads * s * s * b / tp
    return per_block * dtype_bytes / 2


def llama_block_activation_bytes(cfg, micro_batch: int, seq: int, tp: int = 1,
                                 sequence_parallel: bool = False, recompute="none",
                                 flash_attention: bool = True, dtype_bytes: int = 2,
                                 repeat_kv: bool = True, regather: bool = False) -> int:
    """The bytes one LLaMA block of ``minitp.models`` keeps for backward on one tensor-parallel
    rank, tensor by tensor (N = b·s tokens, D, F, H heads; p = tp under sequence parallel, else 1):

    * each of the two RMSNorms: its input, its normalised output (before the weight) and 1/rms per
      position, (2·N·D + N)/p; then the full (N, D) input of the column-parallel linears, N·D
      (under sequence parallel the all-gathered one, as minitp keeps it; ``regather``: only its
      N·D/p slice, gathered again in backward, as Megatron-LM does);
    * attention: q and the heads' output, 2·N·D/t; k and v after RoPE, 2·N·D/t when repeated to the
      H query heads (``repeat_kv``, as minitp does), 2·N·H_kv·Dh/t when a kernel reads the shared
      heads; without FlashAttention the softmax b·(H/t)·s² and the causal mask, s² bytes (with it,
      only a log-sum-exp per head and position, N·H/t floats, left out here: under 0.1 %);
    * the MLP: x·W1, SiLU of it, x·W3 and their product, 4·N·F/t.

    recompute: "selective" drops the s² terms (the scores are computed again); "full" keeps only the
    block's input, N·D/p. In ``dtype_bytes`` per element (the mask: 1 byte)."""
    recompute = recompute_mode(recompute)
    n, d, f, p = micro_batch * seq, cfg.dim, cfg.ffn_hidden, tp if sequence_parallel else 1
    if recompute == "full":
        return n * d // p * dtype_bytes
    norms = 2 * ((2 * n * d + n) // p + (n * d // p if regather else n * d))
    kv = 2 * n * d // tp if repeat_kv else 2 * n * cfg.kv_heads * cfg.head_dim // tp
    attention = 2 * n * d // tp + kv
    mlp = 4 * n * f // tp
    kept = (norms + attention + mlp) * dtype_bytes
    if recompute == "none" and not flash_attention:
        kept += micro_batch * (cfg.n_heads // tp) * seq * seq * dtype_bytes + seq * seq
    return kept


# activation_bytes_per_rank's ways of counting a block
FORMULAS = ("llama", "llama-regather", "gpt3")


def activation_bytes_per_rank(cfg, micro_batch: int, seq: int, tp: int, pp: int, stage: int,
                              microbatches: int, dtype_bytes: int = 2, flash_attention: bool = True,
                              recompute=False, sequence_parallel: bool = False,
                              formula: str = "gpt3") -> float:
    """The activations a rank keeps for backward under 1F1B: one block's (``formula``: "gpt3",
    Korthikanti et al.'s ``block_activation_bytes``; "llama", ``llama_block_activation_bytes``, its
    attention reading the shared key/value heads (no repeated copies, as kernels at scale do);
    "llama-regather", the same with the column-parallel inputs gathered again in backward) times the
    stage's blocks, times the micro-batches in flight (min(pp - stage, m)). recompute: False /
    "none", "selective" or True / "full"."""
    if formula not in FORMULAS:
        raise ValueError(
            f"formula must be one of {', '.join(map(repr, FORMULAS))}, got {formula!r}")
    args = (cfg, micro_batch, seq, tp, sequence_parallel, recompute, flash_attention, dtype_bytes)
    if formula == "gpt3":
        per_block = block_activation_bytes(*args)
    else:
        per_block = llama_block_activation_bytes(*args, repeat_kv=False,
                                                 regather=formula == "llama-regather")
    # min(pp - stage, m)
    in_flight = pp_peak_microbatches_in_flight(pp, microbatches, stage, "1f1b")
    return per_block * stage_num_blocks(cfg.n_layers, pp, stage) * in_flight


def output_activation_bytes(cfg, micro_batch: int, seq: int, tp: int = 1,
                            sequence_parallel: bool = False, dtype_bytes: int = 2,
                            regather: bool = False) -> int:
    """The bytes the last stage keeps for backward after its blocks, for one micro-batch on one
    tensor-parallel rank, as ``minitp.models`` computes them (N = b·s tokens, V the vocabulary,
    p = tp under sequence parallel, else 1):

    * the final RMSNorm, as a block's: its input, its normalised output and 1/rms, (2·N·D + N)/p;
      then the output layer's (N, D) input (all-gathered under sequence parallel; ``regather``:
      only its N·D/p slice), in ``dtype_bytes``;
    * the loss: one fp32 copy of the logits, 4·N·V/t bytes whatever the precision. ``loss_fn``
      upcasts the logits to fp32 and ``F.cross_entropy`` keeps its log-softmax's fp32 output
      (nll_loss reads the same tensor), plus the int64 targets and a 4-byte total weight; tensor
      parallel's vocabulary-parallel loss (the output layer is column-parallel: each rank's logits
      are (N, V/t)) keeps its shifted fp32 logits (N, V/t) and, per position, the log-sum-exp
      (fp32), the local target (int64) and whether this rank holds it (bool).

    Only what is held from the loss's forward to its backward is counted, as for every block. The
    model's bf16 logits and their fp32 upcast live beside the kept copy only while the loss's
    forward runs (2 + 4 + 4 bytes per logit at that moment: 9.8 GiB per sequence of 8192 tokens of
    LLaMA-3's 128,256 at t = 1, against the 3.9 GiB kept), and backward makes the gradient's
    copies beside it; transients are not counted anywhere in this model. A fused cross-entropy
    (computing the gradient chunk by chunk in forward, as Liger's or Apple's cut cross-entropy do)
    keeps no (N, V) tensor at all: for one, this count is an upper bound."""
    n, d, p = micro_batch * seq, cfg.dim, tp if sequence_parallel else 1
    norm = (2 * n * d + n) // p + (n * d // p if regather else n * d)
    logits = 4 * n * cfg.vocab_size // tp
    per_position = 8 * n + 4 if tp == 1 else (4 + 8 + 1) * n
    return norm * dtype_bytes + logits + per_position


def output_activation_bytes_per_rank(cfg, micro_batch: int, seq: int, tp: int, pp: int,
                                     stage: int, dtype_bytes: int = 2,
                                     sequence_parallel: bool = False,
                                     formula: str = "llama") -> int:
    """``output_activation_bytes`` on the last stage (its input gathered again in backward under
    ``formula`` "llama-regather"), 0 on the others. Under 1F1B the last stage runs each
    micro-batch's backward right after its forward: it holds one micro-batch's, whatever m is. No
    recomputation mode touches it: the output layer and the loss are outside the blocks."""
    if stage != pp - 1:
        return 0
    return output_activation_bytes(cfg, micro_batch, seq, tp, sequence_parallel, dtype_bytes,
                                   regather=formula == "llama-regather")


def tiny_block_activation_bytes(cfg, batch: int, seq: int, tp: int = 1,
                                sequence_parallel: bool = False, recompute: bool = False,
                                dtype_bytes: int = 4) -> int:
    """Exactly the bytes one block of ``minitp.models`` saves for backward on one tensor-parallel
    rank as it runs here, in fp32: ``llama_block_activation_bytes`` without FlashAttention (plain
    attention, K and V repeated to H heads); with ``cfg.fused_attention``, with it (the kernel reads
    the shared K and V heads) and its log-sum-exp, one fp32 per query head and position; with
    ``recompute`` only the block's input."""
    fused = getattr(cfg, "fused_attention", False)
    kept = llama_block_activation_bytes(cfg, batch, seq, tp, sequence_parallel, "full" if recompute
                                        else "none", flash_attention=fused,
                                        dtype_bytes=dtype_bytes, repeat_kv=not fused)
    return kept + (batch * seq * cfg.n_heads // tp * 4 if fused and not recompute else 0)


def attention_weight_shapes(cfg, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(in, out) of W_Q, W_K, W_V, W_O on one tensor-parallel rank. Grouped-query attention: K and V
    have n_kv_heads heads, each read by n_heads/n_kv_heads query heads, so W_K and W_V are D ×
    (H_kv·Dh); tp splits the heads (query and key/value alike), hence tp must divide n_kv_heads."""
    check_tp_config(cfg, tp)
    q, kv = cfg.n_heads * cfg.head_dim // tp, cfg.kv_heads * cfg.head_dim // tp
    return {"wq": (cfg.dim, q), "wk": (cfg.dim, kv), "wv": (cfg.dim, kv), "wo": (q, cfg.dim)}


def kv_cache_bytes(cfg, tokens: int, batch: int = 1, tp: int = 1, dtype_bytes: int = 2) -> float:
    """Bytes of the KV cache one rank holds for ``batch`` sequences of ``tokens`` positions: keys
    and values, every layer, its n_kv_heads/tp heads of head_dim each: 2·L·(H_kv/tp)·Dh·b per
    token."""
    return 2 * cfg.n_layers * cfg.kv_heads // tp * cfg.head_dim * dtype_bytes * tokens * batch
