"""Chapter 02's exercise 4: one ZeRO-3 unit written by hand (``check_fsdp_unit``, re-exported by
``ch02``).

The unit keeps only its shard between steps. Forward: all-gather the flat parameters, run, free
them. Backward: all-gather again, run the unit's forward once more with autograd on, reduce-scatter
the averaged gradient of the flat parameters so each rank keeps its shard's. The checker follows the
buffers the answer's all-gathers fill, to see when they are freed.
"""

from __future__ import annotations

import copy
import math
import time
import weakref

import torch

from minitp import comm, cost, fsdp, trace
from minitp.exercises import ExerciseError, passed, run_answer, wrong

_ANSWER = "answer"  # the scope the learner's calls are traced under


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([flat, flat.new_zeros(cost.padded_numel(flat.numel(), n) - flat.numel())])


# -- exercise 4: one ZeRO-3 unit: gather, run, free; gather again, reduce-scatter ------------------
def _blocks() -> list[torch.nn.Module]:
    """Two units of 56 and 27 parameters: 27 needs padding on 4 ranks, 56 on 3."""
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh()),
            torch.nn.Sequential(torch.nn.Linear(8, 3))]


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class _GatheredBuffers:
    """Follows the outputs of the answer's all-gathers: which are still alive, and the most held at
    once."""

    def __init__(self):
        self.alive: list[weakref.ref] = []
        self.peak = 0

    def _held_now(self) -> int:
        live = [r() for r in self.alive]
        return sum(t.untyped_storage().nbytes() for t in live if t is not None)

    def held(self, allowed: int = 0) -> int:
        """Bytes of gathered buffers still alive. gloo's worker thread may let go of a finished
        collective's buffers a moment late, so above ``allowed`` wait up to 0.2 s for them."""
        for _ in range(20):
            held = self._held_now()
            if held <= allowed:
                return held
            time.sleep(0.01)
        return held

    def watch(self, all_gather):
        def recording(output, input, *args, **kwargs):
            result = all_gather(output, input, *args, **kwargs)
            self.alive.append(weakref.ref(output))
            mine = output.untyped_storage().nbytes()
            self.peak = max(self.peak, self.held(allowed=mine))
            return result
        return recording


def _unit_worker(cls, steps: int):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    blocks = _blocks()
    full_flats = [_flat(b) for b in blocks]
    single = torch.nn.Sequential(*copy.deepcopy(blocks))
    library = torch.nn.Sequential(*copy.deepcopy(blocks))
    with trace.scope("library"):
        sharded = fsdp.FullyShardedDataParallel(library, wrap=lambda name, m: name in ("0", "1"),
                                                prefetch=False)
    gathered = _GatheredBuffers()
    comm.all_gather = gathered.watch(comm.all_gather)  # this worker process only
    with trace.scope(_ANSWER):
        units = [cls(copy.deepcopy(b), None) for b in blocks]
    shards = [u.shard.detach().clone() if isinstance(getattr(u, "shard", None), torch.Tensor)
              else None
              for u in units]
    answer = torch.nn.Sequential(*units)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (answer, single)]
    optimizers.append(sharded.attach(torch.optim.SGD(sharded.parameters(), lr=0.3)))
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(7 + step)
        # the global batch
        x, y = torch.randn(2 * n, 6, generator=g), torch.randn(2 * n, 3, generator=g)
        mine = slice(2 * rank, 2 * rank + 2)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        gathered.peak = 0
        with trace.scope(_ANSWER, f"step{step}",
                         "forward"), trace.tagged(step=step, phase="forward"):
            out_answer = answer(x[mine])
        held_after_forward = gathered.held()
        with trace.scope(_ANSWER, f"step{step}",
                         "backward"), trace.tagged(step=step, phase="backward"):
            torch.nn.functional.mse_loss(out_answer, y[mine]).backward()
        torch.nn.functional.mse_loss(single(x), y).backward()
        with trace.scope("library"):
            torch.nn.functional.mse_loss(sharded(x[mine]), y[mine]).backward()
        out.append({"output": out_answer.detach(), "single_output": single(x[mine]).detach(),
                    "held_after_forward": held_after_forward, "peak": gathered.peak,
                    "grads": [None if u.shard.grad is None else u.shard.grad.clone()
                              for u in units],
                    "single_grads": [torch.cat([p.grad.reshape(-1) for p in b.parameters()])
                                     for b in single],
                    "library_grads": [u.master.grad.clone() for u in sharded.units]})
        for opt in optimizers:
            opt.step()
    return {"flats": full_flats, "shards": shards, "steps": out,
            "final": [u.shard.detach().clone() for u in units],
            "single_final": [_flat(b) for b in single]}


