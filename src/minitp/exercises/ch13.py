"""Checkers for chapter 13, the final project: GPT-2 by your own hand.

* ``check_shard(fn)``: ``fn(name, whole, tp, rank)`` is tensor-parallel rank ``rank``'s slice of
  GPT-2 parameter ``name``: checked on every parameter of the byte preset at tp = 2 and 4 against
  the grader's own split (``minitp.exercises.grade``): each slice's shape, and the slices put back
  together give the whole.
* ``check_row_parallel(fn)`` (2 processes): ``fn(x, weight, bias, group)`` is a row-parallel linear
  layer with a bias on this rank's slices: the sum over the group, then the bias once.
* ``check_tied_gradients(fn)`` (2 processes): ``fn(grad, peer, group)`` gives the tied embedding's
  two copies (the first stage's and the last's) the sum of both gradients, in place, sending each
  rank's gradient once (traced).
* ``check_counts_in_norm(fn)``: ``fn(name, dp_rank, tp_rank)`` says whether that rank's gradient of
  ``name`` counts in the global norm, so that each element counts once over the world.
* ``check_problem(n, answer)``: the chapter's worked problems, on GPT-2 small.
"""

from __future__ import annotations

import torch

from minitp.exercises import call_answer, passed, problems, refuse_own, run_answer, wrong
from minitp.exercises import grade as _grade
from minitp.exercises.problems import Problem
from minitp.models.gpt2 import GPT2_124M, GPT2_BYTE, build_gpt2

MIB, GIB = 2**20, 2**30


def _names_and_wholes() -> dict[str, torch.Tensor]:
    params = {n: p.detach() for n, p in build_gpt2(GPT2_BYTE, seed=0).named_parameters()}
    # biases drawn too (they start at zero): a wrong slice of zeros would look right
    g = torch.Generator().manual_seed(1)
    params = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
    params["lm_head.weight"] = params["wte.weight"]
    return params


# -- exercise 1: which parameter splits how --------------------------------------------------------
def check_shard(fn) -> None:
    """``fn(name, whole, tp, rank)``: this rank's slice of ``name``."""
    name = "the split of GPT-2"
    for tp in (2, 4):
        for param, whole in _names_and_wholes().items():
            pieces = [call_answer(name, fn, param, whole.clone(), tp, rank) for rank in range(tp)]
            want = _grade.slice_shape(param, tuple(whole.shape), tp)
            got = tuple(pieces[0].shape) if isinstance(pieces[0], torch.Tensor) else pieces[0]
            if got != want:
                dim = _grade.split_of(param)
                how = {None: "whole on every rank (a LayerNorm, wpe, a row layer's bias)",
                       0: "split along its rows (dim 0: a column-parallel layer's outputs, or the "
                          "vocabulary)",
                       1: "split along its columns (dim 1: a row-parallel layer's inputs)"}[dim]
                raise wrong(name, f"{param} at tp={tp}: rank 0's slice is {got}; it is {how}",
                            f"{want}")
            if _grade.split_of(param) is not None and "c_attn." in param:
                contiguous = whole.chunk(tp)[0]
                if torch.equal(pieces[0], contiguous):
                    raise wrong(name, f"{param} at tp={tp}: rank 0 took the first "
                                      f"{len(contiguous)} rows, all of them q's: c_attn stacks q, "
                                      "k and v, so each rank takes its heads of each of the three")
            back = _grade.unshard(param, pieces)
            if not torch.equal(back, whole):
                raise wrong(name, f"{param} at tp={tp}: the slices put back together are not the "
                                  "whole tensor: each rank's part must be its own, in rank order")
    passed(name, "every parameter of GPT-2 at tp = 2 and 4: shapes, and the slices give the whole")


# -- exercise 2: a row-parallel layer's bias -------------------------------------------------------
def _row_case(tp: int):
    g = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(3, 5, 8, generator=g), torch.randn(6, 8, generator=g),
               torch.randn(6, generator=g))
    return x, w, b


def _row_worker(fn):
    import torch.distributed as dist

    rank, tp = dist.get_rank(), dist.get_world_size()
    x, w, b = _row_case(tp)
    group = dist.new_group(list(range(tp)))
    out = fn(x.chunk(tp, dim=-1)[rank].clone(), w.chunk(tp, dim=1)[rank].clone(), b.clone(), group)
    return out.detach() if isinstance(out, torch.Tensor) else out


def check_row_parallel(fn, tp: int = 2) -> None:
    """``fn(x, weight, bias, group)`` on 2 processes: the full layer's output on every rank."""
    name = "the row-parallel layer with a bias"
    refuse_own(name, fn)
    x, w, b = _row_case(tp)
    want = torch.nn.functional.linear(x, w, b)
    results = run_answer(_row_worker, tp, (fn,), name)
    for rank, got in enumerate(results):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise wrong(name, f"rank {rank} returned {getattr(got, 'shape', got)!r}",
                        f"the full output, shape {tuple(want.shape)}")
        if torch.allclose(got, want + (tp - 1) * b, atol=1e-5):
            raise wrong(name, f"rank {rank}'s output holds the bias {tp} times: each rank added it "
                              "to its partial sum before the all-reduce; add it once, after")
        partial = torch.nn.functional.linear(x.chunk(tp, dim=-1)[rank], w.chunk(tp, dim=1)[rank])
        if torch.allclose(got, partial + b, atol=1e-5):
            raise wrong(name, f"rank {rank}'s output is its own partial product: the partial "
                              "sums must be added over the group (an all-reduce)")
        if not torch.allclose(got, want, atol=1e-5):
            raise wrong(name, f"rank {rank}'s output differs from the full layer's by "
                              f"{(got - want).abs().max().item():.2e}")
    passed(name, f"{tp} ranks: the partial sums added over the group, the bias once")


