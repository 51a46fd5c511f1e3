"""minitp's pipeline parallel against PyTorch's ``torch.distributed.pipelining``: the same stages,
seed, data and number of micro-batches, alternating in one run on the same ranks.

    python benchmarks/bench_pp.py [--models tiny,small] [--quick]

Each rank builds its stage twice from the same seed: once run by ``minitp.pp.Pipeline``, once
wrapped in torch's ``PipelineStage`` and run by torch's runtime. The stage modules torch runs are
minitp's ``PipelineStage`` (the same blocks under the same names), so both compute the same thing
and only the schedule runtime differs. Two stages: one per core here.

Which table torch runs: GPipe, 1F1B and interleaved 1F1B (2 chunks per rank) are torch's own
classes (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``), the same schedules by
name, each with its own order of actions. Zero-bubble is minitp's ZB-H1 table itself, action for
action (F, B as torch's input-gradient ``I``, W), handed to torch's table-driven runtime
(``_PipelineScheduleRuntime``, which adds the sends and receives), since torch's own zero-bubble
class (``ScheduleInterleavedZeroBubble``) is a different schedule.

What each side does, and where the harness times it: the step is the schedule's forwards and
backwards over the 8 micro-batches with their sends and receives; then AdamW steps this stage's
parameters, with no message.
"""

from __future__ import annotations

import sys

import harness

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
             "zb": "_PipelineScheduleRuntime"}  # zb: torch's runtime on minitp's own ZB-H1 table
VIRTUAL_STAGES = {"interleaved": 2}  # chunks per rank; 1 for the others
MICROBATCHES = 8
NOTES = {"zb": " on minitp's ZB-H1 table (the same schedule)"}


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
    if schedule == "zb":
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

        theirs = _PipelineScheduleRuntime(stages, MICROBATCHES, loss_fn=loss_fn)
        theirs._prepare_schedule_with_comms(torch_actions(ours.table))
    else:
        schedule_class = getattr(pipelining, SCHEDULES[schedule])
        theirs = schedule_class(stages if v > 1 else stages[0], MICROBATCHES, loss_fn=loss_fn)
    theirs_opt = make_optimizer([q for m in modules for q in m.parameters()], train.lr)

    def theirs_state():
        return {k: t for m in modules for k, t in m.state_dict().items()}

    def minitp_step(i):
        ours_opt.zero_grad()
        ours.forward_backward(*batches[i])

    def torch_step(i):
        tokens, targets = batches[i]
        theirs_opt.zero_grad()
        if rank == 0:  # the first stage feeds the tokens, the last the targets
            theirs.step(tokens)
        elif rank == world - 1:
            theirs.step(target=targets)
        else:
            theirs.step()

    sides = {"minitp": harness.Side(minitp_step, ours.state_dict, lambda i: ours_opt.step()),
             "torch": harness.Side(torch_step, theirs_state, lambda i: theirs_opt.step())}
    return harness.time_sides(sides, rounds, steps, warmup)


def torch_actions(table) -> dict:
    """minitp's schedule table as torch's compute-only actions, rank by rank: F stays F, B becomes
    ``I`` (the input gradient) where the table has W's and ``B`` (the whole backward) where it has
    none, W stays W; chunk c of rank r is stage c·p + r, as in minitp."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    p = len(table)
    kinds = {"F": _ComputationType.FORWARD, "W": _ComputationType.BACKWARD_WEIGHT}
    order = {}
    for rank, actions in enumerate(table):
        split = any(a.kind == "W" for a in actions)
        backward = _ComputationType.BACKWARD_INPUT if split else _ComputationType.FULL_BACKWARD
        order[rank] = [_Action(a.chunk * p + rank, kinds.get(a.kind, backward), a.microbatch) for a in actions]
    return order


def comparisons(models: list[str]) -> list[harness.Comparison]:
    return [harness.Comparison(f"pp/{schedule}", model, 2, _worker, (model, schedule),
                               note=f"vs {torch_name}{NOTES.get(schedule, '')}, {MICROBATCHES} micro-batches")
            for model in models for schedule, torch_name in SCHEDULES.items()]


if __name__ == "__main__":
    harness.main(["--only", "pp", *sys.argv[1:]])
