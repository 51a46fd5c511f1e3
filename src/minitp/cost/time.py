"""Time: compute from FLOPs at a device's rate, messages by an α–β model per link, minus what
overlaps.

Notation (as in ``minitp.cost``, plus):

* ``F``: floating-point operations; a matrix multiply (M, K) @ (K, N) is 2·M·K·N of them;
* ``R``: a device's rate in FLOP/s; ``α``: a link's latency per message step (seconds);
  ``β``: its bandwidth, bytes per second **per direction** (what a ring uses: each rank sends to one
  neighbour while it receives from the other).

Training costs about **6Ψ FLOPs per token** (2Ψ forward: one multiply-add per parameter; 4Ψ
backward: the gradients of the activations and of the weights; Ψ the *active* parameters of a MoE,
those a token goes through: its k experts of each layer, ``active_params``), plus attention's scores
and weighted sum, **12·L·D·S per token** (2·2·S·D forward per layer and token, twice that backward;
counted whole in the model's FLOPs, as PaLM's MFU does). A causal kernel skips the masked half of
the scores (FlashAttention's blocks above the diagonal): the time of a step charges half of them on
the GPU sheets (``Device.causal_skip``), all of them on this machine, whose attention computes every
score and then masks. MFU (model FLOPs utilisation) divides the model FLOPs by what the GPUs could
have done in the step at their published peak; recomputation's extra forward is work the hardware
does but the model does not count.

A collective on a ring of n ranks takes (n-1) steps per phase (an all-reduce has two phases), each
one message of B/n bytes: T = phases·(n-1)·α + (bytes the rank sends)/β. A point-to-point send takes
α + B/β.

The last of ``minitp.cost``'s modules: it times the bytes the others count. This machine's figures
come in as a ``Device`` (``device_from_calibration`` of what ``minitp.measure.calibrate`` read);
nothing here reads a file.

The hardware sheet (``H100``, ``A100``) and ``Device`` are in ``minitp.cost.devices``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minitp.cost.activations import recompute_mode
from minitp.cost.context import check_cp_attention, cp_mesh_step_bytes
from minitp.cost.devices import A100, DEVICES, H100, Device, Link, device_from_calibration
from minitp.cost.experts import active_params, check_ep, ep_mesh_step_bytes
from minitp.cost.strategies import collective_sent_bytes
from minitp.cost.threed import check_hsdp_shard, rank_num_blocks
from minitp.layout import CP_TILE, check_positive, cp_chunks

__all__ = ["Link", "Device", "H100", "A100", "DEVICES", "device_from_calibration",
           "training_flops_per_token", "activation_elements", "recompute_flops_per_token",
           "compute_time", "collective_time", "ring_exposed_s", "links_of_layout", "StepTime",
           "step_time", "arithmetic_intensity", "overlap_budget_bytes", "strategy_ops", "ring_ops",
           "moe_ops", "link_on_machine"]


# -- compute ---------------------------------------------------------------------------------------
def training_flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs to train on one token: 6Ψ (forward 2Ψ, backward 4Ψ) + 12·L·D·S for attention;
    Ψ the active parameters (a MoE's token goes through k of its E experts per layer)."""
    return 6 * active_params(cfg) + 12 * cfg.n_layers * cfg.dim * seq


def activation_elements(cfg, tokens: float, seq: int, tp: int = 1, pp: int = 1) -> float:
    """The elements a rank's forward+backward works through outside its matmuls, roughly, for
    ``tokens`` of its own: per token, each of its L/pp blocks' width D (the norms, RoPE, residuals)
    and its split part F/tp (SwiGLU's gate; written-out attention adds its H/tp·S scores, a fused
    kernel keeps them inside), and the logits' V/tp. ``Device.element_s`` prices one."""
    scores = 0 if getattr(cfg, "fused_attention", False) else cfg.n_heads * seq
    per_token = cfg.n_layers / pp * (cfg.dim + (cfg.ffn_hidden + scores) / tp) + cfg.vocab_size / tp
    return tokens * per_token


