"""``minitp train``'s parent: what runs around the ranks' loop (``minitp.runs.train_rank``).

- **checks** before any process starts: the settings, the memory the ranks will hold, and ``out``
  (a folder minitp may write; a run there continued or replaced only when asked; the checkpoint to
  resume passes every check a rank's load would make);
- **the lock** on ``out``: a second ``minitp train`` into the same folder is refused;
- **signals**: Ctrl-C, Jupyter's Interrupt and SIGTERM ask the ranks to finish the step, save and
  leave; a second one ends everything at once (``StoppedAtOnce``);
- **restarts**: ``max_restarts`` relaunches a run whose rank died, from its last checkpoint (the
  same as ``torchrun --max-restarts N ... -m minitp.cli train --resume``, which restarts the
  processes itself);
- **the figure**: ``out/loss.png``, drawn from ``out/log.jsonl`` (``minitp.viz.train``);
- **the layout picked for you** (``auto_layout``): the time model's fastest on this machine;
- **the peak** MFU is measured against: one core's matrix-multiply rate.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import replace

import torch

from minitp import checkpoint
from minitp.data import load_corpus
from minitp.runs.common import WARM, check_memory
from minitp.runs.train_log import read_log
from minitp.runs.train_rank import kill_mark, train_worker
from minitp.trainer import Settings, build

OUT_FILES = ("log.jsonl", "loss.png", "checkpoint")  # what a run writes in ``out``: a run is there
LOCK = ".minitp-lock"  # in ``out``: held by the run that writes there


def train(s: Settings, max_restarts: int = 0, timeout: float = 24 * 3600, echo: bool = True,
          keep_shards: bool = False, backend: str = "gloo"):
    """Run ``s`` on ``s.world`` local processes (or in place under torchrun); relaunch up to
    ``max_restarts`` times from the last checkpoint when a rank dies. backend: "gloo" (CPU) or
    "nccl" (one GPU per process; no MFU is shown, as the peak is measured on a CPU core). Returns
    the last launch's ``Results`` (each rank's ``train_worker`` dict)."""
    s.check()
    if max_restarts and not s.out:
        raise ValueError("--max-restarts needs --out DIR: a restart continues from the checkpoint "
                         "saved there")
    check_memory(s.config, s.world, s.batch_size // s.dp, s.seq_len, s.tp)
    corpus = load_corpus(s.corpus, max_files=s.max_files)  # built once here, not by every rank
    with _holding(s.out):
        if s.out:
            _check_out(s)
        return _train(s, corpus, max_restarts, timeout, echo, keep_shards, backend)


def _check_out(s: Settings) -> None:
    """Before any rank starts: ``out`` is a folder minitp may write, a finished run there is
    continued (``resume``) or replaced (``overwrite``) only when asked, and the checkpoint to resume
    passes every check a rank's load would make."""
    folder = os.path.join(s.out, "checkpoint")
    checkpoint.check_save_folder(folder, f"--out {s.out}'s checkpoint/")
    held = [name for name in OUT_FILES if os.path.exists(os.path.join(s.out, name))]
    if held and not (s.resume or s.overwrite):
        raise ValueError(f"--out {s.out} holds a run ({', '.join(held)}): add --resume to continue "
                         f"it, or --overwrite to start again there (its log, figure and checkpoint "
                         f"are replaced)")
    if s.overwrite and not under_torchrun_rank(1):
        for name in held:
            path = os.path.join(s.out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if s.resume and os.path.exists(os.path.join(s.out, "log.jsonl")):
        read_log(os.path.join(s.out, "log.jsonl"))  # a damaged line refused, a torn last one said
    if s.resume and os.path.exists(os.path.join(folder, checkpoint.INDEX)):
        with torch.device("meta"):  # the shapes of the model the ranks will build: no memory
            model = build(s.config, s.seed)
            shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        step = checkpoint.check_before_launch(folder, s.config, shapes)
        if step >= s.steps:
            raise ValueError(f"--out {s.out}'s checkpoint is at step {step}: nothing left to train "
                             f"up to --steps {s.steps}; give more steps to go on")


def under_torchrun_rank(first: int) -> bool:
    """Under torchrun, whether this process is a rank from ``first`` on (one that leaves shared
    files to rank 0)."""
    from minitp.launcher import under_torchrun

    return under_torchrun() and int(os.environ["RANK"]) >= first


@contextlib.contextmanager
def _holding(out: str | None):
    """Hold ``out`` for the run: a second ``minitp train`` into it is refused, not interleaved (its
    saves and clean-ups would remove this run's). An advisory lock (``fcntl.flock``) on
    ``out/.minitp-lock``: the kernel lets it go when the process ends, however it ends. Under
    torchrun every rank runs this function, so only rank 0 holds it."""
    if not out or under_torchrun_rank(1):
        yield
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; expected a folder for the log, figure and "
                         "checkpoint")
    try:
        os.makedirs(out, exist_ok=True)
        handle = open(os.path.join(out, LOCK), "a+")
    except OSError as e:
        raise ValueError(f"--out {out}: cannot make the folder or write in it ({e.strerror})") \
            from None
    try:
        import fcntl

        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            who = handle.read().strip() or "another process"
            raise ValueError(f"--out {out} is in use by another minitp train ({who}): wait for it "
                             f"to end, or give another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # the lock goes with the file


def _train(s: Settings, corpus, max_restarts: int, timeout: float, echo: bool, keep_shards: bool,
           backend: str):
    """``train`` once its checks passed: the launches, a restart after each lost rank, the
    figure."""
    from minitp.launcher import LaunchError, launch, under_torchrun

    peak = _peak_flops() if backend == "gloo" else None
    # the parent's terminal, for the first rank's progress bar (a forked rank inherits the copy;
    # its own stderr goes to a file the launcher relays at the end)
    on_terminal = echo and sys.stderr.isatty() and not under_torchrun()
    fd = os.dup(sys.stderr.fileno()) if on_terminal else None
    if echo and not under_torchrun_rank(1):  # under torchrun, rank 0 speaks for the run
        print(f"minitp train: {s.model} ({s.config.num_params() / 1e6:.2f} M parameters) on "
              f"{s.world} process{'es' * (s.world > 1)} (dp {s.dp}, tp {s.tp}, pp {s.pp}, "
              f"cp {s.cp}, ep {s.ep}, {s.data_parallel}); {corpus.describe()}", flush=True)
    for attempt in range(max_restarts + 1):
        began = time.time()
        try:
            with _signals_ask_the_ranks():
                results = launch(train_worker, None if under_torchrun() else s.world, s, peak, fd,
                                 keep_shards, timeout=timeout, echo=False, backend=backend,
                                 keep_sigterm=True)
            break
        except LaunchError as e:
            if attempt == max_restarts or not s.out or _refused(e):
                raise
            said = str(e).splitlines()[0]
            mark = kill_mark(s) if s.kill_at is not None else None
            planted = mark is not None and os.path.exists(mark) and os.path.getmtime(mark) >= began
            if planted and "SIGKILL" in said:
                said = said.split(" before ")[0]
                said += f" at step {s.kill_at}: the failure --kill-at planted"
            print(f"minitp train: {said}\nminitp train: restart {attempt + 1} of {max_restarts}, "
                  f"from the last checkpoint in {s.out}", file=sys.stderr, flush=True)
            s = replace(s, resume=True, overwrite=False)
    if fd is not None:
        os.close(fd)
    if s.out and (not under_torchrun() or os.environ["RANK"] == "0"):
        _draw(s.out)
    return results


def _draw(out: str) -> None:
    """``out/loss.png`` from ``out/log.jsonl``; a word instead where matplotlib is missing."""
    try:
        from minitp.viz.train import save_loss_figure

        save_loss_figure(read_log(os.path.join(out, "log.jsonl")), os.path.join(out, "loss.png"))
    except ImportError:
        print("minitp train: loss.png not drawn: matplotlib is not installed "
              "(pip install 'minitp[course]')", file=sys.stderr)


def _refused(error) -> bool:
    """Whether a rank refused its input (a ``CheckpointError`` or another ``ValueError``): the same
    refusal would come again after a restart, so none is made."""
    from minitp.launcher import RankError

    kind = error.raised[0] if isinstance(error, RankError) else ""
    return kind in ("ValueError", "minitp.checkpoint.CheckpointError")


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C (or SIGTERM) while the ranks were finishing their step to save: they were
    ended at once, and the last checkpoint saved before stays."""

    def __init__(self, signum: int):
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _signals_ask_the_ranks():
    """In the parent, while the ranks run: Ctrl-C, Jupyter's Interrupt (SIGINT to this process
    alone) and SIGTERM (``timeout``, a batch scheduler) each ask the ranks to finish the step, save
    and leave: the parent passes the signal on to every rank (a terminal's Ctrl-C reached them
    already: asking twice is asking once). A second signal ends everything at once
    (``StoppedAtOnce``)."""
    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return
    import multiprocessing

    got = []

    def on_signal(signum, _frame):
        got.append(signum)
        if len(got) > 1:
            raise StoppedAtOnce(signum)
        again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\nminitp train: stopping at the end of this step and saving a checkpoint ({again} "
              f"again: stop now)", file=sys.stderr, flush=True)
        for child in multiprocessing.active_children():
            if child.name.startswith("minitp-rank") and child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)

    old = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


def _peak_flops() -> float | None:
    """One core's matrix-multiply FLOP/s (one thread, 512³ in fp32): from this machine's
    calibration (``minitp calibrate``) when stored. MFU is the model's FLOPs per second over this,
    times the ranks."""
    from minitp.measure.calibrate import matmul_flops_per_s, read_calibration

    cal, _ = read_calibration()
    if cal:
        return cal.get("flops_per_s_large") or cal["flops_per_s"]
    return matmul_flops_per_s(512, 512, 512, repeats=5)  # none stored: a fraction of a second


def predicted_step_s(s: Settings, device) -> float:
    """The time model's step for these settings' layout (``minitp.cost.step_time``, fp32) on
    ``device``: what ``--layout auto`` ranks, and ``minitp train`` prints beside the measured
    step."""
    from minitp import cost

    return cost.step_time(s.config, s.batch_size, s.seq_len, s.dp, s.tp, s.pp, device,
                          s.microbatches if s.pp > 1 else 1, s.data_parallel, s.zero or 3, "fp32",
                          cp=s.cp, ep=s.ep, virtual_stages=s.virtual_stages,
                          cp_attention=s.cp_attention).step_s


def measured_and_predicted(s: Settings, results) -> str | None:
    """'step: measured X ms (...), predicted Y ms (...)' once the run took more than ``WARM``
    steps and a calibration is stored; else None."""
    from minitp import cost
    from minitp.measure.calibrate import read_calibration

    cal, _ = read_calibration()
    # the slowest rank's step, step by step (each step ends with every rank)
    taken = [max(ranks) for ranks in zip(*(r["seconds"] for r in results))]
    if cal is None or len(taken) <= WARM:
        return None
    measured = statistics.median(taken[WARM:])
    predicted = predicted_step_s(s, cost.device_from_calibration(cal))
    return (f"step: measured {measured * 1e3:.0f} ms (median of {len(taken) - WARM} steps after "
            f"{WARM}), predicted {predicted * 1e3:.0f} ms (minitp.cost.step_time on this machine's "
            f"calibration): {measured / predicted:.2f}x")


# -- --layout auto ---------------------------------------------------------------------------------
def auto_layout(s: Settings, nproc: int) -> tuple[Settings, list[dict]]:
    """The planner's pick for ``nproc`` processes of this machine: every (dp, pp, tp) the model and
    the batch allow (micro-batches: 2·pp with a pipeline), each step timed by the time model
    (``minitp.cost.step_time``, fp32) on this machine's calibration; the fastest wins. Memory
    decides nothing here: the byte models need a few tens of MB per process. Returns (the settings,
    every row)."""
    from minitp import cost
    from minitp.measure.calibrate import read_calibration
    from minitp.plan import candidate_layouts

    cal, why = read_calibration()
    if cal is None:
        raise ValueError(why or "--layout auto times each layout on this machine's calibration, "
                         "and none is stored: run minitp calibrate first (about 10 s), or give "
                         "--dp, --tp and --pp")
    device, rows = cost.device_from_calibration(cal), []
    for dp, pp, tp in candidate_layouts(nproc, nproc):
        option = replace(s, dp=dp, pp=pp, tp=tp, cp=1, microbatches=2 * pp if pp > 1 else 1)
        try:
            option.check()
        except ValueError:
            continue
        step = predicted_step_s(option, device)
        rows.append({"dp": dp, "pp": pp, "tp": tp, "microbatches": option.microbatches,
                     "step_s": step})
    if not rows:
        raise ValueError(f"no layout of {nproc} processes takes the {s.model} model with batch "
                         f"{s.batch_size}")
    rows.sort(key=lambda r: r["step_s"])
    best = rows[0]
    return replace(s, dp=best["dp"], pp=best["pp"], tp=best["tp"], cp=1,
                   microbatches=best["microbatches"]), rows
