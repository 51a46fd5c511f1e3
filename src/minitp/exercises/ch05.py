"""Checkers for chapter 05, pipeline parallel.

* ``check_one_f_one_b(fn)``: ``fn(stage, num_stages, microbatches)`` is one stage's 1F1B order, a
  list of ("F", i) / ("B", i) (``minitp.pp.Action`` works too). Compared with ``pp.one_f_one_b``
  for many (p, m, s), m < p included; the whole schedule is then played by ``pp.simulate``.
* ``check_send_recv_loop(fn)``: ``fn(stage, inputs, rank, world_size, microbatches, shape)`` runs
  the forwards of one stage over m micro-batches: receive the input from the previous rank (unless
  first), compute, send the output to the next rank (unless last), through ``minitp.comm``. Run on 2
  and 4 ranks with stages of the tiny model; the last rank's logits compared with the plain model on
  one process, each rank's messages with who it should talk to.
* ``check_bubble(fn)``: ``fn(p, m)`` is the idle share of a step with equal stages; compared with
  ``minitp.cost.pp_bubble_fraction``.
* ``check_zero_bubble(fn)`` and ``check_pipeline_runtime(fn)``: see
  ``minitp.exercises.ch05_runtime``.
* ``check_problem(n, answer)``: worked problems 1-3, estimates from the hardware sheet
  (``minitp.cost.H100``) checked against ``minitp.cost`` (``minitp.exercises.problems``).
"""

from __future__ import annotations

import math

import torch

from minitp import cost, pp, trace
from minitp.exercises import ExerciseError, passed, problems, refuse_own, run_answer, wrong
from minitp.exercises.ch05_runtime import as_actions
from minitp.exercises.ch05_runtime import check_pipeline_runtime as check_pipeline_runtime
from minitp.exercises.ch05_runtime import check_zero_bubble as check_zero_bubble  # the notebook's
from minitp.exercises.problems import Problem

ANSWER = "answer"  # the scope the learner's messages are traced under


# -- exercise 1: the 1F1B order of one stage -------------------------------------------------------
def _show(actions) -> str:
    return " ".join(f"{a.kind}{a.microbatch}" for a in actions)


def _warmup(actions: list[pp.Action]) -> int:
    """Forwards before the first backward."""
    for k, a in enumerate(actions):
        if a.kind == "B":
            return k
    return len(actions)


def check_one_f_one_b(fn) -> None:
    """``fn(stage, num_stages, microbatches)`` must give the 1F1B order of that stage."""
    name = "1F1B order"
    refuse_own(name, fn, pp.one_f_one_b)
    cases = [(s, 4, 8) for s in range(4)] + [(s, 3, 4)
                                             for s in range(3)] + [(0, 4, 2), (1, 4, 2), (3, 4, 2),
                                                                             (0, 2, 1), (0, 1, 3),
                                                                             (2, 5, 7)]
    answers = {}
    for stage, p, m in cases:  # first what makes an order impossible, on any stage
        try:
            got = fn(stage, p, m)
        except NotImplementedError:
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError). "
                "Replace the stub with your answer and run the check again.") from None
        got = answers[stage, p, m] = as_actions(got, name, "FB")
        want = pp.one_f_one_b(p, m)[stage]
        head = f"{name}, stage {stage} of p={p}, m={m}:\n  you gave {_show(got)}\n"
        if sorted(got) != sorted(want):
            raise wrong(name, head + f"Every micro-batch 0..{m - 1} needs exactly one forward and "
                        "one backward on every stage (2m actions).", _show(want))
        late = [i for i in range(m) if got.index(pp.Action("B", i)) < got.index(pp.Action("F", i))]
        if late:
            raise wrong(name,
                        head + f"The backward of micro-batch {late[0]} comes before its forward: a "
                        "backward needs the activations its forward kept.", _show(want))
    for stage, p, m in cases:  # then what makes it another schedule than 1F1B
        got, want = answers[stage, p, m], pp.one_f_one_b(p, m)[stage]
        if got == want:
            continue
        head = f"{name}, stage {stage} of p={p}, m={m}:\n  you gave {_show(got)}\n"
        if got == pp.gpipe(p, m)[stage] or _warmup(got) == m and m > p - stage - 1:
            raise wrong(name, head
                        + "That runs every forward before any backward (GPipe): the stage then "
                        "holds all m micro-batches. 1F1B starts backwards as soon as it can.",
                        _show(want))
        w, w_want = _warmup(got), _warmup(want)
        if w != w_want:
            more = "many" if w > w_want else "few"
            raise wrong(
                name, head + f"{w} forwards run before the first backward: too {more} warm-up "
                "forwards. How many micro-batches must this stage start before the first gradient "
                "can come back to it from the last stage? Enough to fill the pipe below it, and no "
                "more (never more than m).", _show(want))
        backs = [a.microbatch for a in got if a.kind == "B"]
        if backs != sorted(backs):
            raise wrong(name,
                        head + "Run the backwards in increasing micro-batch order, the order the "
                        "gradients come back from the next stage.", _show(want))
        raise wrong(name,
                    head + "After the warm-up, alternate one forward and one backward; when the "
                    "forwards run out, drain the remaining backwards.", _show(want))
    for p, m in ((4, 8), (3, 5)):  # the whole schedule must play without a deadlock
        schedule = [as_actions(fn(s, p, m), name, "FB") for s in range(p)]
        try:
            timelines = pp.simulate(schedule, 1.0, 2.0)
        except ValueError as err:
            raise ExerciseError(
                f"{name}: the stages' orders deadlock together for p={p}, m={m}: {err}") from None
        peaks = [pp.peak_in_flight(a) for a in schedule]
        bubble = pp.bubble_fraction(timelines)[0]
    passed(name,
           f"p=3, m=5: peak micro-batches in flight per stage {peaks}, ideal bubble {bubble:.3f}")


