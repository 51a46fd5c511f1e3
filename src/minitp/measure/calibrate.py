"""Measure this machine for the time model: one rank's matmul rate, fixed costs, and gloo's α and β.

``minitp calibrate`` measures them (``minitp.runs.measuring.calibrate``, which launches the runs
below and fits them here) and stores them (``calibration_path()``: $MINITP_CALIBRATION,
else ~/.cache/minitp/calibration.json); every ``minitp run`` then reports its ``predicted_step_s``
from them (``this_machine()``). The time model itself (``minitp.cost``) reads no file: the figures
are read and checked here, and handed to it as a ``Device``.

* FLOP/s: a matrix multiply timed on one thread (each rank of a run uses one), at the shapes the
  tiny model runs, (B·S, D) @ (D, F) with B·S = 128, D = 64, F = 128: small matmuls reach a small
  share of what large ones do, and the tiny model's step is made of them (plus per-operation
  overhead, which this rate then carries too). The rate at a large size is stored beside it.
* the fixed costs: a one-process training step of the tiny model on one thread (the fastest of
  20), once with its batch of 8 in one micro-batch and once in 8 micro-batches of one sequence
  (gradients accumulated, one optimizer step). The growth per micro-batch added is what a forward
  and backward cost beyond their FLOPs (``microbatch_overhead_s``); the one-micro-batch step less
  that and its FLOPs is what the step costs once (``step_overhead_s``: the optimizer's loop over
  tensors, zeroing the gradients). At these sizes the FLOPs take about a millisecond and the step
  several: Python, autograd and the optimizer's loop dominate, and a prediction without these terms
  would be off by an order of magnitude. ``op_s``, the cost of one small tensor operation (what
  ring attention and a MoE add, ``minitp.cost.time.strategy_ops``), is the micro-batch's fixed cost
  over the number of operations its forward and backward dispatch (counted here, once).
* the work beyond the matmuls at training shapes: the byte model's step beside the tiny one's, a
  line in the elements their activations hold (``minitp.measure.elements``).
* a strategy's own code: the tiny model's step at one rank under minitp's DDP, FSDP (ZeRO-3) and
  tensor parallel, against the plain step, less a bare one-rank all-reduce per collective it calls
  (the time model charges a collective as α): their hooks, autograd Functions, gathers and releases,
  trace records (``ddp_own_s``, ``fsdp_own_s``, ``tp_own_s``, ``fit_own_work``). Measured where no
  message crosses anything, so nothing in it is fitted to the runs it predicts. In the same way,
  what one operation ring attention and a MoE add costs (``cp_op_s``, ``ep_op_s``,
  ``fit_op_costs``): the growth of their forward+backward at one rank over the plain model's, per
  operation added (their indexing, masking and scattering of small tensors cost about twice
  ``op_s``). These two runs build strategies, so they are a runner's (``minitp.runs.measuring``);
  only their fits are here.
* α and β: all-reduces of a few sizes on 2 ranks over gloo, each issued as training issues them,
  after a burst of compute (a few of the tiny model's matmuls), and fitted to
  T(B) = 2(n-1)·α + 2(n-1)/n · B/β (n = 2: T = 2α + B/β) by least squares on the **mean** time per
  size. A step's time is the sum of its collectives' times, so the mean is what adds up: it holds
  the wire (what the fastest call shows) and what comes with every call on a busy machine, waking
  gloo's threads and waiting for the other rank to arrive. On 2 shared cores the mean is several
  times the fastest; the fit to the fastest calls is stored beside it (``alpha_min_s``,
  ``bytes_per_s_min``) for comparison.
* more ranks than cores: the same all-reduces on 2·cores ranks (on a machine of 2 to 4 cores). The
  fit there (``alpha_shared_s``, ``bytes_per_s_shared``) is what a message costs when its ranks wait
  for a core. Each run ends with bursts of matmuls on every rank at once: their mean time on 2·cores
  ranks over their mean time on 2 is how much the compute slows (``shared_slowdown``; ranks/cores
  would say 2). The time model draws lines through these and the figures at a core per rank
  (``minitp.cost.time.link_on_machine``, ``_shared_cores``).

Reading a stored calibration never raises: a file that is not one, or a figure the time model cannot
use (a rate of 0, a negative α, NaN, ``"cores": "two"``), reads as no calibration, with a note that
says why (``read_calibration``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

import torch

from minitp.cost import Device, device_from_calibration

SIZES = (4, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # bytes of the all-reduced buffer
TINY_SHAPE = (128, 64, 128)  # (M, K, N): tokens, D, F of the tiny model at batch 8, seq 16


def matmul_flops_per_s(m: int, k: int, n: int, repeats: int = 50, seconds: float = 0.2) -> float:
    """FLOP/s of (m, k) @ (k, n) in fp32 on one thread: 2mkn per multiply, the best of a few
    rounds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b  # warm-up
        best, t_end = float("inf"), time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            for _ in range(repeats):
                a @ b
            best = min(best, (time.perf_counter() - t0) / repeats)
            if time.perf_counter() > t_end:
                break
        return 2 * m * k * n / best
    finally:
        torch.set_num_threads(threads)