def recompute_flops_per_token(cfg, seq: int, recompute: str = "none") -> float:
    """The extra FLOPs recomputation adds per token: ``full`` runs each block's forward again
    (2Ψ_blocks + 4·L·D·S, Ψ_blocks active), ``selective`` only attention's scores and weighted sum
    (4·L·D·S)."""
    recompute = recompute_mode(recompute)
    if recompute == "none":
        return 0.0
    attention = 4 * cfg.n_layers * cfg.dim * seq
    if recompute == "selective":
        return float(attention)
    d, v = cfg.dim, cfg.vocab_size
    return 2 * (active_params(cfg) - 2 * v * d - d) + attention


def _shared_cores(device: Device, ranks_on_machine: int) -> float:
    """How many times slower a rank runs beside the others than alone (CPU only, as ``minitp
    calibrate`` measured it). Up to a rank per core: the line from 1 at one rank to
    ``busy_slowdown`` at ``cores`` ranks. Beyond: that, times the ranks' sharing of the cores,
    ranks/cores or the line through 1 at ``cores`` ranks and ``shared_slowdown`` at 2·cores."""
    if not device.cores or ranks_on_machine <= 1:
        return 1.0
    busy = device.busy_slowdown or 1.0
    if ranks_on_machine <= device.cores:
        return 1 + (ranks_on_machine - 1) / max(device.cores - 1, 1) * (busy - 1)
    over = ranks_on_machine / device.cores - 1  # 1 at twice as many ranks as cores
    return busy * (1 + over * ((device.shared_slowdown or 2.0) - 1))


def link_on_machine(link: Link, device: Device, ranks_on_machine: int) -> Link:
    """The link as ranks that outnumber the cores see it (CPU only): a rank waiting for a message
    waits for its sender to get a core. α and 1/β on the line through the link's figures at
    ``cores`` ranks and ``shared_link``'s at 2·cores (both measured by ``minitp calibrate``);
    ``link`` itself with a core per rank or no ``shared_link``."""
    shared = device.shared_link
    if shared is None or not device.cores or ranks_on_machine <= device.cores:
        return link
    over = ranks_on_machine / device.cores - 1
    alpha = link.alpha_s + over * (shared.alpha_s - link.alpha_s)
    seconds_per_byte = 1 / link.bytes_per_s + over * (1 / shared.bytes_per_s - 1 / link.bytes_per_s)
    return Link(link.name + f", {ranks_on_machine} ranks on {device.cores} cores", max(0.0, alpha),
                1 / max(seconds_per_byte, 1e-30))


def compute_time(flops: float, device: Device, ranks_on_machine: int = 1) -> float:
    """Seconds to do ``flops`` at the device's rate; on a CPU with fewer cores than ranks, the ranks
    share them (each gets cores/ranks of one)."""
    return flops / (
        device.flops_per_s * device.efficiency) * _shared_cores(device, ranks_on_machine)


# -- the small operations a strategy adds ----------------------------------------------------------
# Tensor operations (forward and backward together) that context and expert parallel add to the
# plain model's, per block and micro-batch, counted on minitp's own code: every operation a
# forward+backward dispatches, counted (TorchDispatchMode) under the strategy and for the plain
# model, rank by rank at 2 and 4 ranks, and split into the units below by least squares, rounded.
# Counts, not times: the totals are within 2 % of what ``benchmarks/time_model.py --count-ops``
# counts. ring attention: per piece of work (a pair of query and key chunks that has any, cut as
# ``cp._pairs`` cuts it) its scores, online-softmax update and their gradients, 104, and 37 more
# where a causal mask is built and applied; per ring step the hand-over of keys and values (and of
# their gradients) and the grouped heads' expansion, 40; per block, the ring's set-up less the plain
# attention it replaces, -38. MoE: per layer the router (its softmax, top-k, capacity and auxiliary
# loss), 46; per expert this rank holds, the gather of its rows, its SwiGLU and the scatter back,
# 45; with ep > 1 the dispatch and combine (sorting by expert, the counts, the regrouping by source
# rank), 73.
RING_OPS = {"piece": 104, "masked_piece": 104 + 37, "step": 40, "block": -38}
MOE_OPS = {"routing": 46, "expert": 45, "dispatch": 73}


