"""Checkers for chapter 01, data parallel (DDP).

* ``check_split_batch(fn)``: ``fn(batch, rank, world_size)`` returns this rank's contiguous slice of
  a global batch (dim 0), as ``minitp.ddp.split_batch`` does. Checked for every rank of 2 and of 4
  ranks: the slices are equal in size, disjoint, cover the batch, and laid out in rank order.
* ``check_average_bucket(fn)``: ``fn(bucket)`` turns this rank's flat bucket of gradients into the
  mean over the ranks with ``minitp.comm.all_reduce``. Run on 2 and 4 processes; compared with the
  true mean and with the trace: exactly one all-reduce of the bucket's bytes.
* ``check_ddp_bytes(fn)``: ``fn(num_params, world_size, grad_bytes)`` gives the bytes one rank sends
  per DDP step; compared with ``minitp.cost.ddp_step_bytes``.
* ``check_bucketed_ddp(cls)``: ``cls(model, bucket_bytes)`` registers gradient hooks that launch one
  asynchronous all-reduce per bucket while backward runs; ``finish()`` waits and writes the averages
  into ``.grad``. Run on 4 processes for two SGD steps; checked against one process on the
  whole batch and ``minitp.ddp``, the launch times against the gradients' (before backward ends),
  the bytes against ``minitp.cost.ddp_step_bytes``.

Batch rows and gradients are small integers stored as floats: sums are exact whatever the order, and
a wrong value points at where it came from (another rank's rows, a sum instead of a mean).
* ``check_problem(n, answer)``: worked problems 1-3, estimates from the hardware sheet
  (``minitp.cost.H100``) checked against ``minitp.cost`` (``minitp.exercises.problems``).
"""

from __future__ import annotations

import copy
import math
import time

import torch

from minitp import cost, ddp, trace
from minitp.exercises import ExerciseError, passed, problems, refuse_own, run_answer, wrong
from minitp.exercises.problems import Problem

_ANSWER = "answer"  # the scope the learner's calls are traced under


# -- exercise 1: this rank's slice of the global batch ---------------------------------------------
def check_split_batch(fn, world_sizes: tuple[int, ...] = (2, 4), batch_size: int = 8) -> None:
    """``fn(batch, rank, world_size)`` must return rows [rank * m/n, (rank + 1) * m/n) of a batch of
    m rows."""
    name = "split the batch"
    # row i starts with 3i
    batch = torch.arange(batch_size * 3, dtype=torch.float32).reshape(batch_size, 3)
    row_of = {int(batch[i, 0]): i for i in range(batch_size)}
    for n in world_sizes:
        size = batch_size // n
        got_rows = []
        for rank in range(n):
            given = batch.clone()
            try:
                got = fn(given, rank, n)
            except NotImplementedError:
                raise ExerciseError(
                    f"{name}: not done yet (the function still raises NotImplementedError). "
                    "Replace the stub with your answer and run the check again.") from None
            where = f"global batch of m = {batch_size} rows on n = {n} ranks, rank {rank}"
            if not torch.equal(given, batch):
                raise ExerciseError(
                    f"{name}: {where}: your function changed the batch it was given; "
                    "return a slice, do not write into `batch`.")
            if not isinstance(got, torch.Tensor):
                raise ExerciseError(
                    f"{name}: {where}: returned {type(got).__name__}, expected a tensor of "
                    f"{size} rows.")
            if got.dim() != 2 or got.shape[1] != batch.shape[1]:
                raise ExerciseError(
                    f"{name}: {where}: got shape {tuple(got.shape)}, expected ({size}, "
                    f"{batch.shape[1]}): slice along dim 0 (the samples), keep every column.")
            rows = [row_of.get(int(v), -1) for v in got[:, 0].tolist()]
            if got.shape[0] == batch_size:
                raise ExerciseError(f"{name}: {where}: you returned the whole batch ({batch_size} "
                                    f"rows). Every rank then computes the same gradient: n = {n} "
                                    "times the work for one rank's worth of learning. Keep m/n = "
                                    f"{size} rows.")
            if got.shape[0] != size:
                raise wrong(name, f"{name}: {where}: got {got.shape[0]} rows: every rank gets an "
                                  "equal share, m/n rows, so that the mean of the ranks' mean "
                                  "losses is the mean loss of the whole "
                                  "batch.", f"{batch_size}/{n} = {size} rows")
            want = list(range(rank * size, (rank + 1) * size))
            if rows == want:
                got_rows.append(rows)
                continue
            if rows == list(range(rank, batch_size, n)):
                raise wrong(name, f"{name}: {where}: you dealt the rows out like cards "
                                  f"(batch[rank::n], rows {rows}). That covers the batch too, but "
                                  "split_batch keeps each rank's rows together and in order: [rank "
                                  "* m/n, (rank + 1) * m/n).", f"rows {want}")
            for k in range(n):
                if k != rank and rows == list(range(k * size, (k + 1) * size)):
                    raise wrong(name, f"{name}: {where}: you returned rank {k}'s rows {rows}: rank "
                                      "r's rows start at row r * m/n.", f"rows {want}")
            raise wrong(name, f"{name}: {where}: you returned rows {rows}, not this rank's: every "
                              "rank keeps m/n consecutive rows, in rank order.", f"rows {want}")
        flat = [r for rows in got_rows for r in rows]
        # pragma: no cover
        if sorted(flat) != list(range(batch_size)) or len(set(flat)) != batch_size:
            raise ExerciseError(
                f"{name}: on {n} ranks the slices overlap or leave rows out: {got_rows}.")
    passed(name, "equal, disjoint, covering, in rank order on "
                 f"{' and '.join(map(str, world_sizes))} ranks")