def tiny_step_s(microbatches: tuple[int, ...] = (1, 8), batch: int = 8, seq: int = 16,
                repeats: int = 20, cfg=None) -> dict[int, float]:
    """{m: seconds of the fastest of ``repeats`` training steps of the tiny model (or ``cfg``'s) on
    one thread}, its batch cut into m micro-batches whose gradients accumulate before one AdamW
    step. The counts of micro-batches take turns, step by step, so that what else runs on the
    machine slows them alike; the first two rounds warm up."""
    from minitp.models import TINY, build_model, loss_fn
    from minitp.models.train import make_optimizer

    cfg = cfg or TINY
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(cfg, seed=0)
        optimizer = make_optimizer(model.parameters(), 1e-3)
        g = torch.Generator().manual_seed(0)
        tokens, targets = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
                           for _ in range(2))
        best = {m: float("inf") for m in microbatches}
        for i in range(repeats + 2):
            for m in microbatches:
                t0 = time.perf_counter()
                optimizer.zero_grad()
                for x, y in zip(tokens.chunk(m), targets.chunk(m)):
                    (loss_fn(model(x), y) / m).backward()
                optimizer.step()
                best[m] = min(best[m], time.perf_counter() - t0) if i >= 2 else best[m]
    finally:
        torch.set_num_threads(threads)
    return best


def count_dispatched(fn) -> int:
    """How many tensor operations ``fn()`` dispatches (every call that reaches PyTorch's operator
    dispatcher, counted by a TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def count_ops(batch: int = 8, seq: int = 16) -> int:
    """How many tensor operations one forward and backward of the tiny model dispatch."""
    from minitp.models import TINY, build_model, loss_fn

    model = build_model(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq),
                           generator=torch.Generator().manual_seed(0))
    return count_dispatched(lambda: loss_fn(model(tokens), tokens).backward())


def fit_fixed_costs(step_one: float, step_many: float, microbatches: int, flops_s: float,
                    ops: int) -> dict:
    """The fixed costs from the tiny model's step at one micro-batch (``step_one`` seconds) and at
    ``microbatches`` (``step_many``), the same batch and FLOPs (``flops_s`` seconds at the measured
    rate): per micro-batch the growth per one added, per step what is left of ``step_one`` beyond
    its FLOPs and its micro-batch, per small operation the micro-batch's over its ``ops``
    operations."""
    microbatch = max(0.0, (step_many - step_one) / (microbatches - 1))
    return {"step_overhead_s": max(0.0, step_one - flops_s - microbatch),
            "microbatch_overhead_s": microbatch, "op_s": microbatch / ops, "microbatch_ops": ops}


# more ranks than this (a machine of more than 4 cores): not measured at 2·cores ranks
SHARED_MAX_RANKS = 8
# the fixed costs: the tiny model's batch of 8 in one micro-batch, then in 8 of one sequence
MICROBATCHES = 8


def moe_extra_flops_s(flops_per_s: float, batch: int = 8, seq: int = 16) -> float:
    """Seconds the MoE of ``minitp.runs.measuring._op_cost_worker`` spends on FLOPs beyond the plain
    tiny model's."""
    from minitp.cost import training_flops_per_token
    from minitp.models import TINY
    from minitp.models.moe import moe_config

    moe = moe_config(TINY, n_experts=8, top_k=2, capacity_factor=1.25)
    return batch * seq * (training_flops_per_token(
        moe, seq) - training_flops_per_token(TINY, seq)) / flops_per_s