def _pieces(queries: range, keys: range) -> tuple[int, int]:
    """(unmasked, masked) pieces of work of a causal (query chunk, key chunk) pair, as ``minitp.cp``
    cuts them: all of it (keys before the queries), none (keys after), or a masked diagonal, cut in
    four when longer than CP_TILE (its upper-right quarter skipped, its lower-left unmasked)."""
    if keys.stop <= queries.start:
        return 1, 0
    if keys.start > queries.stop - 1:
        return 0, 0
    if queries == keys and len(queries) > CP_TILE:
        h = len(queries) // 2
        lo, hi = range(queries.start, queries.start + h), range(queries.start + h, queries.stop)
        (a, b), (c, d) = _pieces(lo, lo), _pieces(hi, hi)
        return a + c + 1, b + d
    return 0, 1


def strategy_ops(cfg, seq: int, cp: int = 1, ep: int = 1, balanced: bool = True) -> int:
    """Small tensor operations (forward and backward) that ring attention over cp ranks and a MoE's
    routing, experts and all-to-alls over ep ranks add to the plain model's, per micro-batch of the
    whole model, on its busiest rank (``RING_OPS``, ``MOE_OPS``): ``ring_ops`` + ``moe_ops``."""
    return ring_ops(cfg, seq, cp, balanced) + moe_ops(cfg, ep)


def ring_ops(cfg, seq: int, cp: int = 1, balanced: bool = True) -> int:
    """The operations ring attention over cp ranks adds, per micro-batch, on its busiest rank. Each
    costs ``Device.cp_op_s`` (or ``op_s`` where that was not measured)."""
    if cp == 1:
        return 0
    chunks = [cp_chunks(seq, cp, r, balanced) for r in range(cp)]
    per_block = []
    for rank in range(cp):
        pieces = [_pieces(q, k) for source in range(cp) for q in chunks[rank]
                  for k in chunks[source]]
        unmasked, masked = sum(p[0] for p in pieces), sum(p[1] for p in pieces)
        per_block.append(RING_OPS["piece"] * unmasked + RING_OPS["masked_piece"] * masked
                         + RING_OPS["step"] * cp + RING_OPS["block"])
    return cfg.n_layers * max(per_block)


def moe_ops(cfg, ep: int = 1) -> int:
    """The operations a MoE's routing, its experts on this rank and (ep > 1) its dispatch and
    combine add, per micro-batch. Each costs ``Device.ep_op_s`` (or ``op_s``); 0 for a dense
    model."""
    if not hasattr(cfg, "n_experts"):
        return 0
    local = cfg.n_experts // ep
    return cfg.n_layers * (MOE_OPS["routing"] + MOE_OPS["expert"] * local
                           + (MOE_OPS["dispatch"] if ep > 1 else 0))


