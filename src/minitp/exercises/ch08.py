"""Checkers for chapter 08, expert parallel.

* ``check_capacity(fn)``: ``fn(seq_len, n_experts, top_k, capacity_factor)`` is C, the most assignments
  one expert takes from one sequence; compared with ``MoEConfig.capacity``.
* ``check_capacity_mask(fn)``: ``fn(expert, n_experts, capacity)`` gives the (B, S, k) bool mask of the
  assignments that fit, first choices of every token before second choices; compared with
  ``minitp.models.moe.capacity_mask``.
* ``check_dispatch(fn)``: ``fn(rows, counts, group)`` sends each rank the rows for its experts with
  ``minitp.comm.all_to_all`` and returns (received rows, incoming counts); run on 2 and 4 ranks, compared
  with what every rank sent, messages with two all-to-alls.
* ``check_layer_bytes(fn)``: ``fn(tokens, rank, dim, dtype_bytes)`` gives the bytes one rank sends in the
  token all-to-alls of one MoE layer, forward and backward, from the matrix T of rows rank i sends rank j.
"""

from __future__ import annotations

import math

import torch

from minitp import trace
from minitp.exercises import ExerciseError, passed, refuse_own, run_answer, wrong
from minitp.models.moe import capacity_mask, moe_config

ANSWER = "answer"


def _call(name: str, fn, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        raise ExerciseError(f"{name}: not done yet (the function still raises NotImplementedError).") from None


# -- exercise 1: capacity ----------------------------------------------------------------------------
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
            (math.ceil(raw), "An expert gets a token at most once, so it never needs more than S slots: cap at S."),
            (math.floor(raw), "Round up, not down: a fraction of a slot is still a slot (math.ceil)."),
            (math.ceil(c * s / e), "Each token makes k assignments, so the sequence has k·S of them to share out."),
            (math.ceil(c * s * e / k), "The k·S assignments are shared by E experts: divide by E, multiply by k."),
        ]
        hint = next((h for v, h in hints if got == v),
                    "How many assignments does the sequence make, shared by how many experts? Then the slack "
                    "capacity_factor, the rounding, and the most one expert can ever need.")
        raise wrong(name, f"for S={s}, E={e}, k={k}, capacity_factor={c} you gave {got}. {hint}", str(want))
    passed(name, "ceil(c·S·k/E), at most S")


# -- exercise 2: which assignments fit -----------------------------------------------------------------
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
            raise ExerciseError(f"{name}: expected a bool tensor of shape {tuple(want.shape)} (B, S, k), got {shape}.")
        got = got.bool()
        if torch.equal(got, want):
            continue
        hint = "Keep the first `capacity` assignments of each expert, counted per sequence."
        if torch.equal(got, _token_major(expert, e, c)):
            hint = ("You queued token by token (token 0's choices, then token 1's...). First choices go first: "
                    "every token's first choice, then every token's second choice (order the queue slot-major, "
                    "e.g. expert.transpose(1, 2)), so a token's best expert is the last thing dropped.")
        elif torch.equal(got, _whole_batch(expert, e, c)) and expert.shape[0] > 1:
            hint = "The capacity holds per sequence: count each sequence's queue from zero."
        elif torch.equal(got, capacity_mask(expert, e, c + 1)):
            hint = "One too many kept: places count from 0, so keep place < capacity."
        elif torch.equal(got, capacity_mask(expert, e, c - 1)):
            hint = "One too few kept: an expert takes `capacity` assignments, places 0 .. capacity - 1."
        raise ExerciseError(f"{name}: for {tuple(expert.shape)} choices of {e} experts, capacity {c}, "
                            f"{int((got != want).sum())} assignments are wrong. {hint}")
    passed(name, "per sequence, first choices first")


# -- exercise 3: dispatch with all_to_all (on several processes) --------------------------------------------
EXPERTS = 8
DIM = 3


