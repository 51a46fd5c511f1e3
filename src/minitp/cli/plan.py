"""``minitp plan`` (the layouts of N GPUs that fit a model, from the cost model) and ``minitp
calibrate`` (this machine's figures for the time model)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from minitp.cli.common import check_output_file, write_json
from minitp.plan import MAX_GPUS
from minitp.runs.context_parallel import ATTENTION
from minitp.runs.registry import Option, OptionError


def plan_command(args: argparse.Namespace) -> int:
    from minitp import plan
    from minitp.models import get_config
    from minitp.models.moe import MOE_PRESETS

    if args.gpus is not None and args.gpus > MAX_GPUS:  # the planner answers at once up to it
        raise OptionError("gpus", args.gpus, f"an integer from 1 to {MAX_GPUS}", "--gpus")
    for flag, value in (("--gpus", args.gpus), ("--gpu-memory", args.gpu_memory)):
        if value is None:
            raise ValueError(
                f"{flag} is required: minitp plan --model llama3-8b --gpus 64 --gpu-memory 80")
    check_output_file("--json", args.json)

    cfg = MOE_PRESETS.get(args.model) or get_config("tiny" if args.model == "custom"
                                                    else args.model)
    sizes = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                                           "vocab_size")}
    cfg = cfg.with_(**{k: v for k, v in sizes.items() if v is not None})
    if args.recompute and args.selective_recompute:
        raise ValueError(
            "--recompute (full) and --selective-recompute exclude each other: choose one")
    from minitp.cost import DEVICES, active_params

    recompute = "full" if args.recompute else "selective" if args.selective_recompute else "none"
    options = dict(flash_attention=args.flash_attention, recompute=recompute,
                   sequence_parallel=args.sequence_parallel, device=DEVICES[args.device],
                   cp=args.cp, ep=args.ep, activations=args.activations,
                   cp_attention=args.cp_attention)
    rows = plan.plan(cfg, args.gpus, args.gpu_memory, args.gpus_per_node, args.batch_size,
                     args.seq_len, "ddp" if args.ddp else "fsdp", args.zero, args.precision,
                     include_unfit=args.all, **options)
    active = f", {active_params(cfg) / 1e9:.2f} B active" if hasattr(cfg, "n_experts") else ""
    title = (f"minitp plan: {args.model} ({cfg.num_params() / 1e9:.2f} B parameters{active}) on "
             f"{args.gpus} GPUs of {args.gpu_memory:g} GiB"
             + (f", sequences split over cp = {args.cp} ({args.cp_attention} attention)"
                if args.cp > 1 else "")
             + (f", experts split over ep = {args.ep}" if args.ep > 1 else ""))
    if not any(r["fits"] for r in rows):  # say so, and show how far each layout is from fitting
        refused = []
        rows = plan.plan(cfg, args.gpus, args.gpu_memory, args.gpus_per_node, args.batch_size,
                         args.seq_len, "ddp" if args.ddp else "fsdp", args.zero, args.precision,
                         include_unfit=True, refused=refused, **options)
        if not rows:  # none is possible at all: say why, in one line
            raise ValueError(plan.why_no_layout(refused, args.gpus, args.batch_size, args.cp,
                                                args.ep))
        title += "\nno layout fits; every possible one, with what it would need:"
    print(plan.format_plan(rows, title))
    if args.json:
        write_json({"model": args.model, "num_params": cfg.num_params(),
                     "active_params": active_params(cfg), "gpus": args.gpus,
                     "gpu_memory_gib": args.gpu_memory, "layouts": rows}, args.json)
    return 0 if any(r["fits"] for r in rows) else 1


# `minitp plan`'s options, checked like a strategy's (it runs nothing, so no COMMON ones)
PLAN_OPTIONS = (
    Option("model", str, "llama3-8b", "preset, or 'custom' with the sizes below",
           choices=("tiny", "llama3-8b", "llama3-70b", "mixtral-8x7b", "custom")),
    Option("gpus", int, None, f"number of GPUs (at most {MAX_GPUS})", low=1, optional=True),
    Option("gpu_memory", float, None, "memory per GPU in GiB", above=0, optional=True),
    Option("gpus_per_node", int, 8, "GPUs per machine (tp stays inside one)", low=1),
    Option("batch_size", int, None, "global batch in sequences (default: one per GPU)", low=1,
           optional=True),
    Option("seq_len", int, None, "tokens per sequence (default: the model's max_seq_len)", low=1,
           optional=True),
    Option("ddp", bool, False, "DDP across replicas (default FSDP, ZeRO-3 or 1 with pp)"),
    Option("zero", int, None, "ZeRO stage", choices=(None, 1, 2, 3)),
    Option("precision", str, "bf16", "bytes per parameter and activation",
           choices=("bf16", "fp32")),
    Option("all", bool, False, "also list the layouts that do not fit"),
    Option("recompute", bool, False, "full activation recomputation (keep block inputs)"),
    Option("selective_recompute", bool, False,
           "recompute attention's scores only (Korthikanti et al.)"),
    Option("sequence_parallel", bool, False,
           "split the norms' activations over tp (reduce-scatter/all-gather)"),
    Option("device", str, "h100", "whose FLOP/s and links time the step", choices=("h100", "a100")),
    Option("cp", int, 1, "context parallel: each sequence split over cp GPUs (ring attention); "
           "the layouts are those of gpus/cp", low=1),
    replace(ATTENTION, name="cp_attention"),
    Option("ep", int, 1,
           "expert parallel (a MoE model, e.g. mixtral-8x7b): its experts split over ep of the "
           "data-parallel GPUs; ep divides n_experts and dp·cp", low=1),
    Option("flash_attention", bool, True, "count the stored attention scores", negate=True),
    Option("activations", str, "llama",
           "how a block's activations are counted: minitp's LLaMA block, the same with the "
           "linears' inputs gathered again in backward (Megatron-LM), or GPT-3's (Korthikanti et "
           "al.)",
           choices=("llama", "llama-regather", "gpt3")),
    *(Option(name, int, None, "override the preset's size", low=1, optional=True)
      for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size")),
)


def calibrate_command(args: argparse.Namespace) -> int:
    from minitp.measure import calibrate
    from minitp.runs import measuring

    check_output_file("--json", args.json)
    if not args.dry_run:  # where it will be stored, before seconds of measuring
        calibrate.check_store()
    cal = measuring.calibrate()
    print(calibrate.format_calibration(cal))
    if not args.dry_run:
        print(f"stored in {calibrate.save(cal)}")
    if args.json:
        write_json(cal, args.json)
    return 0


# `minitp calibrate`'s options (it measures this machine for the time model)
CALIBRATE_OPTIONS = (
    Option("dry_run", bool, False, "measure and print, store nothing"),
)