# -- communication ---------------------------------------------------------------------------------
RING_PHASES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def collective_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds one ``op`` on a buffer of ``nbytes`` over a ring of ``n`` ranks takes: (n-1) steps
    per phase, each α plus B/n bytes at β. ``send``: α + B/β."""
    if op == "send":
        return link.alpha_s + nbytes / link.bytes_per_s
    if n <= 1:
        return 0.0
    if op not in RING_PHASES:
        raise ValueError(
            f"unknown collective {op!r}; expected all_reduce, all_gather, reduce_scatter or send")
    return RING_PHASES[op] * (n - 1) * link.alpha_s + collective_sent_bytes(
        op, nbytes, n) / link.bytes_per_s


def ring_exposed_s(chunk_s: float, message_s: float, n: int, overlapped: bool) -> float:
    """Seconds an all-gather ring of ``n`` ranks leaves a rank waiting, beside its ``n`` matmul
    chunks of ``chunk_s`` each, when one chunk's message takes ``message_s``. Done whole, its n - 1
    steps come before the matmul: all exposed. As one ring (``minitp.tp_overlap``) the message of
    step k travels beside matmul chunk k, and only its time beyond the chunk is exposed: a message
    cannot hide behind another step's chunk, as the next step needs it."""
    if n < 1 or chunk_s < 0 or message_s < 0:
        raise ValueError(f"ring_exposed_s: expected n >= 1 and times >= 0, got n={n}, "
                         f"chunk_s={chunk_s}, message_s={message_s}")
    per_step = max(0.0, message_s - chunk_s) if overlapped else message_s
    return (n - 1) * per_step


def links_of_layout(dp: int, pp: int, tp: int, device: Device, cp: int = 1, ep: int = 1,
                    dp_shard: int | None = None) -> dict[str, Link]:
    """Which link each dimension's messages cross, with minitp's order (tp fastest, then pp, then cp
    inside the dp dimension, dp slowest; ranks filling machines in order): a group stays inside a
    machine when its span (tp; tp·pp; cp·pp·tp; dp·cp·pp·tp) fits in one. An ep group, ep
    consecutive ranks of the dp·cp dimension, spans ep·pp·tp. Megatron and torchtitan order pp
    outermost instead; the tp rule is the same. With ``dp_shard`` (HSDP, shard fastest inside dp,
    as ``minitp.hsdp`` numbers its ranks): "dp_shard", a shard group spanning dp_shard·cp·pp·tp,
    and "dp_replicate", its replicas, one per shard group, spanning all dp·cp·pp·tp."""
    inside = device.gpus_per_node
    links = {"tp": device.intra if tp <= inside else device.inter,
             "pp": device.intra if tp * pp <= inside else device.inter,
             "cp": device.intra if cp * pp * tp <= inside else device.inter,
             "dp": device.intra if dp * cp * pp * tp <= inside else device.inter,
             "ep": device.intra if ep * pp * tp <= inside else device.inter}
    if dp_shard is not None:
        links["dp_shard"] = device.intra if dp_shard * cp * pp * tp <= inside else device.inter
        links["dp_replicate"] = links["dp"]
    return links


# -- one training step -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """A predicted step, in seconds: each part and what is left exposed after overlap."""

    compute_s: float  # this rank's FLOPs (recomputation included) at the device's rate
    bubble_s: float  # pipeline idle time: compute · (p-1)/m
    tp_s: float  # tensor parallel's all-reduces: on the critical path, never hidden
    pp_s: float  # activations between stages (point-to-point), counted exposed
    dp_s: float  # the gradient all-reduce (DDP) or FSDP's gathers and reduce-scatters, whole
    dp_exposed_s: float  # what of dp_s does not hide behind compute
    step_s: float  # compute + bubble + tp + pp + exposed dp + exposed cp
    model_flops: float  # per step, whole model, no recomputation
    mfu: float  # model_flops / (step_s · gpus · peak)
    # context parallel's ring: keys and values (and their gradients) passed on (or
    cp_s: float = 0.0
    # Ulysses' all-to-alls, or the all-gathers and reduce-scatters: ``step_time(cp_attention=)``)
    # what of cp_s does not hide behind this rank's attention compute (the ring's only)
    cp_exposed_s: float = 0.0
    # expert parallel's all-to-alls (dispatch, combine and their gradients): never hidden
    ep_s: float = 0.0
    # the small operations cp and ep add (``strategy_ops``), at cp_op_s / ep_op_s each; in compute_s
    ops_s: float = 0.0
    # what the collectives wait for the other ranks, ``Device.wait_per_compute`` · compute (CPU)
    wait_s: float = 0.0