# -- exercise 2: average one bucket of gradients ---------------------------------------------------
def _bucket_worker(fn, numel: int, seed: int):
    import torch.distributed as dist

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    local = torch.randint(-50, 50, (numel,), generator=g).to(torch.float32)
    bucket = local.clone()
    with trace.scope(_ANSWER):
        got = fn(bucket)
    got = bucket if got is None else got
    got = got.detach().clone() if isinstance(got, torch.Tensor) else got
    return {"local": local, "got": got}


def check_average_bucket(fn, nprocs: tuple[int, ...] = (2, 4), numel: int = 12,
                         timeout: float = 20.0) -> None:
    """Run ``fn(bucket)`` on each world size; every rank must end with the mean of the ranks'
    buckets."""
    name = "average a bucket"
    for n in nprocs:
        results = run_answer(_bucket_worker, n, (fn, numel, n), name, timeout,
                             hang_hint="Every rank must call comm.all_reduce on its bucket, once.")
        locals_ = [r["local"] for r in results]
        mean = sum(locals_) / n
        for rank, r in enumerate(results):
            got, where = r["got"], f"on {n} ranks, rank {rank}"
            if not isinstance(got, torch.Tensor):
                raise ExerciseError(
                    f"{name} {where}: returned {type(got).__name__}; return the averaged bucket "
                    "(or average it in place and return it).")
            got = got.reshape(-1).float()
            if got.numel() != numel:
                raise ExerciseError(
                    f"{name} {where}: got {got.numel()} elements, expected the whole bucket of "
                    f"{numel}: in DDP every rank keeps every averaged gradient.")
            if torch.allclose(got, mean, rtol=1e-6, atol=1e-6):
                continue
            if torch.allclose(got, mean * n, rtol=1e-6, atol=1e-6):
                raise ExerciseError(
                    f"{name} {where}: your bucket is the SUM over the ranks, {n} times the mean. "
                    "Divide by the world size (before or after the all-reduce): each rank's loss "
                    "is the mean over its slice, so the whole batch's gradient is the mean of "
                    "the ranks' gradients.")
            if torch.allclose(got, locals_[rank], rtol=1e-6, atol=1e-6):
                raise ExerciseError(
                    f"{name} {where}: the bucket still holds this rank's own gradient: nothing "
                    "was added from the other ranks. Call comm.all_reduce(bucket), then divide "
                    "by the world size.")
            if torch.allclose(got, locals_[rank] / n, rtol=1e-6, atol=1e-6):
                raise ExerciseError(
                    f"{name} {where}: you divided this rank's gradient by n but never summed over "
                    "the ranks: the all-reduce is missing, or its result was not kept.")
            if torch.allclose(got, mean / n, rtol=1e-6, atol=1e-6):
                raise ExerciseError(
                    f"{name} {where}: your bucket is the mean divided by n once more: divide "
                    "once, by the world size.")
            raise wrong(name, f"{name} {where}: your bucket is {got.tolist()}, not the mean over "
                              "the ranks of their buckets: sum over the ranks with one all-reduce, "
                              "and divide by the world size.",
                        str(mean.tolist()))
        events = [e for e in results.traces[0].comm() if _ANSWER in e.scopes]
        ops = [e.op for e in events]
        if not events:
            raise ExerciseError(f"{name}: the values are right but no message was traced: use "
                                "minitp.comm.all_reduce (not torch.distributed directly) so the "
                                "bytes are recorded.")
        if set(ops) != {"all_reduce"}:
            raise ExerciseError(
                f"{name}: you called {', '.join(sorted(set(ops)))}; one comm.all_reduce of the "
                "bucket is all it takes.")
        bucket_bytes = numel * 4
        if len(events) != 1 or events[0].bytes != bucket_bytes:
            sizes = ", ".join(f"{e.bytes} B" for e in events)
            raise ExerciseError(
                f"{name}: the values are right, but rank 0 made {len(events)} all-reduce(s) of "
                f"{sizes}; expected exactly one of the whole bucket, {bucket_bytes} B. The point "
                "of a bucket is one large message instead of many small ones.")
        want = cost.collective_sent_bytes("all_reduce", bucket_bytes, n)
        sent = trace.sent_bytes_per_rank(results.traces, scope=_ANSWER)
        if any(s != want for s in sent):  # pragma: no cover - follows from one all-reduce per rank
            raise wrong(name, f"the ranks sent {sent} bytes, not 2(n-1)/n * B each.",
                        f"{want:g} bytes each")
    passed(name,
           f"the mean on {' and '.join(map(str, nprocs))} ranks, one all-reduce of the bucket's "
                 "bytes, 2(n-1)/n * B sent per rank")


