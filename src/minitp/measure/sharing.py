"""What a rank on every core does to a step, measured for ``minitp calibrate``: the tiny model's
training step with every core running one against one rank alone (``busy_slowdown``).

Both halves run inside one launch, in rounds that swap which half comes first: the lone rank steps
while the others wait in a barrier (gloo's wait sleeps on its socket), then every rank steps at
once. Measured as two launches a few seconds apart, the figure moved from 1.00 to 1.51 between
two calibrations on this 2-core VM, whose speed drifts from one minute to the next; paired round
by round, a drift moves both halves alike.
"""

from __future__ import annotations

import statistics
import time

import torch


def _busy_step_worker(repeats: int, rounds: int = 5) -> list[tuple[float, float | None]]:
    """Per round, (this rank's median step with every rank stepping at once, a barrier before each,
    the first rank's median step alone while the others wait in a barrier; None on the others): the
    tiny model's training step (one micro-batch, AdamW), ``repeats`` steps each. The rounds swap
    which comes first, so a machine whose speed drifts moves both halves of a round alike."""
    import torch.distributed as dist

    from minitp.models import TINY, build_model, loss_fn
    from minitp.models.train import make_optimizer

    torch.set_num_threads(1)
    model = build_model(TINY, seed=0)
    optimizer = make_optimizer(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, TINY.vocab_size, (8, 16), generator=g) for _ in range(2))

    def median_step(crowd: bool) -> float:
        times = []
        for _ in range(repeats):
            if crowd:
                dist.barrier()
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(model(tokens), targets).backward()
            optimizer.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    median_step(True)  # warm-up
    out = []
    for r in range(rounds):
        pair = {}
        for crowd in ((True, False) if r % 2 == 0 else (False, True)):
            dist.barrier()
            pair[crowd] = median_step(crowd) if crowd or dist.get_rank() == 0 else None
        out.append((pair[True], pair[False]))
    return out


def busy_slowdown(ranks: list[list[tuple[float, float | None]]]) -> float:
    """How many times slower a step runs when every core runs a rank than on one rank alone, from
    ``_busy_step_worker``'s rounds on every rank: per round the ranks' mean step together over the
    first rank's alone, the median over the rounds (at least 1: a faster crowd is noise). Caches,
    memory bandwidth and the cores' shared clock make it more than 1 on most machines, before any
    message is sent."""
    ratios = [statistics.fmean(rank[i][0] for rank in ranks) / ranks[0][i][1]
              for i in range(len(ranks[0]))]
    return max(1.0, statistics.median(ratios))
