"""One strategy at a time: the bytes and memory of data parallel (DDP), fully sharded data parallel
(ZeRO / FSDP) and its hybrid (HSDP), tensor parallel and pipeline parallel.

The first of ``minitp.cost``'s modules: it imports none of the others (the notation, and the table
of what each collective sends, are in the package's docstring). Each call of a collective is counted
with the payload model the trace records on every message, ``minitp.trace.collective_sent_bytes``.
The modules after this one compose these formulas: the 3D mesh, context and expert parallel, time.
"""

from __future__ import annotations

from minitp.layout import check_divisible, check_tp_config, padded_numel
from minitp.pp_schedules import schedule_entry
from minitp.trace import collective_sent_bytes  # the payload model: what one call puts on the wire

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


# -- data parallel ---------------------------------------------------------------------------------
def ddp_step_bytes(num_params: int, world_size: int, grad_bytes: int = 4) -> float:
    """Bytes each rank sends in one DDP step: one all-reduce of every gradient, 2(n-1)/n · Ψ·b."""
    return collective_sent_bytes("all_reduce", num_params * grad_bytes, world_size)


def ddp_run_bytes(num_params: int, world_size: int, steps: int, rank: int,
                  param_bytes: int = 4, grad_bytes: int = 4,
                  broadcast_at_init: bool = True) -> float:
    """Bytes ``rank`` sends over a DDP run: the start-up broadcast of the parameters from rank 0
    (a chain: every rank but the last forwards Ψ·b), then ``steps`` gradient all-reduces.

    Steps inside ``no_sync`` send nothing; count only the steps that synchronise.
    """
    total = steps * ddp_step_bytes(num_params, world_size, grad_bytes)
    if broadcast_at_init:
        total += collective_sent_bytes("broadcast", num_params * param_bytes, world_size,
                                       position=rank)
    return total


