"""Checkers for chapter 08, expert parallel.

* ``check_capacity(fn)``: ``fn(seq_len, n_experts, top_k, capacity_factor)`` is C, the most
  assignments one expert takes from one sequence; compared with ``MoEConfig.capacity``.
* ``check_capacity_mask(fn)``: ``fn(expert, n_experts, capacity)`` gives the (B, S, k) bool mask of
  the assignments that fit, first choices of every token before second choices; compared with
  ``minitp.models.moe.capacity_mask``.
* ``check_dispatch(fn)``: ``fn(rows, counts, group)`` sends each rank the rows for its experts with
  ``minitp.comm.all_to_all`` and returns (received rows, incoming counts); run on 2 and 4 ranks,
  compared with what every rank sent, messages with two all-to-alls.
* ``check_layer_bytes(fn)``: ``fn(tokens, rank, dim, dtype_bytes)`` gives the bytes one rank sends
  in the token all-to-alls of one MoE layer, forward and backward, from the matrix T of rows rank i
  sends rank j.
* ``check_combine(fn)``: ``fn(done, order, gate, send_splits, recv_splits, group)`` sends the
  experts' outputs back to their tokens' ranks and adds each token's k outputs by their gates, with
  a backward that sends the gradients to the experts; run on 2 and 4 ranks on exercise 3's dispatch,
  compared with one process's autograd (outputs, the experts' and the input's gradients) and with
  the trace.
* ``check_problem(n, answer)``: the worked problems (``PROBLEMS``), from ``minitp.cost`` (problem 3:
  the capacity of ``minitp.models.moe``, which ``minitp.cost`` has no formula for).
"""

from __future__ import annotations

import math

import torch

from minitp import comm, cost, models, regions, trace
from minitp.exercises import (
    ExerciseError,
    _names_used,
    bound_names,
    passed,
    problems,
    refuse_own,
    refuse_own_deep,
    run_answer,
    wrong,
)
from minitp.exercises.problems import Problem
from minitp.models.moe import MIXTRAL_8X7B, capacity_mask, moe_config

ANSWER = "answer"


def _call(name: str, fn, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        raise ExerciseError(
            f"{name}: not done yet (the function still raises NotImplementedError).") from None


# -- exercise 1: capacity --------------------------------------------------------------------------
def check_capacity(fn) -> None:
    """``fn(seq_len, n_experts, top_k, capacity_factor)`` must be ceil(c·S·k/E), at most S."""
    name = "expert capacity"
    cases = [(16, 8, 2, 1.25), (4096, 256, 8, 1.0), (10, 4, 1, 1.5), (8, 4, 2, 4.0), (7, 3, 2, 1.0)]
    for s, e, k, c in cases:
        got = _call(name, fn, s, e, k, c)
        want = moe_config(n_experts=e, top_k=k, capacity_factor=c).capacity(s)
        if got == want:
            continue
        raw = c * s * k / e
        hints = [
            (math.ceil(raw),
             "An expert gets a token at most once, so it never needs more than S slots: cap at S."),
            (math.floor(raw),
             "Round up, not down: a fraction of a slot is still a slot (math.ceil)."),
            (math.ceil(c * s / e),
             "Each token makes k assignments, so the sequence has k·S of them to share out."),
            (math.ceil(c * s * e / k),
             "The k·S assignments are shared by E experts: divide by E, multiply by k."),
        ]
        hint = next((h for v, h in hints if got == v),
                    "How many assignments does the sequence make, shared by how many experts? Then "
                    "the slack capacity_factor, the rounding, and the most one expert can ever "
                    "need.")
        raise wrong(name, f"for S={s}, E={e}, k={k}, capacity_factor={c} you gave {got}. {hint}",
                    str(want))
    passed(name, "ceil(c·S·k/E), at most S")


# -- exercise 2: which assignments fit -------------------------------------------------------------
def _mask_cases():
    g = torch.Generator().manual_seed(8)
    cases = [(torch.tensor([[[0, 1], [0, 1], [1, 0]]]), 2, 2)]
    for B, S, E, k, c in [(2, 12, 4, 2, 5), (3, 9, 3, 1, 2), (1, 16, 8, 2, 3)]:
        expert = torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(S)])
                              for _ in range(B)])  # (B, S, k): k different experts per token
        cases.append((expert, E, c))
    return cases


