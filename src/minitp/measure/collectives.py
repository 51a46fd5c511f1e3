"""What an all-gather and a reduce-scatter cost on this machine, against the ring model of an
all-reduce, measured for ``minitp calibrate``.

The time model prices every collective by one α and β, fitted to all-reduces
(``minitp.measure.calibrate.fit_alpha_beta``): on a ring an all-gather or a reduce-scatter is half
an all-reduce, (n-1) steps of B/n bytes. That holds for NCCL's rings; gloo on a CPU runs each kind
its own way. On 2 ranks here a reduce-scatter took 1.3 to 2 times as long as an all-reduce of the
same buffer and an all-gather about half to four fifths (mean calls, 4 KiB to 1 MiB), so FSDP, whose
messages are gathers and reduce-scatters, came out 1.2 to 1.4 times slower than predicted. The same
calls are timed as the all-reduces are (each after a short burst of compute), and each kind's
factor is its mean times summed over the sizes, over what the ring model says for them with the
all-reduces' α and β (``fit_kind_factors``): the time model multiplies that kind's messages by it
(``minitp.cost.Device.gather_factor``, ``scatter_factor``; 1 on the GPU sheets).

And what a collective waits for the other ranks: α is fitted to all-reduces issued after 0.1 ms of
compute, but in a step a collective comes after milliseconds of it, and the longer the ranks
computed, the further apart they arrive. A 4-byte all-reduce here took 0.3-0.7 ms on average after
0.1 ms of compute, 1.0-1.2 ms after 5 ms. ``fit_wait`` turns the two into seconds of waiting per
second of compute (``Device.wait_per_compute``), which the time model adds to a step of more than
one rank.
"""

from __future__ import annotations

import statistics
import time

import torch

from minitp.cost import Link, collective_time

KINDS = ("all_gather", "reduce_scatter")
# matmuls of the tiny model's shape before a wait's all-reduce: about 0.1 ms (as the all-reduces
# that fit α come) and about 5 ms (a block's forward and backward and more)
BURSTS = (8, 400)
FIELDS = {"all_gather": "all_gather_factor", "reduce_scatter": "reduce_scatter_factor"}


def _kinds_worker(sizes: tuple[int, ...], repeats: int, shape: tuple[int, int]) -> dict:
    """{kind: {bytes of the full buffer: mean seconds}} on this rank: each call after a burst of
    the tiny model's matmuls (``shape``: tokens, D), as ``calibrate._all_reduce_worker`` times its
    all-reduces; the first two calls of each size warm up. And "waits": {matmuls in the burst:
    (its mean seconds, the mean seconds of a 4-byte all-reduce after it)} (``fit_wait``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    n = dist.get_world_size()
    a, w = torch.randn(*shape), torch.randn(shape[1], shape[1])
    out = {kind: {} for kind in KINDS}
    for nbytes in sizes:
        full = torch.zeros(max(n, nbytes // 4 // n * n))  # divides into n shards
        shard = torch.zeros(full.numel() // n)
        calls = {"all_gather": (dist.all_gather_into_tensor, full, shard),
                 "reduce_scatter": (dist.reduce_scatter_tensor, shard, full)}
        for kind, (call, output, input) in calls.items():
            times = []
            for _ in range(repeats + 2):
                for _ in range(8):
                    a @ w
                t0 = time.perf_counter()
                call(output, input)
                times.append(time.perf_counter() - t0)
            out[kind][nbytes] = statistics.fmean(times[2:])
    out["waits"] = {}
    one = torch.zeros(1)
    for burst in BURSTS:
        spent, times = [], []
        for _ in range(max(4, repeats // 2) + 2):
            t0 = time.perf_counter()
            for _ in range(burst):
                a @ w
            t1 = time.perf_counter()
            dist.all_reduce(one)
            spent.append(t1 - t0)
            times.append(time.perf_counter() - t1)
        out["waits"][burst] = (statistics.fmean(spent[2:]), statistics.fmean(times[2:]))
    return out


def fit_wait(ranks: list[dict[int, tuple[float, float]]]) -> float:
    """Seconds a collective waits per second of compute before it (``Device.wait_per_compute``):
    the slope of a 4-byte all-reduce's mean time from a short burst of compute to a long one,
    averaged over the ranks (at least 0). Ranks that compute the same work still arrive apart, the
    more so the longer they computed, and a collective ends only once the last has come: over a
    step the waits add up to this slope times the compute, however many collectives cut it."""
    slopes = []
    for waits in ranks:
        (short_s, short_wait), (long_s, long_wait) = (waits[b] for b in sorted(waits))
        slopes.append((long_wait - short_wait) / (long_s - short_s) if long_s > short_s else 0.0)
    return max(0.0, statistics.fmean(slopes))


def fit_kind_factors(means: dict[str, dict[int, float]], alpha_s: float, bytes_per_s: float,
                     n: int = 2) -> dict[str, float]:
    """Each kind's measured seconds summed over the sizes, over the ring model's for the same calls
    (α, β of the all-reduces; ``minitp.cost.collective_time``): {"all_gather_factor": ...,
    "reduce_scatter_factor": ...}."""
    link = Link("gloo, as the all-reduces fit it", alpha_s, bytes_per_s)
    return {FIELDS[kind]: sum(times.values()) / sum(
        collective_time(kind, b, n, link) for b in times) for kind, times in means.items()}


def describe(cal: dict) -> str:
    """'; all-gather 0.71x, reduce-scatter 1.93x the ring model; a collective waits 0.14 s per s of
    compute before it' (each part only when measured)."""
    text = ""
    if cal.get("all_gather_factor") is not None and cal.get("reduce_scatter_factor") is not None:
        text += (f"; all-gather {cal['all_gather_factor']:.2f}x, reduce-scatter "
                 f"{cal['reduce_scatter_factor']:.2f}x the ring model")
    if cal.get("wait_per_compute") is not None:
        text += f"; a collective waits {cal['wait_per_compute']:.2f} s per s of compute before it"
    return text