# -- exercise 3: DDP's bytes per rank per step -----------------------------------------------------
def _bytes_hint(got: float, psi: int, n: int, b: int) -> str:
    def near(x):
        return math.isclose(got, x, rel_tol=1e-9)

    if near(psi * b):
        return ("That is the gradient's size B = Ψ·b, not what a rank sends: a ring all-reduce "
                "sends 2(n-1)/n · B (a reduce-scatter then an all-gather, each (n-1)/n · B).")
    if near(2 * psi * b):
        return (
            "Close: each half of the ring sends (n-1)/n · B, not B: the factor is 2(n-1)/n, not 2.")
    if near((n - 1) / n * psi * b):
        return ("That is one half of the all-reduce (a reduce-scatter); the all-gather that "
                "follows sends as much again: 2(n-1)/n · B.")
    if near(2 * (n - 1) / n * psi):
        return "You counted elements: multiply by the bytes per gradient element, grad_bytes."
    if near(2 * (n - 1) * psi * b):
        return "Each rank sends n-1 chunks of B/n per half, not n-1 whole copies: 2(n-1)/n · B."
    if near(n * psi * b) or near(2 * n * psi * b):
        return "A rank's traffic does not grow with n in a ring: it approaches 2B, whatever n."
    return ("One ring all-reduce of every gradient per step: how many chunks of B/n does a rank "
            "send in each of its two halves, the reduce-scatter and the all-gather?")