def _token_major(expert, n_experts, capacity):
    B, S, k = expert.shape
    queue = torch.nn.functional.one_hot(expert.reshape(B, S * k), n_experts)
    place = ((queue.cumsum(1) - 1) * queue).sum(-1)
    return (place < capacity).view(B, S, k)


def _whole_batch(expert, n_experts, capacity):
    B, S, k = expert.shape
    return capacity_mask(expert.reshape(1, B * S, k), n_experts, capacity).view(B, S, k)


def check_capacity_mask(fn) -> None:
    """``fn(expert (B, S, k), n_experts, capacity)`` must keep, per sequence and expert, the first
    ``capacity`` assignments, all first choices before any second choice, earlier tokens first."""
    name = "capacity mask"
    refuse_own(name, fn, capacity_mask)
    for expert, e, c in _mask_cases():
        got = _call(name, fn, expert.clone(), e, c)
        want = capacity_mask(expert, e, c)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ExerciseError(f"{name}: expected a bool tensor of shape {tuple(want.shape)} (B, "
                                f"S, k), got {shape}.")
        got = got.bool()
        if torch.equal(got, want):
            continue
        hint = "Keep the first `capacity` assignments of each expert, counted per sequence."
        if torch.equal(got, _token_major(expert, e, c)):
            hint = ("You queued token by token (token 0's choices, then token 1's...). First "
                    "choices go first: every token's first choice, then every token's second "
                    "choice (order the queue slot-major, e.g. expert.transpose(1, 2)), so a "
                    "token's best expert is the last thing dropped.")
        elif torch.equal(got, _whole_batch(expert, e, c)) and expert.shape[0] > 1:
            hint = "The capacity holds per sequence: count each sequence's queue from zero."
        elif torch.equal(got, capacity_mask(expert, e, c + 1)):
            hint = "One too many kept: places count from 0, so keep place < capacity."
        elif torch.equal(got, capacity_mask(expert, e, c - 1)):
            hint = ("One too few kept: an expert takes `capacity` assignments, places 0 .. "
                    "capacity - 1.")
        raise ExerciseError(
            f"{name}: for {tuple(expert.shape)} choices of {e} experts, capacity {c}, "
            f"{int((got != want).sum())} assignments are wrong. {hint}")
    passed(name, "per sequence, first choices first")


# -- exercise 3: dispatch with all_to_all (on several processes) -----------------------------------
EXPERTS = 8
DIM = 3