def step_time(cfg, batch: int, seq: int, dp: int = 1, tp: int = 1, pp: int = 1,
              device: Device = H100, microbatches: int = 1, data_parallel: str = "ddp",
              zero: int = 3, precision: str = "bf16", sequence_parallel: bool = False,
              recompute="none", overlap: bool = True, buckets: int | None = None, cp: int = 1,
              virtual_stages: int = 1, ep: int = 1, balanced: bool = True,
              cp_attention: str = "ring", dp_shard: int | None = None) -> StepTime:
    """Predicted seconds of one training step of ``cfg`` on dp·cp·pp·tp ranks of ``device``.

    Overlap (``overlap=True``): DDP's bucketed all-reduce hides behind backward (2/3 of the compute;
    with a pipeline only the last micro-batch's backward is left to hide behind); FSDP (ZeRO-3)
    prefetches its gathers behind forward and backward, so all of the compute; tensor parallel's g
    and f sit between two matmuls that need their result, so nothing hides them; the pipeline's
    sends are counted whole. Compute includes the device's fixed costs, on its stage's 1/pp of the
    model (every tp and dp rank runs all the operations): ``microbatch_overhead_s`` per micro-batch
    and ``overhead_s`` once per step, so a pipeline of m micro-batches pays the forward+backward's
    fixed cost m times and the optimizer's once. buckets: DDP's all-reduces per step (default: one
    per 25 MiB of gradients, PyTorch's bucket size); each message step costs α (``_ring_steps``).

    The small operations cp and ep add to the plain model (``strategy_ops``: ring attention's
    per-chunk online-softmax updates and hand-overs, a MoE's routing, per-expert work and dispatch)
    cost what ``minitp calibrate`` measured one of each to cost (``Device.cp_op_s``, ``ep_op_s``;
    ``op_s`` where not measured; ``ops_s``, part of compute); DDP's, FSDP's (ZeRO-3) and tensor
    parallel's own code costs what ``minitp calibrate`` measured at one rank per micro-batch
    (``Device.ddp_own_s``..., also part of compute); ``balanced``: context parallel's load-balanced
    chunks (the default) or contiguous slices.

    cp: context parallel, each of the dp replicas' sequences split over cp ranks (ring attention,
    ``minitp.cost.context``). A rank then computes (B/dp)·(S/cp) tokens; tensor and pipeline
    parallel move activations of S/cp positions; the gradients are averaged over the dp·cp ranks
    that hold the same weights; the ring's keys and values hide behind the attention compute
    they feed (the 12·L·D·S FLOPs per token, half of them under a causal kernel), and only what
    exceeds it is exposed.
    cp_attention: how attention crosses the cp group (``minitp.cost.context.CP_ATTENTIONS``). "ring"
    as above. "ulysses": four all-to-alls forward and four backward per block, each of c-1 message
    steps, counted whole: the heads' attention waits for the first three, the output projection for
    the last. "allgather": the keys' and values' all-gathers forward and their gradients'
    reduce-scatters backward (c-1 steps each), counted whole too: attention waits for the whole
    sequence's keys. A kernel could gather the next layer's keys and values behind this layer's
    compute (they depend only on that layer's input); this model does not assume it, so the
    all-gather's figure is an upper bound. The small operations (``strategy_ops``) are the ring's,
    measured; the other ways' are not counted.

    data_parallel "hsdp" (``dp_shard`` of the dp replicas per shard group, with their cp ranks): the
    shard group's gathers and reduce-scatters on the link its span crosses, the all-reduce of the
    gradient shards over the dp/dp_shard replicas on the replicate group's (``links_of_layout``),
    one after the other in dp_s; ZeRO-3's prefetch hides them behind all of the compute, as FSDP's.

    virtual_stages: interleaved 1F1B's v chunks per rank: the bubble shrinks to compute·(p-1)/(v·m),
    and each micro-batch crosses v times as many boundaries (v times the pipeline's sends).

    A MoE (``minitp.models.moe``) computes 6 FLOPs per *active* parameter and token; ep: its experts
    split over ep of the dp·cp ranks (``minitp.cost.experts.ep_mesh_step_bytes``): the expert
    gradients average over dp·cp/ep copies, and the all-to-alls, on the link the ep group spans
    (``links_of_layout``), are counted whole: the experts wait for the dispatch, the next layer for
    the combine.

    An all-gather and a reduce-scatter take ``Device.gather_factor`` and ``scatter_factor`` times
    what the ring model says (1 on the GPU sheets; gloo's, measured by ``minitp calibrate``):
    FSDP's, sequence parallel's and the all-gather attention's messages are priced so. On more
    than one rank, the collectives wait for the rank that computed longest:
    ``Device.wait_per_compute`` · compute (``wait_s``; 0 on the GPU sheets).

    On a CPU (``device.cores``) with no core to spare (as many ranks as cores, or more) nothing
    overlaps: gloo copies and adds the bytes on the same cores that compute. With more ranks than
    cores, compute slows by ranks/cores (or as ``minitp calibrate`` measured it, ``_shared_cores``)
    and every message crosses the link as measured with ranks waiting for cores
    (``link_on_machine``); with a rank on every core, compute and fixed costs run ``busy_slowdown``
    times slower than alone.
    """
    recompute = recompute_mode(recompute)
    check_positive("cp", cp)
    ring = check_cp_attention(cp_attention) == "ring"
    gpus, m = dp * cp * pp * tp, microbatches if pp > 1 else 1
    b = 2 if precision in ("bf16", "fp16") else 4
    tokens = batch * seq
    model_flops = tokens * training_flops_per_token(cfg, seq)
    # what the device runs: a causal kernel skips half of the scores' FLOPs (the model counts them
    # whole), those of the recomputed forward too
    scores = (12 + (4 if recompute != "none" else 0)) * cfg.n_layers * cfg.dim * seq
    skipped = tokens * scores / 2 if device.causal_skip else 0.0
    rank_flops = (model_flops + tokens * recompute_flops_per_token(cfg, seq, recompute)
                  - skipped) / gpus
    compute = compute_time(rank_flops, device, gpus)
    attention = compute_time(tokens * 12 * cfg.n_layers * cfg.dim * seq
                             * (0.5 if device.causal_skip else 1.0) / gpus, device, gpus)
    # the fixed costs, on the stage's share of the model: each micro-batch's forward+backward with
    # the strategies' own code (ZeRO-1/2's is not measured), the step's optimizer once, and each
    # small operation the strategy adds
    shared = _shared_cores(device, gpus)
    ops = (ring_ops(cfg, seq, cp if ring else 1, balanced) * (device.cp_op_s or device.op_s)
           + moe_ops(cfg, ep) * (device.ep_op_s or device.op_s))
    ops_s = m * ops / pp * shared
    if device.element_s:  # the work beyond the matmuls, at this rank's share of tokens and width
        rank_tokens = tokens / (dp * cp)
        compute += device.element_s * activation_elements(cfg, rank_tokens, seq, tp, pp) * shared
    own = device.tp_own_s if tp > 1 else 0.0
    if dp * cp > 1:
        own += (device.ddp_own_s if data_parallel == "ddp" else device.fsdp_own_s if zero == 3
                else 0.0)
    compute += ((device.microbatch_overhead_s + own) * m + device.overhead_s) / pp * shared + ops_s
    v = virtual_stages if pp > 1 else 1
    check_positive("virtual_stages", v)
    bubble = compute * (pp - 1) / (v * m)
    # as the ranks see it when they outnumber the cores
    hsdp = data_parallel == "hsdp"
    links = {dim: link_on_machine(link, device, gpus) for dim, link in links_of_layout(
        dp, pp, tp, device, cp, ep, dp_shard if hsdp else None).items()}
    worst = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "cp": 0.0, "ep": 0.0}
    sizes = {"tp": tp, "pp": pp, "dp": dp * cp, "cp": cp, "ep": ep}
    moe = check_ep(cfg, ep)
    if hsdp:
        if moe:
            raise ValueError("data_parallel='hsdp' is counted for a dense model, not a MoE")
        shard = check_hsdp_shard(dp, dp_shard)
        sizes.update(dp_shard=shard * cp, dp_replicate=dp // shard)
    for stage in range(pp):
        kept = dict(data_parallel=data_parallel, zero=zero, activation_bytes=b, param_bytes=b,
                    grad_bytes=b, sequence_parallel=sequence_parallel, recompute=recompute,
                    virtual_stages=v)
        if moe:  # the all-to-alls, and the expert gradients over their dp·cp/ep copies
            sent = ep_mesh_step_bytes(cfg, batch, seq, dp, cp, tp, pp, stage, ep, **kept)
        else:
            sent = {**cp_mesh_step_bytes(cfg, batch, seq, dp, cp, tp, pp, stage, **kept,
                                         attention=cp_attention, dp_shard=dp_shard),
                    "ep": 0.0}
        blocks = rank_num_blocks(cfg.n_layers, pp, stage, v)
        # the embedding's all-reduce; the output's and the loss's two
        ends = (stage == 0) + 3 * (stage == pp - 1)
        steps = _ring_steps(blocks, m, sizes, data_parallel, zero, recompute, sent["dp"], buckets,
                            v, cp_attention, ends)
        # HSDP's dp: its two groups, each on its own link
        timed = {"dp": ("dp_shard", "dp_replicate")} if hsdp else {}
        for dim in worst:
            seconds = sum((steps.get(part, 0) * links[part].alpha_s
                           + sent[part] / links[part].bytes_per_s)
                          * _kind_factor(device, part, data_parallel, zero, sequence_parallel,
                                         cp_attention) for part in timed.get(dim, (dim,)))
            worst[dim] = max(worst[dim], seconds)
    if device.cores and gpus >= device.cores:
        # a CPU moves gloo's bytes with its own cores: with none spare, nothing hides
        overlap = False
    if not overlap:
        window = 0.0
    elif data_parallel in ("fsdp", "hsdp") and zero == 3:
        window = compute
    else:
        window = compute * 2 / 3 / m
    dp_exposed = max(0.0, worst["dp"] - window)
    cp_exposed = max(0.0, worst["cp"] - (attention if overlap and ring else 0.0))
    wait = device.wait_per_compute * compute if gpus > 1 else 0.0
    step = (compute + bubble + worst["tp"] + worst["pp"] + dp_exposed + cp_exposed + worst["ep"]
            + wait)
    mfu = model_flops / (step * gpus * device.flops_per_s) if step > 0 else 0.0
    return StepTime(compute, bubble, worst["tp"], worst["pp"], worst["dp"], dp_exposed, step,
                    model_flops, mfu, worst["cp"], cp_exposed, worst["ep"], ops_s, wait)


def _kind_factor(device: Device, part: str, data_parallel: str, zero: int,
                 sequence_parallel: bool, cp_attention: str) -> float:
    """How many times the ring model's time a dimension's messages take on ``device``: all-gathers
    and reduce-scatters at their measured factors (``Device.gather_factor``, ``scatter_factor``),
    in the proportions the dimension sends them (ZeRO-3 two gathers per reduce-scatter, ZeRO-1/2
    one each, sequence parallel's and the all-gather attention's pairs one each); all-reduces,
    sends and all-to-alls at 1."""
    g, s = device.gather_factor, device.scatter_factor
    if part in ("dp", "dp_shard") and data_parallel in ("fsdp", "hsdp"):
        return (2 * g + s) / 3 if zero == 3 else (g + s) / 2
    if (part == "tp" and sequence_parallel) or (part == "cp" and cp_attention == "allgather"):
        return (g + s) / 2
    return 1.0


def _ring_steps(blocks: int, m: int, sizes: dict, data_parallel: str, zero: int, recompute: str,
                dp_bytes: float, buckets: int | None, virtual_stages: int = 1,
                cp_attention: str = "ring", ends: int = 4) -> dict[str, float]:
    """Message steps on the critical path per step, each costing α: an all-reduce over n ranks takes
    2(n-1), an all-gather or reduce-scatter n-1 (sequence parallel's pairs: the same 2(n-1)), a send
    1. tp: per micro-batch 4 per block (6 with full recomputation), plus ``ends``: the embedding's
    one (on the first stage), the output's and the loss's two (its maximum, then its sums; on the
    last stage); pp: m sends forward, m backward (v times that, interleaved); dp: DDP's buckets, or
    FSDP's gathers and reduce-scatters per unit;
    cp: per micro-batch and block, c-1 hops forward and (c-1) + c backward (the ring); Ulysses'
    eight all-to-alls, or the all-gather's two all-gathers and two reduce-scatters (keys and
    values), c-1 each; with full recomputation the forward's again; ep: per micro-batch and MoE
    layer, five all-to-alls of e-1 steps each: the dispatch's counts, then its rows, the combine,
    and the two gradients (the counts have none). HSDP ("dp_shard", "dp_replicate" in ``sizes``):
    FSDP's per unit in the shard group, and one all-reduce per unit across the replicas."""
    tp, pp, dp = sizes["tp"], sizes["pp"], sizes["dp"]
    cp, ep = sizes.get("cp", 1), sizes.get("ep", 1)
    per_block = 6 if recompute == "full" else 4
    out = {"tp": m * (per_block * blocks + ends) * 2 * (tp - 1), "pp": 2 * m * virtual_stages
           if pp > 1 else 0, "dp": 0,
           "cp": m * blocks * ({"ring": 3 * cp - 2, "ulysses": 8 * (cp - 1),
                                "allgather": 4 * (cp - 1)}[cp_attention]
                               + ({"ring": cp - 1, "ulysses": 4 * (cp - 1),
                                   "allgather": 2 * (cp - 1)}[cp_attention]
                                  if recompute == "full" else 0))
           if cp > 1 else 0, "ep": m * blocks * 5 * (ep - 1)}
    if dp > 1:
        units = blocks + 1
        if data_parallel == "ddp":
            out["dp"] = (buckets or max(1, math.ceil(dp_bytes / (2 * (
                dp - 1) / dp) / (25 * 2**20)))) * 2 * (dp - 1)
        # ZeRO-3: gather in forward and in backward, reduce-scatter; ZeRO-1/2: reduce-scatter,
        # gather
        elif data_parallel == "hsdp":
            out["dp_shard"] = units * (3 if zero == 3 else 2) * (sizes["dp_shard"] - 1)
            out["dp_replicate"] = units * 2 * (sizes["dp_replicate"] - 1)
        else:
            out["dp"] = units * (3 if zero == 3 else 2) * (dp - 1)
    return out


def arithmetic_intensity(m: int, k: int, n: int, dtype_bytes: int = 2) -> float:
    """FLOPs per byte moved of a (m, k) @ (k, n) matmul reading both inputs and writing the output
    once: 2mkn / ((mk + kn + mn)·b). Above the device's FLOP/s ÷ memory bandwidth it is
    compute-bound."""
    return 2 * m * k * n / ((m * k + k * n + m * n) * dtype_bytes)


def overlap_budget_bytes(compute_s: float, link: Link) -> float:
    """Bytes a link can carry while ``compute_s`` of compute runs: what can hide behind it."""
    return compute_s * link.bytes_per_s