def _dispatch_data(rank: int, n_experts: int = EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows grouped by expert and its counts per expert; each row says (source, expert, i)."""
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
    """``fn(rows, counts, group)``: rows (A, D) grouped by expert, counts (E,) rows per expert; rank j
    holds experts j·E/n .. (j+1)·E/n - 1. Return (received (R, D): every rank's rows for this rank's
    experts, rank 0's first, each source's in expert order; incoming (n, E/n): rows from each rank for
    each local expert)."""
    name = "dispatch with all_to_all"
    hint = ("Split sizes count rows per *rank*, one per rank of the group: sum the counts of the experts each "
            "rank holds (counts.view(n, -1).sum(1)). How many rows arrive from each rank you only learn "
            "from the counts the others send you: exchange the counts first, with an all-to-all of their own.")
    for n in nprocs:
        results = run_answer(_dispatch_worker, n, (fn,), name, hint=hint)
        for rank, r in enumerate(results):
            if "bad" in r:
                raise ExerciseError(f"{name}: return a pair (received, incoming), got {r['bad']}.")
            want_rows, want_counts = _expected_dispatch(n, rank)
            incoming = r["incoming"]
            if incoming.numel() != want_counts.numel() or not torch.equal(incoming.reshape(want_counts.shape).long(),
                                                                          want_counts):
                raise wrong(
                    name, f"{name} on {n} ranks: rank {rank}'s incoming counts are {incoming.tolist()}; row i must "
                    f"hold the rows from rank i for each of this rank's {EXPERTS // n} experts. An all-to-all of "
                    "the counts (E,) gives rank j every rank's counts for j's experts.", str(want_counts.tolist()))
            if tuple(incoming.shape) != tuple(want_counts.shape):
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank}'s incoming counts have shape {tuple(incoming.shape)}, expected "
                    f"{tuple(want_counts.shape)} (n, E/n): row i holds the rows from rank i for each of this rank's "
                    f"{EXPERTS // n} experts. The values are right: view them as (n, E/n), e.g. incoming.view(n, -1).")
            got = r["received"]
            if got.shape != want_rows.shape or not torch.equal(got, want_rows):
                srcs = sorted({int(s) for s in got[:, 0].tolist()}) if got.dim() == 2 and got.numel() else []
                raise ExerciseError(
                    f"{name} on {n} ranks: rank {rank} received {tuple(got.shape)} rows (from ranks {srcs}), expected "
                    f"{tuple(want_rows.shape)}: every rank's rows for experts {EXPERTS // n * rank}.."
                    f"{EXPERTS // n * (rank + 1) - 1}, in source-rank order. {hint}")
        for tr in results.traces:
            ops = [e.op for e in tr.comm() if ANSWER in e.scopes]
            if ops != ["all_to_all", "all_to_all"]:
                raise ExerciseError(
                    f"{name}: the rows are right, but rank {tr.rank} sent {ops or 'nothing traced'}. Use "
                    "minitp.comm.all_to_all (so every byte is recorded), twice: the counts, then the rows.")
    passed(name, f"every rank got its experts' rows on {' and '.join(map(str, nprocs))} ranks, two all-to-alls")


# -- exercise 4: the bytes of one layer ------------------------------------------------------------------
def check_layer_bytes(fn) -> None:
    """``fn(tokens, rank, dim, dtype_bytes)``: tokens[i][j] rows rank i dispatches to rank j; the bytes
    ``rank`` sends in the layer's token all-to-alls: dispatch and combine forward, their two backward."""
    name = "bytes of one MoE layer"
    cases = [([[5, 3], [2, 6]], 0, 4, 4), ([[1, 2, 3, 4], [0, 5, 1, 1], [2, 2, 2, 2], [7, 0, 0, 1]], 2, 8, 2),
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
            (want / 2, "That is the forward only: backward sends the gradients of the combine and of the dispatch "
                       "back the same ways, as many bytes again."),
            (want + 2 * diag, "The rows a rank addresses to itself never leave it: leave the diagonal out."),
            (2 * out_rows * dim * b, "That counts the dispatch only: the combine sends back the outputs of the rows "
                                     "it received (column `rank` of T)."),
            (4 * out_rows * dim * b, "The combine sends back what this rank *received* (column `rank` of T), not what "
                                     "it sent."),
            (want / b, "Multiply by the bytes per element."),
        ]
        hint = next((h for v, h in hints if got is not None and math.isclose(float(got), v)),
                    "Which rows does this rank send in the dispatch, which in the combine, and which never leave "
                    "it? Backward sends each of them once more; a row is D elements of b bytes.")
        raise wrong(name, f"for T={tokens}, rank {rank}, D={dim}, b={b} you gave {got}. {hint}", f"{want:g} bytes")
    passed(name, "2·D·b·(rows out + rows in), without the diagonal")