def _dispatch_data(rank: int, n_experts: int = EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows grouped by expert and its counts per expert; each row says (source, expert,
    i)."""
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.randint(0, 4, (n_experts,), generator=g)
    counts[(rank + 1) % n_experts] = 0  # an expert this rank sends nothing
    rows = torch.tensor([[rank, e, 0] for e, c in enumerate(counts.tolist()) for _ in range(c)],
                        dtype=torch.float32).view(-1, DIM)  # (A, D), grouped by expert
    rows[:, 2] = torch.arange(rows.shape[0], dtype=torch.float32)  # position in this rank's buffer
    return rows, counts


def _expected_dispatch(n: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    per = EXPERTS // n
    received, incoming = [], []
    for src in range(n):
        rows, counts = _dispatch_data(src)
        keep = (rows[:, 1] >= rank * per) & (rows[:, 1] < (rank + 1) * per)
        received.append(rows[keep])
        incoming.append(counts[rank * per:(rank + 1) * per])
    return torch.cat(received), torch.stack(incoming)


def _dispatch_worker(fn):
    import torch.distributed as dist

    rows, counts = _dispatch_data(dist.get_rank())
    with trace.scope(ANSWER):
        out = fn(rows.clone(), counts.clone(), None)
    if not isinstance(out, tuple) or len(out) != 2:
        return {"bad": type(out).__name__}
    received, incoming = out
    return {"received": received.detach().clone(), "incoming": torch.as_tensor(incoming).clone()}


def check_dispatch(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(rows, counts, group)``: rows (A, D) grouped by expert, counts (E,) rows per expert; rank
    j holds experts j·E/n .. (j+1)·E/n - 1. Return (received (R, D): every rank's rows for this
    rank's experts, rank 0's first, each source's in expert order; incoming (n, E/n): rows from each
    rank for each local expert)."""
    name = "dispatch with all_to_all"
    hint = ("Split sizes count rows per *rank*, one per rank of the group: sum the counts of the "
            "experts each rank holds (counts.view(n, -1).sum(1)). How many rows arrive from each "
            "rank you only learn from the counts the others send you: exchange the counts first, "
            "with an all-to-all of their own.")
    for n in nprocs:
        results = run_answer(_dispatch_worker, n, (fn,), name, hint=hint)
        for rank, r in enumerate(results):
            if "bad" in r:
                raise ExerciseError(f"{name}: return a pair (received, incoming), got {r['bad']}.")
            want_rows, want_counts = _expected_dispatch(n, rank)
            incoming = r["incoming"]
            if incoming.numel() != want_counts.numel() or not torch.equal(
                incoming.reshape(want_counts.shape).long(),
                want_counts):
                raise wrong(
                    name, f"{name} on {n} ranks: rank {rank}'s incoming counts are "
                    f"{incoming.tolist()}; row i must hold the rows from rank i for each of this "
                    f"rank's {EXPERTS // n} experts. An all-to-all of the counts (E,) gives rank j "
                    "every rank's counts for j's experts.", str(want_counts.tolist()))
            if tuple(incoming.shape) != tuple(want_counts.shape):
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank}'s incoming counts have shape "
                    f"{tuple(incoming.shape)}, expected {tuple(want_counts.shape)} (n, E/n): row i "
                    f"holds the rows from rank i for each of this rank's {EXPERTS // n} experts. "
                    "The values are right: view them as (n, E/n), e.g. incoming.view(n, -1).")
            got = r["received"]
            if got.shape != want_rows.shape or not torch.equal(got, want_rows):
                srcs = sorted({int(
                    s) for s in got[:, 0].tolist()}) if got.dim() == 2 and got.numel() else []
                raise wrong(
                    name, f"{name} on {n} ranks: rank {rank} received {tuple(got.shape)} rows "
                    f"(from ranks {srcs}); it must get every rank's rows for experts "
                    f"{EXPERTS // n * rank}..{EXPERTS // n * (rank + 1) - 1}, in source-rank "
                    f"order. {hint}",
                    f"{tuple(want_rows.shape)} rows, the first {want_rows[:4].int().tolist()} as "
                    "(source, expert, i)")
        for tr in results.traces:
            ops = [e.op for e in tr.comm() if ANSWER in e.scopes]
            if ops != ["all_to_all", "all_to_all"]:
                raise ExerciseError(
                    f"{name}: the rows are right, but rank {tr.rank} sent "
                    f"{ops or 'nothing traced'}. Use minitp.comm.all_to_all (so every byte is "
                    "recorded), twice: the counts, then the rows.")
    passed(name, f"every rank got its experts' rows on {' and '.join(map(str, nprocs))} ranks, two "
                 "all-to-alls")


# -- exercise 4: the bytes of one layer ------------------------------------------------------------
def check_layer_bytes(fn) -> None:
    """``fn(tokens, rank, dim, dtype_bytes)``: tokens[i][j] rows rank i dispatches to rank j; the
    bytes ``rank`` sends in the layer's token all-to-alls: dispatch and combine forward, their two
    backward."""
    name = "bytes of one MoE layer"
    cases = [([[5, 3], [2, 6]], 0, 4, 4), ([[1, 2, 3, 4], [0, 5, 1, 1], [2, 2, 2, 2], [7, 0, 0, 1]],
                                           2, 8, 2),
             ([[0, 9, 1], [4, 0, 0], [3, 3, 3]], 1, 16, 4)]
    for tokens, rank, dim, b in cases:
        got = _call(name, fn, [list(row) for row in tokens], rank, dim, b)
        n = len(tokens)
        out_rows = sum(tokens[rank][j] for j in range(n) if j != rank)
        in_rows = sum(tokens[i][rank] for i in range(n) if i != rank)
        want = 2 * (out_rows + in_rows) * dim * b
        if got is not None and math.isclose(float(got), want):
            continue
        diag = 2 * tokens[rank][rank] * dim * b
        hints = [
            (want / 2, "That is the forward only: backward sends the gradients of the combine and "
                       "of the dispatch back the same ways, as many bytes again."),
            (want + 2 * diag,
             "The rows a rank addresses to itself never leave it: leave the diagonal out."),
            (2 * out_rows * dim * b,
             "That counts the dispatch only: the combine sends back the outputs of the rows "
                                     "it received (column `rank` of T)."),
            (4 * out_rows * dim * b,
             "The combine sends back what this rank *received* (column `rank` of T), not what "
                                     "it sent."),
            (want / b, "Multiply by the bytes per element."),
        ]
        hint = next((h for v, h in hints if got is not None and math.isclose(float(got), v)),
                    "Which rows does this rank send in the dispatch, which in the combine, and "
                    "which never leave it? Backward sends each of them once more; a row is D "
                    "elements of b bytes.")
        raise wrong(name, f"for T={tokens}, rank {rank}, D={dim}, b={b} you gave {got}. {hint}",
                    f"{want:g} bytes")
    passed(name, "2·D·b·(rows out + rows in), without the diagonal")