def check_ddp_bytes(fn) -> None:
    """``fn(num_params, world_size, grad_bytes)`` must give ``cost.ddp_step_bytes``."""
    name = "DDP bytes per step"
    refuse_own(name, fn, cost.ddp_step_bytes)
    for psi in (164_416, 8_030_261_248):  # the tiny model's Ψ and LLaMA-3-8B's
        for n in (4, 2, 8, 1, 64):
            for b in (4, 2):
                try:
                    got = fn(psi, n, b)
                except NotImplementedError:
                    raise ExerciseError(
                        f"{name}: not done yet (the function still raises NotImplementedError).") \
                        from None
                if got is None:
                    raise ExerciseError(
                        f"{name}: fn({psi}, {n}, {b}) returned None; return a number of bytes.")
                want = cost.ddp_step_bytes(psi, n, grad_bytes=b)
                if math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-9):
                    continue
                hint = _bytes_hint(float(got), psi, n, b)
                raise wrong(
                    name, f"for Ψ = {psi:,} parameters, n = {n} ranks, {b}-byte gradients you gave "
                                  f"{float(got):,.0f} bytes. {hint}", f"{want:,.0f} bytes")
    passed(name, "2(n-1)/n · Ψ · b per rank, as minitp.cost.ddp_step_bytes")


# -- exercise 4: bucketed DDP with gradient hooks --------------------------------------------------
# the test MLP's six parameters fall into three buckets of at most 600 B (one larger, alone)
_BUCKET_BYTES = 600


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _grads(model) -> dict[str, torch.Tensor | None]:
    return {k: None if p.grad is None else p.grad.detach().clone()
            for k, p in model.named_parameters()}


def _ddp_worker(cls, steps: int, bucket_bytes: int):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    model = _mlp()
    single, local, library = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    ready_at: dict[str, float] = {}  # when autograd finished each of the learner's gradients
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: ready_at.__setitem__(name, time.perf_counter()))
    with trace.scope("library"):
        reference_ddp = ddp.DistributedDataParallel(library, bucket_mb=bucket_bytes / 2**20)
    with trace.scope(_ANSWER):
        answer = cls(model, bucket_bytes)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.2) for m in (model, single, library)]
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        # the global batch
        x, y = torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 4, generator=g)
        mine = slice(rank * 4, (rank + 1) * 4)
        for m in (model, single, local, library):
            m.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        ready_at.clear()
        # labels "answer/step0/..."
        with trace.scope(_ANSWER, f"step{step}"), trace.tagged(step=step):
            try:
                loss.backward()
            # a hook read a .grad that backward had not made yet
            except (AttributeError, TypeError) as error:
                missing = [k for k, p in model.named_parameters() if p.grad is None]
                if "NoneType" not in str(error) or not missing:
                    raise
                return {"too_early": {"step": step, "missing": missing,
                                      "error": f"{type(error).__name__}: {error}"}}
            backward_ended = time.perf_counter()
            answer.finish()
        torch.nn.functional.mse_loss(single(x), y).backward()  # one process, the whole batch
        # this rank alone, not averaged
        torch.nn.functional.mse_loss(local(x[mine]), y[mine]).backward()
        with trace.scope("library", f"step{step}"), trace.tagged(step=step):
            torch.nn.functional.mse_loss(reference_ddp(x[mine]), y[mine]).backward()
        out.append({"grads": _grads(model), "single": _grads(single), "local": _grads(local),
                    "library": _grads(library), "last_grad_at": max(ready_at.values(), default=0.0),
                    "backward_ended": backward_ended})
        for opt in optimizers:
            opt.step()
        local.load_state_dict(model.state_dict())
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    single_params = {k: p.detach().clone() for k, p in single.named_parameters()}
    return {"steps": out, "params": params, "single_params": single_params}


def _close(a, b) -> bool:
    return a is not None and b is not None and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _check_ddp_values(name: str, where: str, got: dict, n: int, buckets: list[list[str]]) -> None:
    wrong = [k for k in got["single"] if not _close(got["grads"][k], got["single"][k])]
    if not wrong:
        return
    k = wrong[0]
    g, want, own = got["grads"][k], got["single"][k], got["local"][k]
    if g is None:
        raise ExerciseError(
            f"{name} {where}: {k}.grad is None after finish(); backward filled it, so it was "
            "dropped: write the averaged values back into each parameter's .grad.")
    if all(_close(got["grads"][j], n * got["single"][j]) for j in wrong):
        raise ExerciseError(
            f"{name} {where}: the gradients are the SUM over the ranks, {n} times the mean "
            "(one process on the whole batch). Divide each bucket by the world size.")
    unsent = [b for b in buckets if all(_close(got["grads"][j], got["local"][j]) for j in b)]
    if unsent:
        raise ExerciseError(
            f"{name} {where}: the gradients of {', '.join(unsent[0])} are still this rank's own: "
            "their bucket was never all-reduced, or its result never copied back. A bucket "
            "is launched when its last parameter's hook has fired; count every parameter.")
    if _close(g, own / n):
        raise ExerciseError(
            f"{name} {where}: {k}.grad is this rank's gradient divided by n: the all-reduced "
            "buffer was not the one copied back (torch.cat makes a copy; wait, then read it).")
    raise ExerciseError(f"{name} {where}: {k}.grad differs from one process on the whole batch by "
                        f"{(g - want).abs().max().item():.3g} (wrong offsets when copying back?).")


