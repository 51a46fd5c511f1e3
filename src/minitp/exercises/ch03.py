"""Checkers for chapter 03, column- and row-parallel linear layers.

* ``check_row_parallel_forward(fn)``: ``fn(x_shard, weight_shard, bias, group)`` is the forward of a
  row-parallel ``nn.Linear``: this rank's input features (..., in/n) times its columns of the weight
  (out, in/n), summed over the ranks, bias added once. Run on 2 and 4 ranks; output and gradients
  compared with ``nn.Linear`` on one process, messages with one all-reduce forward, none backward.
* ``check_f_operator(cls)``: ``cls`` is the autograd Function f (identity forward, all-reduce of the
  gradient backward), called as ``cls.apply(x, group)``. Put in front of a column-then-row pair on 2
  and 4 ranks; the input's gradient compared with one process, messages with one all-reduce each
  way.
* ``check_pair_bytes(fn)``: ``fn(batch, seq, dim, n, dtype_bytes)`` gives the bytes one rank sends
  for one forward and backward of the column-then-row pair; compared with ``minitp.cost``.
* ``check_parallel_attention(fn)``: ``fn(x, wq, wk, wv, wo, n_heads, group)`` is multi-head
  attention with its heads split over the ranks, from the full weights. Run on 2 and 4 ranks; output
  and every gradient compared with one process and ``minitp.tp.ParallelAttention``, messages with
  f's and g's all-reduces (``minitp.exercises.heads``).
* ``check_problem(n, answer)``: worked problems 1-3, estimates from the hardware sheet
  (``minitp.cost.H100``) checked against ``minitp.cost`` within 5 % (``minitp.exercises.problems``).
"""

from __future__ import annotations

import math

import torch

from minitp import cost, regions, trace
from minitp.exercises import ExerciseError, passed, problems, run_answer, wrong
from minitp.exercises.heads import causal_attention as causal_attention  # for the notebook
from minitp.exercises.heads import check_heads
from minitp.exercises.problems import Problem
from minitp.models import LLAMA3_8B, LLAMA3_70B

ANSWER = "answer"  # the scope the learner's messages are traced under
TOL = 1e-5


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return (a.float() - b.float()).abs().max().item()


def answer_messages(tr: trace.Trace) -> list[trace.Event]:
    return [e for e in tr.comm() if ANSWER in e.scopes]


def phase(e: trace.Event) -> str:
    """The checker's pass the message was sent in: the scope it opened inside ``ANSWER``, "forward"
    or "backward" (whatever the learner's code tagged its own messages with)."""
    inner = e.scopes[e.scopes.index(ANSWER) + 1:]
    return inner[0] if inner else "forward"


