"""Checkers for chapter 05's later exercises: the zero-bubble table and a 1F1B runtime.

* ``check_zero_bubble(fn)``: ``fn(stage, num_stages, microbatches)`` is one stage's ZB-H1 order, a
  list of ("F", i) / ("B", i) / ("W", i). Compared with ``pp.zero_bubble_h1``; the whole table is
  then played by ``pp.simulate`` and its bubble compared with 1F1B's.
* ``check_pipeline_runtime(fn)``: ``fn(stage, actions, inputs, targets, rank, world_size, shape,
  loss_fn)`` runs one rank's 1F1B actions for real with ``comm.isend`` / ``comm.irecv`` and
  backward. Run on 2 and 4 ranks; the gradients put together are compared with one process, the
  order of the forwards and backwards with the table, the messages with the neighbours; a run that
  hangs is stopped, each stuck rank's call named (its peer and label) with the likely mistake.
"""

from __future__ import annotations

import torch

from minitp import cost, pp, trace
from minitp.exercises import ExerciseError, passed, refuse_own, run_answer, wrong

ANSWER = "answer"  # the scope the learner's messages are traced under


def _show(actions) -> str:
    return " ".join(f"{a.kind}{a.microbatch}" for a in actions)


# -- the zero-bubble table ----------------------------------------------------------------------
_KINDS = {"F": "forward", "B": "backward", "W": "weight gradient"}


def as_actions(got, name: str, kinds: str = "FBW") -> list[pp.Action]:
    """A learner's list of (kind, microbatch) pairs as ``pp.Action``s, or a message saying what is
    off."""
    example = ", ".join(f"('{k}', 0)" for k in kinds)
    if got is None:
        raise ExerciseError(
            f"{name}: the function returned None; return a list of (kind, microbatch) pairs "
            f"such as [{example}, ...].")
    out = []
    for item in got:
        try:
            kind, mb = item[:2] if isinstance(item, pp.Action) else item
        except (TypeError, ValueError):
            raise ExerciseError(
                f"{name}: each entry must be a pair (kind, microbatch) like ('{kinds[-1]}', 3); "
                f"got {item!r}.") from None
        if kind not in kinds:
            allowed = ", ".join(f"'{k}' ({_KINDS[k]})" for k in kinds)
            raise ExerciseError(f"{name}: the kind of an action is one of {allowed}; got {kind!r}.")
        out.append(pp.Action(kind, int(mb)))
    return out