# -- exercise 5: combine, and the backward (on several processes) ----------------------------------
TOP_K = 2


def _combine_data(rank: int, n_experts: int = EXPERTS):
    """Exercise 3's dispatch (``_dispatch_data``'s counts per expert) made into tokens: its A rows,
    grouped by expert, are the kept assignments of T tokens of k = 2 slots, row a being slot a // T
    of token a % T (T > every count, so a token's two slots go to two different experts; the slots
    no row fills are dropped). Returns x (T, D), order (A,) the slot (token·k + slot) of each row,
    the experts of every slot (T, k), counts (E,)."""
    _, counts = _dispatch_data(rank, n_experts)
    rows = int(counts.sum())
    tokens = max(math.ceil(rows / TOP_K), int(counts.max()) + 1) + 1
    a = torch.arange(rows)
    order = (a % tokens) * TOP_K + a // tokens  # (A,): row a -> slot a // T of token a % T
    experts = torch.full((tokens * TOP_K,), -1)
    experts[order] = torch.repeat_interleave(torch.arange(n_experts), counts)
    experts = experts.view(tokens, TOP_K)
    # a dropped slot: any expert but the token's other one
    for t, s in (experts < 0).nonzero().tolist():
        other = int(experts[t, 1 - s])
        experts[t, s] = (other + 1) % n_experts if other >= 0 else s
    x = torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(300 + rank))
    return x, order, experts, counts


def _combine_weights(n_experts: int = EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's matrix (E, D, D) (expert e maps v to tanh(v W_e)) and the router (D, E)."""
    g = torch.Generator().manual_seed(8)
    return torch.randn(n_experts, DIM, DIM,
                       generator=g) / DIM**0.5, torch.randn(DIM, n_experts, generator=g)


def _loss_weights(rank: int, tokens: int) -> torch.Tensor:
    """The loss of rank ``rank``'s tokens is (y · these).sum(): a sum, so the ranks' gradients add
    up to one process's."""
    return torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(400 + rank))


