"""Checkers for chapter 06, 3D parallelism (dp × pp × tp).

* ``check_mesh_position(fn)``: ``fn(rank, dp, pp, tp)`` returns ``((dp_rank, pp_rank, tp_rank),
  {"tp": [...], "pp": [...], "dp": [...]})``: where ``rank`` sits on the mesh, tp varying fastest,
  and the global ranks of its three groups. Run on 8 real processes of a 2×2×2 mesh, each compared
  with the members its real process groups gather, then on other layouts against ``minitp.mesh``.
* ``check_step_bytes(fn)``: ``fn(cfg, batch, seq, dp, tp, pp, stage)`` gives ``{"tp", "pp", "dp"}``,
  the bytes a rank of stage ``stage`` sends in one training step (fp32, DDP, no start-up broadcast);
  compared with ``minitp.cost.threed_step_bytes``, the formula the runs' traces are checked against.
* ``check_choose_layout(fn)``: ``fn(cfg, gpus, gpu_memory_bytes, gpus_per_node)`` picks the layout
  whose parameters, gradients and AdamW state (bf16 mixed precision, DDP) fit each GPU, with the
  most data parallel, then the largest tp; or None when nothing fits.
* ``check_make_groups(fn)``: ``fn(dp, pp, tp)``, called on every rank, creates the mesh's process
  groups with ``torch.distributed.new_group`` and returns this rank's three, ``{dim: (ranks,
  group)}``. Run on 8 processes for three layouts; members compared with ``minitp.grid.group_lists``
  and ``minitp.mesh.Mesh``, and each group used: an all-reduce over it must add exactly its members.
* ``check_dp_tp_step(fn)``: ``fn(model, rows, loss_fn, mesh, lr)`` does one SGD step of a
  tensor-parallel model on a (dp, 1, tp) mesh: this replica's rows, forward and backward (tp's
  messages inside), the gradients averaged over ``mesh.dp_group``, the update. Run on 4 ranks (2×2,
  4×1, 1×4) for 3 steps; every replica's parameters, unsharded, compared with one process trained on
  the whole batch.
* ``check_problem(n, answer)``: worked problems 1-3, LLaMA-3-70B's bytes and states at dp = 2, pp =
  4, tp = 8, checked against ``minitp.cost`` (``minitp.exercises.problems``).
"""

from __future__ import annotations

import math

import torch

from minitp import cost, mesh
from minitp.exercises import ExerciseError, passed, problems, refuse_own, run_answer, wrong
from minitp.grid import coordinates, group_lists
from minitp.layout import AXES
from minitp.models import LLAMA3_8B, LLAMA3_70B, TINY

GIB = 2**30
FASTEST_FIRST = tuple(reversed(AXES))  # ("tp", "pp", "dp"): the mesh's axes, the fastest first


# -- exercise 1: a rank's coordinates and groups ---------------------------------------------------
def _normalize(answer):
    """((d, p, t), {dim: [ranks]}) from what the learner returned, or None when it has the wrong
    form."""
    try:
        coords, groups = answer
        if all(hasattr(coords, a) for a in AXES):
            coords = (coords.dp, coords.pp, coords.tp)
        coords = tuple(int(c) for c in coords)
        groups = {dim: sorted(int(r) for r in groups[dim]) for dim in FASTEST_FIRST}
    except (TypeError, ValueError, KeyError):
        return None
    return (coords, groups) if len(coords) == 3 else None


def _dp_fastest(rank: int, dp: int, pp: int, tp: int):
    """The placement with dp varying fastest and tp slowest: rank = (t·pp + p)·dp + d."""
    def at(d, p, t):
        return (t * pp + p) * dp + d
    d, p, t = rank % dp, rank // dp % pp, rank // (dp * pp)
    return (d, p, t), {"tp": [at(d, p, x) for x in range(tp)], "pp": [at(d, x, t)
                                                                      for x in range(pp)],
                       "dp": [at(x, p, t) for x in range(dp)]}


def _pp_tp_swapped(rank: int, dp: int, pp: int, tp: int):
    """The placement with pp varying fastest, then tp: rank = (d·tp + t)·pp + p."""
    def at(d, p, t):
        return (d * tp + t) * pp + p
    d, t, p = rank // (pp * tp), rank // pp % tp, rank % pp
    return (d, p, t), {"tp": [at(d, p, x) for x in range(tp)], "pp": [at(d, x, t)
                                                                      for x in range(pp)],
                       "dp": [at(x, p, t) for x in range(dp)]}