def check_zero_bubble(fn) -> None:
    """``fn(stage, num_stages, microbatches)`` must give the ZB-H1 order of that stage."""
    name = "zero-bubble table"
    refuse_own(name, fn, pp.zero_bubble_h1)
    cases = [(s, 4, 8) for s in range(4)] + [(s, 2, 4)
                                             for s in range(2)] + [(s, 3, 6) for s in range(3)]
    for stage, p, m in cases:
        try:
            got = fn(stage, p, m)
        except NotImplementedError:
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError). "
                "Replace the stub with your answer and run the check again.") from None
        got, want = as_actions(got, name), pp.zero_bubble_h1(p, m)[stage]
        if got == want:
            continue
        head = f"{name}, stage {stage} of p={p}, m={m}:\n  you gave {_show(got)}\n"
        if not any(a.kind == "W" for a in got):
            raise wrong(name,
                        head + "There is no W: zero-bubble cuts each backward in two, B (the input "
                              "gradient, sent back at once) and W (the weight gradient), one of "
                              "each per micro-batch.", _show(want))
        if sorted(got) != sorted(want):
            raise wrong(name, head
                        + f"Every micro-batch 0..{m - 1} needs exactly one F, one B and one W.",
                        _show(want))
        for i in range(m):
            at = [got.index(pp.Action(k, i)) for k in "FBW"]
            if at != sorted(at):
                raise wrong(name, head + f"Micro-batch {i} runs out of order: F, then B (needs F's "
                                  "activations), then W (needs what B left: the layers' inputs and "
                                  "output gradients).", _show(want))
        if [a for a in got if a.kind != "W"] != [a for a in want if a.kind != "W"]:
            raise wrong(name, head
                        + "Keep 1F1B's order of F and B (with p - s forwards before the first B); "
                              "only the W's are new.", _show(want))
        ws = [k for k, a in enumerate(got) if a.kind == "W"]
        if ws == list(range(len(got) - m, len(got))) and m > p - stage:
            raise wrong(name, head
                        + "Every W waits until the end: the stage then keeps all m micro-batches' "
                              "inputs and gradients, as GPipe keeps activations. Run W(i - s) "
                              "right after B(i), so a stage never holds more than p "
                              "micro-batches.", _show(want))
        delay = next((i - got[k - 1].microbatch for k in ws if got[k - 1].kind == "B"
                      for i in [got[k].microbatch]), None)
        raise wrong(name,
                    head
                    + f"Stage s runs W(i - s) right after B(i) (here s = {stage}); your W's are "
                    + ("not right after a B" if delay is None else f"{-delay} micro-batches behind")
                    + ". "
                          "The last stages hold back the most W's, so the gradient the others wait "
                          "for goes out sooner.", _show(want))
    p, m = 4, 8
    table = [as_actions(fn(s, p, m), name) for s in range(p)]
    zb = pp.bubble_fraction(pp.simulate(table, 1.0, 2.0))[0]
    one = pp.bubble_fraction(pp.simulate(pp.one_f_one_b(p, m), 1.0, 2.0))[0]
    passed(name, f"p=4, m=8 with F = B = W: bubble {zb:.3f} against 1F1B's {one:.3f}; "
                 f"at most {max(pp.peak_in_flight(a) for a in table)} micro-batches held")


# -- a 1F1B runtime -----------------------------------------------------------------------------
RUNTIME_CASES = ((2, 4), (4, 8))  # (ranks, micro-batches)
_HINT = ("Walk the actions in order. F i: take the input (tokens on rank 0, else irecv from rank - "
         "1 and wait), run the stage, isend the output to rank + 1 (unless last; keep the handle "
         "and wait at the end); on the last rank the output is the loss of micro-batch i divided "
         "by m. B i: irecv the gradient of the output from rank + 1 (unless last), "
         "torch.autograd.backward(output, grad), isend the input's .grad to rank - 1 (unless "
         "first).")


def _setup():
    from minitp.models import TINY
    from minitp.models.train import TrainConfig, synthetic_batches

    cfg = TINY.with_(n_layers=4)
    tokens, targets = synthetic_batches(cfg, TrainConfig(steps=1, batch_size=8, seq_len=8,
                                                         seed=7))[0]
    return cfg, tokens, targets  # (8, 8) each


class _RecordingStage:
    """The rank's stage, called like it, noting the order of forwards (the k-th call is micro-batch
    k) and of backwards (a gradient reaching the k-th output)."""

    def __init__(self, stage, order):
        self.stage, self.order = stage, order

    def __call__(self, x):
        k = sum(1 for kind, _ in self.order if kind == "F")
        self.order.append(("F", k))
        y = self.stage(x)
        if y.requires_grad:
            y.register_hook(lambda g: self.order.append(("B", k)))
        return y

    def __getattr__(self, name):  # parameters(), is_first, ... of the stage itself
        return getattr(self.stage, name)


