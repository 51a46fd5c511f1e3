"""minitp's ring all-reduce (``minitp.ring``, built from sends and receives) against the backend's own
``all_reduce`` (gloo's), on the same buffer, alternating in one run.

    python benchmarks/bench_ring.py [--quick]

Both sides sum the same float32 buffer (copied fresh each step, on both) over 4 ranks; the sums
must agree at the end. Two lines: minitp's default sub-chunk size, and 1 MiB sub-chunks (the ring
pipelined four ways per step: more messages, the same bytes). What both sides do each step: copy
the buffer, then sum it over the ranks; there is no optimizer, so the table's optimizer columns are
empty and the whole step is the all-reduce.
"""

from __future__ import annotations

import sys

import harness

from minitp.ring import SUB_CHUNK_BYTES


def _worker(numel: int, sub_chunk_bytes: int, rounds: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    from minitp.ring import ring_all_reduce

    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    ours, theirs = torch.empty_like(x), torch.empty_like(x)

    def minitp_step(i):
        ours.copy_(x)
        ring_all_reduce(ours, sub_chunk_bytes=sub_chunk_bytes)

    def torch_step(i):
        theirs.copy_(x)
        dist.all_reduce(theirs)

    return harness.time_sides({"minitp": harness.Side(minitp_step, lambda: {"sum": ours}),
                               "torch": harness.Side(torch_step, lambda: {"sum": theirs})},
                              rounds, steps, warmup)


def comparisons(models: list[str]) -> list[harness.Comparison]:
    """The ring at 16 MB on 4 ranks (the size the target names), whatever the models: with the
    default sub-chunks (a 4 MiB chunk goes whole) and cut into 1 MiB sub-chunks (4 per step)."""
    return [harness.Comparison(f"ring/16MB{suffix}", "16 MB float32", 4, _worker, (4 * 2**20, sub),
                               note=f"vs gloo all_reduce; sub-chunks of {sub // 2**20} MiB",
                               timing={"rounds": 16, "steps": 3})
            for suffix, sub in (("", SUB_CHUNK_BYTES), ("/sub-chunks-1MiB", 2**20))]


if __name__ == "__main__":
    harness.main(["--only", "ring", *sys.argv[1:]])