def _truth(rank: int, dp: int, pp: int, tp: int):
    c = coordinates(rank, dp, pp, tp)
    groups = {dim: next(g for g in lists if rank in g)
              for dim, lists in group_lists(dp, pp, tp).items()}
    return (c.dp, c.pp, c.tp), groups


def _position_worker(fn, dp: int, pp: int, tp: int):
    import torch.distributed as dist

    from minitp import comm

    m = mesh.Mesh(dp, pp, tp)
    seen = {}
    for dim in FASTEST_FIRST:  # who is really in each of this rank's groups: ask them
        group = m.group(dim)
        size = comm.group_size(group)
        out = torch.empty(size, dtype=torch.long)
        comm.all_gather(out, torch.tensor([dist.get_rank()]), group=group, label=f"who/{dim}")
        seen[dim] = out.tolist()
    c = m.coords
    return {"answer": fn(dist.get_rank(), dp, pp, tp), "coords": (c.dp, c.pp, c.tp), "groups": seen}


def _compare_position(name: str, rank: int, layout: tuple[int, int, int], answer, want) -> None:
    dp, pp, tp = layout
    where = f"rank {rank} of dp={dp}, pp={pp}, tp={tp}"
    got = _normalize(answer)
    if got is None:
        raise ExerciseError(f"{name}: for {where} the function returned {answer!r}; return "
                            "((dp_rank, pp_rank, tp_rank), {'tp': [...], 'pp': [...], 'dp': "
                            "[...]}).")
    want = (tuple(want[0]), {d: sorted(want[1][d]) for d in FASTEST_FIRST})
    if got == want:
        return
    for mistake, hint in ((_dp_fastest, "you let dp vary fastest. minitp places tp fastest, rank = "
                                        "(dp_rank·pp + pp_rank)·tp + tp_rank, so that each "
                                        "tensor-parallel group is made of neighbouring ranks (one "
                                        "machine)."),
                          (_pp_tp_swapped,
                           "pp and tp are swapped: you let pp vary fastest. tp varies fastest, "
                           "then pp, then dp: rank = (dp_rank·pp + pp_rank)·tp + tp_rank.")):
        other = mistake(rank, dp, pp, tp)
        if got == (other[0], {d: sorted(other[1][d]) for d in FASTEST_FIRST}):
            raise wrong(name,
                        f"for {where} you gave coordinates {got[0]} and groups {got[1]}: {hint}",
                        f"coordinates {want[0]} and groups {want[1]}")
    if got[0] != want[0]:
        raise wrong(name, f"for {where} you gave coordinates (dp, pp, tp) = {got[0]}. Hint: tp "
                          "varies fastest, then pp, then dp, as in rank = (dp_rank·pp + "
                          "pp_rank)·tp + tp_rank; undo that with % and //, starting with "
                          "tp.", f"coordinates {want[0]}")
    dim = next(d for d in FASTEST_FIRST if got[1][d] != want[1][d])
    raise wrong(name, f"for {where} the coordinates are right but the {dim} group is "
                      f"{got[1][dim]}. Its members share the other two coordinates and run through "
                      f"every {dim}_rank: rank_of(...) for {dim}_rank in "
                      f"range({dim}).", f"the {dim} group {want[1][dim]}")


def check_mesh_position(fn) -> None:
    """``fn(rank, dp, pp, tp)`` -> ((dp_rank, pp_rank, tp_rank), {"tp": [...], "pp": [...], "dp":
    [...]})."""
    name = "a rank's coordinates and groups"
    results = run_answer(_position_worker, 8, (fn, 2, 2, 2), name)
    # the real mesh: coordinates and the members its groups gathered
    for rank, r in enumerate(results):
        _compare_position(name, rank, (2, 2, 2), r["answer"], (tuple(r["coords"]), r["groups"]))
    for layout in ((1, 2, 4), (4, 2, 1), (2, 4, 1), (3, 1, 2), (2, 3, 4)):
        for rank in range(math.prod(layout)):
            try:
                answer = fn(rank, *layout)
            except NotImplementedError:
                raise ExerciseError(f"{name}: not done yet (the function still raises "
                                    "NotImplementedError).") from None
            _compare_position(name, rank, layout, answer, _truth(rank, *layout))
    passed(name, "matches the groups 8 real processes formed, and 5 other layouts")


