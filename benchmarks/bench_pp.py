"""minitp's pipeline parallel against PyTorch's ``torch.distributed.pipelining``: the same stages,
seed, data and number of micro-batches, alternating in one run on the same ranks.

    python benchmarks/bench_pp.py [--models tiny,small] [--quick]

Each rank builds its stage twice from the same seed: once run by ``minitp.pp.Pipeline``, once
wrapped in torch's ``PipelineStage`` and run by the matching schedule (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B`` over 2 chunks per rank, ``ScheduleInterleavedZeroBubble``
over one). The stage modules torch runs are minitp's ``PipelineStage`` (the same blocks under the
same names), so both compute the same thing and only the schedule runtime differs. Two stages: one
per core here.
"""

from __future__ import annotations

import sys

import harness

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
             "zb": "ScheduleInterleavedZeroBubble"}
VIRTUAL_STAGES = {"interleaved": 2}  # chunks per rank; 1 for the others
MICROBATCHES = 8


def _worker(model_name: str, schedule: str, rounds: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    from minitp.models import build_model, get_config, loss_fn
    from minitp.models.train import make_optimizer, synthetic_batches
    from minitp.pp import Pipeline, PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, train = get_config(model_name), harness.train_config(model_name, warmup + rounds * steps)
    batches = synthetic_batches(cfg, train)

    v = VIRTUAL_STAGES.get(schedule, 1)
    ours = Pipeline(build_model(cfg, seed=train.seed), None, schedule, MICROBATCHES, virtual_stages=v)
    ours_opt = make_optimizer(ours.parameters(), train.lr)
    model = build_model(cfg, seed=train.seed)
    pieces = [c * world + rank for c in range(v)]  # chunk c is piece c·p + rank, as in minitp
    modules = [PipelineStage(model, k, world * v) for k in pieces]
    stages = [pipelining.PipelineStage(m, k, world * v, torch.device("cpu")) for m, k in zip(modules, pieces)]
    schedule_class = getattr(pipelining, SCHEDULES[schedule])
    theirs = schedule_class(stages if v > 1 or schedule == "zb" else stages[0], MICROBATCHES, loss_fn=loss_fn)
    theirs_opt = make_optimizer([q for m in modules for q in m.parameters()], train.lr)

    def theirs_state():
        return {k: t for m in modules for k, t in m.state_dict().items()}

    def minitp_step(i):
        ours_opt.zero_grad()
        ours.forward_backward(*batches[i])
        ours_opt.step()

    def torch_step(i):
        tokens, targets = batches[i]
        theirs_opt.zero_grad()
        if rank == 0:  # the first stage feeds the tokens, the last the targets
            theirs.step(tokens)
        elif rank == world - 1:
            theirs.step(target=targets)
        else:
            theirs.step()
        theirs_opt.step()

    sides = {"minitp": harness.Side(minitp_step, ours.state_dict),
             "torch": harness.Side(torch_step, theirs_state)}
    return harness.time_sides(sides, rounds, steps, warmup)


def comparisons(models: list[str]) -> list[harness.Comparison]:
    return [harness.Comparison(f"pp/{schedule}", model, 2, _worker, (model, schedule),
                               note=f"vs {torch_name}, {MICROBATCHES} micro-batches")
            for model in models for schedule, torch_name in SCHEDULES.items()]


if __name__ == "__main__":
    harness.main(["--only", "pp", *sys.argv[1:]])