def _runtime_worker(fn, m):
    import torch.distributed as dist

    from minitp.models import build_model, loss_fn

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, tokens, targets = _setup()
    stage = pp.PipelineStage(build_model(cfg, seed=3), rank, world)
    order: list = []
    inputs = pp.split_microbatches(tokens, m) if rank == 0 else None
    labels = pp.split_microbatches(targets, m) if rank == world - 1 else None
    shape = (tokens.shape[0] // m, tokens.shape[1], cfg.dim)  # (b, S, D) at a boundary
    actions = [(a.kind, a.microbatch) for a in pp.one_f_one_b(world, m)[rank]]  # ("F", 0), ...
    with trace.scope(ANSWER):
        fn(_RecordingStage(stage, order), actions, inputs, labels, rank, world, shape, loss_fn)
    grads = {k: (None if p.grad is None else p.grad.clone()) for k, p in stage.named_parameters()}
    return {"grads": grads, "order": order}


def check_pipeline_runtime(fn, timeout: float = 30.0) -> None:
    """``fn(stage, actions, inputs, targets, rank, world_size, shape, loss_fn)``: run this rank's
    1F1B ``actions`` (a list of pairs ("F", i) / ("B", i)) for real; gradients end up in
    the stage's ``.grad``. ``inputs`` (rank 0) and ``targets`` (last rank) are the m micro-batches,
    None elsewhere; ``shape`` is (b, S, D), what crosses a boundary."""
    from minitp.models import build_model, loss_fn

    name = "1F1B runtime"
    cfg, tokens, targets = _setup()
    model = build_model(cfg, seed=3)
    loss_fn(model(tokens), targets).backward()  # the one-process gradient of the full batch
    want = {k: p.grad for k, p in model.named_parameters()}
    for n, m in RUNTIME_CASES:
        # a hang: the call each stuck rank waits in (peer, label) and the likely mistake, in a few
        # lines
        results = run_answer(_runtime_worker, n, (fn, m), name, timeout, hint=_HINT, hang_hint="")
        table = pp.one_f_one_b(n, m)
        for rank, (r, tr) in enumerate(zip(results, sorted(results.traces, key=lambda t: t.rank))):
            where = f"{name} on {n} ranks, m={m}, rank {rank}"
            got_order = [pp.Action(kind, i) for kind, i in r["order"]]
            if got_order != table[rank]:
                raise ExerciseError(
                    f"{where}: the forwards and backwards ran in another order than the table:\n"
                    f"  table {_show(table[rank])}\n  ran   {_show(got_order)}\n"
                    "Run the actions one by one, in the order given.")
            msgs = [e for e in tr.comm() if ANSWER in e.scopes]
            sends = [e for e in msgs if e.op == "send"]
            want_peers = sorted([rank + 1] * (m if rank < n - 1 else 0)
                                + [rank - 1] * (m if rank > 0 else 0))
            if sorted(e.peer for e in sends) != want_peers:
                raise wrong(name, f"{where}: sent to ranks {sorted(e.peer for e in sends)}: one "
                                  "activation to rank + 1 per F (unless last), one gradient to "
                                  "rank - 1 per B (unless first), through comm.isend so it is "
                                  "traced.", f"sends to ranks {want_peers}")
            for key, g in r["grads"].items():
                w = want[key]
                if g is None or not g.abs().sum():
                    raise ExerciseError(f"{where}: {key} got no gradient. Call "
                                        "torch.autograd.backward(output, grad) in each B, with the "
                                        "gradient received from rank + 1 (None on the last rank).")
                diff = (g - w).abs().max().item()
                if diff > 1e-5:
                    why = (f" It is {m} times the right one: divide each micro-batch's loss by m = "
                           f"{m}, so the sum over micro-batches is the full batch's mean."
                           if torch.allclose(g, w * m, rtol=1e-4, atol=1e-6) else
                           " Check that each B feeds the gradient received for that micro-batch's "
                           "output.")
                    raise ExerciseError(f"{where}: the gradient of {key} differs from one process "
                                        f"by {diff:.3g}.{why}")
    peaks = [cost.pp_peak_microbatches_in_flight(4, 8, s, "1f1b") for s in range(4)]
    passed(name, f"gradients equal one process on {' and '.join(str(n) for n, _ in RUNTIME_CASES)} "
                 f"ranks, every action in the table's order; at most {peaks} micro-batches held "
                 "per rank at p=4, m=8")