# -- exercise 2: the bytes of one step, per dimension ----------------------------------------------
def _ring(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes


def check_step_bytes(fn) -> None:
    """``fn(cfg, batch, seq, dp, tp, pp, stage)`` -> {"tp", "pp", "dp"}: one step, fp32, DDP."""
    name = "bytes of one step per dimension"
    refuse_own(name, fn, cost.threed_step_bytes)
    cases = [(TINY, "tiny", 8, 16, 2, 2, 2, 0), (TINY, "tiny", 8, 16, 2, 2, 2, 1),
             (TINY, "tiny", 8, 16, 1, 2, 4, 0), (TINY, "tiny", 8, 16, 1, 2, 4, 2),
             (TINY, "tiny", 8, 16, 1, 2, 4, 3), (TINY, "tiny", 8, 16, 4, 1, 2, 1),
             (TINY, "tiny", 8, 16, 2, 4, 1, 0), (LLAMA3_8B, "LLaMA-3-8B", 16, 4096, 2, 4, 2, 1)]
    for cfg, model, batch, seq, dp, tp, pp, stage in cases:
        where = f"{model}, B={batch}, S={seq}, dp={dp}, tp={tp}, pp={pp}, stage {stage}"
        try:
            got = fn(cfg, batch, seq, dp, tp, pp, stage)
        except NotImplementedError:
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError).") from None
        if not isinstance(got, dict):
            raise ExerciseError(
                f"{name}: return a dict {{'tp': ..., 'pp': ..., 'dp': ...}}, got {got!r}.")
        want = cost.threed_step_bytes(cfg, batch, seq, dp, tp, pp, stage)
        for dim in FASTEST_FIRST:
            value = got.get(dim)
            if value is None or (not value and want[dim]):
                why = {"tp": "the all-reduces of tensor parallel (two per block each way, plus the "
                             "embedding, the output layer and the loss)",
                       "pp": "the activations sent to the next stage and the gradients sent back",
                       "dp": "the all-reduce of this rank's gradients over its dp group"}[dim]
                raise wrong(name, f"for {where} the {dim} bytes are {value!r}: you left out the "
                                  f"{dim} bytes: {why}.",
                            f"{dim} = {want[dim]:,.0f} bytes")
            if math.isclose(float(value), want[dim], rel_tol=1e-9, abs_tol=1e-6):
                continue
            hint = _bytes_hint(dim, float(value), want[dim], cfg, batch, seq, dp, tp, pp, stage)
            raise wrong(name, f"for {where} you gave {dim} = {float(value):,.0f} bytes. {hint}",
                        f"{dim} = {want[dim]:,.0f} bytes")
    passed(name, "tp, pp and dp all match minitp.cost on 8 layouts and stages")


def _bytes_hint(dim, got, want, cfg, batch, seq, dp, tp, pp, stage) -> str:
    close = lambda a, b: b and math.isclose(a, b, rel_tol=1e-9)  # noqa: E731
    b = batch // dp
    if dim in ("tp", "pp") and dp > 1 and close(got, want * dp):
        return f"You used the global batch B={batch}; each replica runs B/dp = {b} sequences."
    if dim == "tp":
        blocks = cost.stage_num_blocks(cfg.n_layers, pp,
                                       stage) * cost.tp_block_bytes(b, seq, cfg.dim, tp)
        if close(got, blocks):
            return ("That is the blocks alone: the first stage also all-reduces the embedding's "
                    "output (its vocabulary is split), the last the output layer's input gradient "
                    "(f) and the loss's max and sums.")
        return ("Each block is two column-then-row pairs: 4 all-reduces of the (B/dp, S, D) "
                "activation, each 2(tp-1)/tp of it per rank (cost.tp_block_bytes).")
    if dim == "pp":
        return ("A stage sends each micro-batch's activation forward and its gradient backward, "
                "(B/dp)·S·D·4 bytes per step each way, but the first stage sends no gradient and "
                "the last no activation (cost.pp_step_bytes).")
    psi = cost.threed_params_per_rank(cfg, tp, pp, stage)
    if close(got, _ring(4 * cfg.num_params(), dp)):
        return ("You counted the whole model's parameters; a rank all-reduces the gradients of "
                "what it holds: its stage's tp slice, Ψ_rank = cost.threed_params_per_rank(cfg, "
                "tp, pp, stage).")
    if close(got, 4 * psi) or close(got, 2 * 4 * psi):
        return "An all-reduce of A bytes sends 2(dp-1)/dp · A per rank on a ring."
    return ("The gradients of the parameters this rank holds (Ψ_rank, its stage's tp slice), "
            "all-reduced over dp: 2(dp-1)/dp · 4 Ψ_rank.")