def _slice_of(flat: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    padded = _padded(flat, n)
    k = padded.numel() // n
    return padded[rank * k:(rank + 1) * k]


def _check_shard(name: str, where: str, got, flat: torch.Tensor, n: int, rank: int,
                 unit: int) -> None:
    want = _slice_of(flat, n, rank)
    if not isinstance(got, torch.Tensor):
        raise ExerciseError(
            f"{name} {where}: unit {unit} has no tensor `shard`; keep this rank's slice of the "
            "padded flat parameters as an nn.Parameter named `shard`.")
    got = got.reshape(-1)
    if got.numel() == flat.numel() or got.numel() == _padded(flat, n).numel():
        raise ExerciseError(
            f"{name} {where}: unit {unit}'s shard holds the whole flat parameter ({got.numel()} "
            f"elements): keep 1/n of it, {want.numel()} elements.")
    if got.numel() != want.numel():
        raise ExerciseError(
            f"{name} {where}: unit {unit}'s shard has {got.numel()} elements, expected "
            f"{want.numel()}: the flat parameter ({flat.numel()}) padded to a multiple of n = {n}, "
            "divided by n.")
    if torch.equal(got, want):
        return
    for other in range(n):
        if torch.equal(got, _slice_of(flat, n, other)):
            raise ExerciseError(
                f"{name} {where}: unit {unit}'s shard is rank {other}'s slice; rank r keeps "
                "elements [r * P/n, (r + 1) * P/n) of the padded flat parameter.")
    if torch.equal(got, _padded(flat, n)[rank::n]):
        raise ExerciseError(
            f"{name} {where}: unit {unit}'s shard is strided (flat[rank::n]); minitp.fsdp keeps a "
            "contiguous slice, [r * P/n, (r + 1) * P/n), so one all-gather puts the slices "
            "back in order.")
    raise wrong(name, f"{name} {where}: unit {unit}'s shard is {got.tolist()}, not this rank's "
                      "slice: pad the unit's flat parameters with zeros to P, a multiple of n; "
                      "rank r keeps elements [r * P/n, (r + 1) * P/n).",
                str(want.tolist()))


def check_fsdp_unit(cls, nprocs: tuple[int, ...] = (4,), steps: int = 2,
                    timeout: float = 60.0) -> None:
    """``cls(module, group)`` must be a ZeRO-3 unit: a shard between steps, gather/run/free around
    forward, gather again for backward, a reduce-scatter of the averaged gradient."""
    name = "FSDP unit"
    numels = [_flat(b).numel() for b in _blocks()]
    for n in nprocs:
        results = run_answer(_unit_worker, n, (cls, steps), name, timeout, hang_hint=(
            "Every rank must make the same collectives in the same order: an all-gather per unit "
            "in forward, an all-gather and a reduce-scatter per unit in backward."))
        unit_bytes = [cost.padded_numel(k, n) * 4 for k in numels]
        for rank, r in enumerate(results):
            where = f"on {n} ranks, rank {rank}"
            for i, (got, flat) in enumerate(zip(r["shards"], r["flats"])):
                _check_shard(name, where, got, flat, n, rank, i)
            events = [e for e in results.traces[rank].comm() if _ANSWER in e.scopes]
            for step, got in enumerate(r["steps"]):
                at = f"{where}, step {step}"
                fwd = [e.op for e in events if e.step == step and e.phase == "forward"]
                bwd = [e.op for e in events if e.step == step and e.phase == "backward"]
                if fwd.count("all_gather") != 2:
                    raise ExerciseError(
                        f"{name} {at}: forward made {fwd.count('all_gather')} all-gathers for 2 "
                        "units: gather each unit's full parameters from the shards, once, "
                        "right before it runs (through comm.all_gather, so it is traced).")
                if not torch.allclose(got["output"], got["single_output"], rtol=1e-5, atol=1e-6):
                    raise ExerciseError(
                        f"{name} {at}: the forward output differs from one process by "
                        f"{(got['output'] - got['single_output']).abs().max().item():.3g}: the "
                        "gathered flat buffer should be the unit's parameters in order.")
                if got["held_after_forward"]:
                    raise ExerciseError(f"{name} {at}: after forward, {got['held_after_forward']} "
                                        "bytes of gathered parameters were still held (saved for "
                                        "backward, or kept on the unit). Free them after the "
                                        "unit's forward (keep only the shard and the input) and "
                                        "gather again in backward: that is what saves memory.")
                if bwd.count("all_gather") != 2:
                    raise ExerciseError(
                        f"{name} {at}: backward made {bwd.count('all_gather')} all-gathers for 2 "
                        "units: the parameters were freed after forward, so gather them again.")
                if bwd.count("reduce_scatter") != 2:
                    raise ExerciseError(f"{name} {at}: backward made {bwd.count('reduce_scatter')} "
                                        "reduce-scatters for 2 units, expected one per unit: each "
                                        "rank keeps the summed gradient of its own shard only.")
                for i, (g, want, lib) in enumerate(zip(got["grads"], got["single_grads"],
                                                       got["library_grads"])):
                    want = _slice_of(want, n, rank)
                    if g is None:
                        raise ExerciseError(
                            f"{name} {at}: unit {i}'s shard has no gradient: return the "
                            "reduce-scattered gradient for `shard` from backward.")
                    if torch.allclose(g, want, rtol=1e-5, atol=1e-6):
                        if not torch.allclose(g, lib, rtol=1e-5, atol=1e-6):  # pragma: no cover
                            raise ExerciseError(
                                f"{name} {at}: unit {i}'s gradient differs from minitp.fsdp's.")
                        continue
                    if torch.allclose(g, n * want, rtol=1e-5, atol=1e-6):
                        raise ExerciseError(
                            f"{name} {at}: unit {i}'s shard gradient is the SUM over the ranks, "
                            f"{n} times the mean: divide by n (before or after the "
                            "reduce-scatter), as one process on the whole batch averages.")
                    raise ExerciseError(
                        f"{name} {at}: unit {i}'s shard gradient differs from one process by "
                        f"{(g - want).abs().max().item():.3g} (the slice of the full gradient "
                        "a rank keeps must be its own shard's).")
                most = max(unit_bytes)
                if got["peak"] > most:
                    raise ExerciseError(f"{name} {at}: up to {got['peak']} bytes of gathered "
                                        "parameters were held at once, expected one unit's at most "
                                        f"({most} B): free each gathered buffer as soon as its "
                                        "unit is done, in backward too.")
            sent = sum(e.sent_bytes for e in events) / steps
            want = cost.fsdp_step_bytes(numels, n, zero=3, root=False)
            if not math.isclose(sent, want, rel_tol=1e-9):
                raise wrong(name, f"{name} {where}: sent {sent:g} bytes per step, not what two "
                                  "all-gathers and one reduce-scatter of each padded unit "
                                  "send.", f"{want:g} bytes per step")
            for i, (got, want) in enumerate(zip(r["final"], r["single_final"])):
                # pragma: no cover
                if not torch.allclose(got, _slice_of(want, n, rank), rtol=1e-5, atol=1e-6):
                    raise ExerciseError(
                        f"{name} {where}: after {steps} steps unit {i}'s shard differs from one "
                        "process.")
    passed(name,
           f"as one process and minitp.fsdp on {' and '.join(map(str, nprocs))} ranks; one unit's "
                 "parameters gathered at a time; 3 (n-1)/n * P * 4 bytes per unit per step")


__all__ = ["check_fsdp_unit"]
