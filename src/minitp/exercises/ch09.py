"""Checkers for chapter 09, a real training run on a layout the learner composes.

* ``check_parallelize(fn)``: ``fn(model, mesh)`` turns a plain model into what this rank runs on a
  ``Mesh``: tensor parallel over ``mesh.tp_group`` first, then this rank's ``pp.PipelineStage``,
  then ``FullyShardedDataParallel`` over ``mesh.dp_group`` (ZeRO-1 with a pipeline, else ZeRO-3); a
  dimension of size 1 may be left out. Run on 4 ranks (dp2×tp2, tp2×pp2, dp2×pp2): what each rank
  holds must equal ``Parallel3D``'s pieces (its tp slices of its stage), and a forward and backward
  through it must give the loss of one process.
* ``check_train_step(fn)``: ``fn(stage, mesh, tokens, targets, m)``, one 3D step written by hand on
  this rank's tp-split stage: this replica's rows, ``m`` micro-batches sent and received through the
  pipeline, the loss on the last stage (vocabulary-parallel under tp), the gradients averaged over
  ``mesh.dp_group``. Run on 4 ranks (dp2×pp2, pp2×tp2, dp2×tp2): every gradient and the loss must
  be one process's, the rows of each forward B/(dp·m), the sends one per micro-batch to each
  neighbouring stage, the dp all-reduces each gradient once.
* ``check_clip_grad_norm(fn)``: ``fn(par, max_norm)`` clips the gradients of a ``Parallel3D`` by the
  global norm, each element of the model counted once, with one all-reduce. Run on 4 ranks (DDP
  tp2×pp2, DDP dp2×tp2, FSDP dp2×tp2) after a forward and backward on a real batch: the norm must be
  ``torch.nn.utils.clip_grad_norm_``'s on one process and every gradient scaled as it scales them.
* ``check_lr_schedule(fn)``: ``fn(step, steps, warmup, lr, min_ratio)``, linear warm-up then a
  cosine down to ``min_ratio``·lr, against ``minitp.trainer.lr_at``.
* ``check_wasted_fraction(fn)``: ``fn(interval, save_seconds, restart_seconds, mtbf)``, the share of
  a run's time lost to checkpoints and failures, to first order (Young, 1974).
* ``check_problem(n, answer)``: worked problems 1-3, a run at scale estimated from the hardware
  sheet (``minitp.cost.H100``) and the chapter's formulas, checked against ``minitp.cost`` and
  ``wasted_fraction`` (``minitp.exercises.problems``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from minitp import comm, cost, trace
from minitp.exercises import (
    ExerciseError,
    call_answer,
    passed,
    problems,
    refuse_own,
    refuse_own_deep,
    run_answer,
    wrong,
)
from minitp.exercises.problems import Problem
from minitp.grid import coordinates, group_lists
from minitp.models import LLAMA3_70B

ANSWER = "answer"
# what a pipeline stage takes from the model itself
WHOLE_CONTEXT = ("tok_embeddings.weight", "output.weight")


def _config():
    """A small byte-level model (vocabulary 256) that tp = 2 and pp = 2 can split: 4 blocks, D =
    64."""
    from minitp.trainer import BYTE

    return BYTE.with_(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=192, max_seq_len=64)


# -- exercise 1: compose the layout ----------------------------------------------------------------
PARALLELIZE_LAYOUTS = ((2, 1, 2), (1, 2, 2), (2, 2, 1))  # (dp, pp, tp), 4 ranks each


def _random_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    rows = torch.randint(0, 256, (4, 17), generator=g)  # (B, S + 1)
    return rows[:, :-1], rows[:, 1:]


def _loss_through(out, module, mesh) -> float | None:
    """One forward and backward of the batch through what the learner built, as ``Parallel3D`` runs
    it: this replica's rows; the pipeline's schedule calling the wrapper when pp > 1. The loss of
    this replica's rows on the last stage, else None."""
    from minitp import pp, tp
    from minitp.ddp import split_batch
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.models import loss_fn
    from minitp.models.train import make_optimizer

    fsdp = isinstance(out, FullyShardedDataParallel)
    if fsdp:  # FSDP runs only with its optimizer attached (its step hooks finish each step)
        out.attach(make_optimizer(out.parameters(), 3e-3))
    tokens, targets = _random_batch()
    if mesh.dp > 1:
        tokens, targets = split_batch(tokens, mesh.dp_group), split_batch(targets, mesh.dp_group)
    if mesh.tp > 1:
        def loss_of(logits, y):  # logits (b, S, V/tp)
            return tp.vocab_parallel_cross_entropy(logits, y, mesh.tp_group)
    else:
        loss_of = loss_fn
    if mesh.pp == 1:
        loss = loss_of(out(tokens), targets)
        loss.backward()
        return loss.item()
    stage = pp.StageSpec(module.stage, module.num_stages, module, out, module.config.dim,
                         torch.float32, torch.device("cpu"))
    pipeline = pp.Pipeline(stage, mesh.pp_group, "1f1b", 2, loss=loss_of)
    with out.no_sync() if fsdp else nullcontext():
        record = pipeline.forward_backward(tokens, targets)
    if fsdp:
        out.finish_gradients()
    return record.loss