# -- exercise 3: the layout that fits --------------------------------------------------------------
def _states(cfg, dp: int, pp: int, tp: int, optimizer: bool = True) -> float:
    """Worst stage's parameters + gradients (+ AdamW state) per GPU, bf16 mixed precision, DDP."""
    worst = 0.0
    for s in range(pp):
        m = cost.threed_memory_per_rank(cfg, dp, tp, pp, s, "ddp", precision="bf16")
        worst = max(worst, m["params"] + m["grads"] + (m["optimizer"] if optimizer else 0))
    return worst


def reference_layout(cfg, gpus: int, gpu_memory_bytes: float, gpus_per_node: int = 8):
    """minitp's own answer to exercise 3."""
    best = None
    for dp, pp, tp in mesh_layouts(gpus):
        if tp > gpus_per_node:
            continue
        try:
            cost.check_3d_layout(cfg, dp, pp, tp)
        except ValueError:
            continue
        if _states(cfg, dp, pp, tp) <= gpu_memory_bytes and (best is None
                                                             or (dp, tp) > (best[0], best[2])):
            best = (dp, pp, tp)
    return best


def mesh_layouts(gpus: int) -> list[tuple[int, int, int]]:
    from minitp.plan import layouts

    return layouts(gpus)


def check_choose_layout(fn) -> None:
    """``fn(cfg, gpus, gpu_memory_bytes, gpus_per_node)`` -> (dp, pp, tp) or None."""
    name = "the layout that fits"
    refuse_own(name, fn, reference_layout)
    h100 = cost.H100.memory_bytes / GIB  # 80 GiB, the hardware sheet's
    cases = [(LLAMA3_8B, "LLaMA-3-8B", 64, h100), (LLAMA3_8B, "LLaMA-3-8B", 64, 24),
             (LLAMA3_70B, "LLaMA-3-70B", 64, h100), (LLAMA3_70B, "LLaMA-3-70B", 64, 40),
             (LLAMA3_70B, "LLaMA-3-70B", 8, h100), (TINY, "tiny", 8, 2e6 / GIB)]
    for cfg, model, gpus, gib in cases:
        budget = gib * GIB
        shown = f"{gib:g} GiB" if gib >= 1 else f"{budget / 1e6:.1f} MB"
        where = f"{model} on {gpus} GPUs of {shown}"
        try:
            got = fn(cfg, gpus, budget, 8)
        except NotImplementedError:
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError).") from None
        want = reference_layout(cfg, gpus, budget)
        if got is not None:
            try:
                got = tuple(int(x) for x in got)
            except (TypeError, ValueError):
                raise ExerciseError(f"{name}: return (dp, pp, tp) or None, got {got!r}.") from None
        if got == want:
            continue
        if want is None:
            need = min(_states(cfg, *lay) for lay in mesh_layouts(gpus) if lay[2] <= 8)
            raise ExerciseError(
                f"{name}: for {where} you chose {got}, but no layout fits: even the smallest needs "
                f"{need / GIB:.1f} GiB per GPU in parameters, gradients and AdamW state. "
                "Return None when nothing fits.")
        if got is None:
            raise wrong(name, f"for {where} you returned None, but a layout fits. Count 16 bytes "
                              "per parameter a rank holds (its stage's tp slice), for the stage "
                              "that holds the most.",
                        f"{want} ({_states(cfg, *want) / GIB:.1f} GiB per GPU)")
        if len(got) != 3 or math.prod(got) != gpus:
            raise ExerciseError(
                f"{name}: for {where} you chose (dp, pp, tp) = {got}, whose product is not {gpus}.")
        dp, pp, tp = got
        try:
            cost.check_3d_layout(cfg, dp, pp, tp)
        except ValueError as err:
            raise ExerciseError(f"{name}: for {where} you chose {got}, which the model cannot "
                                f"take: {err}.") from None
        if tp > 8:
            raise ExerciseError(
                f"{name}: for {where} you chose tp={tp}: a tensor-parallel group must stay inside "
                "one machine of 8 GPUs.")
        need = _states(cfg, dp, pp, tp)
        if need > budget:
            if _states(cfg, dp, pp, tp, optimizer=False) <= budget:
                raise ExerciseError(f"{name}: for {where} you chose {got}, which needs "
                                    f"{need / GIB:.1f} GiB per GPU with AdamW's state, more than "
                                    f"{shown}: did you count the memory without the optimizer? "
                                    "bf16 mixed precision holds 2 + 2 bytes (parameter, gradient) "
                                    "and 12 of optimizer state (fp32 master copy and two moments) "
                                    "per parameter.")
            raise ExerciseError(f"{name}: for {where} you chose {got}, which needs "
                                f"{need / GIB:.1f} GiB per GPU, more than {shown}. Count 16 bytes "
                                "per parameter a rank holds (its stage's tp slice), for the stage "
                                "that holds the most.")
        if dp < want[0]:
            raise wrong(name, f"for {where} you chose {got} ({need / GIB:.1f} GiB), but a layout "
                              "with more data parallel also fits. Did you count the whole model on "
                              "every GPU, or 4-byte "
                              "parameters?",
                              f"{want} ({_states(cfg, *want) / GIB:.1f} GiB per GPU)")
        raise wrong(name, f"for {where} you chose {got}: with the same dp, prefer the larger tp "
                          "(it stays inside a machine and leaves no pipeline bubble).", str(want))
    passed(name, "6 cases, LLaMA-3-8B and 70B included")


