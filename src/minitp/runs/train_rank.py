"""One rank of ``minitp train``: the loop around ``minitp.trainer.train_step``.

An atomic checkpoint every ``save_every`` steps, at the end and on Ctrl-C or SIGTERM (the ranks
agree to stop at the end of a step, save, and leave); resume from the checkpoint in ``out`` onto
any layout (the sampler is a pure function of the step, so the resumed run sees the batches the
uninterrupted one would); ``out/log.jsonl`` (``minitp.runs.train_log``); validation every
``eval_every`` steps; a progress bar with loss, tokens/s and MFU of this machine; the planted
failure of tests and chapter 09 (``kill_at``). The parent that launches these ranks is
``minitp.runs.training``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

from minitp import checkpoint
from minitp import trace as _trace
from minitp.data import Sampler, load_corpus
from minitp.measure.operators import operators
from minitp.mesh import Mesh
from minitp.models import ModelConfig
from minitp.parallel3d import Parallel3D
from minitp.runs.train_log import Log
from minitp.trainer import Settings, build, evaluate, lr_at, train_step, world_mean

# in ``out``: the planted failure happened (``kill_at``), and not again after a restart
KILL_MARK = "killed-once"


def train_worker(s: Settings, peak_flops: float | None = None, progress_fd: int | None = None,
                 keep_shards: bool = False) -> dict:
    """One rank of a run: returns its losses and norms per step (and, ``keep_shards``, its
    pieces)."""
    cfg = s.config
    mesh = Mesh(s.dp * s.cp, s.pp, s.tp, cp=s.cp, ep=s.ep)
    par = Parallel3D(build(cfg, s.seed), mesh, s.data_parallel, s.zero, s.microbatches, s.schedule,
                     lr=s.lr, virtual_stages=s.virtual_stages, cp_attention=s.cp_attention)
    corpus = load_corpus(s.corpus, max_files=s.max_files)
    train = Sampler(corpus.train, s.batch_size, s.seq_len, s.seed)
    val = Sampler(corpus.val, s.batch_size, s.seq_len)
    folder = os.path.join(s.out, "checkpoint") if s.out else None
    start = 0
    if s.resume and folder and os.path.exists(os.path.join(folder, checkpoint.INDEX)):
        start = checkpoint.load(par, folder)
    first = mesh.rank == 0
    log = Log(os.path.join(s.out, "log.jsonl") if s.out and first else None, start)
    if first:
        log.write({"event": "start", "step": start, "world": mesh.world_size, "settings": asdict(s),
                   "params": cfg.num_params(), "corpus": corpus.describe()})
    flops_per_step = _flops_per_token(cfg, s.seq_len) * s.batch_size * s.seq_len
    bar = _bar(s, start, progress_fd) if first else None
    stop = _StopOnInterrupt()
    losses, norms, recording, stopping = [], [], _trace.current(), False
    seconds_taken = []  # each step's, but a profiled one's
    try:
        for step in range(start, s.steps):
            if recording is not None:
                recording.clear()  # keep the last step's record only (``--trace-out``)
            last_rank = mesh.rank == mesh.world_size - 1
            if s.kill_at == step and last_rank and not os.path.exists(kill_mark(s)):
                open(kill_mark(s), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # a lost rank, planted: the run must notice
            # --profile: the last step's operators, nested under its spans in the trace
            profiled = s.profile and recording is not None and step == s.steps - 1
            t0 = time.perf_counter()
            with operators(recording) if profiled else nullcontext():
                loss, aux, norm = train_step(par, *train.batch(step), lr_at(step, s), s.clip)
            loss, stopping = world_mean(loss, par.device, stop.asked, aux)
            seconds = time.perf_counter() - t0
            losses.append(loss)
            norms.append(norm)
            if not profiled:
                seconds_taken.append(seconds)
            done = step + 1
            record = {"step": done, "loss": round(loss, 5), "grad_norm": round(norm, 5),
                      "lr": lr_at(step, s), "seconds": round(seconds, 4),
                      "tokens_per_s": round(s.batch_size * s.seq_len / seconds)}
            if profiled:  # its time holds the profiler's
                record["profiled"] = True
            if peak_flops:
                record["mfu"] = round(flops_per_step / seconds / (peak_flops * mesh.world_size), 4)
            if done == s.steps or (s.eval_every and done % s.eval_every == 0):
                with _trace.recording(mesh.rank):  # apart: --trace-out holds the training step
                    record["val_loss"] = round(evaluate(par, val, s.eval_batches), 5)
            if first:
                log.write(record)
                _advance(bar, record)
            saving = s.save_every and done % s.save_every == 0
            if folder and (stopping or done == s.steps or saving):
                checkpoint.save(par, folder, step=done)
            if stopping:
                break
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
    out = {"losses": losses, "norms": norms, "seconds": seconds_taken, "start": start,
           "stopped": stopping,
           "signal": stop.signal, "coords": [mesh.coords.dp, mesh.coords.pp, mesh.coords.tp]}
    if keep_shards:
        out["shards"] = par.local_shards()
    return out


def kill_mark(s: Settings) -> str:
    """The file that says the planted failure (``kill_at``) happened: it happens once."""
    return os.path.join(s.out, KILL_MARK)


def _flops_per_token(cfg: ModelConfig, seq: int) -> float:
    from minitp.cost import training_flops_per_token

    return training_flops_per_token(cfg, seq)


class _StopOnInterrupt:
    """Ctrl-C or SIGTERM asks for a stop: the ranks agree at the end of the step, save and leave.
    ``signal``: the one that asked (the command's exit status says which: 130 or 143)."""

    def __init__(self):
        self.signal: int | None = None
        watched = (signal.SIGINT, signal.SIGTERM) if _main_thread() else ()
        self.old = {signum: signal.signal(signum, self._ask) for signum in watched}

    @property
    def asked(self) -> bool:
        return self.signal is not None

    def _ask(self, signum, _frame):
        self.signal = self.signal or signum

    def restore(self):
        for signum, handler in self.old.items():
            signal.signal(signum, handler)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# -- the progress bar ------------------------------------------------------------------------------
def _bar(s: Settings, start: int, fd: int | None):
    """The first rank's progress bar; under minitp's launcher on the parent's terminal (``fd``)."""
    if fd is None and not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    try:
        stream = os.fdopen(os.dup(fd), "w") if fd is not None else sys.stderr
    except OSError:  # a rank started by spawn does not inherit the parent's terminal: no bar
        return None
    try:
        width = os.get_terminal_size(stream.fileno()).columns or 100
    except OSError:
        width = 100
    return tqdm(total=s.steps, initial=start, file=stream, unit="step", ncols=min(width, 120),
                mininterval=0.5)


def _advance(bar, record: dict) -> None:
    if bar is None:
        return
    shown = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,}"}
    if "mfu" in record:
        shown["mfu"] = f"{record['mfu']:.0%}"
    if "val_loss" in record:
        shown["val"] = f"{record['val_loss']:.3f}"
    bar.set_postfix(shown, refresh=False)
    bar.update(1)