def _combine_worker(fn):
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    per = EXPERTS // n
    x, order, experts, counts = _combine_data(rank)
    weights, router = _combine_weights()
    x.requires_grad_()
    router.requires_grad_()
    # this rank's experts (E/n, D, D)
    local = weights[rank * per:(rank + 1) * per].clone().requires_grad_()
    # (T, k): each slot's router probability
    gate = torch.softmax(x @ router, dim=-1).gather(1, experts)
    # exercise 3's dispatch (the checker's own): the counts, then the rows
    incoming = torch.empty_like(counts)
    comm.all_to_all(incoming, counts, label="dispatch.counts")
    incoming = incoming.view(n, per)
    send, recv = counts.view(n, per).sum(1).tolist(), incoming.sum(1).tolist()
    received = regions.all_to_all_rows(x[order // TOP_K], recv, send, None, "dispatch")  # (R, D)
    # local expert of each row
    which = torch.repeat_interleave(torch.arange(per).repeat(n), incoming.reshape(-1))
    done = torch.tanh(torch.einsum("rd,rdf->rf", received, local[which]))  # (R, D): the experts ran
    with trace.scope(ANSWER):
        y = fn(done, order.clone(), gate, list(send), list(recv), None)
        if not isinstance(y, torch.Tensor):
            return {"bad": type(y).__name__}
        if tuple(y.shape) != tuple(x.shape):
            return {"shape": tuple(y.shape), "want": tuple(x.shape), "rows": tuple(done.shape)}
        if not y.requires_grad:
            return {"detached": True, "y": y.detach().clone()}
        loss = (y * _loss_weights(rank, x.shape[0])).sum()
        # the answer's backward
        grad_done, grad_gate = torch.autograd.grad(loss, (done, gate), allow_unused=True)
    out = {"y": y.detach().clone(), "A": len(order), "R": len(done),
           "kept": (send[rank], recv[rank])}
    if grad_done is None:  # nothing reaches the experts, nor the dispatch's backward: stop here
        return {**out, "expert_grads": None}
    torch.autograd.backward([done, gate], [grad_done, torch.zeros_like(gate) if grad_gate is None
                                           else grad_gate])
    return {**out, "x_grad": x.grad.clone(), "expert_grads": local.grad.clone()}


def _combine_reference(n: int, gate_power: int = 1, slots: str = "sum") -> dict:
    """One process, every rank's tokens: the same layer with plain autograd. ``gate_power`` and
    ``slots`` ("sum" or "first") plant the usual mistakes, to name them."""
    weights, router = _combine_weights()
    weights, router = weights.clone().requires_grad_(), router.clone().requires_grad_()
    ys, xs, loss = [], [], 0.0
    for rank in range(n):
        x, order, experts, _ = _combine_data(rank)
        x.requires_grad_()
        gate = torch.softmax(x @ router, dim=-1).gather(1, experts)
        kept = torch.zeros(experts.numel(), dtype=torch.bool)
        kept[order] = True
        # (T, k, D): every slot's expert
        out = torch.tanh(torch.einsum("td,tkdf->tkf", x, weights[experts]))
        out = out * kept.view(-1, TOP_K, 1)  # dropped slots add nothing
        weighted = gate.unsqueeze(-1) ** gate_power * out
        y = weighted.sum(1) if slots == "sum" else weighted[:, 0]
        loss = loss + (y * _loss_weights(rank, x.shape[0])).sum()
        ys.append(y)
        xs.append(x)
    loss.backward()
    return {"y": [y.detach() for y in ys], "x_grad": [x.grad for x in xs],
            "expert_grads": weights.grad}


def _autograd_functions(fn) -> list:
    """The torch.autograd.Function classes ``fn`` uses by name (a global, or a name it closes over):
    their forward and backward are the answer too."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    bound = bound_names(fn)
    names = _names_used(code)[0] | set(code.co_freevars)
    return [value for name in sorted(names) if isinstance(value := bound.get(name), type)
            and issubclass(value, torch.autograd.Function)
            and not value.__module__.startswith("torch")]


def _close(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b,
                                                                                     atol=1e-5,
                                                                                     rtol=1e-5)


def check_combine(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(done, order, gate, send_splits, recv_splits, group)``: done (R, D) the experts' outputs
    of the rows this rank received in exercise 3's dispatch, in the order they came; order (A,) the
    slot (token·k + slot) of each row this rank dispatched; gate (T, k) each slot's gate;
    send_splits and recv_splits the dispatch's split sizes (rows sent to, received from each rank).
    Return y (T, D): each token's outputs weighted by their gates and summed (dropped slots add
    nothing), differentiable, its backward sending each output's gradient back to the rank whose
    expert made it."""
    name = "combine and its backward"
    own = (regions.all_to_all_rows, regions._AllToAll, models.moe.combine)
    refuse_own_deep(name, fn, *own)
    for cls in _autograd_functions(fn):
        for method in ("forward", "backward"):
            refuse_own(name, getattr(cls, method), *own)
    splits = ("The combine is the dispatch run backwards: each output goes back to the rank its "
              "row came from, so the dispatch's two split sizes trade places; backward sends the "
              "gradients the way the rows first went.")
    for n in nprocs:
        results = run_answer(_combine_worker, n, (fn,), name, hint=splits)
        reference = None
        for rank, r in enumerate(results):
            if "bad" in r:
                raise ExerciseError(
                    f"{name}: return the tensor y (T, D), one row per token; got {r['bad']}.")
            if "shape" in r:
                T, D = r["want"]
                if r["shape"] == (T, TOP_K, D):
                    hint = ("one row per slot: add each token's k weighted outputs (sum over the "
                            "slots).")
                elif r["shape"] == (r["rows"][0], D) or len(r["shape"]) == 2 and r["shape"][1] == D:
                    hint = ("one row per assignment: put each row back in its token's slot (order "
                            "says which), weight it by its gate and add each token's k slots.")
                else:
                    hint = "y holds one row of D values per token of this rank."
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank} returned shape {r['shape']}, expected "
                    f"{r['want']} (T, D): {hint}")
            if "detached" in r:
                raise ExerciseError(
                    f"{name} on {n} ranks: y does not require grad, so no gradient can reach the "
                    "experts or the router. Build y from `done` and `gate` with autograd-aware "
                    "operations (and a torch.autograd.Function for the all-to-all).")
            reference = reference or _combine_reference(n)
            want = reference["y"][rank]
            if not _close(r["y"], want):
                hint = ("Each output must go back to the rank that sent its row, land in the slot "
                        "`order` names, be weighted by its gate, and each token's k slots "
                        "added. " + splits)
                if _close(r["y"], _combine_reference(n, gate_power=0)["y"][rank]):
                    hint = ("The gates are never applied: weight each output by its token's gate "
                            "for that slot.")
                elif _close(r["y"], _combine_reference(n, gate_power=2)["y"][rank]):
                    hint = "The gates are applied twice: each output is weighted by its gate once."
                elif _close(r["y"], _combine_reference(n, slots="first")["y"][rank]):
                    hint = ("Only one of each token's k outputs counts: add the k slots, each "
                            "weighted by its gate.")
                bad = int((~torch.isclose(r["y"], want, atol=1e-5, rtol=1e-5)).any(1).sum())
                raise wrong(
                    name, f"{name} on {n} ranks: rank {rank}'s outputs are wrong for {bad} of its "
                                  f"{len(want)} tokens. {hint}",
                                  f"y[0] = {[round(v, 5) for v in want[0].tolist()]}")
        per = EXPERTS // n
        for rank, r in enumerate(results):
            want = reference["expert_grads"][rank * per:(rank + 1) * per]
            if r["expert_grads"] is None:
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank}'s experts got no gradient. The gradient was "
                    "not sent back: backward must send each output's gradient to the rank whose "
                    "expert made it (an all-to-all, the forward's reversed) and return it as the "
                    "gradient of `done`.")
            if not _close(r["expert_grads"], want):
                raise wrong(name, f"{name} on {n} ranks: rank {rank}'s experts' weight gradients "
                                  "differ from one process's by up to "
                                  f"{float((r['expert_grads'] - want).abs().max()):.3g}. Backward "
                                  "must send each gradient row to the rank whose expert made that "
                                  "output, the way the rows first went, in the order they came.",
                            f"max |gradient| {float(want.abs().max()):.5f}")
            if not _close(r["x_grad"], reference["x_grad"][rank]):
                raise ExerciseError(f"{name} on {n} ranks: the experts' gradients are right but "
                                    f"rank {rank}'s input gradient is not: the gates' gradient "
                                    "must flow too (leave `gate` in the graph, no .detach()).")
        for tr, r in zip(results.traces, results):
            events = [e for e in tr.comm() if ANSWER in e.scopes]
            ops = [e.op for e in events]
            if ops != ["all_to_all", "all_to_all"]:
                raise ExerciseError(
                    f"{name}: the numbers are right, but rank {tr.rank} sent "
                    f"{ops or 'nothing traced'}. Use minitp.comm.all_to_all (so every byte is "
                    "recorded): once forward, the outputs, and once backward, their gradients.")
            kept_out, kept_in = r["kept"]
            want_bytes = ((r["R"] - kept_in) + (r["A"] - kept_out)) * DIM * 4
            sent = sum(e.sent_bytes for e in events)
            if not math.isclose(sent, want_bytes):
                raise wrong(name, f"{name} on {n} ranks: rank {tr.rank}'s two all-to-alls sent "
                                  f"{sent:g} bytes. Forward sends the outputs of the rows it "
                                  "received, backward the gradients of the rows it dispatched; a "
                                  "row addressed to the rank itself stays.",
                            f"{want_bytes:g} bytes")
    passed(name, f"outputs and the experts' and inputs' gradients match one process on "
                 f"{' and '.join(map(str, nprocs))} ranks; two all-to-alls, one each way")


