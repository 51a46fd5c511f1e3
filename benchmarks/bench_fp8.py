"""FP8 training (``minitp.fp8``, simulated) against fp32 and bf16 on the byte model: the same seed,
batches, learning-rate schedule, clipping and steps; validation loss after the same steps, and the
time of a step. Not part of ``make bench`` (there is no PyTorch side here): run it alone.

    python benchmarks/bench_fp8.py [--steps 80] [--batch 8] [--seq 128] [--eval-batches 4]
                                   [--threads 1] [--no-delayed]

The four runs, one after the other in this process:

* **fp32**: the plain byte model (``minitp.models.BYTE``, 0.85 M parameters);
* **bf16**: the same model under ``torch.autocast("cpu", torch.bfloat16)``: fp32 weights (the
  master), the matmuls in bf16 (the recipe ``minitp.fsdp``'s mixed precision follows, without
  the sharding);
* **fp8 current** and **fp8 delayed**: ``minitp.fp8.convert_to_float8`` on the model: every linear
  of the blocks casts its input and weight to e4m3 and its output gradient to e5m2, with current
  scaling (this tensor's amax) or delayed scaling (the last 16 amaxes); the head stays fp32.

Data: the byte corpus (``minitp.data.load_corpus``: the standard library's source), training
batches from ``Sampler(train, batch, seq, seed=0)``, validation on the held-out files
(``Sampler(val, batch, seq)``, its first ``--eval-batches`` batches). Schedule and clipping are
``minitp train``'s (``trainer.lr_at``: warm-up over a tenth of the steps, then a cosine; the
global norm clipped at 1.0); AdamW by ``make_optimizer``.

What to read: the validation losses, side by side (how much the formats cost in quality at this
size and length); the step times say what the *simulation* costs on a CPU, which has neither bf16
nor FP8 matmul units: the casts are extra work here, where an H100 would run the FP8 matmul at
twice bf16's rate. bf16 is the slowest of the four on a CPU without bf16 instructions (AVX512-BF16,
AMX): torch's bf16 matmul there converts as it goes, about 9 times fp32's time on the machine this
was written on, which is why the default run is short (80 steps: about 2.5 minutes on one core).
The load average is printed before and after: the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch


def _run(kind: str, steps: int, batch: int, seq: int, eval_batches: int) -> dict:
    from minitp import fp8, trainer
    from minitp.data import Sampler, load_corpus
    from minitp.models import BYTE, build_model, loss_fn
    from minitp.models.train import make_optimizer

    corpus = load_corpus()
    s = trainer.Settings(steps=steps, batch_size=batch, seq_len=seq, warmup=max(1, steps // 10))
    train, val = Sampler(corpus.train, batch, seq, s.seed), Sampler(corpus.val, batch, seq)
    model = build_model(BYTE, seed=s.seed)
    if kind.startswith("fp8"):
        fp8.convert_to_float8(model, recipe=kind.removeprefix("fp8 "))
    optimizer = make_optimizer(model.parameters(), s.lr)

    def precision():
        if kind == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    times, losses = [], []
    for i in range(steps):
        start = time.perf_counter()
        tokens, targets = train.batch(i)
        optimizer.zero_grad(set_to_none=True)
        with precision():
            loss = loss_fn(model(tokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        for group in optimizer.param_groups:
            group["lr"] = trainer.lr_at(i, s)
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    with torch.no_grad(), precision():
        val_loss = statistics.fmean(loss_fn(model(x), y).item()
                                    for x, y in (val.batch(i) for i in range(eval_batches)))
    return {"kind": kind, "train": statistics.fmean(losses[-10:]), "val": val_loss,
            "step_ms": 1e3 * statistics.median(times[1:] or times), "first": losses[0]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-delayed", action="store_true", help="skip the fp8 delayed run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = ["fp32", "bf16", "fp8 current"] + ([] if args.no_delayed else ["fp8 delayed"])
    load_before = [round(x, 2) for x in os.getloadavg()]
    print(f"byte model, {args.steps} steps of {args.batch}x{args.seq} bytes, "
          f"{args.threads} thread(s); load before {load_before}")
    rows = []
    for kind in kinds:
        row = _run(kind, args.steps, args.batch, args.seq, args.eval_batches)
        rows.append(row)
        print(f"{kind:12s} train (last 10) {row['train']:.4f}  val {row['val']:.4f}  "
              f"step {row['step_ms']:.1f} ms  (step 0: {row['first']:.4f})", flush=True)
    fp32 = rows[0]
    for row in rows[1:]:
        print(f"{row['kind']:12s} val - fp32's: {row['val'] - fp32['val']:+.4f} nats/byte, "
              f"step time {row['step_ms'] / fp32['step_ms']:.2f}x fp32's")
    print(f"load after {[round(x, 2) for x in os.getloadavg()]}")
    return rows


if __name__ == "__main__":
    main()