def check_bucketed_ddp(cls, nprocs: tuple[int, ...] = (4,), steps: int = 2,
                       timeout: float = 60.0) -> None:
    """``cls(model, bucket_bytes)`` must average gradients with one async all-reduce per bucket,
    launched from gradient hooks during backward; ``finish()`` completes them."""
    name = "bucketed DDP"
    probe = _mlp()
    params = [p for p in probe.parameters()][::-1]
    names = {id(p): k for k, p in probe.named_parameters()}
    buckets = [[names[id(p)] for p in b] for b in ddp.make_buckets(params, _BUCKET_BYTES)]
    bucket_bytes = sorted(sum(dict(probe.named_parameters())[k].numel() * 4 for k in b)
                          for b in buckets)
    psi = sum(p.numel() for p in params)
    for n in nprocs:
        results = run_answer(_ddp_worker, n, (cls, steps, _BUCKET_BYTES), name, timeout, hang_hint=(
            "Every rank must launch the same all-reduces in the same order: one per bucket, each "
            "once per step."))
        for rank, r in enumerate(results):
            if "too_early" in r:
                early = r["too_early"]
                raise ExerciseError(
                    f"{name} on {n} ranks, rank {rank}, step {early['step']}: a bucket was "
                    "launched too early: a bucket is ready when its last gradient arrives. Your "
                    "hook read the .grad of parameters that backward had not reached yet "
                    f"({', '.join(early['missing'])} were still None: {early['error']}). Count the "
                    "gradients each bucket has received and launch it when the count reaches its "
                    "size.")
            events = [e for e in results.traces[rank].comm() if _ANSWER in e.scopes]
            ops = sorted({e.op for e in events} - {"all_reduce"})
            if ops:
                raise ExerciseError(
                    f"{name}: rank {rank} called {', '.join(ops)}; one comm.all_reduce per bucket "
                    "is all DDP sends.")
            for step, got in enumerate(r["steps"]):
                where = f"on {n} ranks, rank {rank}, step {step}"
                # traced in this step's backward and finish()
                mine = [e for e in events if e.step == step]
                if not mine and step > 0 and any(e.step == step - 1 for e in events):
                    raise ExerciseError(
                        f"{name} {where}: step {step - 1} launched its all-reduces from the hooks, "
                        f"step {step} none: each bucket's count of gradients received went on from "
                        "where the last step left it, so no bucket filled up again. Reset the "
                        "counts in finish().")
                if not mine:
                    raise ExerciseError(
                        f"{name} {where}: no all-reduce was traced during backward and finish(). "
                        "Launch comm.all_reduce(flat, async_op=True) from the hook (through "
                        "minitp.comm, so the bytes are recorded).")
                if len(mine) > len(buckets):
                    raise ExerciseError(
                        f"{name} {where}: {len(mine)} all-reduces for {len(buckets)} buckets: one "
                        "per bucket, launched once its last gradient is ready, not one per "
                        "parameter or per hook call.")
                _check_ddp_values(name, where, got, n, buckets)
                if len(mine) < len(buckets):
                    raise ExerciseError(
                        f"{name} {where}: {len(mine)} all-reduces for {len(buckets)} buckets: a "
                        "bucket was never launched.")
                early = [e for e in mine if e.start < got["last_grad_at"]]
                if len(early) < len(buckets) - 1:
                    late = "after backward ended" if all(e.start > got["backward_ended"]
                                                         for e in mine) else \
                        "only once every gradient was ready"
                    raise ExerciseError(
                        f"{name} {where}: the values are right, but the buckets were launched "
                        f"{late}: {len(early)} of {len(buckets)} started while backward still had "
                        "gradients to compute. Launch each bucket from the hook, as soon as its "
                        "last gradient is ready, so its message overlaps the rest of backward.")
                if sorted(e.bytes for e in mine) != bucket_bytes:
                    raise ExerciseError(
                        f"{name} {where}: all-reduces of {sorted(e.bytes for e in mine)} bytes, "
                        f"expected one per bucket of {bucket_bytes} bytes.")
                sent = sum(e.sent_bytes for e in mine)
                want = cost.ddp_step_bytes(psi, n)
                # pragma: no cover - follows from the bytes
                if not math.isclose(sent, want, rel_tol=1e-9):
                    raise wrong(name, f"{name} {where}: sent {sent:g} bytes, not 2(n-1)/n * Ψ * 4.",
                                f"{want:g} bytes")
                off = [k for k in got["library"] if not _close(got["grads"][k], got["library"][k])]
                if off:  # pragma: no cover - minitp.ddp matches one process in its own tests
                    raise ExerciseError(f"{name} {where}: {off[0]}.grad differs from minitp.ddp's.")
            off = [k for k in r["params"] if not _close(r["params"][k], r["single_params"][k])]
            if off:
                raise ExerciseError(
                    f"{name} on {n} ranks, rank {rank}: after {steps} SGD steps {off[0]} differs "
                    "from one process: are the buckets ready again for the next step (reset the "
                    "counts in finish())?")
    passed(name, f"{len(buckets)} buckets, each all-reduced during backward; gradients and "
                 f"parameters as one process and minitp.ddp on {' and '.join(map(str, nprocs))} "
                 "ranks; 2(n-1)/n * Ψ * 4 bytes per step")


