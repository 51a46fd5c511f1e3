"""The collective matmul (``minitp.tp_overlap``) against the unfused sequence-parallel MLP
(``minitp.tp``): the same SwiGLU MLP, the same weights and input, alternating in one run on the
same 2 ranks. Not part of ``make bench`` (there is no PyTorch side here): run it alone.

    python benchmarks/bench_overlap.py [--tokens 2048] [--dim 512] [--hidden 256]
                                       [--rounds 9] [--steps 2] [--warmup 2]

The size: 2048 tokens (B = 2, S = 1024), D = 512, F = 256, picked so that a matmul chunk takes
about as long as the message beside it, where hiding one behind the other matters most. Each rank
holds (2, 512, 512) of the input; a forward chunk is 1024 tokens through this rank's 128 units of
w1 and of w3 (2 × 2 × 1024 × 512 × 128 ≈ 0.27 GFLOP), the message beside it a 2 MiB chunk of the
input. Measured on 2 cores with gloo over loopback, one thread per rank: a 3.5-5 ms matmul chunk
beside a 4-4.6 ms all-gather. With ``--hidden 1536`` the chunk is six times longer than the same
message: little is left to hide. Each rank has one thread (``torch.set_num_threads(1)``, as
``launch`` sets).

What each side does in a step: forward and backward of the MLP on this rank's (B, S/2, D)
positions (which need a gradient, as a block's input does), gradients zeroed first; no optimizer.
A round runs both sides ``--steps`` steps each, the order swapped every round (as
``harness.time_sides`` does), each step after a barrier; a step's time is the slower rank's.
Exposed communication is read from the step's own trace: the unfused side's collectives block, so
their whole duration is time the rank waits; the overlapped side posts its messages and waits for
them in "wait" spans, whose durations are what is left exposed. Either way a wait also holds the
time this rank waits for a slower neighbour to arrive, not only bytes on the wire. Reported:
medians over rounds of each side's step and exposed time, the median paired ratio (overlapped /
unfused, per round) with its interquartile range, the load average before and after, and the
median forward matmul chunk beside the unfused all-gather (one chunk's message at 2 ranks) to
show the balance the size strikes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import harness

SIDES = ("unfused", "overlapped")


def _worker(tokens: int, dim: int, hidden: int, rounds: int, steps: int, warmup: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from minitp import tp, tp_overlap
    from minitp import trace as _trace
    from minitp.models.llama import FeedForward

    n, rank = dist.get_world_size(), dist.get_rank()
    batch = 2
    torch.manual_seed(0)
    plain = FeedForward(dim, hidden)
    mlps = {"unfused": tp.ParallelFeedForward(plain, None, sequence_parallel=True),
            "overlapped": tp_overlap.OverlappedFeedForward(plain, None)}
    x = torch.randn(batch, tokens // batch, dim, generator=torch.Generator().manual_seed(1))
    # (B, S/2, D), needing a gradient as the residual stream does inside a model
    mine = x.chunk(n, dim=1)[rank].contiguous().requires_grad_()

    def step(side: str) -> tuple[float, float, list]:
        mlp = mlps[side]
        mlp.zero_grad(set_to_none=True)
        mine.grad = None
        dist.barrier()
        with _trace.recording(rank) as record:
            start = time.perf_counter()
            mlp(mine).pow(2).mean().backward()
            seconds = time.perf_counter() - start
        if side == "unfused":  # blocking collectives: all their time is waiting
            waits = [e for e in record.events if e.kind == "comm"]
        else:  # posted, then waited for in "wait" spans
            waits = [e for e in record.events if e.kind == "compute" and e.op == "wait"]
        return seconds, sum(e.duration for e in waits), record.events

    outputs = {side: mlps[side](mine).detach() for side in SIDES}
    diff = (outputs["unfused"] - outputs["overlapped"]).abs().max().item()
    for _ in range(warmup):
        for side in SIDES:
            step(side)
    times = {side: [] for side in SIDES}  # per round: [(seconds, exposed seconds), ...]
    chunks, gathers = [], []
    for i in range(rounds):
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        for side in order:
            runs = [step(side) for _ in range(steps)]
            times[side].append([(s, w) for s, w, _ in runs])
            for _, _, events in runs:
                for e in events:
                    if e.phase != "forward":
                        continue
                    if e.kind == "compute" and e.op == "matmul" and "matmul_reduce" not in e.label:
                        chunks.append(e.duration)  # w1 and w3 on one chunk of positions
                    if e.kind == "comm" and e.op == "all_gather":
                        gathers.append(e.duration)
    return {"times": times, "diff": diff, "chunk_s": statistics.median(chunks),
            "gather_s": statistics.median(gathers)}


def summarize(per_rank: list[dict]) -> dict:
    """Per side: the median over rounds of the median step (each step the slower rank's), its
    exposed communication likewise; the paired ratio of the step times."""
    rounds = len(per_rank[0]["times"]["unfused"])

    def per_round(side: str, which: int) -> list[float]:
        return [statistics.median(max(r["times"][side][i][j][which] for r in per_rank)
                                  for j in range(len(per_rank[0]["times"][side][i])))
                for i in range(rounds)]

    step = {side: per_round(side, 0) for side in SIDES}
    exposed = {side: per_round(side, 1) for side in SIDES}
    q1, ratio, q3 = harness.quartiles([o / u for o, u in zip(step["overlapped"], step["unfused"])])
    return {
        **{f"{side}_ms": round(statistics.median(step[side]) * 1e3, 1) for side in SIDES},
        **{f"{side}_exposed_ms": round(statistics.median(exposed[side]) * 1e3, 2)
           for side in SIDES},
        "ratio": round(ratio, 3), "iqr": [round(q1, 3), round(q3, 3)], "rounds": rounds,
        "forward_chunk_matmul_ms": round(max(r["chunk_s"] for r in per_rank) * 1e3, 2),
        "unfused_all_gather_ms": round(max(r["gather_s"] for r in per_rank) * 1e3, 2),
        "output_diff": max(r["diff"] for r in per_rank),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="B·S, with B = 2")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    args = parser.parse_args(argv)
    from minitp.launcher import launch

    before = harness.loadavg()
    per_rank = launch(_worker, 2, args.tokens, args.dim, args.hidden, args.rounds, args.steps,
                      args.warmup, echo=False, timeout=600)
    line = {"ranks": 2, "tokens": args.tokens, "dim": args.dim, "hidden": args.hidden,
            **summarize(list(per_rank)),
            "loadavg": {"before": before, "after": harness.loadavg()}, "machine": harness.machine()}
    print(json.dumps(line))
    print(f"\nSP MLP, 2 ranks, {args.tokens} tokens, D={args.dim}, F={args.hidden}; "
          f"load {before} before, {line['loadavg']['after']} after")
    print("| side | fwd+bwd ms | exposed comm ms |\n|---|---:|---:|")
    for side in SIDES:
        print(f"| {side} | {line[f'{side}_ms']} | {line[f'{side}_exposed_ms']} |")
    print(f"overlapped / unfused: {line['ratio']} (IQR {line['iqr'][0]}–{line['iqr'][1]}), "
          f"{line['rounds']} paired rounds; a forward matmul chunk {line['forward_chunk_matmul_ms']} "
          f"ms, the unfused all-gather {line['unfused_all_gather_ms']} ms")
    return line


if __name__ == "__main__":
    main(sys.argv[1:])
