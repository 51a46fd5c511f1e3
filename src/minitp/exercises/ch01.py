"""Checkers for chapter 01, data parallel (DDP).

* ``check_split_batch(fn)``: ``fn(batch, rank, world_size)`` returns this rank's contiguous slice of a
  global batch (dim 0), as ``minitp.ddp.split_batch`` does. Checked for every rank of 2 and of 4 ranks:
  the slices are equal in size, disjoint, cover the batch, and laid out in rank order.
* ``check_average_bucket(fn)``: ``fn(bucket)`` turns this rank's flat bucket of gradients into the
  mean over the ranks with ``minitp.comm.all_reduce``. Run on 2 and 4 processes; compared with the true
  mean and with the trace: exactly one all-reduce of the bucket's bytes.
* ``check_ddp_bytes(fn)``: ``fn(num_params, world_size, grad_bytes)`` gives the bytes one rank sends per
  DDP step; compared with ``minitp.cost.ddp_step_bytes``.

Batch rows and gradients are small integers stored as floats: sums are exact whatever the order, and a
wrong value points at where it came from (another rank's rows, a sum instead of a mean).
"""

from __future__ import annotations

import math

import torch

from minitp import cost, trace
from minitp.exercises import ExerciseError, passed, run_answer

_ANSWER = "answer"  # the scope the learner's calls are traced under


# -- exercise 1: this rank's slice of the global batch ------------------------------------------------
def check_split_batch(fn, world_sizes: tuple[int, ...] = (2, 4), batch_size: int = 8) -> None:
    """``fn(batch, rank, world_size)`` must return rows [rank * m/n, (rank + 1) * m/n) of a batch of m rows."""
    name = "split the batch"
    batch = torch.arange(batch_size * 3, dtype=torch.float32).reshape(batch_size, 3)  # row i starts with 3i
    row_of = {int(batch[i, 0]): i for i in range(batch_size)}
    for n in world_sizes:
        size = batch_size // n
        got_rows = []
        for rank in range(n):
            given = batch.clone()
            try:
                got = fn(given, rank, n)
            except NotImplementedError:
                raise ExerciseError(f"{name}: not done yet (the function still raises NotImplementedError). "
                                    "Replace the stub with your answer and run the check again.") from None
            where = f"global batch of m = {batch_size} rows on n = {n} ranks, rank {rank}"
            if not torch.equal(given, batch):
                raise ExerciseError(f"{name}: {where}: your function changed the batch it was given; "
                                    "return a slice, do not write into `batch`.")
            if not isinstance(got, torch.Tensor):
                raise ExerciseError(f"{name}: {where}: returned {type(got).__name__}, expected a tensor of "
                                    f"{size} rows.")
            if got.dim() != 2 or got.shape[1] != batch.shape[1]:
                raise ExerciseError(f"{name}: {where}: got shape {tuple(got.shape)}, expected ({size}, "
                                    f"{batch.shape[1]}): slice along dim 0 (the samples), keep every column.")
            rows = [row_of.get(int(v), -1) for v in got[:, 0].tolist()]
            if got.shape[0] == batch_size:
                raise ExerciseError(f"{name}: {where}: you returned the whole batch ({batch_size} rows). Every rank "
                                    f"then computes the same gradient: n = {n} times the work for one rank's worth "
                                    f"of learning. Keep m/n = {size} rows.")
            if got.shape[0] != size:
                raise ExerciseError(f"{name}: {where}: got {got.shape[0]} rows, expected m/n = {batch_size}/{n} = "
                                    f"{size}: every rank gets an equal share, so that the mean of the ranks' mean "
                                    "losses is the mean loss of the whole batch.")
            want = list(range(rank * size, (rank + 1) * size))
            if rows == want:
                got_rows.append(rows)
                continue
            if rows == list(range(rank, batch_size, n)):
                raise ExerciseError(f"{name}: {where}: you dealt the rows out like cards (batch[rank::n], rows "
                                    f"{rows}). That covers the batch too, but split_batch keeps each rank's rows "
                                    f"together and in order: rows {want}, i.e. [rank * m/n, (rank + 1) * m/n).")
            for k in range(n):
                if k != rank and rows == list(range(k * size, (k + 1) * size)):
                    raise ExerciseError(f"{name}: {where}: you returned rank {k}'s rows {rows}; rank {rank}'s are "
                                        f"{want}, i.e. batch[rank * m/n : (rank + 1) * m/n].")
            raise ExerciseError(f"{name}: {where}: expected rows {want}, got rows {rows}.")
        flat = [r for rows in got_rows for r in rows]
        if sorted(flat) != list(range(batch_size)) or len(set(flat)) != batch_size:  # pragma: no cover
            raise ExerciseError(f"{name}: on {n} ranks the slices overlap or leave rows out: {got_rows}.")
    passed(name, f"equal, disjoint, covering, in rank order on {' and '.join(map(str, world_sizes))} ranks")


# -- exercise 2: average one bucket of gradients -------------------------------------------------------
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