# -- exercise 2: a stage's send/recv loop ----------------------------------------------------------
SEND_RECV_MICROBATCHES = 4
_HINT_NEIGHBOURS = (
    "Rank r receives its input from rank r - 1 (the first rank reads the tokens) and sends "
    "its output to rank r + 1 (the last rank sends nothing); every send needs the matching "
    "receive on the neighbour, in the same micro-batch order.")


def _send_recv_setup():
    from minitp.models import TINY
    from minitp.models.train import TrainConfig, synthetic_batches

    cfg = TINY.with_(n_layers=4)
    tokens, _ = synthetic_batches(cfg, TrainConfig(steps=1, batch_size=8, seq_len=8, seed=5))[0]
    return cfg, tokens  # (8, 8)


def _send_recv_worker(fn):
    import torch.distributed as dist

    from minitp.models import build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, tokens = _send_recv_setup()
    stage = pp.PipelineStage(build_model(cfg, seed=3), rank, world)
    inputs = pp.split_microbatches(tokens, SEND_RECV_MICROBATCHES) if rank == 0 else None
    # (b, S, D) at a boundary
    shape = (tokens.shape[0] // SEND_RECV_MICROBATCHES, tokens.shape[1], cfg.dim)
    with torch.no_grad(), trace.scope(ANSWER):
        outputs = fn(stage, inputs, rank, world, SEND_RECV_MICROBATCHES, shape)
    out = [o.detach().clone() if isinstance(o, torch.Tensor) else None for o in (outputs or [])]
    return {"outputs": out, "returned": outputs is not None}


def check_send_recv_loop(fn, nprocs: tuple[int, ...] = (2, 4), timeout: float = 25.0) -> None:
    """``fn(stage, inputs, rank, world_size, microbatches, shape)``: the forward-only send/recv loop
    of one stage; ``inputs`` holds the micro-batches' tokens on rank 0 (None elsewhere), ``shape``
    is (b, S, D), the activation that crosses a boundary."""
    from minitp.models import build_model

    name = "send/recv loop"
    m = SEND_RECV_MICROBATCHES
    cfg, tokens = _send_recv_setup()
    with torch.no_grad():
        want = build_model(cfg, seed=3)(tokens).chunk(m)  # m x (b, S, V) logits, on one process
    b, S = tokens.shape[0] // m, tokens.shape[1]
    for n in nprocs:
        results = run_answer(_send_recv_worker, n, (fn,), name, timeout, hint=_HINT_NEIGHBOURS,
                             hang_hint="Some rank waited for a message nobody sent. "
                             + _HINT_NEIGHBOURS)
        for rank, (r, tr) in enumerate(zip(results, sorted(results.traces, key=lambda t: t.rank))):
            msgs = [e for e in tr.comm() if ANSWER in e.scopes]
            sends = [e for e in msgs if e.op == "send"]
            recvs = [e for e in msgs if e.op == "recv"]
            if not r["returned"] or len(r["outputs"]) != m:
                raise ExerciseError(f"{name} on {n} ranks: rank {rank} returned "
                                    f"{len(r['outputs']) if r['returned'] else 'None'} outputs, "
                                    f"expected one per micro-batch ({m}).")
            other_peers = {e.peer for e in msgs} - {rank - 1, rank + 1}
            if other_peers:
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank} talked to rank(s) {sorted(other_peers)}. "
                    + _HINT_NEIGHBOURS)
            wrong = [e for e in sends if e.peer != rank + 1] + [e for e in recvs
                                                                if e.peer != rank - 1]
            if wrong:
                e = wrong[0]
                did = "sent to" if e.op == "send" else "received from"
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank} {did} rank {e.peer}: the wrong "
                    "neighbour. " + _HINT_NEIGHBOURS)
            want_sends = m if rank < n - 1 else 0
            want_recvs = m if rank > 0 else 0
            if len(sends) != want_sends or len(recvs) != want_recvs:
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank} sent {len(sends)} and received "
                    f"{len(recvs)} messages through minitp.comm, expected {want_sends} and "
                    f"{want_recvs} (one per micro-batch). Send with comm.send / comm.isend and "
                    "receive with comm.recv / comm.irecv, so every message is traced.")
            bad_shape = [e for e in msgs if tuple(e.shape) != (b, S, cfg.dim)]
            if bad_shape:
                raise ExerciseError(f"{name} on {n} ranks: rank {rank} moved a tensor of shape "
                                    f"{tuple(bad_shape[0].shape)}; a stage boundary carries one "
                                    f"micro-batch's activation (b, S, D) = {(b, S, cfg.dim)}.")
        last = results[-1]["outputs"]
        for i, (got, w) in enumerate(zip(last, want)):
            if got is None or got.shape != w.shape:
                raise ExerciseError(f"{name} on {n} ranks: the last rank's output {i} has shape "
                                    f"{None if got is None else tuple(got.shape)}, expected the "
                                    f"logits {tuple(w.shape)}.")
            diff = (got - w).abs().max().item()
            if diff > 1e-5:
                order = next((j for j, ww in enumerate(want)
                              if (got - ww).abs().max().item() <= 1e-5), None)
                why = (f" They are micro-batch {order}'s: keep the micro-batches in order."
                       if order is not None
                       else " Feed each received activation to this rank's stage (stage(x)) and "
                            "send what it returns.")
                raise ExerciseError(
                    f"{name} on {n} ranks: the last rank's logits for micro-batch {i} differ from "
                    f"one process by {diff:.3g}.{why}")
    passed(name,
           f"the last rank's logits match one process on {' and '.join(map(str, nprocs))} ranks; "
                 "every message went to the next rank, every receive came from the previous one")