def _parallelize_worker(fn, layout):
    import torch.nn as nn

    from minitp import pp, tp
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.mesh import Mesh
    from minitp.models import build_model
    from minitp.parallel3d import Parallel3D

    dp, pp_size, tp_size = layout
    cfg = _config()
    mesh = Mesh(dp, pp_size, tp_size)
    # {name: (tp slice, dim)}
    want = Parallel3D(build_model(cfg, seed=0), mesh, "fsdp").local_shards()
    model = build_model(cfg, seed=0)
    try:
        with trace.scope(ANSWER):
            out = fn(model, mesh)
    except RuntimeError as error:
        if "storage of size 0" in str(error):  # tp.parallelize met tensors FSDP had already emptied
            return {"fsdp_first": str(error).splitlines()[0]}
        raise
    fsdp = isinstance(out, FullyShardedDataParallel)
    module = out.module if fsdp else out
    if not isinstance(module, nn.Module):
        return {"bad": type(out).__name__}
    info = {"fsdp": fsdp, "kind": type(out).__name__, "stage": isinstance(module, pp.PipelineStage),
            "split_layers": sum(isinstance(m, tp.SPLIT_LAYERS) for m in module.modules()),
            "want": {name: t for name, (t, _) in want.items()}}
    if fsdp:
        info["zero"], info["group"] = out.zero, list(comm.group_ranks(out.group))
        held = out.full_state_dict()  # collective over the learner's group: every rank calls it
    else:
        held = {name: p.detach() for name, p in module.named_parameters()}
    info["held"] = {name: t.detach().clone().cpu() for name, t in held.items()}
    same = held.keys() == want.keys() and all(tuple(held[n].shape) == tuple(want[n][0].shape)
                                              for n in want)
    # run it only when it holds what it should (no hang)
    if same and (mesh.pp == 1 or info["stage"]):
        try:
            info["loss"] = _loss_through(out, module, mesh)
        except Exception as error:  # told after what is wrong with the pieces, if anything is
            info["loss_error"] = f"{type(error).__name__}: {error}".splitlines()[0]
    return info


def _blocks(names) -> list[int]:
    return sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})


def _check_pieces(name: str, layout, rank: int, r: dict, whole: dict) -> None:
    """What rank ``rank`` built and holds, against ``Parallel3D``'s pieces: the first mistake
    found."""
    dp, pp_size, tp_size = layout
    where = f"on dp={dp}, pp={pp_size}, tp={tp_size}, rank {rank}"
    c = coordinates(rank, dp, pp_size, tp_size)
    if "fsdp_first" in r:
        raise wrong(name,
            f"{name} {where}: tp.parallelize found the model's tensors empty (\"storage of size "
            "0\"). FSDP had wrapped the model first: it flattens every parameter into its own "
            "buffer, keeps this rank's shard and frees the whole tensors, so tensor parallel found "
            "nothing to split. Wrap with FSDP last, around what tp and pp left on this rank.")
    if "bad" in r:
        raise wrong(name, f"{name} {where}: return the module this rank runs (the FSDP wrapper, or "
                          f"the stage or the model when dp = 1), got {r['bad']}.")
    held, want = r["held"], r["want"]
    if tp_size > 1 and r["split_layers"] == 0:
        raise wrong(name,
                    f"{name} {where}: nothing is split over tp: every layer is whole. Start with "
                          "tp.parallelize(model, mesh.tp_group), on the whole model.")
    if r["fsdp"] and tp_size > 1 and any(tuple(held[n].shape) == tuple(whole[n].shape) for n in held
                                         if n.startswith("layers.") and n in want
                                         and want[n].shape != whole[n].shape):
        raise wrong(name,
            f"{name} {where}: FSDP holds the whole matrices, unsplit, while the model's layers are "
            "tp-parallel: FSDP wrapped the model before tensor parallel split it. tp.parallelize "
            "then put new, split layers in place, which FSDP never saw (it shards and averages the "
            "old ones). Split first, wrap last.")
    if dp > 1 and not r["fsdp"]:
        raise wrong(name, f"{name} {where}: dp={dp}, but this rank returned a {r['kind']} that "
                          "keeps a whole copy of its piece and never averages its gradients. Wrap "
                          "what the rank holds in FullyShardedDataParallel(module, mesh.dp_group, "
                          "zero=...) and return the wrapper.")
    if r["fsdp"]:
        ranks = next(g for g in group_lists(dp, pp_size, tp_size)["dp"] if rank in g)
        if r["group"] != ranks:
            raise wrong(name, f"{name} {where}: FSDP shards over ranks {r['group']}, not the dp "
                              "group: the ranks that hold the same piece of the model "
                              "(mesh.dp_group).", f"the dp group {ranks}")
        zero = 1 if pp_size > 1 else 3
        if r["zero"] != zero:
            why = ("with a pipeline each micro-batch runs its own backward, so the gradients must "
                   "add up whole before they are sharded: ZeRO-1" if pp_size > 1 else
                   "without a pipeline, shard everything: ZeRO-3")
            raise wrong(name, f"{name} {where}: FSDP with zero={r['zero']}, not the stage this "
                              f"layout needs: {why}.",
                        f"zero={zero}")
    if held.keys() != want.keys():
        mine, expected = _blocks(held), _blocks(want)
        if pp_size > 1 and len(mine) > len(expected):
            raise wrong(name, f"{name} {where}: this rank holds blocks {mine}, the whole model, "
                              "not its stage's. Cut it with pp.PipelineStage(model, "
                              "mesh.coords.pp, mesh.pp).", f"blocks {expected}")
        extra, missing = sorted(held.keys() - want.keys()), sorted(want.keys() - held.keys())
        raise wrong(name, f"{name} {where} (stage {c.pp} of {pp_size}): it holds blocks {mine}, "
                          "not its stage's"
                          + (f"; unexpected {extra[:3]}" if extra else "")
                          + (f"; missing {missing[:3]}" if missing else "")
                          + ". The stage is this rank's pp coordinate: mesh.coords.pp of mesh.pp.",
                    f"blocks {expected}")
    for n in want:
        got, expected = tuple(held[n].shape), tuple(want[n].shape)
        if got == expected:
            continue
        if n in WHOLE_CONTEXT and got == tuple(whole[n].shape):
            raise wrong(name,
                f"{name} {where}: the stage's {n} is whole, {got}, while its blocks are split: the "
                "stage was cut before tensor parallel. PipelineStage keeps the model's embedding "
                "and output layer as they were; tp.parallelize then put split ones on the model, "
                "not on the stage. Split the whole model first, then cut the stage.")
        raise wrong(name, f"{name} {where}: {n} has shape {got}, not this rank's tp slice of "
                          f"{tuple(whole[n].shape)}. Split over mesh.tp_group, whose {tp_size} "
                          "ranks differ only in tp.", f"shape {expected}")
    for n in want:
        if not torch.equal(held[n], want[n]):
            raise wrong(
                name, f"{name} {where}: {n} has the right shape but not the values of this rank's "
                              f"slice (tp rank {c.tp} holds slice {c.tp}). Split over "
                              "mesh.tp_group, and build nothing anew: the plain model's weights "
                              "are the ones to cut.")