# -- exercise 4: the mesh's process groups, created for real ---------------------------------------
_GROUP_LAYOUTS = ((2, 2, 2), (2, 1, 4), (1, 4, 2))


def _groups_worker(fn, layouts):
    import torch.distributed as dist

    from minitp import comm

    rank, out = dist.get_rank(), []
    for dp, pp, tp in layouts:
        answer = fn(dp, pp, tp)
        got, summed = {}, {}
        for dim in FASTEST_FIRST:
            try:
                ranks, group = answer[dim]
                ranks = [int(r) for r in ranks]
            except (TypeError, KeyError, ValueError):
                got = None
                break
            got[dim] = ranks
            if rank in ranks:  # who really is in it: every member adds its rank
                total = torch.tensor([rank])
                comm.all_reduce(total, group=group, label=f"check/{dim}")
                summed[dim] = int(total)
        m = mesh.Mesh(dp, pp, tp)
        out.append({"answer": got, "raw": repr(answer)[:200], "summed": summed,
                    "mesh": m.group_ranks})
    return out


def check_make_groups(fn, layouts=_GROUP_LAYOUTS, timeout: float = 60.0) -> None:
    """``fn(dp, pp, tp)`` -> {"tp": (ranks, group), "pp": ..., "dp": ...}: this rank's three groups,
    after every rank created every group in the same order."""
    name = "the mesh's process groups"
    results = run_answer(_groups_worker, 8, (fn, layouts), name, timeout, hang_hint=(
        "torch.distributed.new_group must be called by EVERY rank for EVERY group (even the groups "
        "it is not in), in the same order on all ranks: loop over all groups of all three "
        "dimensions on every rank."))
    for li, (dp, pp, tp) in enumerate(layouts):
        lists = group_lists(dp, pp, tp)
        for rank, r in enumerate(results):
            r = r[li]
            where = f"rank {rank} of dp={dp}, pp={pp}, tp={tp}"
            if r["answer"] is None:
                raise ExerciseError(f"{name}: for {where} the function returned {r['raw']}; return "
                                    "{'tp': (ranks, group), 'pp': (ranks, group), 'dp': (ranks, "
                                    "group)}.")
            want = {dim: next(g for g in lists[dim] if rank in g) for dim in lists}
            # pragma: no cover
            if want != {d: list(want_ranks) for d, want_ranks in r["mesh"].items()}:
                raise ExerciseError(f"{name}: minitp.mesh and minitp.grid disagree for {where}.")
            got = r["answer"]
            coords = coordinates(rank, dp, pp, tp)
            if got != want:
                other = _dp_fastest(rank, dp, pp, tp)[1]
                if all(sorted(got[d]) == sorted(other[d]) for d in want) and other != want:
                    raise wrong(name, f"for {where} you gave {got}: you let dp vary fastest. "
                                      "minitp places tp fastest, rank = (dp_rank·pp + pp_rank)·tp "
                                      "+ tp_rank, so each tensor-parallel group is made of "
                                      "neighbouring ranks.", str(want))
                dim = next(d for d in FASTEST_FIRST if sorted(got[d]) != sorted(want[d]))
                raise wrong(name, f"for {where} (coordinates {(coords.dp, coords.pp, coords.tp)}) "
                                  f"the {dim} group is {got[dim]}: its members share this rank's "
                                  "other two coordinates and run through every "
                                  f"{dim}_rank.", f"the {dim} group {want[dim]}")
            for dim in FASTEST_FIRST:
                if r["summed"].get(dim) != sum(want[dim]):
                    raise ExerciseError(
                        f"{name}: for {where} the {dim} group lists the right ranks, but an "
                        f"all-reduce over the group you returned added {r['summed'].get(dim)}, "
                        f"not {sum(want[dim])} (the sum of {want[dim]}): return the group "
                        "new_group made for those ranks.")
    passed(name, f"8 processes, {len(layouts)} layouts: members as minitp.grid.group_lists and "
                 "minitp.mesh.Mesh, each group adds exactly its members")