# -- memory ----------------------------------------------------------------------------------------
def memory_per_rank(num_params: int, world_size: int = 1, zero: int = 0, precision: str = "fp32",
                    num_tensors: int = 0) -> dict[str, float]:
    """Bytes one rank holds in parameters, gradients and AdamW state, per ZeRO stage.

    ``zero=0`` is plain data parallel (every rank holds everything); 1 shards the optimizer state,
    2 the gradients too, 3 the parameters too. ``precision="fp32"``: 4-byte parameters and
    gradients, 8 bytes of moments. ``"bf16"`` (mixed precision): 2-byte parameters and gradients,
    and an fp32 master copy next to the moments, 12 bytes of optimizer state: 16Ψ in all, the
    ZeRO paper's 2Ψ + 2Ψ + 12Ψ. ``num_tensors`` adds AdamW's 4-byte step counter per optimizer
    tensor (pass how many tensors the optimizer holds on this rank; 0 to leave them out).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if precision == "fp32":
        p, g, o = 4, 4, 8
    elif precision in ("bf16", "fp16"):
        p, g, o = 2, 2, 12
    else:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    n = world_size
    params = num_params * p / (n if zero >= 3 else 1)
    grads = num_params * g / (n if zero >= 2 else 1)
    optimizer = num_params * o / (n if zero >= 1 else 1) + 4 * num_tensors
    return {"params": params, "grads": grads, "optimizer": optimizer}


def total_memory(memory: dict[str, float]) -> float:
    return memory["params"] + memory["grads"] + memory["optimizer"]


# -- fully sharded data parallel (ZeRO) ------------------------------------------------------------
# A model is cut into units (minitp.fsdp); unit u has p_u parameters, laid out flat and padded with
# zeros to P_u = ceil(p_u / n) * n, so that each of the n ranks holds an equal shard of P_u / n.
# Every formula below counts the padded sizes: Ψ_pad = Σ_u P_u (equal to Ψ when n divides every
# p_u). Per step, with b_p the bytes of a gathered parameter (4 fp32, 2 bf16) and b_r of a reduced
# gradient (4: minitp always sums gradients over ranks in fp32), each rank sends:
#
#   ZeRO-1  reduce-scatter of each unit's gradient after backward, optimizer step on the shard,
# all-gather
#           of the updated shard:   Σ_u (n-1)/n · P_u · (b_r + b_p)    (= DDP's all-reduce when b_r
# = b_p)
#   ZeRO-2  the same messages; the reduce-scatters go out during backward and free the full gradient
#   ZeRO-3  all-gather in forward, again in backward if the unit was resharded after forward (never
# the
#           root, with which backward starts), reduce-scatter in backward:
#           Σ_u (n-1)/n · P_u · (g_u · b_p + b_r),  g_u = 2 for a resharded unit, else 1  (1.5x DDP)


def fsdp_step_bytes(unit_numels: list[int], world_size: int, zero: int = 3,
                    reshard_after_forward: bool = True, param_bytes: int = 4, reduce_bytes: int = 4,
                    root: bool = True) -> float:
    """Bytes each rank sends in one training step of ZeRO stage ``zero`` (see the table above).

    unit_numels: parameters of each unit, unpadded (``minitp.fsdp.unit_numels``); with ``root``
    the first is the root unit, which ZeRO-3 gathers once per step, never resharded after forward.
    """
    if zero not in (1, 2, 3):
        raise ValueError(f"zero must be 1, 2 or 3, got {zero}")
    n, total = world_size, 0.0
    for i, numel in enumerate(unit_numels):
        nbytes = padded_numel(numel, n)
        if zero < 3:
            gathers = 1  # after the optimizer step
        else:
            gathers = 2 if reshard_after_forward and not (root and i == 0) else 1
        total += gathers * collective_sent_bytes("all_gather", nbytes * param_bytes, n)
        total += collective_sent_bytes("reduce_scatter", nbytes * reduce_bytes, n)
    return total


def fsdp_run_bytes(unit_numels: list[int], world_size: int, steps: int, zero: int = 3,
                   reshard_after_forward: bool = True, param_bytes: int = 4, reduce_bytes: int = 4,
                   root: bool = True, state_dict: bool = True) -> float:
    """Bytes each rank sends over a run: ``steps`` steps, then (``state_dict``) one all-gather of
    every fp32 master shard to assemble the full state dict. Nothing is sent at start-up: every
    rank builds the same model and keeps its slices."""
    total = steps * fsdp_step_bytes(unit_numels, world_size, zero, reshard_after_forward,
                                    param_bytes, reduce_bytes, root)
    if state_dict:
        total += sum(collective_sent_bytes("all_gather", padded_numel(p, world_size) * 4,
                                           world_size)
                     for p in unit_numels)
    return total


def fsdp_memory_per_rank(unit_numels: list[int], world_size: int, zero: int = 3,
                         precision: str = "fp32") -> dict[str, float]:
    """``memory_per_rank`` for minitp.fsdp: Ψ is the padded Ψ_pad (full buffers are padded too),
    and the optimizer holds one flat shard per unit, so one AdamW step counter per unit.
    With Adam, per rank: fp32  ZeRO-1 8Ψ + 8Ψ/n,  ZeRO-2 4Ψ + 12Ψ/n,  ZeRO-3 16Ψ/n;
    bf16 mixed precision  ZeRO-1 4Ψ + 12Ψ/n,  ZeRO-2 2Ψ + 14Ψ/n,  ZeRO-3 16Ψ/n."""
    psi = sum(padded_numel(p, world_size) for p in unit_numels)
    return memory_per_rank(psi, world_size, zero=zero, precision=precision,
                           num_tensors=len(unit_numels))


def fsdp_gathered_peak_bytes(unit_numels: list[int], world_size: int, zero: int = 3,
                             reshard_after_forward: bool = True, prefetch: bool = True,
                             param_bytes: int = 4, root: bool = True) -> int:
    """The most bytes of full (unsharded) parameters a rank holds at once during a step.

    ZeRO-1/2 hold every unit whole all the time. ZeRO-3 without resharding ends forward with every
    unit gathered. With resharding: the root (gathered through forward and backward) plus one unit
    being computed, plus, with prefetch, the next one being gathered.
    """
    full = [padded_numel(p, world_size) * param_bytes for p in unit_numels]
    if zero < 3 or not reshard_after_forward:
        return sum(full)
    base, blocks = (full[0], full[1:]) if root else (0, full)
    if not blocks:
        return base
    if prefetch and len(blocks) > 1:
        return base + max(a + b for a, b in zip(blocks, blocks[1:]))
    return base + max(blocks)


# -- hybrid sharded data parallel (HSDP) -----------------------------------------------------------
# R replicas × S ranks (minitp.hsdp): FSDP inside each shard group of S ranks, so every unit is
# padded to a multiple of S, not of R·S; then each rank all-reduces its gradient shard, P_u/S, over
# the R ranks that hold the same shard in the other replicas. Per step each rank sends
#
#   shard group      fsdp_step_bytes with n = S
#   replicate group  Σ_u 2(R-1)/R · P_u/S · b_r
#
# and holds what FSDP on S ranks holds: R does not appear in the memory.

def hsdp_step_bytes(unit_numels: list[int], replicate: int, shard: int, zero: int = 3,
                    reshard_after_forward: bool = True, param_bytes: int = 4,
                    reduce_bytes: int = 4, root: bool = True) -> dict[str, float]:
    """Bytes each rank sends in one HSDP step, per group: {"dp_shard", "dp_replicate"} (the names
    of ``minitp.hsdp``'s groups in a trace). Arguments as ``fsdp_step_bytes``."""
    if replicate < 1 or shard < 1:
        raise ValueError(f"replicate and shard must be >= 1, got replicate={replicate}, "
                         f"shard={shard}")
    in_shard = fsdp_step_bytes(unit_numels, shard, zero, reshard_after_forward, param_bytes,
                               reduce_bytes, root)
    shards = [padded_numel(numel, shard) // shard for numel in unit_numels]  # P_u / S
    across = sum(collective_sent_bytes("all_reduce", p * reduce_bytes, replicate) for p in shards)
    return {"dp_shard": in_shard, "dp_replicate": across}


def hsdp_memory_per_rank(unit_numels: list[int], shard: int, zero: int = 3,
                         precision: str = "fp32") -> dict[str, float]:
    """Bytes one rank holds under HSDP: ``fsdp_memory_per_rank`` over its shard group of ``shard``
    ranks, whatever the number of replicas (with Adam, ZeRO-3: 16Ψ/S, not 16Ψ/(R·S))."""
    return fsdp_memory_per_rank(unit_numels, shard, zero, precision)


# -- FSDP's all-gather in FP8 (``minitp.fp8``) -----------------------------------------------------
def float8_all_gather_bytes(numel: int, world_size: int, current_scaling: bool = True) -> float:
    """Bytes each rank sends to all-gather one weight of ``numel`` elements as e4m3 bytes (1 each,
    against bf16's 2 and fp32's 4): (n-1)/n · numel, plus, under current scaling, the all-reduce of
    its amax (one fp32 number, so that every rank casts with the same scale): 2(n-1)/n · 4.
    Delayed scaling knows the scale from its history and sends no amax."""
    gathered = collective_sent_bytes("all_gather", numel * 1, world_size)
    amax = collective_sent_bytes("all_reduce", 4, world_size) if current_scaling else 0.0
    return gathered + amax


# -- tensor parallel -------------------------------------------------------------------------------
# A = B·S·D·b: the bytes of one activation of the residual stream (batch B, sequence S, model dim D,
# b bytes per element). Each rank sends, per training step (forward and backward):
#
#   piece        plain tensor parallel                  sequence parallel
#   MLP          2 all-reduces of A: g after w2 (fwd),  2 reduce-scatters + 2 all-gathers of A
#                f at the input (bwd)
#   attention    the same as the MLP                    the same as the MLP
#   block        4 all-reduces of A                     4 RS + 4 AG of A, + 2 all-reduces of D·b
#                                                       (the norm weights' partial gradients)
#   full recompute  + 2 all-reduces of A (forward again)  + 2 AG + 2 RS of A
#   embedding    1 all-reduce of A (fwd)                1 RS (fwd) + 1 AG (bwd)
#   output       1 all-reduce of A (f, bwd)             1 AG (fwd) + 1 RS (bwd), + D·b for the final
# norm
#   loss         all-reduces of B·S·4 (max) and 2·B·S·4 (sum of exps, target logit), fp32 either way
#
# (the whole model's, embedding, output and loss included: ``tp_step_bytes`` in
# ``minitp.cost.threed``, 3D's tp part with one stage.)
# A reduce-scatter plus an all-gather sends what an all-reduce sends: sequence parallel costs the
# same bytes (plus the tiny norm gradients) and holds 1/tp of the activations between regions.
# Parameters: every matrix is split over the ranks; the RMSNorm weights are replicated.

def tp_region_bytes(batch: int, seq: int, dim: int, tp: int, sequence_parallel: bool = False,
                    dtype_bytes: int = 4) -> float:
    """Bytes each rank sends for one forward and backward of one tensor-parallel MLP or attention:
    2 all-reduces of the (B, S, D) activation (or a reduce-scatter and an all-gather in each
    direction under sequence parallel, the same bytes)."""
    a = batch * seq * dim * dtype_bytes
    if sequence_parallel:
        return 2 * (collective_sent_bytes("all_gather", a,
                                          tp) + collective_sent_bytes("reduce_scatter", a, tp))
    return 2 * collective_sent_bytes("all_reduce", a, tp)


def tp_mlp_bytes(batch: int, seq: int, dim: int, tp: int, dtype_bytes: int = 4) -> float:
    """One step of the tensor-parallel SwiGLU MLP alone: g's all-reduce forward, f's backward."""
    return tp_region_bytes(batch, seq, dim, tp, False, dtype_bytes)


def tp_block_bytes(batch: int, seq: int, dim: int, tp: int, sequence_parallel: bool = False,
                   dtype_bytes: int = 4, recompute: bool | str = False) -> float:
    """One step of one transformer block: attention and MLP, each 2 all-reduces of B·S·D·b; under
    sequence parallel also the all-reduce of each norm weight's gradient (D·b, twice).

    recompute: with full recomputation ("full" or True) backward runs the block's forward again, and
    with it forward's collectives (g's all-reduce after attention and after the MLP, or their
    all-gather and reduce-scatter under sequence parallel): 6 per block instead of 4. Selective
    recomputation re-does only attention's scores inside each rank's heads: no extra messages."""
    total = 2 * tp_region_bytes(batch, seq, dim, tp, sequence_parallel, dtype_bytes)
    if recompute in (True, "full"):  # forward's half again
        total += tp_region_bytes(batch, seq, dim, tp, sequence_parallel, dtype_bytes)
    if sequence_parallel:
        total += 2 * collective_sent_bytes("all_reduce", dim * dtype_bytes, tp)
    return total


def tp_params_per_rank(cfg, tp: int) -> int:
    """Parameters one rank holds: every matrix / tp, plus the replicated RMSNorm weights
    (2 per block and the final one, D each)."""
    check_tp_config(cfg, tp)
    replicated = (2 * cfg.n_layers + 1) * cfg.dim
    return (cfg.num_params() - replicated) // tp + replicated


def tp_memory_per_rank(cfg, tp: int, precision: str = "fp32",
                       num_tensors: int = 0) -> dict[str, float]:
    """Bytes one rank holds in parameters, gradients and AdamW state under tensor parallel: what
    ``memory_per_rank`` gives for this rank's own parameter count (nothing else is sharded)."""
    return memory_per_rank(tp_params_per_rank(cfg, tp), 1, zero=0, precision=precision,
                           num_tensors=num_tensors)


def tp_mlp_params_per_rank(dim: int, hidden: int, tp: int) -> int:
    """Parameters one rank holds of a tensor-parallel SwiGLU MLP: w1, w3 (D·F/tp each), w2
    (F/tp·D)."""
    check_divisible("hidden", hidden, "tp", tp)
    return 3 * dim * hidden // tp


# -- pipeline parallel -----------------------------------------------------------------------------
# p stages, the global batch B cut into m micro-batches of b = B/m sequences. A = b·S·D·bytes: one
# micro-batch's activation where two stages meet. Per step, every boundary carries m activations
# forward and m gradients (the same shape) backward, so each rank sends:
#
#   first stage    m·A forward                    = B·S·D·bytes
#   middle stage   m·A forward + m·A backward     = 2·B·S·D·bytes
#   last stage     m·A backward                   = B·S·D·bytes
#
# independent of m and of the schedule (GPipe or 1F1B only reorder the messages). Parameters: each
# stage holds its blocks, the first also the embedding (V·D), the last the final norm and the output
# layer (D + D·V). Bubble: (p-1)/(m+p-1) of the step with equal stage times.

def pp_step_bytes(batch: int, seq: int, dim: int, pp: int, stage: int, dtype_bytes: int = 4,
                  virtual_stages: int = 1) -> float:
    """Bytes stage ``stage`` of ``pp`` sends in one step: the activations of the whole batch forward
    (unless last), their gradients backward (unless first). Interleaved over ``virtual_stages`` v
    chunks per rank, each of its v chunks sends both ways, except the model's very first piece
    (rank 0, chunk 0: no gradient back) and very last (rank p-1, last chunk: no activation on)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is not a stage of pp={pp}")
    a = batch * seq * dim * dtype_bytes  # m micro-batches of (B/m)·S·D
    v = virtual_stages
    return float(a * (v - (stage == pp - 1)) + a * (v - (stage == 0))) if pp > 1 else 0.0


def pp_run_bytes(batch: int, seq: int, dim: int, pp: int, stage: int, steps: int,
                 dtype_bytes: int = 4, virtual_stages: int = 1) -> float:
    """Bytes a stage sends over ``steps`` steps (nothing at start-up: every rank builds the model
    from the same seed and keeps its own blocks)."""
    return steps * pp_step_bytes(batch, seq, dim, pp, stage, dtype_bytes, virtual_stages)


def pp_stage_params(cfg, blocks: int, first: bool, last: bool) -> int:
    """Parameters one stage holds: ``blocks`` transformer blocks, plus the embedding on the first
    stage and the final norm and output layer on the last."""
    d, v = cfg.dim, cfg.vocab_size
    per_block = (cfg.num_params() - 2 * v * d - d) // cfg.n_layers
    return blocks * per_block + (v * d if first else 0) + (d + d * v if last else 0)


def pp_memory_per_rank(cfg, blocks: int, first: bool, last: bool, precision: str = "fp32",
                       num_tensors: int = 0) -> dict[str, float]:
    """Bytes one stage holds in parameters, gradients and AdamW state: ``memory_per_rank`` of its
    own parameters (nothing is sharded within a stage)."""
    return memory_per_rank(pp_stage_params(cfg, blocks, first, last), 1, zero=0,
                           precision=precision, num_tensors=num_tensors)


def pp_bubble_fraction(pp: int, microbatches: int, schedule: str = "1f1b",
                       virtual_stages: int = 1) -> float:
    """The idle share of a step with equal stages.

    GPipe and 1F1B: (p-1)/(m+p-1): the step takes m+p-1 slots of one micro-batch's forward and
    backward, each stage computes in m of them. Interleaved (v chunks per rank): (p-1)/(v·m+p-1),
    filling and draining costs p-1 slots of one chunk, 1/v of a stage. Zero-bubble ZB-H1, with F, B
    and W equally long (a backward twice a forward, cut in two halves): (p-1)/(3m+p-1) in units of
    one F, since only B's travel back through the pipe (Qi et al. 2023); with m < p every stage
    also waits p-m more slots."""
    if pp < 1 or microbatches < 1:
        raise ValueError(
            f"pp and microbatches must be >= 1, got pp={pp}, microbatches={microbatches}")
    return schedule_entry(schedule).bubble(pp, microbatches, virtual_stages)


def pp_peak_microbatches_in_flight(pp: int, microbatches: int, stage: int, schedule: str,
                                   virtual_stages: int = 1) -> int:
    """The most micro-batches whose activations a stage holds at once: GPipe all m; 1F1B at most
    p - stage (its warm-up forwards plus the one of the steady state), and never more than m.
    Interleaved counts (micro-batch, chunk) sets, each 1/v of a stage's: its warm-up 2(p-s-1) +
    (v-1)p plus one, at most v·m. ZB-H1 holds a micro-batch from F to W: p on every stage (at most
    m)."""
    return schedule_entry(schedule).peak_in_flight(pp, microbatches, stage, virtual_stages)