# -- exercise 3: predict the bubble ----------------------------------------------------------------
def check_bubble(fn) -> None:
    """``fn(p, m)``: the idle share of a step with p equal stages and m micro-batches."""
    name = "bubble fraction"
    refuse_own(name, fn, cost.pp_bubble_fraction)
    cases = [(4, 8), (2, 1), (8, 32), (4, 1), (8, 8), (3, 5), (1, 4), (16, 64)]
    for p, m in cases:
        try:
            got = fn(p, m)
        except NotImplementedError:
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError).") from None
        if got is None:
            raise ExerciseError(
                f"{name}: the function returned None; return a fraction between 0 and 1.")
        want = cost.pp_bubble_fraction(p, m)
        if math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-12):
            continue
        hints = [
            ((m - 1) / (m + p - 1),
             "m and p are swapped: the idle slots come from the p - 1 other stages "
                                    "filling and draining the pipe, not from the micro-batches."),
            ((p - 1) / m,
             "That is the idle time over the compute time (p-1)/m. The share of the *step* divides "
                          "by the whole step, m + p - 1 slots."),
            ((p - 1) / (m + p),
             "Count the slots again: the step lasts m + p - 1 slots (m for the micro-batches, "
                                "p - 1 more to fill and drain)."),
            ((p - 1) / (p * m), "Divide the p - 1 idle slots by the step's m + p - 1 slots."),
            (1 - (p - 1) / (m + p - 1), "That is the busy share; the bubble is what is left idle."),
        ]
        hint = next((h for v, h in hints if math.isclose(float(got), v, rel_tol=1e-9,
                                                         abs_tol=1e-12)),
                    "Count in slots of one micro-batch: how many slots does the step last, and in "
                    "how many of them does one stage compute?")
        raise wrong(name, f"for p={p}, m={m} you gave {float(got):.4f}. {hint}", f"{want:.4f}")
    passed(name, "(p-1)/(m+p-1): 0.273 at p=4, m=8; 0.179 at p=8, m=32")


# -- worked problems: estimates from the hardware sheet (minitp.exercises.problems) ----------------
def _smallest_m(p: int, schedule: str, v: int = 1, bubble: float = 0.05) -> int:
    """The fewest micro-batches whose bubble (``cost.pp_bubble_fraction``) is at most ``bubble``."""
    m = 1
    while cost.pp_bubble_fraction(p, m, schedule, v) > bubble + 1e-12:
        m += 1
    return m


def _boundary_over_forward() -> float:
    """LLaMA-3-70B on 8 stages of 10 blocks: one micro-batch of one 8192-token sequence in bf16. The
    send of its activation (S·D·2 bytes) over InfiniBand against its forward through one stage
    (2 FLOPs per weight and token plus attention's 4·D·S, at the device's efficiency)."""
    from minitp.exercises.ch03 import block_params
    from minitp.models import LLAMA3_70B as cfg

    S, device = 8192, cost.H100
    send = S * cfg.dim * 2 / device.inter.bytes_per_s
    forward = 10 * S * (2 * block_params(cfg)
                        + 4 * cfg.dim * S) / (device.flops_per_s * device.efficiency)
    return send / forward


PROBLEMS = {
    1: Problem("problem 1, micro-batches for a 5 % bubble", lambda: _smallest_m(8, "1f1b"),
               "micro-batches", rel=0.01),
    2: Problem("problem 2, the same interleaved", lambda: _smallest_m(8, "interleaved", 4),
               "micro-batches",
               {4.0: "each of the v chunks fills and drains for 1/v of a stage: (p-1)/(v·m+p-1)"},
               rel=0.01),
    3: Problem("problem 3, a boundary's send against a stage's forward", _boundary_over_forward, "",
               {2.0: "one activation crosses a boundary per micro-batch forward, S·D numbers of 2 "
                     "bytes"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 05: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