def check_parallelize(fn, layouts=PARALLELIZE_LAYOUTS) -> None:
    """``fn(model, mesh)`` -> what this rank runs: tp split, then the stage, then FSDP over dp."""
    from minitp.models import build_model, loss_fn

    name = "parallelize on a mesh"
    cfg = _config()
    plain = build_model(cfg, seed=0)
    whole = {n: p.detach() for n, p in plain.named_parameters()}
    tokens, targets = _random_batch()
    with torch.no_grad():
        reference = loss_fn(plain(tokens), targets).item()
    for layout in layouts:
        dp, pp_size, tp_size = layout
        results = run_answer(_parallelize_worker, dp * pp_size * tp_size, (fn, layout), name,
                             timeout=60)
        for rank, r in enumerate(results):
            _check_pieces(name, layout, rank, r, whole)
        for rank, r in enumerate(results):
            if "loss_error" in r:
                raise wrong(name, f"{name} on dp={dp}, pp={pp_size}, tp={tp_size}: each rank holds "
                                  "the right pieces, but a forward and backward through them "
                                  f"failed on rank {rank}: {r['loss_error']}")
        last = [r["loss"] for rank, r in enumerate(results)
                if coordinates(rank, dp, pp_size, tp_size).pp == pp_size - 1
                and r.get("loss") is not None]
        if len(last) != dp * tp_size:
            raise wrong(name, f"{name} on dp={dp}, pp={pp_size}, tp={tp_size}: the last stage's "
                              "ranks returned no loss: return the module itself (a PipelineStage, "
                              "or FSDP around it).")
        # every tp rank of a replica has its loss; the replicas' mean is the batch's
        loss = sum(last) / len(last)
        if not math.isclose(loss, reference, rel_tol=1e-5, abs_tol=1e-6):
            raise wrong(
                name, f"{name} on dp={dp}, pp={pp_size}, tp={tp_size}: every rank holds the right "
                f"pieces, but a forward gives the loss {loss:.6f}, not one process's.",
                f"{reference:.6f}")
    shown = ", ".join(f"dp{d}·pp{p}·tp{t}".replace("·pp1",
                                                   "").replace("·tp1", "").replace("dp1·", "")
                      for d, p, t in layouts)
    passed(name, f"on 4 ranks, {shown}: each rank holds Parallel3D's pieces, and the loss is one "
                 "process's")


# -- exercise 2: the step, by hand -----------------------------------------------------------------
STEP_LAYOUTS = ((2, 2, 1), (1, 2, 2), (2, 1, 2))  # (dp, pp, tp), 4 ranks each
STEP_MICROBATCHES = 3
_STEP_HINT = ("Under tp the last stage's logits are (b, S, V/tp): its loss is "
              "tp.vocab_parallel_cross_entropy(logits, targets, mesh.tp_group). A stage other than "
              "the first takes (b, S, D) from the previous one (D = stage.config.dim); send and "
              "receive with the global ranks of comm.group_ranks(mesh.pp_group).")
_STEP_HANG = ("A send and its receive must pair up: each forward sends its output to the next "
              "stage (unless last), each backward sends its input's gradient to the previous one "
              "(unless first), and every dp rank joins the gradients' all-reduce.")


def _step_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 256, (12, 17), generator=g)  # (B, S + 1)
    return rows[:, :-1], rows[:, 1:]


def _step_worker(fn, layout, m):
    from minitp import pp, tp
    from minitp.mesh import Mesh
    from minitp.models import build_model

    dp, pp_size, tp_size = layout
    mesh = Mesh(dp, pp_size, tp_size)
    model = build_model(_config(), seed=0)
    if tp_size > 1:
        tp.parallelize(model, mesh.tp_group)
    stage = pp.PipelineStage(model, mesh.coords.pp, mesh.pp) if pp_size > 1 else model
    rows: list[int] = []  # the rows of each forward the learner runs
    stage.register_forward_pre_hook(lambda module, args: rows.append(int(args[0].shape[0])))
    tokens, targets = _step_batch()
    with trace.scope(ANSWER):
        loss = fn(stage, mesh, tokens, targets, m)
    return {"loss": None if loss is None else float(loss), "rows": rows,
            "grads": {n: (None if g is None else g.cpu()) for n, (g, _)
                      in tp.local_shards(stage, grads=True).items()},
            "dims": tp.split_dims(stage),
            "grad_bytes": sum(p.numel() * p.element_size() for p in stage.parameters())}