def check_average_bucket(fn, nprocs: tuple[int, ...] = (2, 4), numel: int = 12, timeout: float = 20.0) -> None:
    """Run ``fn(bucket)`` on each world size; every rank must end with the mean of the ranks' buckets."""
    name = "average a bucket"
    for n in nprocs:
        results = run_answer(_bucket_worker, n, (fn, numel, n), name, timeout,
                             hang_hint="Every rank must call comm.all_reduce on its bucket, once.")
        locals_ = [r["local"] for r in results]
        mean = sum(locals_) / n
        for rank, r in enumerate(results):
            got, where = r["got"], f"on {n} ranks, rank {rank}"
            if not isinstance(got, torch.Tensor):
                raise ExerciseError(f"{name} {where}: returned {type(got).__name__}; return the averaged bucket "
                                    "(or average it in place and return it).")
            got = got.reshape(-1).float()
            if got.numel() != numel:
                raise ExerciseError(f"{name} {where}: got {got.numel()} elements, expected the whole bucket of "
                                    f"{numel}: in DDP every rank keeps every averaged gradient.")
            if torch.allclose(got, mean, rtol=1e-6, atol=1e-6):
                continue
            if torch.allclose(got, mean * n, rtol=1e-6, atol=1e-6):
                raise ExerciseError(f"{name} {where}: your bucket is the SUM over the ranks, {n} times the mean. "
                                    "Divide by the world size (before or after the all-reduce): each rank's loss "
                                    "is the mean over its slice, so the whole batch's gradient is the mean of "
                                    "the ranks' gradients.")
            if torch.allclose(got, locals_[rank], rtol=1e-6, atol=1e-6):
                raise ExerciseError(f"{name} {where}: the bucket still holds this rank's own gradient: nothing "
                                    "was added from the other ranks. Call comm.all_reduce(bucket), then divide "
                                    "by the world size.")
            if torch.allclose(got, locals_[rank] / n, rtol=1e-6, atol=1e-6):
                raise ExerciseError(f"{name} {where}: you divided this rank's gradient by n but never summed over "
                                    "the ranks: the all-reduce is missing, or its result was not kept.")
            if torch.allclose(got, mean / n, rtol=1e-6, atol=1e-6):
                raise ExerciseError(f"{name} {where}: your bucket is the mean divided by n once more: divide "
                                    "once, by the world size.")
            raise ExerciseError(f"{name} {where}: expected {mean.tolist()}, got {got.tolist()}.")
        events = [e for e in results.traces[0].comm() if e.label.startswith(_ANSWER)]
        ops = [e.op for e in events]
        if not events:
            raise ExerciseError(f"{name}: the values are right but no message was traced: use "
                                "minitp.comm.all_reduce (not torch.distributed directly) so the bytes are recorded.")
        if set(ops) != {"all_reduce"}:
            raise ExerciseError(f"{name}: you called {', '.join(sorted(set(ops)))}; one comm.all_reduce of the "
                                "bucket is all it takes.")
        bucket_bytes = numel * 4
        if len(events) != 1 or events[0].bytes != bucket_bytes:
            sizes = ", ".join(f"{e.bytes} B" for e in events)
            raise ExerciseError(f"{name}: the values are right, but rank 0 made {len(events)} all-reduce(s) of "
                                f"{sizes}; expected exactly one of the whole bucket, {bucket_bytes} B. The point of "
                                "a bucket is one large message instead of many small ones.")
        want = cost.collective_sent_bytes("all_reduce", bucket_bytes, n)
        sent = results.sent_bytes(_ANSWER)
        if any(s != want for s in sent):  # pragma: no cover - follows from one all-reduce per rank
            raise ExerciseError(f"{name}: the ranks sent {sent} bytes, expected 2(n-1)/n * B = {want:g} each.")
    passed(name, f"the mean on {' and '.join(map(str, nprocs))} ranks, one all-reduce of the bucket's "
                 "bytes, 2(n-1)/n * B sent per rank")


# -- exercise 3: DDP's bytes per rank per step ---------------------------------------------------------
def _bytes_hint(got: float, psi: int, n: int, b: int) -> str:
    def near(x):
        return math.isclose(got, x, rel_tol=1e-9)

    if near(psi * b):
        return ("That is the gradient's size B = Ψ·b, not what a rank sends: a ring all-reduce sends 2(n-1)/n · B "
                "(a reduce-scatter then an all-gather, each (n-1)/n · B).")
    if near(2 * psi * b):
        return "Close: each half of the ring sends (n-1)/n · B, not B: the factor is 2(n-1)/n, not 2."
    if near((n - 1) / n * psi * b):
        return ("That is one half of the all-reduce (a reduce-scatter); the all-gather that follows sends as much "
                "again: 2(n-1)/n · B.")
    if near(2 * (n - 1) / n * psi):
        return "You counted elements: multiply by the bytes per gradient element, grad_bytes."
    if near(2 * (n - 1) * psi * b):
        return "Each rank sends n-1 chunks of B/n per half, not n-1 whole copies: 2(n-1)/n · B."
    if near(n * psi * b) or near(2 * n * psi * b):
        return "A rank's traffic does not grow with n in a ring: it approaches 2B, whatever n."
    return "One ring all-reduce of every gradient per step: 2(n-1)/n · Ψ · grad_bytes."


def check_ddp_bytes(fn) -> None:
    """``fn(num_params, world_size, grad_bytes)`` must give ``cost.ddp_step_bytes``."""
    name = "DDP bytes per step"
    for psi in (180_800, 8_030_261_248):
        for n in (4, 2, 8, 1, 64):
            for b in (4, 2):
                try:
                    got = fn(psi, n, b)
                except NotImplementedError:
                    raise ExerciseError(f"{name}: not done yet (the function still raises NotImplementedError).") \
                        from None
                if got is None:
                    raise ExerciseError(f"{name}: fn({psi}, {n}, {b}) returned None; return a number of bytes.")
                want = cost.ddp_step_bytes(psi, n, grad_bytes=b)
                if math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-9):
                    continue
                hint = _bytes_hint(float(got), psi, n, b)
                raise ExerciseError(f"{name}: for Ψ = {psi:,} parameters, n = {n} ranks, {b}-byte gradients you "
                                    f"gave {float(got):,.0f} bytes, expected {want:,.0f}. {hint}")
    passed(name, "2(n-1)/n · Ψ · b per rank, as minitp.cost.ddp_step_bytes")


__all__ = ["check_split_batch", "check_average_bucket", "check_ddp_bytes"]