# -- worked problems: estimates from the hardware sheet (minitp.exercises.problems) ----------------
PROBLEM_TOKENS = 4096  # tokens on each GPU in problem 1; a sequence's in problem 3


def _all_to_all_over_experts(cfg=MIXTRAL_8X7B, ep: int = 8, tokens: int = PROBLEM_TOKENS) -> float:
    """A Mixtral-8x7B-like layer, its ep ranks in different machines: the forward's dispatch and
    combine over InfiniBand (bf16 rows, even routing, bandwidth only) against the experts' forward
    on one GPU (k·T assignments, 2 FLOPs per expert weight each, at the sheet's efficiency)."""
    device = cost.H100
    sent = cost.moe_all_to_all_bytes(tokens, cfg.dim, cfg.top_k, ep, 2, 2, backward=False)
    transfer = (sent["dispatch"] + sent["combine"]) / device.inter.bytes_per_s
    compute = cost.compute_time(cfg.top_k * tokens * 2 * cfg.expert_params(), device)
    return transfer / compute


def _dispatch_bytes_per_token(max_nodes: int | None = None) -> float:
    """DeepSeek-V3's shapes (D = 7168, 256 experts, k = 8, ep = 64 on 8 nodes): the bytes one token
    sends across InfiniBand in one FP8 dispatch, once per node of its experts
    (``cost.moe_internode_bytes``)."""
    return cost.moe_internode_bytes(1, 7168, 8, 256, 64, cost.H100.gpus_per_node, max_nodes,
                                    dispatch_bytes=1, backward=False)["dispatch"]