def _step_messages(tr) -> tuple[list, list]:
    """(the learner's sends over pp, the all-reduces over dp) of one rank's trace."""
    msgs = [e for e in tr.comm() if ANSWER in e.scopes]
    return ([e for e in msgs if e.op == "send"],
            [e for e in msgs if e.op == "all_reduce" and e.dim == "dp"])


def _check_step_rank(name, layout, m, rank, r, tr, want, loss_want) -> None:
    dp, pp_size, tp_size = layout
    where = f"{name} on dp={dp}, pp={pp_size}, tp={tp_size}, rank {rank}"
    c = coordinates(rank, dp, pp_size, tp_size)
    b = _step_batch()[0].shape[0]
    if r["rows"] != [b // (dp * m)] * m:
        if len(r["rows"]) != m:
            raise wrong(name, f"{where}: the stage ran {len(r['rows'])} forwards, not one per "
                              f"micro-batch: split this replica's rows into m = {m}.",
                        f"{m} forwards of {b // (dp * m)} rows")
        if dp > 1 and r["rows"] == [b // m] * m:
            raise wrong(name, f"{where}: each forward took {b // m} rows: every replica trained on "
                              f"the whole batch of {b}. Keep this replica's B/dp rows first "
                              "(rows mesh.coords.dp·B/dp onwards), then cut them into "
                              "micro-batches.",
                        f"{b // (dp * m)} rows a forward")
        raise wrong(name, f"{where}: the forwards took {r['rows']} rows: B/dp rows a replica, cut "
                          f"into m = {m} equal micro-batches.", f"{[b // (dp * m)] * m}")
    sends, reductions = _step_messages(tr)
    ranks = next(g for g in group_lists(dp, pp_size, tp_size)["pp"] if rank in g)
    want_peers = sorted(([ranks[c.pp + 1]] * m if c.pp < pp_size - 1 else [])
                        + ([ranks[c.pp - 1]] * m if c.pp > 0 else []))
    got_peers = sorted(e.peer for e in sends)
    if got_peers != want_peers:
        raise wrong(name, f"{where} (stage {c.pp}): sent to ranks {got_peers}: one activation to "
                          "the next stage per forward (unless last), one gradient to the previous "
                          "per backward (unless first), with comm.send or comm.isend so it is "
                          "traced.", f"sends to ranks {want_peers}")
    for key, g in r["grads"].items():
        dim = r["dims"][key]
        w = want[key] if dim is None else want[key].chunk(tp_size, dim)[c.tp]
        if g is None or not g.abs().sum():
            raise wrong(name, f"{where}: {key} got no gradient. Run each micro-batch's backward: "
                              "the last stage from its loss, the others from the gradient the next "
                              "stage sent back.")
        if (g - w).abs().max().item() <= 1e-5:
            continue
        def close(k, g=g, w=w):
            return torch.allclose(g, w * k, rtol=1e-4, atol=1e-6)

        if close(m):
            why = (f"it is {m} times one process's: divide each micro-batch's loss by m = {m}, so "
                   "the micro-batches add up to the mean of the batch.")
        elif dp > 1 and close(dp):
            why = (f"it is {dp} times one process's: the all-reduce over mesh.dp_group sums the "
                   f"replicas' gradients; divide by dp = {dp} to average them.")
        elif dp > 1 and not reductions:
            why = ("each replica kept the gradient of its own rows: after the last micro-batch, "
                   "all-reduce every gradient over mesh.dp_group (comm.all_reduce, so it is "
                   "traced) and divide by dp.")
        else:
            why = ("check that each backward feeds the gradient received for that micro-batch's "
                   "output, and that the gradients are averaged over mesh.dp_group only.")
        raise wrong(name, f"{where}: the gradient of {key} differs from one process's by "
                          f"{(g - w).abs().max().item():.3g}: {why}")
    sent = sum(e.bytes for e in reductions)
    if dp > 1 and sent != r["grad_bytes"]:
        raise wrong(name, f"{where}: the all-reduces over dp carried {sent:,} bytes, not the "
                          f"{r['grad_bytes']:,} of this rank's gradients: each once, after the "
                          "last micro-batch.", f"{r['grad_bytes']:,} bytes")
    if c.pp == pp_size - 1:
        if r["loss"] is None:
            raise wrong(name, f"{where}: the last stage returned no loss: return the mean of its "
                              "micro-batches' losses.")
    elif r["loss"] is not None:
        raise wrong(name, f"{where}: stage {c.pp} returned a loss, {r['loss']:.4f}; only the last "
                          "stage computes one: return None elsewhere.")


def check_train_step(fn, layouts=STEP_LAYOUTS, m: int = STEP_MICROBATCHES) -> None:
    """``fn(stage, mesh, tokens, targets, m)``: one forward and backward of the global batch (B, S)
    on this rank's tp-split stage (the model when pp = 1): this replica's rows in ``m``
    micro-batches through the pipeline (sends and receives over ``mesh.pp_group``), the loss on the
    last stage (vocabulary-parallel under tp), then the gradients averaged over ``mesh.dp_group``.
    Returns the replica's loss on the last stage, else None."""
    from minitp import trainer
    from minitp.models import build_model, loss_fn
    from minitp.parallel3d import Parallel3D

    name = "the 3D step"
    refuse_own_deep(name, fn, trainer.train_step, Parallel3D)
    plain = build_model(_config(), seed=0)
    tokens, targets = _step_batch()
    loss = loss_fn(plain(tokens), targets)
    loss.backward()  # one process, the whole batch
    want = {n: p.grad for n, p in plain.named_parameters()}
    for layout in layouts:
        dp, pp_size, tp_size = layout
        results = run_answer(_step_worker, dp * pp_size * tp_size, (fn, layout, m), name,
                             timeout=60, hint=_STEP_HINT, hang_hint=_STEP_HANG)
        traces = sorted(results.traces, key=lambda t: t.rank)
        for rank, (r, tr) in enumerate(zip(results, traces)):
            _check_step_rank(name, layout, m, rank, r, tr, want, loss.item())
        last = [r["loss"] for rank, r in enumerate(results)
                if coordinates(rank, dp, pp_size, tp_size).pp == pp_size - 1]
        got = sum(last) / len(last)  # each replica's mean; the replicas' mean is the batch's
        if not math.isclose(got, loss.item(), rel_tol=1e-5, abs_tol=1e-6):
            why = (f" It is {m} times one process's: return the mean of the micro-batches' losses."
                   if math.isclose(got, m * loss.item(), rel_tol=1e-4) else "")
            raise wrong(name, f"{name} on dp={dp}, pp={pp_size}, tp={tp_size}: the last stage's "
                              f"losses average {got:.6f}, not one process's.{why}",
                        f"{loss.item():.6f}")
    shown = ", ".join(f"dp{d}·pp{p}·tp{t}".replace("·pp1", "").replace("·tp1", "")
                      .replace("dp1·", "") for d, p, t in layouts)
    passed(name, f"on 4 ranks, {shown}, m = {m}: every gradient and the loss equal one process's; "
                 "one activation and one gradient per micro-batch across each stage boundary; "
                 "each gradient all-reduced once over dp")


# -- exercise 3: clip by the global norm -----------------------------------------------------------
# (dp, pp, tp, data parallel)
# (dp, pp, tp, data parallel, cp, ep): cp splits each replica's sequences (the dp axis holds dp·cp
# ranks); ep puts a MoE's experts over the first ep ranks of the dp axis
CLIP_LAYOUTS = ((1, 2, 2, "ddp", 1, 1), (2, 1, 2, "ddp", 1, 1), (2, 1, 2, "fsdp", 1, 1),
                (1, 1, 1, "ddp", 2, 1), (2, 1, 1, "ddp", 1, 2))
NO_CLIP = 1e6  # a max_norm no gradient reaches: nothing may change


def _real_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """4 sequences of 32 bytes of the course's corpus (step 0 of the training sampler)."""
    from minitp.data import COURSE_CORPUS, Sampler, load_corpus

    return Sampler(load_corpus(COURSE_CORPUS).train, 4, 32, seed=0).batch(0)


def _clip_model(ep: int):
    """The byte model, or for expert parallel its MoE (2 experts, top-1, no token dropped)."""
    from minitp.models import build_model
    from minitp.models.moe import build_moe_model, moe_config

    if ep == 1:
        return build_model(_config(), seed=0)
    cfg = moe_config(_config(), n_experts=2, top_k=1, expert_hidden=96, capacity_factor=None)
    return build_moe_model(cfg, seed=0)


def _reference_gradients(ep: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole batch: the global norm (torch's) and every gradient, unclipped."""
    from minitp.models import loss_fn
    from minitp.models.moe import moe_loss

    model = _clip_model(ep)
    tokens, targets = _real_batch()
    loss = moe_loss(model) if ep > 1 else loss_fn
    loss(model(tokens), targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item()
    return norm, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _clip_worker(fn, layout, small: float, reference: float):
    from minitp.mesh import Mesh
    from minitp.parallel3d import Parallel3D
    from minitp.trainer import all_gradients

    dp, pp_size, tp_size, data_parallel, cp, ep = layout
    mesh = Mesh(dp * cp, pp_size, tp_size, cp=cp, ep=ep)
    par = Parallel3D(_clip_model(ep), mesh, data_parallel, microbatches=2 if pp_size > 1 else 1)
    par.optimizer.zero_grad(set_to_none=True)
    par.forward_backward(*_real_batch())
    grads = all_gradients(par)
    saved = [g.detach().clone() for g in grads]
    out = {"replicated": sorted(n for n, d in par.split_dims.items() if d is None)}
    for case, max_norm in (("no clip", NO_CLIP), ("clip", small)):
        for g, s in zip(grads, saved):
            g.copy_(s)
        with trace.scope(ANSWER, case.replace(" ", "_")):
            norm = fn(par, max_norm)
        try:
            norm = float(norm)
        except (TypeError, ValueError):
            out[case] = {"bad": repr(norm)[:80]}
            continue
        coef = min(1.0, max_norm / (reference + 1e-6))
        flat, before = torch.cat([g.reshape(-1)
                                  for g in grads]), torch.cat([s.reshape(-1) for s in saved])
        out[case] = {"norm": norm,
                     "unchanged": bool(torch.equal(flat, before)),
                     "untouched": sum(bool(torch.equal(g, s)) and bool(s.any())
                                      for g, s in zip(grads, saved)),
                     "scaled": bool(torch.allclose(flat, before * coef, rtol=1e-4, atol=1e-10)),
                     # the scale it applied, if one
                     "factor": float(flat @ before / (before @ before))}
    return out


def _ops(results, case: str) -> list[list[tuple[str, int]]]:
    """Per rank: (op, group size) of every message the answer sent in ``case``."""
    scope = case.replace(" ", "_")
    return [[(e.op, len(e.group)) for e in tr.comm() if ANSWER in e.scopes and scope in e.scopes]
            for tr in results.traces]


def _norm_hint(got: float, want: float, n2: float, r2: float, dp: int, tp_size: int,
               ddp: bool) -> str:
    """The usual mistake whose norm is nearest to ``got`` (the replicated norm weights' share r2 of
    the squares is small, so the candidates are compared closely), else what to do."""
    twice = "The replicated norm weights are counted twice"
    candidates = [(n2, "That is the sum of squares: return its square root.")]
    if tp_size > 1:
        candidates.append((math.sqrt(n2 + (tp_size - 1) * r2),
                           f"{twice}: every tp rank holds the same whole RMSNorm weight and the "
                           "same gradient for it (split_dims[name] is None). Count them on tp rank "
                           "0 only."))
    if ddp and dp > 1:
        candidates.append((want * math.sqrt(dp),
                           f"That is the norm times sqrt(dp) = sqrt({dp}): DDP replicas summed. "
                           "After the average every replica holds the same gradients; count the "
                           "first replica's only (dp rank 0)."))
    if ddp and dp > 1 and tp_size > 1:
        candidates.append((math.sqrt(dp * (n2 + (tp_size - 1) * r2)),
                           f"DDP replicas summed (the norm times sqrt(dp)), and {twice[4:]}: count "
                           "the first replica only (dp rank 0), and a replicated weight on tp rank "
                           "0 only."))
    value, hint = min(candidates, key=lambda c: abs(c[0] - got) / c[0])
    if abs(value - got) <= 2e-5 * value:
        return hint
    if not ddp and got < 1e-12:
        return ("Under FSDP the averaged gradients live in the shards, not on the module's "
                "parameters: read par.fsdp.gradient_pieces(), (name, this rank's piece); every "
                "rank's pieces are disjoint.")
    if not ddp and dp > 1 and got < want:
        return ("Under FSDP every rank holds a different shard of the gradients: all of them count "
                "(the replicated weights still on tp rank 0 only).")
    return ("Sum the squares of the gradient elements this rank owns (each element of the model "
            "once over the world), all-reduce that one number over the world, take the square "
            "root.")


def check_clip_grad_norm(fn, layouts=CLIP_LAYOUTS) -> None:
    """``fn(par, max_norm)`` -> the global norm before clipping; every gradient scaled by
    min(1, max_norm / (norm + 1e-6)), as ``torch.nn.utils.clip_grad_norm_`` on one process."""
    name = "clip by the global norm"
    _real_batch()  # builds the corpus's cache here once, not on every rank at once
    references = {ep: _reference_gradients(ep) for ep in sorted({layout[5] for layout in layouts})}
    for layout in layouts:
        dp, pp_size, tp_size, data_parallel, cp, ep = layout
        want, grads = references[ep]
        small = want / 4  # clips: every gradient must shrink 4 times
        ddp = data_parallel == "ddp"
        where = (f"on {data_parallel.upper()} dp={dp}, pp={pp_size}, tp={tp_size}"
                 + "".join(f", {d}={n}" for d, n in (("cp", cp), ("ep", ep)) if n > 1))
        results = run_answer(_clip_worker, dp * cp * pp_size * tp_size,
                             (fn, layout, small, want), name, timeout=60)
        replicated = set().union(*(r["replicated"] for r in results)) if tp_size > 1 else set()
        n2, r2 = want * want, sum(float(grads[n].pow(2).sum()) for n in replicated)
        for case in ("no clip", "clip"):
            bad = [(rank, r[case]["bad"]) for rank, r in enumerate(results) if "bad" in r[case]]
            if bad:
                raise wrong(name, f"{name} {where}: rank {bad[0][0]} returned {bad[0][1]}; return "
                                  "the norm, a number (a float, or a 0-d tensor).")
            norms = [r[case]["norm"] for r in results]
            if max(norms) - min(norms) > 1e-6 * max(1.0, max(norms)):
                stages = [coordinates(rank, dp * cp, pp_size, tp_size).pp
                          for rank in range(len(norms))]
                per_stage = {s: norms[stages.index(s)] for s in set(stages)}
                same_in_stage = all(math.isclose(v, per_stage[s], rel_tol=1e-6)
                                    for v, s in zip(norms, stages))
                if pp_size > 1 and same_in_stage and math.isclose(
                        math.sqrt(sum(v * v for v in per_stage.values())), want, rel_tol=1e-4):
                    shown = ", ".join(f"{v:.4f}" for v in per_stage.values())
                    raise wrong(
                        name, f"{name} {where}: each pipeline stage found its own norm ({shown}), "
                        "not one norm on every rank: the all-reduce is missing across pipeline "
                        "stages. A stage holds only its blocks' gradients; the norm needs every "
                        "stage's: all-reduce over the whole world (group=None), not over the tp or "
                        "dp group.", f"{want:.4f} on every rank")
                shown = ", ".join(f"{v:.4f}" for v in norms)
                raise wrong(name, f"{name} {where}: the ranks disagree on the norm ({shown}). Each "
                                  "rank's sum of squares is a piece of one sum: all-reduce it over "
                                  "the whole world (group=None), then every rank takes the same "
                                  "square root.")
            got = norms[0]
            if ep > 1 and got < want * (1 - 1e-5):
                raise wrong(name, f"{name} {where}: you gave the norm {got:.6f}, less than one "
                                  "process's: under expert parallel each of the first ep ranks of "
                                  "the dp axis holds experts of its own (their names hold "
                                  "'.experts.'), which no other rank holds: count them on each of "
                                  "those ranks, the rest on dp rank 0 only (par.mesh.ep).",
                            f"{want:.6f}")
            if not math.isclose(got, want, rel_tol=1e-5):
                hint = _norm_hint(got, want, n2, r2, dp * cp, tp_size, ddp)
                raise wrong(name, f"{name} {where}: you gave the norm {got:.6f}, not the norm one "
                                  "process finds (torch.nn.utils.clip_grad_norm_). "
                                  f"{hint}", f"{want:.6f}")
        for rank, r in enumerate(results):
            if not r["no clip"]["unchanged"]:
                raise wrong(name, f"{name} {where}: with max_norm={NO_CLIP:g}, far above the norm "
                                  f"{want:.4f}, rank {rank}'s gradients changed (scaled by "
                                  f"{r['no clip']['factor']:.4g}). Clipping only ever shrinks: "
                                  "coef = min(1, max_norm / (norm + 1e-6)).")
        if all(r["clip"]["unchanged"] for r in results):
            raise wrong(name, f"{name} {where}: the norm is right, but with max_norm={small:.4f} "
                              "(a quarter of it) no gradient changed: you forgot to scale. "
                              "Multiply every gradient in place by min(1, max_norm / (norm + "
                              "1e-6)).")
        for rank, r in enumerate(results):
            if not r["clip"]["scaled"]:
                c = coordinates(rank, dp * cp, pp_size, tp_size)
                if r["clip"]["untouched"]:
                    raise wrong(name,
                        f"{name} {where}: rank {rank} (dp {c.dp}, pp {c.pp}, tp {c.tp}) left "
                        f"{r['clip']['untouched']} of its gradients as they were. Scale every "
                        "gradient the optimizer will read on every rank (every replica, every tp "
                        "rank, every shard), not only the ones you counted in the norm.")
                raise wrong(name, f"{name} {where}: rank {rank}'s gradients were scaled by about "
                                  f"{r['clip']['factor']:.4g}, not by min(1, max_norm / (norm + "
                                  f"1e-6)) with max_norm={small:.4f}, on every "
                                  "gradient.", f"{min(1.0, small / (want + 1e-6)):.4g}")
        for case in ("no clip", "clip"):
            for rank, ops in enumerate(_ops(results, case)):
                if ops != [("all_reduce", len(results))]:
                    said = ", ".join(f"{op} over {n} ranks" for op, n in ops) or "nothing traced"
                    raise wrong(name,
                        f"{name} {where}: the values are right, but rank {rank} sent {said}. One "
                        "all-reduce of one number over the whole world is all it takes (the pieces "
                        "are disjoint), sent with minitp.comm.all_reduce so that it is recorded.")
    passed(name, "DDP tp2·pp2, dp2·tp2, cp2 and a MoE's ep2, FSDP dp2·tp2: torch's norm on one "
                 "process, every gradient scaled as it scales them, one all-reduce")


# -- exercise 4: the learning rate -----------------------------------------------------------------
LR_CASES = [(100, 10, 3e-3, 0.1, (0, 4, 9, 10, 11, 55, 98, 99)),
            (300, 30, 1e-3, 0.0, (0, 29, 30, 164, 299)),
            (60, 6, 3e-3, 0.1, (0, 5, 6, 32, 59)),
            (50, 0, 2e-3, 0.2, (0, 1, 25, 49))]


def _lr(step, steps, warmup, lr, min_ratio):
    from minitp.trainer import Settings, lr_at

    return lr_at(step, Settings(steps=steps, warmup=warmup, lr=lr, min_lr_ratio=min_ratio))


def _lr_hint(fn, steps, warmup, lr, min_ratio) -> str:
    def at(step):
        return float(call_answer("learning rate", fn, step, steps, warmup, lr, min_ratio))

    close = lambda a, b: math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)  # noqa: E731
    if warmup and close(at(0), 0.0):
        return ("The first step already moves the weights: warm up as lr·(step + 1)/warmup, so "
                "step 0 gets lr/warmup and step warmup − 1 the full lr.")
    if warmup and close(at(warmup - 1), lr * (warmup - 1) / warmup):
        return "Warm up as lr·(step + 1)/warmup: step warmup − 1 reaches the full lr."
    if min_ratio and close(at(steps - 1), 0.0):
        return (f"The cosine goes down to min_ratio·lr = {min_ratio * lr:g}, not to 0: "
                "lr·(min_ratio + (1 − min_ratio)·c).")
    if not close(at(steps - 1), min_ratio * lr):
        return ("The last step (steps − 1) must reach min_ratio·lr: progress = (step − warmup) / "
                "(steps − 1 − warmup), from 0 after the warm-up to 1 at the last step.")
    mid = warmup + (steps - 1 - warmup) // 4
    linear = lr * (min_ratio + (1 - min_ratio) * (1 - (mid - warmup) / max(1, steps - 1 - warmup)))
    if close(at(mid), linear):
        return "That decays linearly; the schedule is a cosine: c = (1 + cos(π·progress)) / 2."
    return "After the warm-up: lr·(min_ratio + (1 − min_ratio)·(1 + cos(π·progress))/2)."


def check_lr_schedule(fn) -> None:
    """``fn(step, steps, warmup, lr, min_ratio)``: the learning rate of ``step`` (0-based)."""
    name = "learning rate"
    for steps, warmup, lr, min_ratio, points in LR_CASES:
        for step in points:
            got = call_answer(name, fn, step, steps, warmup, lr, min_ratio)
            want = _lr(step, steps, warmup, lr, min_ratio)
            try:
                ok = math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-15)
            except (TypeError, ValueError):
                raise ExerciseError(f"{name}: return a number, got {got!r}.") from None
            if not ok:
                raise wrong(name,
                            f"for steps={steps}, warmup={warmup}, lr={lr:g}, "
                            f"min_ratio={min_ratio}, step {step} you gave {float(got):.6g}. "
                            + _lr_hint(fn, steps, warmup, lr, min_ratio),
                            f"{want:.6g}")
    passed(name, "warm-up, then a cosine to min_ratio·lr, as minitp.trainer.lr_at")


# -- exercise 5: how often to save -----------------------------------------------------------------
def wasted_fraction(interval: float, save_seconds: float, restart_seconds: float,
                    mtbf: float) -> float:
    """minitp's answer: saving costs save_seconds every interval of work; a failure (one every mtbf
    seconds on average) loses half an interval of work on average and the restart."""
    return save_seconds / interval + (interval / 2 + restart_seconds) / mtbf


WASTE_CASES = [(600, 30, 120, 3 * 3600), (1800, 60, 600, 11_000), (120, 5, 20, 86_400),
               (3600, 300, 900, 7200)]


def check_wasted_fraction(fn) -> None:
    """``fn(interval, save_seconds, restart_seconds, mtbf)``: the share of the time lost, to first
    order."""
    name = "time lost to checkpoints and failures"
    refuse_own(name, fn, wasted_fraction)
    for interval, save, restart, mtbf in WASTE_CASES:
        got = call_answer(name, fn, interval, save, restart, mtbf)
        want = wasted_fraction(interval, save, restart, mtbf)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise ExerciseError(
                f"{name}: return a number (a fraction of the time), got {got!r}.") from None
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        hints = [
            (save / interval + (interval + restart) / mtbf,
             "A failure lands anywhere in an interval: on average halfway, so it loses interval/2 "
             "of work."),
            (save / interval + interval / 2 / mtbf,
             "Each failure also costs the restart: the relaunch and the load of the checkpoint."),
            ((interval / 2 + restart) / mtbf,
             "Saving costs save_seconds once per interval: add save/interval."),
            (100 * want, "Return a fraction (0.05), not a percentage (5)."),
            (save / interval + interval / 2 + restart,
             "Failures come once every mtbf seconds: divide the time each one costs by mtbf."),
        ]
        hint = next((h for v, h in hints if math.isclose(got, v, rel_tol=1e-9)),
                    "Per second of run: save/interval for the saves, plus (interval/2 + "
                    "restart)/mtbf for the failures.")
        raise wrong(name, f"for interval={interval} s, save={save} s, restart={restart} s, "
                          f"mtbf={mtbf} s you gave {got:.6g}. {hint}", f"{want:.6g}")
    passed(name, "save/interval + (interval/2 + restart)/mtbf")


# -- worked problems: a run at scale (minitp.exercises.problems) -----------------------------------
TOKENS = 15e12  # LLaMA-3's pre-training tokens
# assumed: the problems say so (MFU near the 38-43 % the Llama 3 paper reports)
GPUS, MFU, SEQ = 8192, 0.40, 8192
# assumed: a file system's aggregate write rate (storage is not on the hardware sheet)
STORAGE_BYTES_PER_S = 100e9
# section 8: 419 unexpected interruptions in 54 days (Llama 3 paper, 3.3.4)
MTBF_S = 54 * 24 * 3600 / 419
RESTART_S = 600.0  # section 8's restart


def _days_to_train(cfg=LLAMA3_70B) -> float:
    """LLaMA-3-70B on TOKENS tokens of SEQ, training_flops_per_token each, on GPUS H100s at MFU of
    their peak."""
    flops = TOKENS * cost.training_flops_per_token(cfg, SEQ)
    return flops / (GPUS * cost.H100.flops_per_s * MFU) / 86400


def checkpoint_bytes(cfg=LLAMA3_70B) -> float:
    """A mixed-precision checkpoint: the bf16 weights and AdamW's fp32 state (master weights, two
    moments), ``memory_per_rank``'s parameters and optimizer state without the gradients: 14 bytes
    per parameter."""
    held = cost.memory_per_rank(cfg.num_params(), precision="bf16")
    return held["params"] + held["optimizer"]


def _save_seconds() -> float:
    return checkpoint_bytes() / STORAGE_BYTES_PER_S


def best_interval(save_seconds: float, restart_seconds: float, mtbf: float) -> float:
    """The interval of work that minimises ``wasted_fraction`` (found by search: Young's
    sqrt(2CM))."""
    low, high = 1e-3, 100 * mtbf
    for _ in range(200):  # ternary search: wasted_fraction is convex in the interval
        a, b = low + (high - low) / 3, high - (high - low) / 3
        at_a = wasted_fraction(a, save_seconds, restart_seconds, mtbf)
        if at_a < wasted_fraction(b, save_seconds, restart_seconds, mtbf):
            high = b
        else:
            low = a
    return (low + high) / 2


PROBLEMS = {
    1: Problem("problem 1, days to train LLaMA-3-70B", _days_to_train, "days",
               {6 * LLAMA3_70B.num_params() / cost.training_flops_per_token(LLAMA3_70B, SEQ):
                "attention's 12·L·D·S FLOPs per token are missing",
                MFU / cost.H100.efficiency: "the run reaches its MFU of the peak, 40 %, not the "
                                            "sheet's 60 %",
                1 / 3: "that is the forward alone: backward costs twice the forward"}),
    2: Problem("problem 2, one save of LLaMA-3-70B", _save_seconds, "s",
               {16 / 14: "the gradients are not saved: a checkpoint holds weights and optimizer "
                         "state",
                12 / 14: "the bf16 weights are saved too, beside AdamW's fp32 master copy and "
                         "moments"}),
    3: Problem("problem 3, how often to save it",
               lambda: best_interval(_save_seconds(), RESTART_S, MTBF_S) / 60, "minutes",
               {1 / math.sqrt(2): "Young's interval is sqrt(2CM): a failure costs half an interval",
                           60.0: "the answer is in minutes, not seconds"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 09: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