# -- exercise 1: the row-parallel forward ----------------------------------------------------------
def _row_setup(seed: int = 0):
    """A plain nn.Linear(12, 6) with a bias, and an input (3, 5, 12): the same on every process."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, 12, generator=g) * 0.3
    bias = torch.randn(6, generator=g)
    x = torch.randn(3, 5, 12, generator=g)
    return x, weight, bias


def _row_worker(fn):
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    x, weight, bias = _row_setup()
    x_shard = x.chunk(n, dim=-1)[rank].clone().requires_grad_()  # (3, 5, 12/n)
    w_shard = weight.chunk(n, dim=1)[rank].clone().requires_grad_()  # (6, 12/n)
    b = bias.clone().requires_grad_()
    with trace.scope(ANSWER), trace.scope("forward"):
        y = fn(x_shard, w_shard, b, None)
    if not isinstance(y, torch.Tensor):
        return {"y": None}
    out = {"y": y.detach().clone()}
    if y.shape == (3, 5, 6) and y.requires_grad:
        with trace.scope(ANSWER), trace.scope("backward"):
            y.pow(2).sum().backward()
    out.update(x_grad=x_shard.grad, w_grad=w_shard.grad, b_grad=b.grad,
               partial=(x_shard.detach() @ w_shard.detach().T),
               untransposed=x_shard.detach() @ w_shard.detach()
               if w_shard.shape[0] == x_shard.shape[-1] else None)
    return out


def check_row_parallel_forward(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(x_shard, weight_shard, bias, group)`` must give nn.Linear's output on every rank."""
    name = "row-parallel forward"
    x, weight, bias = _row_setup()
    xr = x.clone().requires_grad_()
    wr, br = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    want = torch.nn.functional.linear(xr, wr, br)
    want.pow(2).sum().backward()
    for n in nprocs:
        results = run_answer(_row_worker, n, (fn,), name)
        for rank, r in enumerate(results):
            y = r["y"]
            if y is None:
                raise wrong(name, f"rank {rank} returned no tensor; return the layer's output y.")
            if y.shape != want.shape:
                raise wrong(
                    name, f"{name} on {n} ranks: rank {rank} returned shape {tuple(y.shape)}, not "
                    "the full output (every rank ends with all out features). Multiply x_shard "
                    "(..., in/n) by weight_shard.T (in/n, out); do not gather or split the "
                    "output.", f"shape {tuple(want.shape)}")
            if max_diff(y, want) <= TOL:
                continue
            if max_diff(y, r["partial"] + bias) <= TOL or max_diff(y, r["partial"]) <= TOL:
                raise wrong(
                    name, f"{name} on {n} ranks: rank {rank} returned only its own partial sum. "
                    "Each rank's x_shard @ weight_shard.T covers in/n of the input features; add "
                    "the n partial sums over the ranks (g: regions.reduce_from_parallel, an "
                    "all-reduce) before the bias.")
            if (results[0]["untransposed"] is not None
                    and max_diff(y, sum(q["untransposed"] for q in results) + bias) <= TOL):
                raise wrong(
                    name, f"{name} on {n} ranks: you multiplied by weight_shard, not its "
                    "transpose. nn.Linear stores its weight as (out, in), so this rank's slice is "
                    "(out, in/n) and y = x_shard @ weight_shard.T (here out = in/n, so the shapes "
                    "fitted by chance).")
            if max_diff(y, want + (n - 1) * bias) <= TOL:
                raise wrong(
                    name, f"{name} on {n} ranks: the output is off by (n - 1) x bias = {n - 1} x "
                    "bias: the bias was added on every rank before the sum, so the all-reduce "
                    "counted it n times. Add the bias once, after the all-reduce.")
            if max_diff(y, want - bias) <= TOL:
                raise wrong(
                    name, f"{name} on {n} ranks: the output lacks the bias; add it after the sum.")
            raise wrong(
                name,
                f"{name} on {n} ranks: rank {rank}'s output differs from nn.Linear's by up to "
                f"{max_diff(y, want):.3g}; you gave y[0, 0] = {y[0, 0].tolist()}.\n"
                "Hint: y = g(x_shard @ weight_shard.T) + bias.",
                f"y[0, 0] = {want[0, 0].detach().tolist()}")
        for tr in results.traces:
            msgs = answer_messages(tr)
            fwd = [e for e in msgs if phase(e) == "forward"]
            bwd = [e for e in msgs if phase(e) == "backward"]
            if not msgs:
                raise wrong(
                    name, "the output is right, but no message was traced. Sum with minitp.comm "
                    "(regions.reduce_from_parallel or comm.all_reduce), not torch.distributed "
                    "directly, so every byte is recorded.")
            if [e.op for e in fwd] != ["all_reduce"] or bwd:
                got = ", ".join(f"{e.op} ({phase(e)})" for e in msgs)
                raise wrong(
                    name,
                    f"the output is right, but rank {tr.rank} sent {got}; a row-parallel layer "
                    "needs exactly one all-reduce forward (of y, before the bias) and nothing "
                    "backward: g's backward is the identity.")
        grads = {"x_shard": (0, xr.grad, -1), "weight_shard": (1, wr.grad, 1)}
        for rank, r in enumerate(results):
            for key, (_, full, dim) in grads.items():
                got = r["x_grad" if key == "x_shard" else "w_grad"]
                expected = full.chunk(n, dim=dim)[rank]
                if got is None or max_diff(got, expected) > TOL:
                    ratio = "" if got is None else _ratio(got, expected)
                    raise wrong(
                        name, f"{name} on {n} ranks: the output is right but the gradient of {key} "
                        f"on rank {rank} is wrong{ratio}. g's backward passes the gradient through "
                        "unchanged; an all-reduce in backward would count it n times.")
            if r["b_grad"] is None or max_diff(r["b_grad"], br.grad) > TOL:
                raise wrong(name, f"{name} on {n} ranks: the bias gradient on rank {rank} is wrong"
                            f"{'' if r['b_grad'] is None else _ratio(r['b_grad'], br.grad)}.")
    passed(name,
           f"matches nn.Linear on {' and '.join(map(str, nprocs))} ranks, one all-reduce forward, "
                 "none backward")