__all__ = ["check_split_batch", "check_average_bucket", "check_ddp_bytes", "check_bucketed_ddp"]


# -- worked problems: estimates from the hardware sheet (minitp.exercises.problems) ----------------
def _tokens_to_hide_all_reduce(n: int, link) -> float:
    """Tokens per GPU per step whose backward (4 FLOPs per parameter and token, at the device's
    efficiency) lasts as long as the bandwidth term of the all-reduce of 2Ψ bytes of bf16 gradients:
    Ψ cancels, T = 2(n-1)/n · 2/β · R/4."""
    rate = cost.H100.flops_per_s * cost.H100.efficiency
    return cost.collective_sent_bytes("all_reduce", 2.0, n) / link.bytes_per_s * rate / 4


def _states_8b_gb() -> float:
    """LLaMA-3-8B's parameters, gradients and AdamW moments in fp32 on each DDP rank: 16 bytes a
    parameter."""
    from minitp.models import LLAMA3_8B

    return cost.total_memory(cost.memory_per_rank(LLAMA3_8B.num_params(), 1, zero=0)) / 1e9


PROBLEMS = {
    1: Problem("problem 1, tokens to hide the all-reduce in one machine",
               lambda: _tokens_to_hide_all_reduce(8, cost.H100.intra), "tokens",
               {1.5: "the backward is 4 of the 6 FLOPs per parameter and token, not all 6",
                2.0: "an all-reduce sends 2(n-1)/n of the buffer; the buffer is 2Ψ bytes in bf16"}),
    2: Problem("problem 2, the same across machines",
               lambda: _tokens_to_hide_all_reduce(64, cost.H100.inter), "tokens",
               {1.5: "the backward is 4 of the 6 FLOPs per parameter and token, not all 6"}),
    3: Problem("problem 3, does LLaMA-3-8B fit?", _states_8b_gb, "GB",
               {0.25: "AdamW keeps two moments, and the gradients are as big as the weights: 16 "
                      "bytes a parameter"}),
}


def check_problem(number: int, answer) -> None:
    """Problem ``number`` of chapter 01: ``answer()`` returns the estimate, in the unit the problem
    asks."""
    problems.check_problem(PROBLEMS, number, answer)
