"""The layout planner: which dp × pp × tp layouts of N GPUs fit a model, what each one sends, how
long a step should take.

Nothing runs: every number comes from ``minitp.cost``, the same formulas the runs are checked
against (``minitp run 3d`` compares them with the bytes traced and the memory held on every rank,
and ``tests/test_plan.py`` does so for every layout of the tiny model on 8 ranks).

For each layout the planner takes the worst rank (the stage that holds or sends the most):

* memory: parameters, gradients and AdamW state (``threed_memory_per_rank``; bf16 mixed precision by
  default, 16 bytes per parameter, sharded over dp by ZeRO), plus an *estimate* of the activations
  kept for backward (``activation_bytes_per_rank``, Korthikanti et al.: 1F1B; with or without
  sequence parallel; no, selective or full recomputation) and, on the last stage, the final norm's,
  the output layer's and the loss's (``output_activation_bytes``: one fp32 copy of its V/tp
  logits, 3.9 GiB per sequence of 8192 tokens of LLaMA-3 at tp = 1);
* bytes sent per step in each dimension (``threed_step_bytes``): tp inside a machine, pp and dp
  between machines when the layout spans several; full recomputation repeats forward's tp messages;
* the pipeline bubble (p-1)/(m+p-1);
* the predicted step time and MFU on a device (``minitp.cost.step_time``: H100 by default).

A mixture of experts (``minitp.models.moe``, e.g. ``mixtral-8x7b``) can split its experts over ep of
the data-parallel GPUs (expert parallel, ``ep``, as Megatron and DeepSpeed do: the ep group lies
inside the dp·cp ranks that hold the same dense weights); its all-to-alls are a fifth dimension of
bytes, and its FLOPs (so step time and MFU) count the parameters a token goes through, k of the E
experts.

Data parallel is FSDP (ZeRO-3, or 1 with a pipeline) by default, or DDP, or HSDP
(``data_parallel="hsdp"``: dp = replicas × shards, FSDP inside each shard group of ``dp_shard``
ranks, by default the most that fit in a machine with their cp·pp·tp; the gradient shards
all-reduced across the replicas, each group's bytes on the link it spans).

A layout is listed when tp divides the heads, key/value heads, MLP width and vocabulary, tp fits in
a machine (``gpus_per_node``), pp is at most the number of blocks and the batch splits over dp. The
layouts that fit come first, fastest predicted step first.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

from minitp import cost
from minitp.cost.context import (
    check_cp_attention,
    check_ulysses_heads,
    cp_attention_activation_bytes_per_rank,
)
from minitp.grid import check_3d_layout, check_zero
from minitp.grid import layouts as layouts  # plan.layouts: every layout
from minitp.layout import AXES, check_divisible, check_positive
from minitp.models import ModelConfig

GIB = 2**30
DATA_PARALLEL = ("fsdp", "ddp", "hsdp")  # what plan's data_parallel takes
# 1,048,576: ten times the largest training clusters; the planner answers at once up to it
MAX_GPUS = 2**20


def plan_layout(cfg: ModelConfig, dp: int, pp: int, tp: int, batch_size: int, seq_len: int,
                data_parallel: str = "fsdp", zero: int | None = None, precision: str = "bf16",
                micro_batch: int = 1, flash_attention: bool = True, recompute=False,
                sequence_parallel: bool = False, device: cost.Device = cost.H100, cp: int = 1,
                ep: int = 1, activations: str = "llama", cp_attention: str = "ring",
                dp_shard: int | None = None) -> dict:
    """Memory per GPU, bytes per step (the worst stage of each) and predicted step time of one
    layout, from ``minitp.cost``. recompute: False / "none", "selective" (attention's scores) or
    True / "full"; or, as ``minitp.offload`` runs them (``minitp.cost.offload``), "selective-op"
    (op-level selective checkpointing: each block keeps its input and its matmuls' outputs, and
    nothing recomputed costs a matmul or a message) or "offload" (each block's saved tensors go to
    the host's memory and come back in backward: the device holds two blocks' of one micro-batch; a
    "host" entry gives the bytes each way per step, what the host holds, and whether the link, at
    ``device.host_link``'s rate, hides behind forward (out) and backward (in); what it does not is
    added to the step), both for dense models without context parallel. activations: how a dense
    block's activations are counted (``cost.activation_bytes_per_rank``'s formula): "llama",
    minitp's block tensor by tensor; "llama-regather", the same with the column-parallel inputs
    gathered again in backward under sequence parallel (Megatron-LM; the extra all-gathers are not
    in the bytes or the time); "gpt3", Korthikanti et al.'s count for GPT-3's block. cp: context
    parallel, each sequence split over cp GPUs (ring attention; dp·cp·pp·tp GPUs in all):
    activations of S/cp positions, the ring's key/value bytes, states sharded over dp·cp by ZeRO.
    cp_attention: how attention crosses the cp group: "ring" (the default), "ulysses" (all-to-alls
    of the heads: cp must divide each tp rank's heads and key/value heads, else the layout is
    refused) or "allgather" (LLaMA 3's: every rank gathers the whole sequence's keys and values).
    Each way's bytes (``cost.cp_mesh_step_bytes(attention=)``), time
    (``cost.step_time(cp_attention=)``: only the ring's hide behind attention) and what its
    attention keeps beyond a block of S/cp positions
    (``cost.context.cp_attention_activation_bytes_per_rank``: the all-gather the whole sequence's
    keys and values, Ulysses its kernel's output at all S positions; nothing more under full
    recomputation). The last stage also keeps its final norm's, output layer's and loss's tensors
    for one micro-batch (``cost.output_activation_bytes``), whatever the recomputation.

    data_parallel: "fsdp", "ddp" or "hsdp": dp = R replicas × S = ``dp_shard`` shards (S must
    divide dp; default ``default_dp_shard``), FSDP (ZeRO ``zero``) over the S·cp ranks of a shard
    group, so states of ``cost.hsdp_memory_per_rank`` (16Ψ_rank/(S·cp) under ZeRO-3), whatever R;
    ``bytes_per_step`` "dp_shard", the shard group's gathers and reduce-scatters, and
    "dp_replicate", the all-reduce of each unit's 1/(S·cp) gradient shard over R
    (``cost.hsdp_step_bytes``), "dp" their sum; each timed on the link its group spans
    (``cost.links_of_layout``), hidden as FSDP's. Dense models only.

    A MoE model (``MoEConfig``) has an "ep" entry in ``bytes_per_step``; ep: its experts split over
    ep of the dp·cp ranks that hold the same dense weights (ep divides dp·cp, and n_experts;
    dp·cp·pp·tp GPUs still). With Ψ_d the dense parameters of the stage (attention, router, norms,
    embedding and output) and Ψ_e its experts, after tp, and T = (B/dp)·(S/cp) the rank's tokens per
    step:

    * states: Ψ_d as a dense model's, ZeRO-sharded over dp·cp, plus Ψ_e/ep sharded over the expert's
      dp·cp/ep copies (``cost.ep_mesh_memory_per_rank``; whole under DDP);
    * activations: each block's MLP share replaced by the MoE layer's k·T assignments, each keeping
      its dispatched row and output (D each) and the expert's four tensors of Fe/tp
      (``cost.moe_block_activation_bytes``);
    * bytes: "ep", per MoE layer of the stage, the dispatch, combine and their gradients,
      4·k·T·(ep-1)/ep·D·b (``cost.moe_all_to_all_bytes``, even routing); "dp", Ψ_d's gradients over
      dp·cp and Ψ_e/ep's over dp·cp/ep (``cost.ep_mesh_step_bytes``);
    * time: 6 FLOPs per active parameter and token, plus attention's; the all-to-alls, never hidden,
      on NVLink when the ep group (ep·pp·tp consecutive GPUs) fits in a machine.

    Raises ``ValueError`` for a layout the model or the batch cannot take."""
    check_3d_layout(cfg, dp, pp, tp)
    check_positive("cp", cp)
    check_cp_attention(cp_attention)
    if cp > 1:  # zig-zag chunks: 2·cp pieces of the sequence, two per rank
        check_divisible("seq_len", seq_len, "2·cp", 2 * cp)
        if cp_attention == "ulysses":
            check_ulysses_heads(cfg, cp, tp)
    moe = cost.check_ep(cfg, ep)
    if moe:
        check_divisible("expert_hidden", cfg.expert_hidden, "tp", tp)
        check_divisible("dp·cp", dp * cp, "ep", ep,
                        ": the experts are split over ep of the data-parallel ranks")
    if batch_size % (dp * micro_batch):
        raise ValueError(
            f"batch_size={batch_size} does not split into dp={dp} replicas of micro-batches "
            f"of {micro_batch}")
    hsdp = data_parallel == "hsdp"
    if dp_shard is not None and not hsdp:
        raise ValueError(f"dp_shard={dp_shard} is HSDP's shard group; pass data_parallel='hsdp'")
    if hsdp:
        if moe:
            raise ValueError("data_parallel='hsdp' is counted for a dense model, not a MoE")
        if dp_shard is None:
            dp_shard = default_dp_shard(dp, pp, tp, cp, device.gpus_per_node)
        cost.check_hsdp_shard(dp, dp_shard)
    # HSDP shards as FSDP does inside its shard group: ZeRO-3, or 1 with a pipeline
    zero = check_zero("fsdp" if hsdp else data_parallel, zero, pp)
    mode = cost.activation_mode(recompute)
    if mode in ("selective-op", "offload") and (moe or cp > 1):
        raise ValueError(
            f"recompute={mode!r} is counted for a dense model without context parallel")
    # what the formulas below see: offload and op-level selective recompute no matmul (and send
    # nothing again); their activations are counted apart
    recompute = mode if mode in ("none", "selective", "full") else "none"
    microbatches = batch_size // (dp * micro_batch) if pp > 1 else 1
    b = 2 if precision in ("bf16", "fp16") else 4
    stages = []
    for s in range(pp):
        # the dp·cp ranks holding the same weights share their states (ZeRO) and average gradients;
        # with ep > 1 an expert's, only its dp·cp/ep copies
        if hsdp:  # the S·cp ranks of a shard group share their states, whatever the replicas
            states = cost.threed_memory_per_rank(cfg, dp * cp, tp, pp, s, "hsdp", zero, precision,
                                                 dp_shard=dp_shard * cp)
        elif ep > 1:
            states = cost.ep_mesh_memory_per_rank(cfg, dp * cp, tp, pp, s, ep, data_parallel, zero
                                                  or 3, precision)
        else:
            states = cost.threed_memory_per_rank(cfg, dp * cp, tp, pp, s, data_parallel, zero or 3,
                                                 precision)
        args = (cfg, batch_size // dp // microbatches, seq_len // cp, tp, pp, s, microbatches, b,
                flash_attention, recompute, sequence_parallel)
        kept_activations = (cost.moe_activation_bytes_per_rank(*args) if moe
                            else cost.activation_bytes_per_rank(*args, formula=activations))
        # what the way of attending keeps beyond a block of S/cp positions (0 for the ring)
        kept_activations += cp_attention_activation_bytes_per_rank(
            cfg, batch_size // dp // microbatches, seq_len, cp, tp, pp, s, microbatches,
            cp_attention, b, flash_attention, recompute, sequence_parallel, "moe" if moe
            else activations)
        host = None
        if mode in ("selective-op", "offload"):  # what stays on the device
            kept_activations = cost.device_activation_bytes_per_rank(
                *args[:8], flash_attention, mode, sequence_parallel, activations)
        if mode == "offload":  # what crosses the host link, each way, and what the host holds
            host = cost.host_link_bytes_per_step(*args[:8], flash_attention, sequence_parallel,
                                                 activations)
        # the last stage's final norm, output layer and loss (one fp32 copy of its V/tp logits)
        kept_activations += cost.output_activation_bytes_per_rank(
            *args[:6], b, sequence_parallel, "llama" if moe else activations)
        kept = dict(data_parallel=data_parallel, zero=zero or 3, activation_bytes=b, param_bytes=b,
                    grad_bytes=b, sequence_parallel=sequence_parallel, recompute=recompute)
        if moe:
            sent = cost.ep_mesh_step_bytes(cfg, batch_size, seq_len, dp, cp, tp, pp, s, ep, **kept)
        else:
            sent = cost.cp_mesh_step_bytes(cfg, batch_size, seq_len, dp, cp, tp, pp, s, **kept,
                                           attention=cp_attention, dp_shard=dp_shard)
        stages.append((states, kept_activations, sent, host))
    # the stage that needs the most memory in all (the first: most micro-batches in flight, or the
    # last: the output layer); the one holding the most states can be another
    worst = max(range(pp), key=lambda s: cost.total_memory(stages[s][0]) + stages[s][1])
    states, kept_activations = stages[worst][0], stages[worst][1]
    time = cost.step_time(cfg, batch_size, seq_len, dp, tp, pp, device, microbatches, data_parallel,
                          zero or 3, precision, sequence_parallel, recompute, cp=cp, ep=ep,
                          cp_attention=cp_attention, dp_shard=dp_shard)
    extra = {}
    if mode == "offload":  # the host link's traffic against compute; what it exceeds is exposed
        host = max((st[3] for st in stages), key=lambda h: h["out"])
        extra["host"] = {**host, **cost.host_link_time(host["out"], device, time.compute_s)}
        step_s = time.step_s + extra["host"]["exposed_s"]
        time = replace(time, step_s=step_s, mfu=time.model_flops / (
            step_s * dp * cp * pp * tp * device.flops_per_s))
    # tp, pp, dp (fastest first), cp; HSDP's two groups of dp
    dims = ((*reversed(AXES), "cp") + (("ep",) if moe else ())
            + (("dp_shard", "dp_replicate") if hsdp else ()))
    if hsdp:
        extra.update(dp_shard=dp_shard, dp_replicate=dp // dp_shard)
    return {
        "dp": dp, "pp": pp, "tp": tp, "cp": cp, "ep": ep, "cp_attention": cp_attention,
        "data_parallel": data_parallel, "zero": zero,
        "precision": precision,
        "sequence_parallel": sequence_parallel, "recompute": mode,
        "microbatches": microbatches, "worst_stage": worst,
        "activation_formula": "moe" if moe else activations,
        "memory": {**states, "activations": kept_activations},  # of the worst stage
        "memory_states": max(cost.total_memory(st[0]) for st in stages),  # the most any rank holds
        "memory_total": cost.total_memory(states) + kept_activations,
        "bytes_per_step": {dim: max(st[2][dim] for st in stages) for dim in dims},
        "bubble_fraction": cost.pp_bubble_fraction(pp, microbatches),
        "device": device.name, "time": asdict(time), "step_s": time.step_s, "mfu": time.mfu,
        **extra,
    }


def plan(cfg: ModelConfig, gpus: int, gpu_memory_gib: float, gpus_per_node: int = 8,
         batch_size: int | None = None, seq_len: int | None = None, data_parallel: str = "fsdp",
         zero: int | None = None, precision: str = "bf16", micro_batch: int = 1,
         flash_attention: bool = True, recompute=False, include_unfit: bool = False,
         sequence_parallel: bool = False, device: cost.Device = cost.H100, cp: int = 1, ep: int = 1,
         refused: list | None = None, activations: str = "llama",
         cp_attention: str = "ring", dp_shard: int | None = None) -> list[dict]:
    """The layouts of ``gpus`` GPUs that fit in ``gpu_memory_gib`` each, with ``fits`` on each
    (``include_unfit`` lists the rest too, after them), fastest predicted step first.

    batch_size: global batch in sequences (default: one per GPU, or per cp GPUs); seq_len: default
    the model's ``max_seq_len``. flash_attention / recompute / sequence_parallel: see
    ``minitp.cost.activation_bytes_per_rank``; activations: how a block's are counted
    (``plan_layout``); device: whose FLOP/s and links time the step;
    cp: context parallel degree, fixed: the layouts are those of gpus/cp (see ``plan_layout``);
    cp_attention: its way of attending, "ring", "ulysses" or "allgather" (``plan_layout``; Ulysses
    refuses the layouts whose tp leaves a number of heads cp does not divide).
    ep: expert parallel degree of a MoE model, fixed: the layouts whose dp·cp it divides.
    data_parallel: "fsdp", "ddp" or "hsdp"; dp_shard: HSDP's shard group (``plan_layout``; the
    layouts whose dp it does not divide are refused), by default each layout's ``default_dp_shard``.
    refused: a list to which each layout the model or batch cannot take is appended, as (dp, pp, tp,
    why) (``why_no_layout`` says it in one line when none is left).
    """
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an integer >= 1, got {gpus!r}")
    if gpus > MAX_GPUS:
        raise ValueError(f"gpus={gpus} is more than the planner's {MAX_GPUS} (2**20)")
    if gpu_memory_gib <= 0:
        raise ValueError(f"gpu_memory must be > 0 GiB, got {gpu_memory_gib}")
    check_positive("cp", cp)
    check_divisible("gpus", gpus, "cp", cp)
    check_cp_attention(cp_attention)
    # said once here, not as a refusal of every layout
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be one of {', '.join(map(repr, DATA_PARALLEL))}, "
                         f"got {data_parallel!r}")
    if dp_shard is not None and data_parallel != "hsdp":
        raise ValueError(f"dp_shard={dp_shard} is HSDP's shard group; pass data_parallel='hsdp'")
    if activations not in cost.activations.FORMULAS:
        raise ValueError(
            f"activations must be one of {', '.join(map(repr, cost.activations.FORMULAS))}, "
            f"got {activations!r}")
    if cost.check_ep(cfg, ep):
        check_divisible("gpus", gpus, "ep", ep,
                        ": the experts are split over ep of the data-parallel GPUs")
    batch_size = batch_size or gpus // cp
    seq_len = seq_len or cfg.max_seq_len
    if cp > 1:
        check_divisible("seq_len", seq_len, "2·cp", 2 * cp)
    device = replace(device, gpus_per_node=gpus_per_node)
    rows = []
    for dp, pp, tp in candidate_layouts(gpus // cp, gpus_per_node):
        try:
            row = plan_layout(cfg, dp, pp, tp, batch_size, seq_len, data_parallel, zero, precision,
                              micro_batch, flash_attention, recompute, sequence_parallel, device,
                              cp, ep, activations, cp_attention, dp_shard)
        except ValueError as e:
            if refused is not None:
                refused.append((dp, pp, tp, str(e)))
            continue
        row["fits"] = row["memory_total"] <= gpu_memory_gib * GIB
        if row["fits"] or include_unfit:
            rows.append(row)
    # fitting first; then the fastest predicted step, then fewest bytes between machines (pp and dp)
    rows.sort(key=lambda r: (not r["fits"], round(r["step_s"], 12),
                             r["bytes_per_step"]["pp"] + r["bytes_per_step"]["dp"]
                             + r["bytes_per_step"]["cp"]
                             + r["bytes_per_step"].get("ep", 0.0),
                             r["bytes_per_step"]["tp"]))
    return rows


def default_dp_shard(dp: int, pp: int, tp: int, cp: int, gpus_per_node: int) -> int:
    """HSDP's shard group by default: min(dp, gpus_per_node // (tp·pp·cp)) replicas' ranks, so that
    the group (with their cp·pp·tp) fits in a machine and its gathers stay on NVLink; the largest
    divisor of dp up to that (1 when tp·pp·cp fills a machine alone: DDP across machines)."""
    fits = max(1, gpus_per_node // (tp * pp * cp))
    return max(d for d in divisors(dp) if d <= fits)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, smallest first (trial division up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidate_layouts(n: int, gpus_per_node: int) -> list[tuple[int, int, int]]:
    """The (dp, pp, tp) of ``n`` GPUs whose tensor-parallel group fits in a machine (tp <=
    ``gpus_per_node``), by tp then pp, smallest first: ``grid.layouts(n)`` without the rest, found
    among the divisors of n alone (a loop over every tp would take hours for a huge n)."""
    found = divisors(n)
    return [(n // (tp * pp), pp, tp) for tp in found if tp <= gpus_per_node
            for pp in found if (n // tp) % pp == 0]


def why_no_layout(refused: list, gpus: int, batch_size: int | None, cp: int = 1, ep: int = 1,
                  micro_batch: int = 1) -> str:
    """One line saying why no layout of ``gpus`` GPUs is possible, from what ``plan`` appended to
    its ``refused`` list: the rule that excludes them all when one does (ep must divide dp·cp and dp
    the batch), else the reasons the layouts were refused, the most common first."""
    head = f"no layout of {gpus} GPUs is possible for this model and batch"
    n = gpus // cp
    batch_size = batch_size or n
    if ep > 1:
        step = ep // math.gcd(ep, cp)  # the smallest dp whose dp·cp ep divides
        allowed = [dp for dp in divisors(n) if dp % step == 0]
        if allowed and not any(batch_size % (dp * micro_batch) == 0 for dp in allowed):
            dp_cp = "dp" if cp == 1 else f"dp·cp = dp·{cp}"
            return (f"{head}: ep={ep} must divide {dp_cp} (each expert's ranks lie among the "
                    f"data-parallel ones), so dp is {' or '.join(map(str, allowed))}, but "
                    f"batch_size={batch_size} splits into no such number of replicas (it needs a "
                    f"multiple of {allowed[0] * micro_batch} sequences)")
    reasons: dict[str, list[str]] = {}
    for dp, pp, tp, why in refused:
        reasons.setdefault(why, []).append(f"dp={dp} pp={pp} tp={tp}")
    ranked = sorted(reasons.items(), key=lambda item: -len(item[1]))
    said = [f"{why} ({where[0]}" + (f" and {len(where) - 1} more)" if len(where) > 1 else ")")
            for why, where in ranked[:3]]
    more = f"; and {len(ranked) - 3} other reasons" if len(ranked) > 3 else ""
    return f"{head}: " + "; ".join(said) + more if said else head


ACTIVATION_NOTES = {  # format_plan's footer, by plan's ``activations``
    "llama": "each block's saved tensors as minitp's LLaMA block keeps them "
             "(cost.llama_block_activation_bytes)",
    "llama-regather": "minitp's LLaMA block with the column-parallel inputs gathered again in "
                      "backward",
    "gpt3": "Korthikanti et al.'s count for GPT-3's block (a LLaMA block keeps more)",
    "moe": "an estimate of the MoE block (cost.moe_block_activation_bytes)",
}


def format_plan(rows: list[dict], title: str = "") -> str:
    """The table ``minitp plan`` prints: memory per GPU in GiB, bytes per step in MiB (a cp column,
    the way attention crosses it (ring, ulysses or allgather) and its bytes when the layouts split
    sequences; an ep column and the all-to-alls' bytes when they split experts)."""
    lines = [title] if title else []
    if not rows:
        return "\n".join(lines + ["no layout of these GPUs is possible for this model and batch"])
    cp = any(r.get("cp", 1) > 1 for r in rows)
    ep = any(r.get("ep", 1) > 1 for r in rows)
    lines.append(f"{'dp':>4} {'pp':>3} {'tp':>3} " + (f"{'cp':>3} {'attention':>9} " if cp else "")
                 + (f"{'ep':>3} " if ep else "")
                 + f"{'zero':>4}  {'states GiB':>10} {'activ. GiB':>10} {'total GiB':>9}  "
                 f"{'tp MiB/step':>11} {'pp MiB/step':>11} {'dp MiB/step':>11}  "
                 + (f"{'cp MiB/step':>11}  " if cp else "") + (f"{'ep MiB/step':>11}  " if ep
                                                               else "") + f"{'bubble':>6} "
                                                                          f" {'step s':>7} "
                                                                          f"{'MFU':>5}  fits")
    for r in rows:
        b = r["bytes_per_step"]
        lines.append(f"{r['dp']:>4} {r['pp']:>3} {r['tp']:>3} "
                     + (f"{r['cp']:>3} {r.get('cp_attention', 'ring'):>9} " if cp else "")
                     + (f"{r.get('ep', 1):>3} " if ep else "")
                     + f"{r['zero'] if r['zero'] is not None else '-':>4}  "
                     f"{r['memory_states'] / GIB:>10.2f} {r['memory']['activations'] / GIB:>10.2f} "
                     f"{r['memory_total'] / GIB:>9.2f}  {b['tp'] / 2**20:>11.1f} "
                     f"{b['pp'] / 2**20:>11.1f} "
                     f"{b['dp'] / 2**20:>11.1f}  " + (f"{b['cp'] / 2**20:>11.1f}  " if cp else "")
                     + (f"{b.get('ep', 0.0) / 2**20:>11.1f}  " if ep else "")
                     + f"{r['bubble_fraction']:>6.3f}  {r['step_s']:>7.2f} "
                     f"{r['mfu']:>5.1%}  {'yes' if r['fits'] else 'no'}")
    lines.append(
        "states: parameters, gradients, AdamW (the formulas minitp's runs are checked against); "
        f"activations: under 1F1B, {ACTIVATION_NOTES[rows[0].get('activation_formula', 'llama')]}"
        ", and the last stage's loss's fp32 logits; "
        "bytes: what the busiest rank sends per step; "
        f"step and MFU: predicted on {rows[0]['device']} (minitp.cost.step_time)")
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """The same layouts as a Markdown table (cp and its way of attending when the layouts split
    sequences, an ep column when they split experts)."""
    cp = any(r.get("cp", 1) > 1 for r in rows)
    ep = any(r.get("ep", 1) > 1 for r in rows)
    head = ("| dp | pp | tp | " + ("cp | cp attention | " if cp else "") + ("ep | " if ep else "")
            + "ZeRO | states GiB | activations GiB | total GiB | tp MiB/step | pp MiB/step | dp "
              "MiB/step | " + ("cp MiB/step | " if cp else "") + ("ep MiB/step | " if ep else "")
              + "bubble | step s | MFU | fits |")
    lines = [head, "|" + "---:|" * 3 + ("---:|:---|" if cp else "") + "---:|" * (10 + cp + 2 * ep)
             + ":---:|"]
    for r in rows:
        b = r["bytes_per_step"]
        lines.append(f"| {r['dp']} | {r['pp']} | {r['tp']} | "
                     + (f"{r['cp']} | {r.get('cp_attention', 'ring')} | " if cp else "")
                     + (f"{r.get('ep', 1)} | " if ep else "")
                     + f"{r['zero'] if r['zero'] is not None else '-'} | "
                     f"{r['memory_states'] / GIB:.2f} | {r['memory']['activations'] / GIB:.2f} | "
                     f"{r['memory_total'] / GIB:.2f} | {b['tp'] / 2**20:.1f} | "
                     f"{b['pp'] / 2**20:.1f} | "
                     f"{b['dp'] / 2**20:.1f} | " + (f"{b['cp'] / 2**20:.1f} | " if cp else "")
                     + (f"{b.get('ep', 0.0) / 2**20:.1f} | " if ep else "")
                     + f"{r['bubble_fraction']:.3f} | {r['step_s']:.2f} | {r['mfu']:.1%} | "
                     f"{'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


# the ways of keeping activations a learner picks from (``minitp.viz.explore.plan_explorer``):
# name -> (recompute, sequence_parallel, activations) of ``plan``
ACTIVATIONS = {"replicated norms": (False, False, "llama"),
               "sequence parallel": (False, True, "llama"),
               "sequence parallel, gathered again": (False, True, "llama-regather"),
               "full recomputation": (True, False, "llama")}