def _ratio(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f" (shape {tuple(got.shape)}, expected {tuple(want.shape)})"
    denom = want.abs().sum().item()
    if denom:
        k = (got * want).sum().item() / (want * want).sum().item()
        if max_diff(got, k * want) <= TOL * max(1.0, abs(k)):
            return f" (it is {k:.3g} times the right one)"
    return ""


# -- exercise 2: the f operator -------------------------------------------------------------------
def _pair_setup(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w_col = torch.randn(8, 6, generator=g) * 0.4  # nn.Linear(6, 8).weight: column-parallel
    w_row = torch.randn(6, 8, generator=g) * 0.4  # nn.Linear(8, 6).weight: row-parallel
    x = torch.randn(2, 4, 6, generator=g)
    return x, w_col, w_row


def _pair_forward(x, w_col, w_row):
    return torch.nn.functional.linear(torch.nn.functional.linear(x, w_col).tanh(), w_row)


def _f_worker(cls):
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    x, w_col, w_row = _pair_setup()
    x = x.clone().requires_grad_()
    col = w_col.chunk(n, dim=0)[rank]  # (8/n, 6): this rank's hidden units
    row = w_row.chunk(n, dim=1)[rank]  # (6, 8/n)
    with trace.scope(ANSWER), trace.scope("forward"):
        entered = cls.apply(x, None)
    if not isinstance(entered, torch.Tensor):
        return {"entered": None}
    same = entered.shape == x.shape and torch.equal(entered.detach(), x.detach())
    with trace.scope("g"):
        y = regions.reduce_from_parallel(_pair_forward(entered, col, row), None, label="")
    with trace.scope(ANSWER), trace.scope("backward"):
        if y.requires_grad:
            y.pow(2).sum().backward()
    return {"entered": entered.detach(), "same": same, "y": y.detach(), "x_grad": x.grad}


def check_f_operator(cls, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``cls.apply(x, group)`` must be f: identity forward, all-reduce (sum) of the gradient
    backward."""
    name = "f operator"
    x, w_col, w_row = _pair_setup()
    xr = x.clone().requires_grad_()
    want = _pair_forward(xr, w_col, w_row)
    want.pow(2).sum().backward()
    for n in nprocs:
        results = run_answer(_f_worker, n, (cls,), name)
        for rank, r in enumerate(results):
            if r["entered"] is None:
                raise wrong(name, "forward returned no tensor; return x (a view of it) unchanged.")
            if not r["same"]:
                raise wrong(
                    name, f"{name} on {n} ranks: forward changed x on rank {rank} (max change "
                    f"{max_diff(r['entered'], x):.3g}). f's forward is the identity: every rank "
                    "already holds the same full x. Return x.view_as(x).")
            if max_diff(r["y"], want) > TOL:
                raise wrong(name,
                            f"{name} on {n} ranks: the pair's output is wrong on rank {rank}; "
                            "forward must return x unchanged.")
            grad = r["x_grad"]
            if grad is None:
                raise wrong(name, "x got no gradient; backward must return the gradient for x "
                            "(and None for the group).")
            if max_diff(grad, xr.grad) <= TOL:
                continue
            col = w_col.chunk(n, dim=0)[rank]
            row = w_row.chunk(n, dim=1)[rank]
            xl = x.clone().requires_grad_()
            own = _pair_forward(xl, col, row)
            own.backward(2 * want.detach())
            if max_diff(grad, xl.grad) <= TOL:
                raise wrong(
                    name, f"{name} on {n} ranks: x's gradient on rank {rank} is only this rank's "
                    "part: its column slice reaches F/n hidden units, so it sees only their share "
                    "of dL/dx. Backward must sum the parts over the ranks: all-reduce the gradient "
                    "(comm.all_reduce on a copy).")
            raise wrong(name, f"{name} on {n} ranks: x's gradient on rank {rank} is wrong"
                        f"{_ratio(grad, xr.grad)}. Sum over the ranks, do not average.")
        for tr in results.traces:
            msgs = answer_messages(tr)
            fwd = [e.op for e in msgs if phase(e) == "forward"]
            bwd = [e.op for e in msgs if phase(e) == "backward"]
            if not bwd:
                raise wrong(name, "the gradient is right but no message was traced in backward. "
                            "All-reduce with minitp.comm.all_reduce so every byte is recorded.")
            if fwd or bwd != ["all_reduce"]:
                raise wrong(name,
                            f"rank {tr.rank} sent {fwd or 'nothing'} forward and {bwd} backward; "
                            "f sends nothing forward and one all-reduce backward.")
    passed(name, f"identity forward, one all-reduce backward, x's gradient matches one process on "
                 f"{' and '.join(map(str, nprocs))} ranks")


# -- exercise 3: the bytes of a column-then-row pair -----------------------------------------------
def check_pair_bytes(fn) -> None:
    """``fn(batch, seq, dim, n, dtype_bytes)``: bytes one rank sends for one forward + backward of
    the pair."""
    name = "bytes of a column-then-row pair"
    cases = [(8, 16, 64, 4, 4), (1, 8192, 4096, 8, 2), (2, 2048, 4096, 2, 2), (4, 512, 1024, 4, 4)]
    for batch, seq, dim, n, b in cases:
        try:
            got = fn(batch, seq, dim, n, b)
        except NotImplementedError:
            raise ExerciseError(
                f"{name}: not done yet (the function still raises NotImplementedError).") from None
        if got is None:
            raise ExerciseError(f"{name}: the function returned None; return a number of bytes.")
        want = cost.tp_region_bytes(batch, seq, dim, n, dtype_bytes=b)
        if math.isclose(float(got), want, rel_tol=1e-9):
            continue
        a = batch * seq * dim * b
        ring = 2 * (n - 1) / n * a
        hints = [
            (ring, "That is one all-reduce: g's forward. f sends one more, of the same size, in "
                   "backward."),
            (2 * a, "Each all-reduce of A bytes sends 2(n-1)/n * A per rank on a ring, not A."),
            (4 * a, "Each all-reduce of A bytes sends 2(n-1)/n * A per rank on a ring, not 2A."),
            (2 * ring * 8 / b if b != 8 else -1, "Count bytes, not bits."),
            (2 * ring / b, "Multiply by the bytes per element (dtype_bytes)."),
        ]
        hint = next((h for v, h in hints if math.isclose(float(got), v, rel_tol=1e-9)),
                    "Two all-reduces of the activation A = batch * seq * dim * dtype_bytes (g "
                    "forward, f backward), each 2(n-1)/n * A per rank.")
        raise wrong(name, f"for B={batch}, S={seq}, D={dim}, n={n}, {b} bytes per element you gave "
                          f"{float(got):,.0f} bytes. {hint}", f"{want:,.0f} bytes")
    passed(name, "2 all-reduces of B*S*D*b, each 2(n-1)/n of it per rank")


# -- exercise 4: attention split by heads ----------------------------------------------------------
def check_parallel_attention(fn, nprocs: tuple[int, ...] = (2, 4)) -> None:
    """``fn(x, wq, wk, wv, wo, n_heads, group)``: multi-head attention, heads split over the
    ranks."""
    name = "attention split by heads"
    detail = check_heads(fn, name, [(4, 4)], nprocs, with_kv=False)
    passed(name, detail)


# -- worked problems: estimates from the hardware sheet (minitp.exercises.problems) ----------------
def block_params(cfg) -> int:
    """The weights of one block's matrices: W_Q, W_K, W_V, W_O (grouped-query) and SwiGLU's
    three."""
    attention = sum(i * o for i, o in cost.attention_weight_shapes(cfg).values())
    return attention + 3 * cfg.dim * cfg.ffn_hidden


def _comm_over_compute(cfg, tp: int, seq: int = 8192) -> float:
    """One block, one sequence, bf16: seconds of tensor parallel's all-reduces on NVLink (bandwidth
    only) over seconds of the rank's share of the block's training FLOPs, 6·Ψ_block + 12·D·S per
    token."""
    device = cost.H100
    sent = cost.tp_block_bytes(1, seq, cfg.dim, tp, dtype_bytes=2) / device.intra.bytes_per_s
    flops = seq * (6 * block_params(cfg) + 12 * cfg.dim * seq) / tp
    return sent / cost.compute_time(flops, device)


def _attention_equals_weights_seq() -> float:
    """S at which attention's 12·D·S FLOPs per token equal the block's weights' 6·Ψ_block."""
    return block_params(LLAMA3_8B) / (2 * LLAMA3_8B.dim)


PROBLEMS = {
    1: Problem("problem 1, tensor parallel's messages against its compute",
               lambda: _comm_over_compute(LLAMA3_8B, 8), "",
               {0.5: "forward and backward: each of the block's two pairs all-reduces once each "
                     "way",
                2.0: "a block has two pairs (attention, MLP), each one all-reduce forward and one "
                     "backward: 4 in all"}),
    2: Problem("problem 2, a wider model", lambda: _comm_over_compute(LLAMA3_70B, 8), ""),
    3: Problem("problem 3, when attention outweighs the weights", _attention_equals_weights_seq,
               "tokens", {2.0: "6 FLOPs per weight against 12·D·S: S = Ψ_block / (2D)"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 03: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