# -- exercise 3: the tied embedding's two copies ---------------------------------------------------
def _tied_worker(fn):
    import torch.distributed as dist

    from minitp import trace as _trace

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    g = torch.Generator().manual_seed(3 + rank)
    grad = torch.randn(64, 16, generator=g)
    _trace.current().clear()
    out = fn(grad, 1 - rank, group)
    sent = sum(e.sent_bytes for e in _trace.current().comm())
    return {"grad": grad, "returned": out, "sent": sent}


def check_tied_gradients(fn, timeout: float = 30.0) -> None:
    """``fn(grad, peer, group)`` on 2 processes (the first stage and the last): both end with the
    sum of both gradients in ``grad``."""
    name = "the tied embedding's gradients"
    refuse_own(name, fn)
    parts = [torch.randn(64, 16, generator=torch.Generator().manual_seed(3 + r)) for r in (0, 1)]
    want = parts[0] + parts[1]
    results = run_answer(_tied_worker, 2, (fn,), name, timeout,
                         hang_hint="Both ranks waiting to receive first: neither sends. Post "
                                   "your send without waiting (comm.isend), then receive.")
    ends = [r["grad"] for r in results]
    if all(torch.equal(end, part) for end, part in zip(ends, parts)):
        raise wrong(name, "each gradient is unchanged: add the peer's into it, in place "
                          "(grad += theirs)")
    for rank, end in enumerate(ends):
        if torch.allclose(end, 2 * parts[rank]):
            raise wrong(name, f"rank {rank} added its own gradient again, not the peer's: receive "
                              "into a new buffer, and send a copy of your own")
        if not torch.allclose(end, want, atol=1e-6):
            other = "rank 1" if rank == 0 else "rank 0"
            raise wrong(name, f"rank {rank} does not hold the sum ({other} may): both copies must "
                              "get both parts, or the two stages' embeddings drift apart")
    sent = [r["sent"] for r in results]
    size = parts[0].numel() * 4
    if sent != [size, size]:
        raise wrong(name, f"the ranks sent {sent[0]:,.0f} and {sent[1]:,.0f} bytes through "
                          "minitp.comm: each sends its gradient once",
                    f"{size:,} bytes each")
    passed(name, f"both copies hold the sum; each rank sent its {size:,} bytes once")


# -- exercise 4: what counts in the global norm ----------------------------------------------------
def counts(name: str, dp_rank: int, tp_rank: int) -> bool:
    """The rule: a dp replica not at all, a tensor every tp rank holds whole on tp rank 0 only, the
    tied copy on the last stage never (the first stage's ``wte`` counts)."""
    if dp_rank != 0 or name == "lm_head.weight":
        return False
    return _grade.split_of(name) is not None or tp_rank == 0


def check_counts_in_norm(fn) -> None:
    """``fn(name, dp_rank, tp_rank)`` -> bool, for every parameter a stage may hold."""
    name = "what counts in the global norm"
    refuse_own(name, fn, counts)
    for param in _names_and_wholes():
        for dp_rank in (0, 1):
            for tp_rank in (0, 1):
                got = call_answer(name, fn, param, dp_rank, tp_rank)
                want = counts(param, dp_rank, tp_rank)
                if bool(got) == want:
                    continue
                where = f"{param} on dp rank {dp_rank}, tp rank {tp_rank}"
                if got and dp_rank:
                    why = "a dp replica holds the same gradient as dp rank 0, which counts it"
                elif got and param == "lm_head.weight":
                    why = ("the last stage's lm_head.weight is the first stage's wte.weight "
                           "(tied): counted there already")
                elif got:
                    why = "every tp rank holds it whole: counted on tp rank 0 only"
                elif _grade.split_of(param) is not None:
                    why = "each tp rank holds its own slice of it: every slice counts"
                else:
                    why = "tp rank 0 of dp rank 0 counts what every tp rank holds whole"
                raise wrong(name, f"{where}: {'counted' if got else 'left out'}; {why}")
    passed(name, "each element of GPT-2 counted once over dp × tp, the tied copy not again")


# -- the worked problems: GPT-2 small -------------------------------------------------------------
def _embedding_share() -> float:
    cfg = GPT2_124M
    return 100 * cfg.vocab_size * cfg.dim / cfg.num_params()


def _tied_exchange_mib() -> float:
    cfg, tp = GPT2_124M, 4
    return cfg.vocab_size * cfg.dim / tp * 4 / MIB  # fp32, V/tp rows of D: each way, once a step


def _tp_all_reduce_gib() -> float:
    cfg, tp, batch, seq = GPT2_124M, 4, 8, 1024
    tokens = batch * seq
    elements = (4 * cfg.n_layers + 2) * tokens * cfg.dim + 3 * tokens
    return 2 * (tp - 1) / tp * elements * 4 / GIB


PROBLEMS = {
    1: Problem("problem 1, the token embedding's share", _embedding_share, "%",
               {2.0: "the embedding counted twice: lm_head.weight is wte.weight"}),
    2: Problem("problem 2, the tied gradient's exchange", _tied_exchange_mib, "MiB",
               {4.0: "that is tp = 1: each tp rank exchanges its V/tp rows",
                0.5: "in bf16; the gradients here are fp32"}),
    3: Problem("problem 3, tensor parallel's bytes in a step", _tp_all_reduce_gib, "GiB",
               {2 / 1.5: "each rank sends 2(n-1)/n of a ring all-reduce's size, not twice it"}),
}


def check_problem(number: int, answer) -> None:
    """Check the answer to the chapter's worked problem ``number``."""
    problems.check_problem(PROBLEMS, number, answer)