def _no_expert_share(capacity_factor: float = 1.25, top_k: int | None = None,
                     seq: int = PROBLEM_TOKENS) -> float:
    """A Mixtral-8x7B-like layer at ``capacity_factor``, every token of a sequence choosing experts
    0 then 1: the share of its tokens capacity leaves with no expert at all (``capacity_mask`` of
    that collapsed routing). ``top_k`` only changes the capacity (a slip: C without k)."""
    cfg = MIXTRAL_8X7B.with_(capacity_factor=capacity_factor)
    capacity = cfg.with_(top_k=top_k or cfg.top_k).capacity(seq)
    choice = torch.tensor([0, 1]).repeat(1, seq, 1)  # (1, S, k)
    keep = capacity_mask(choice, cfg.n_experts, capacity)
    return float((~keep.any(-1)).float().mean())


def _slips_of_problem_2() -> dict[float, str]:
    want = _dispatch_bytes_per_token()
    per_assignment = cost.moe_all_to_all_bytes(1, 7168, 8, 64, dispatch_bytes=1,
                                               backward=False)["dispatch"]
    return {per_assignment / want: "one row per assignment: a node gets a token once, however many "
                                   "of its experts chose it",
            8 / 7: "a token's own node is not crossed to: (nodes-1)/nodes of its nodes are remote",
            2.0: "FP8: 1 byte an element",
            _dispatch_bytes_per_token(
                4) / want: "that is with the limit of 4 nodes; here a token's experts may sit "
                                                 "on any node"}


def _slips_of_problem_3() -> dict[float, str]:
    want = _no_expert_share()
    return {(1 - want) / want: "that is the share that keeps its experts; the question asks for "
                               "the share that gets none",
            _no_expert_share(top_k=1) / want: "each token makes k assignments: C = ceil(c·S·k/E)",
            _no_expert_share(capacity_factor=1.0) / want: "the capacity factor c = 1.25 gives each "
                                                          "expert room for 25 % more than an even "
                                                          "share"}


PROBLEMS = {
    1: Problem("problem 1, the all-to-all against the experts", _all_to_all_over_experts, "",
               {0.5: "the dispatch alone: the combine sends every output back, as many rows again",
                8 / 7: "a row whose expert is on its own rank stays: (ep-1)/ep of the k·T rows "
                       "leave",
                1 / 9: "that is NVLink's 450 GB/s: the ranks are in different machines, on "
                       "InfiniBand",
                3.0: "an expert is three matrices (w1, w3, w2): 6·D·Fe FLOPs per assignment "
                     "forward",
                1 / 0.6: "the experts run at 60 % of the peak (cost.H100.efficiency)",
                2.0: "bf16: 2 bytes an element; forward's two all-to-alls against forward's "
                     "compute",
                2 / 3: "that is forward and backward together (backward: the same bytes, twice the "
                       "FLOPs); the question asks for the forward",
                1 / 3: "forward's messages against forward and backward's compute: the forward's "
                       "alone"}),
    2: Problem("problem 2, a token's bytes between nodes", _dispatch_bytes_per_token, "bytes",
               _slips_of_problem_2()),
    3: Problem("problem 3, a collapsed router under capacity", _no_expert_share, "",
               _slips_of_problem_3(), rel=0.01),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 08: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