def fixed_costs(flops_per_s: float, batch: int = 8, seq: int = 16) -> dict:
    """Measure and fit the fixed costs of a step, of a micro-batch and of one operation
    (``fit_fixed_costs``)."""
    from minitp.cost import training_flops_per_token
    from minitp.models import TINY

    flops_s = batch * seq * training_flops_per_token(TINY, seq) / flops_per_s
    steps = tiny_step_s((1, MICROBATCHES), batch, seq)
    return {**fit_fixed_costs(steps[1], steps[MICROBATCHES], MICROBATCHES, flops_s,
                              count_ops(batch // MICROBATCHES, seq)), "tiny_step_s": steps[1]}


OWN_STRATEGIES = ("ddp", "fsdp", "tp")  # whose own code ``minitp.runs.measuring`` times at one rank


def fit_own_work(step_s: dict[str, float], calls: dict[str, int],
                 call_s: float) -> dict[str, float]:
    """{"ddp_own_s": ..., "fsdp_own_s": ..., "tp_own_s": ...}: what each strategy's step at one rank
    costs beyond the plain model's step and beyond its collectives' bare calls (``call_s`` each; the
    time model charges the calls as α): the strategy's own code. 0 where noise makes it negative."""
    return {f"{name}_own_s": max(0.0, step_s[name] - step_s["plain"] - calls[name] * call_s)
            for name in OWN_STRATEGIES}


def fit_op_costs(fb_s: dict[str, float], ops: dict[str, int],
                 moe_flops_s: float = 0.0) -> dict[str, float]:
    """{"cp_op_s": ..., "ep_op_s": ...}: the growth of the forward+backward over the plain model's
    per operation added, under ring attention and as a MoE (less ``moe_flops_s``, the time of the
    MoE's extra FLOPs at the measured rate). None where nothing was added; 0 where noise makes it
    negative."""
    out = {}
    for name in ("cp", "ep"):
        added, extra = ops[name] - ops["plain"], moe_flops_s if name == "ep" else 0.0
        out[f"{name}_op_s"] = max(0.0, (
            fb_s[name] - fb_s["plain"] - extra) / added) if added > 0 else None
    return out


def _all_reduce_worker(sizes: tuple[int, ...], repeats: int) -> dict:
    """{"all_reduce": {bytes: (mean seconds, fastest seconds)}, "compute_s": mean seconds of a long
    burst}: all-reduces each issued after a short burst of compute, as training issues them; then
    bursts of about 20 ms of matmuls that every rank runs at once, timed (what sharing the cores
    does to compute)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    a = torch.randn(TINY_SHAPE[0], TINY_SHAPE[1])
    w = torch.randn(TINY_SHAPE[1], TINY_SHAPE[1])
    out = {}
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4))
        times = []
        for _ in range(repeats + 2):
            for _ in range(8):  # about a block's matmuls of the tiny model
                a @ w
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        # the first two warm the connection up
        out[nbytes] = (statistics.fmean(times[2:]), min(times[2:]))
    bursts = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(2000):
            a @ w
        bursts.append(time.perf_counter() - t0)
    return {"all_reduce": out, "compute_s": statistics.fmean(bursts)}


def fit_alpha_beta(times: dict[int, float], n: int = 2) -> tuple[float, float]:
    """α (s per ring step) and β (bytes/s) from all-reduce times {bytes: seconds} on n ranks:
    least squares of T = 2(n-1)·α + (2(n-1)/n · B)/β, a line in B."""
    xs = [2 * (n - 1) / n * b for b in times]
    ys = list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0:
        raise ValueError(f"all-reduce times do not grow with size ({times}); calibrate again on a "
                         "quieter machine")
    return max(intercept, 0.0) / (2 * (n - 1)), 1.0 / slope


def check_store(path: str | None = None) -> str:
    """Refuse, before anything is measured, a place ``save`` could not write: a folder given as the
    file, a file where a folder of the path should be, a folder that cannot be written. Returns the
    path."""
    path = os.path.abspath(path or calibration_path())
    if os.path.isdir(path):
        raise ValueError(
            f"the calibration file {path} is a folder; set {CALIBRATION_ENV} to a file's path")
    folder = os.path.dirname(path)
    # the first part of the path that exists must be a writable folder
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(
            f"cannot store the calibration at {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path)
                                                    and not os.access(path, os.W_OK)):
        raise ValueError(f"cannot store the calibration at {path}: {folder} is not writable; set "
                         f"{CALIBRATION_ENV} to a writable place or use --dry-run")
    return path


def save(cal: dict, path: str | None = None) -> str:
    """Write a calibration (JSON) where ``load_calibration`` reads it; returns the path."""
    path = path or calibration_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cal, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)  # whole or absent
    return path


# -- reading it back: where it is stored, and whether the time model can use it --------------------
# where to store and read the figures (a test points it elsewhere)
CALIBRATION_ENV = "MINITP_CALIBRATION"
MAX_FILE_BYTES = 2**20  # a calibration is about a kilobyte; a larger file is not one

# the figures the time model uses (``device_from_calibration``) and ``minitp calibrate`` stores
# beside them: (name, required, what a value must be)
FIGURES = (
    ("flops_per_s", True, "> 0"), ("bytes_per_s", True, "> 0"), ("alpha_s", True, ">= 0"),
    ("step_overhead_s", False, ">= 0"), ("microbatch_overhead_s", False, ">= 0"),
    ("op_s", False, ">= 0"), ("memory_bytes", False, ">= 0"), ("ddp_own_s", False, ">= 0"),
    ("fsdp_own_s", False, ">= 0"), ("tp_own_s", False, ">= 0"), ("cp_op_s", False, ">= 0"),
    ("ep_op_s", False, ">= 0"), ("flops_per_s_large", False, "> 0"),
    ("bytes_per_s_min", False, "> 0"), ("alpha_min_s", False, ">= 0"),
    ("alpha_shared_s", False, ">= 0"), ("bytes_per_s_shared", False, "> 0"),
    ("shared_slowdown", False, "> 0"), ("busy_slowdown", False, "> 0"),
    ("element_s", False, ">= 0"), ("element_step_overhead_s", False, ">= 0"),
    ("all_gather_factor", False, "> 0"), ("reduce_scatter_factor", False, "> 0"),
    ("wait_per_compute", False, ">= 0"),
)
# a noisy fit stores null; a machine of one core measures nothing at 2·cores ranks
MAY_BE_NULL = ("cp_op_s", "ep_op_s", "flops_per_s_large", "bytes_per_s_min", "alpha_min_s",
               "alpha_shared_s", "bytes_per_s_shared", "shared_slowdown", "busy_slowdown")


def calibration_path() -> str:
    """Where ``minitp calibrate`` stores this machine's figures: $MINITP_CALIBRATION, else
    ~/.cache/minitp/calibration.json."""
    return os.environ.get(CALIBRATION_ENV) or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "minitp", "calibration.json")


def _shown(value) -> str:
    """A JSON value as the file writes it, short: a list or an object by its kind only."""
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "an object"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # not a JSON value, or an int of more digits than Python prints
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _is_number(value) -> bool:
    """A finite int or float (not a bool, not an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_calibration(cal) -> str | None:
    """Why ``cal`` cannot time a step ("ignored: FIELD is VALUE, expected ..."), or None when it
    can: finite positive rates, a finite non-negative α and overhead, a whole number of cores (not a
    bool)."""
    if not isinstance(cal, dict):
        return f"ignored: the calibration is {_shown(cal)}, expected a JSON object of figures"
    for name, required, low in FIGURES:
        if name not in cal:
            if required:
                return f"ignored: {name} is missing"
            continue
        value = cal[name]
        if value is None and name in MAY_BE_NULL:
            continue
        if not _is_number(value) or (value <= 0 if low == "> 0" else value < 0):
            return f"ignored: {name} is {_shown(value)}, expected a finite number {low}"
    if cal.get("element_s") is not None:  # priced beside the large rate (device_from_calibration)
        for name in ("flops_per_s_large", "element_step_overhead_s"):
            if cal.get(name) is None:
                return f"ignored: element_s is given without {name}"
    cores = cal.get("cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        return f"ignored: cores is {_shown(cores)}, expected a whole number >= 1"
    if not isinstance(cal.get("name", ""), str):
        return f"ignored: name is {_shown(cal['name'])}, expected text"
    return None


def read_calibration(path: str | None = None) -> tuple[dict | None, str | None]:
    """(figures, None) from the stored calibration; (None, None) when none is stored; (None, why)
    when the file is not a calibration the time model can use: never an exception."""
    path = path or calibration_path()
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"ignored: {path} is not a calibration file ({e.strerror or type(e).__name__})"
    if len(data) > MAX_FILE_BYTES:
        return (None,
                f"ignored: {path} is not a calibration file (larger than {MAX_FILE_BYTES} bytes)")
    try:
        cal = json.loads(data)
    except RecursionError:
        return None, f"ignored: {path} is not a calibration file (nested too deeply)"
    except UnicodeDecodeError:
        return None, f"ignored: {path} is not a calibration file (not text)"
    except ValueError as e:
        return None, f"ignored: {path} is not a calibration file (not JSON: {str(e)[:80]})"
    if not isinstance(cal, dict):
        return None, f"ignored: {path} is not a calibration file ({_shown(cal)}, not a JSON object)"
    why = check_calibration(cal)
    return (None, why) if why else (cal, None)


def load_calibration(path: str | None = None) -> dict | None:
    """The stored calibration, or None when there is none (or it cannot be used:
    ``read_calibration`` says why)."""
    return read_calibration(path)[0]


def this_machine(path: str | None = None) -> Device | None:
    """This machine as a Device, from ``minitp calibrate``'s stored figures (None if never
    calibrated, or if what is stored cannot be used)."""
    cal = load_calibration(path)
    return device_from_calibration(cal) if cal else None


def format_calibration(cal: dict) -> str:
    from minitp.measure.collectives import describe as kinds
    from minitp.measure.elements import describe

    return (f"matmul {tuple(cal['matmul_shape'])}: {cal['flops_per_s'] / 1e9:.2f} GFLOP/s per rank "
            f"(512^3: {cal['flops_per_s_large'] / 1e9:.2f}), 1 thread; gloo all-reduce: "
            f"α = {cal['alpha_s'] * 1e6:.1f} µs per step, β = {cal['bytes_per_s'] / 1e9:.2f} GB/s "
            f"(mean calls{_fastest(cal)}){kinds(cal)}; "
            f"{_fixed(cal)}{describe(cal)}; {cal['cores']} cores{_shared(cal)}")


def _fixed(cal: dict) -> str:
    if cal.get("microbatch_overhead_s") is None:
        return f"a tiny-model step costs {cal['step_overhead_s'] * 1e3:.1f} ms beyond its FLOPs"
    return (f"a tiny-model step costs {cal['step_overhead_s'] * 1e3:.1f} ms beyond its FLOPs and "
            f"{cal['microbatch_overhead_s'] * 1e3:.1f} ms per micro-batch "
            f"({cal['op_s'] * 1e6:.1f} µs per small operation{_op_costs(cal)}){_own(cal)}")


def _op_costs(cal: dict) -> str:
    if cal.get("cp_op_s") is None or cal.get("ep_op_s") is None:
        return ""
    return f"; ring attention's {cal['cp_op_s'] * 1e6:.1f}, a MoE's {cal['ep_op_s'] * 1e6:.1f}"


def _own(cal: dict) -> str:
    own = [f"{name} {cal[f'{name}_own_s'] * 1e3:.1f}" for name in OWN_STRATEGIES
           if cal.get(f"{name}_own_s") is not None]
    return f"; a strategy's own code per micro-batch, ms: {', '.join(own)}" if own else ""


def _shared(cal: dict) -> str:
    busy = (f"; every core busy: a step {cal['busy_slowdown']:.2f}x slower"
            if cal.get("busy_slowdown") else "")
    if cal.get("alpha_shared_s") is None or cal.get("bytes_per_s_shared") is None:
        return busy
    return busy + (f"; at {2 * cal['cores']} ranks: α = {cal['alpha_shared_s'] * 1e6:.1f} µs, β = "
                   f"{cal['bytes_per_s_shared'] / 1e9:.2f} GB/s"
                   + (f", compute {cal['shared_slowdown']:.2f}x slower"
                      if cal.get("shared_slowdown") else ""))


def _fastest(cal: dict) -> str:
    if cal.get("alpha_min_s") is None or cal.get("bytes_per_s_min") is None:
        return ""
    return (f"; fastest calls: α = {cal['alpha_min_s'] * 1e6:.1f} µs, β = "
            f"{cal['bytes_per_s_min'] / 1e9:.2f} GB/s")