# -- exercise 4: one training step of dp × tp ------------------------------------------------------
STEP_LAYOUTS = ((2, 1, 2), (4, 1, 1), (1, 1, 4))  # (dp, pp, tp), 4 ranks each
STEP_LR, STEP_STEPS = 0.05, 3


def _step_batch() -> torch.Tensor:
    # (B, S + 1)
    return torch.randint(0, TINY.vocab_size, (8, 17), generator=torch.Generator().manual_seed(6))


def _step_worker(fn, layout):
    from minitp import tp
    from minitp.mesh import Mesh
    from minitp.models import build_model

    dp, pp, tp_size = layout
    grid = Mesh(dp, pp, tp_size)
    model = tp.parallelize(build_model(TINY, seed=0), grid.tp_group)

    def loss_fn(model, rows):  # rows: (b, S + 1) tokens; the logits are (b, S, V/tp)
        return tp.vocab_parallel_cross_entropy(model(rows[:, :-1]), rows[:, 1:], grid.tp_group)

    for _ in range(STEP_STEPS):
        fn(model, _step_batch(), loss_fn, grid, STEP_LR)
    return {"coords": (grid.coords.dp, grid.coords.pp, grid.coords.tp),
            "shards": tp.local_shards(model)}


def _reference_step(lr: float = STEP_LR) -> tuple[list[float], dict[str, torch.Tensor],
                                                  dict[str, torch.Tensor]]:
    """The same steps on one process, the whole batch: losses, the first parameters and the final
    ones (another ``lr``: what a mistake that scales every gradient gives)."""
    from minitp.models import build_model, loss_fn

    model = build_model(TINY, seed=0)
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows, losses = _step_batch(), []
    for _ in range(STEP_STEPS):
        loss = loss_fn(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses, first, {n: p.detach().clone() for n, p in model.named_parameters()}


def check_dp_tp_step(fn, layouts=STEP_LAYOUTS, timeout: float = 60.0) -> None:
    """``fn(model, rows, loss_fn, mesh, lr)``: one SGD step of a tensor-parallel model on a (dp, 1,
    tp) mesh; compared, after 3 steps, with one process training on the whole batch."""
    from minitp import tp

    name = "the dp × tp step"
    want_losses, first, want = _reference_step()
    for layout in layouts:
        dp, _, tp_size = layout
        where = f"dp = {dp}, tp = {tp_size}"
        results = run_answer(_step_worker, 4, (fn, layout), name, timeout)
        replicas = [[r for r in results if r["coords"][0] == d] for d in range(dp)]
        held = [tp.unshard([r["shards"] for r in sorted(rep, key=lambda r: r["coords"][2])])
                for rep in replicas]
        if any(torch.equal(h[n], first[n]) for h in held for n in first):
            raise wrong(name, f"{where}: some parameters never changed: the step must update every "
                              "parameter with its gradient (p -= lr * grad) and clear the gradient "
                              "for the next step")
        if any(max((h[n] - held[0][n]).abs().max().item() for n in want) > 1e-6 for h in held[1:]):
            raise wrong(name, f"{where}: the {dp} replicas hold different parameters after "
                              f"{STEP_STEPS} steps: each computed gradients on its own rows; "
                              "average them over the data-parallel group before the update")
        def off(other, mine=held[0]):
            return max((mine[n] - other[n]).abs().max().item() for n in want)

        diff = off(want)
        if diff <= 1e-5:
            continue
        norm = next(n for n in want if "norm" in n)  # replicated on every tp rank
        moved = (held[0][norm] - first[norm]).norm().item() / (
            want[norm] - first[norm]).norm().item()
        if dp > 1 and off(_reference_step(STEP_LR * dp)[2]) <= 1e-5:
            hint = (f"that is one process at {dp}× the learning rate: the gradients were summed "
                    "over the replicas, not averaged")
        elif tp_size > 1 and off(_reference_step(STEP_LR / tp_size)[2]) <= 1e-5:
            hint = (f"that is one process at 1/{tp_size} of the learning rate: divide by dp, not "
                    "by the world size")
        elif tp_size > 1 and abs(moved - tp_size) < 0.3 * tp_size:
            hint = ("the replicated norms moved tp times too far: the all-reduce ran over the "
                    "whole world, adding the tp ranks' gradients too (and mixing different slices "
                    "of the split weights); run it over mesh.dp_group")
        else:
            hint = ("check which rows each rank trains on: the tp ranks of a replica must see the "
                    "same rows, its mesh.coords.dp-th share of the batch")
        raise wrong(
            name, f"{where}: after {STEP_STEPS} steps the parameters differ from one process's by "
                          f"{diff:.2e}: {hint}",
                          f"losses {[round(x, 5) for x in want_losses]} on one process")
    passed(name, f"4 processes, {len(layouts)} layouts (dp×tp 2×2, 4×1, 1×4): after {STEP_STEPS} "
                 "steps every replica holds what one process trained on the whole batch")


# -- worked problems: LLaMA-3-70B at dp = 2, pp = 4, tp = 8, 64 sequences of 8192 tokens in bf16
# ----------------
def _dp_gb() -> float:
    """GB a rank of a middle stage sends in its dp all-reduce of bf16 gradients, per step."""
    return 2 * (2 - 1) / 2 * 2 * cost.threed_params_per_rank(LLAMA3_70B, 8, 4, 1) / 1e9


def _pp_seconds() -> float:
    """Seconds a middle stage's sends take over InfiniBand per step: 32 micro-batches, an activation
    forward and a gradient backward each."""
    return 2 * 32 * 8192 * LLAMA3_70B.dim * 2 / cost.H100.inter.bytes_per_s


def _zero1_states_gib() -> float:
    """GiB of states on a GPU of the first stage under ZeRO-1 over dp = 2: bf16 weight and gradient
    whole, the fp32 master and two moments split over dp."""
    return cost.threed_params_per_rank(LLAMA3_70B, 8, 4, 0) * (2 + 2 + 12 / 2) / GIB


_MIDDLE_OVER_FIRST = cost.threed_params_per_rank(
    LLAMA3_70B, 8, 4, 1) / cost.threed_params_per_rank(LLAMA3_70B, 8, 4, 0)
PROBLEMS = {
    1: problems.Problem("problem 1, the dp all-reduce of a middle stage", _dp_gb, "GB",
                        {2.0: "4 bytes per gradient is fp32's; these gradients are bf16, 2 bytes"}),
    2: problems.Problem("problem 2, a stage's pipeline sends", _pp_seconds, "s",
                        {0.5: "each micro-batch crosses twice: its activation forward, its "
                              "gradient backward",
                         1 / 9: "that is NVLink's 450 GB/s: consecutive stages sit on different "
                                "machines"}),
    3: problems.Problem("problem 3, the first stage's states under ZeRO-1", _zero1_states_gib,
                        "GiB", {1.6: "ZeRO-1 splits the optimizer's 12 bytes over dp = 2",
                         0.8: "ZeRO-1 splits only the optimizer's 12 bytes over dp; weight and "
                              "gradient stay whole",
                         _MIDDLE_OVER_FIRST: "that is a middle stage: the first holds the "
                                             "embedding too"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 06: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
