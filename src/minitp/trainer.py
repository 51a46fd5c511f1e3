"""What a training step is, on any layout: the step ``minitp train`` runs on each rank.

The pieces are the course's: the corpus and its sampler (``minitp.data``: bytes of the Python
standard library's own source, no download), the model (``minitp.models``), the layout
(``Parallel3D`` on a ``Mesh``), the checkpoint (``minitp.checkpoint``: sharded, loads into any
other layout). What this module adds is what a real run needs around a step, read top to bottom:

- **the settings** of a run (``Settings``), refused before any process starts when they cannot run;
- **the learning rate**: linear warm-up, then a cosine down to ``min_lr_ratio`` of the peak
  (``lr_at``);
- **gradient clipping by the global norm** across every shard (``clip_grad_norm_``): each element
  of the model counted once, wherever it lives (``counts_in_norm``), then one all-reduce over the
  whole world;
- **the step** (``train_step``) and **validation** (``evaluate``) on files the training never sees;
- **the run on each rank** (``train_worker``): an atomic checkpoint every ``save_every`` steps, at
  the end and on Ctrl-C (the ranks agree to stop at the end of a step, save, and leave); resume
  from the checkpoint in ``out`` onto any layout (the sampler is a pure function of the step, so
  the resumed run sees the batches the uninterrupted one would); ``out/log.jsonl``, one JSON
  object per step, per validation and per start (``read_log`` reads it back); a progress bar with
  loss, tokens/s and MFU of this machine;
- **the same run on one process** (``reference``): what every layout is checked against.

The parent's work lives in the runners' wing: ``minitp.runs.training.train`` checks, holds ``out``,
launches the ranks, passes signals on, restarts a run whose rank died and draws ``out/loss.png``
(``minitp.viz.train``); ``minitp.runs.sampling`` writes text with a trained checkpoint.

Every rank computes the whole global batch's sampling (cheap) and ``Parallel3D`` keeps its share,
so the run equals one process on the same batches (``reference``), clipping and schedule included.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from minitp import checkpoint, comm
from minitp import trace as _trace
from minitp.data import Sampler, check_seq_len, load_corpus
from minitp.grid import ParallelDims
from minitp.layout import DIMS
from minitp.mesh import Mesh
from minitp.models import ModelConfig, Transformer, build_model, loss_fn
from minitp.models.moe import MoEConfig, aux_loss, build_moe_model, moe_config, moe_loss
from minitp.models.train import make_optimizer
from minitp.parallel3d import Parallel3D

# byte-level models sized for a laptop run (vocabulary: the 256 byte values)
BYTE = ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384,
                   max_seq_len=256)
PRESETS = {
    "byte": BYTE,  # 0.85 M parameters
    "byte-4m": BYTE.with_(dim=256, n_layers=6, ffn_hidden=704),  # 4.6 M
    # for --ep
    "byte-moe": moe_config(BYTE, n_experts=4, top_k=2, expert_hidden=192, capacity_factor=None),
}
# in ``out``: the planted failure happened (``kill_at``), and not again after a restart
KILL_MARK = "killed-once"


@dataclass(frozen=True)
class Settings:
    model: str = "byte"
    dp: int = 1  # data-parallel replicas (each of cp ranks under context parallel)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cp_attention: str = "ring"  # with cp > 1: "ring", "ulysses" or "allgather" (minitp.cp.Context)
    data_parallel: str = "ddp"  # or "fsdp"
    zero: int | None = None
    schedule: str = "1f1b"
    microbatches: int = 1
    steps: int = 300
    batch_size: int = 16  # global, in sequences
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    clip: float = 1.0  # the largest global gradient norm; 0: no clipping
    eval_every: int = 100
    eval_batches: int = 2
    save_every: int = 100  # and at the end; 0: only at the end
    out: str | None = None  # log.jsonl, loss.png and checkpoint/; None: nothing written
    resume: bool = False  # from out/checkpoint when it holds one
    overwrite: bool = False  # start again in an ``out`` that holds a run (its files go)
    seed: int = 0
    corpus: str | None = None  # .py files: a folder or a .tar.gz (data.COURSE_CORPUS); None: stdlib
    max_files: int | None = None  # the first N files of the corpus only (tests)
    kill_at: int | None = None  # tests and chapter 09: the last rank dies at this step, once

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def config(self) -> ModelConfig:
        return PRESETS[self.model]

    @property
    def virtual_stages(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def dims(self) -> ParallelDims:
        """The dimensions and what composes with what, checked as it is made."""
        return ParallelDims(self.dp, self.pp, self.tp, self.cp, self.ep, self.data_parallel,
                            self.zero, self.schedule, self.virtual_stages, self.cp_attention)

    def check(self) -> None:
        """Refuse what cannot run, with one sentence, before any process starts."""
        if self.model not in PRESETS:
            raise ValueError(f"unknown model {self.model!r}; expected one of {', '.join(PRESETS)}")
        for name in (*DIMS, "steps", "batch_size", "seq_len", "microbatches", "eval_batches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        check_seq_len(self.seq_len, self.config.max_seq_len)
        if self.batch_size % (self.dp * self.microbatches):
            raise ValueError(f"batch_size={self.batch_size} must divide by dp·microbatches = "
                             f"{self.dp}·{self.microbatches}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup} must be from 0 to steps-1 = {self.steps - 1}")
        if self.clip < 0 or not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"expected clip >= 0, lr > 0 and 0 <= min_lr_ratio <= 1; got "
                             f"clip={self.clip}, lr={self.lr}, min_lr_ratio={self.min_lr_ratio}")
        if self.corpus is not None and not (
                os.path.isdir(self.corpus)
                or self.corpus.endswith((".tar.gz", ".tgz")) and os.path.isfile(self.corpus)):
            raise ValueError(f"corpus {self.corpus!r}: expected a folder of .py files or a .tar.gz "
                             "of them")
        if (self.resume or self.kill_at is not None or self.overwrite) and not self.out:
            raise ValueError("--resume, --overwrite and --kill-at need --out DIR (where the "
                             "checkpoint is)")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out, --overwrite starts it again: "
                             "give one")
        if self.zero is not None and self.data_parallel != "fsdp":
            raise ValueError(f"--zero {self.zero} sets FSDP's stage: add --fsdp (without it the "
                             "replicas are DDP's, which keep everything whole)")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be from 0 to 2**63 - 1 (a torch generator's seed), "
                             f"got {self.seed}")
        if not self.lr <= 10:  # AdamW's step is about lr per element: past 10 every weight is noise
            raise ValueError(f"lr={self.lr:g} is far above any learning rate that trains (AdamW "
                             f"moves each weight by about lr a step); expected at most 10")
        self.dims.check_model(self.config, seq_len=self.seq_len)


def lr_at(step: int, s: Settings) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from ``lr`` down to ``min_lr_ratio``·lr
    at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - 1 - s.warmup)
    cosine = 1 + math.cos(math.pi * min(1.0, progress))  # 2 → 0
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * cosine)


# -- the global gradient norm ----------------------------------------------------------------------
def counts_in_norm(par: Parallel3D, name: str) -> bool:
    """Whether this rank's gradient of parameter ``name`` counts in the global norm, so that over
    the world each element of the model is counted once (Megatron's
    ``param_is_not_tensor_parallel_duplicate``, with the replicas added): pipeline stages and tp
    slices hold different elements (all count), a replicated (norm) weight is the same on every tp
    rank (the first counts), FSDP shards are disjoint (all count), DDP replicas hold the same
    gradients after the average (the first replica counts; under context parallel the dp axis's
    dp·cp ranks), and under expert parallel the first ep ranks of the dp axis hold every expert
    between them (as a checkpoint writes them)."""
    coords = par.mesh.coords
    if par.split_dims[name] is None and coords.tp != 0:
        return False  # replicated over tp: tp rank 0 counts it
    if par.fsdp is not None:
        return True  # a shard of its own
    return coords.dp == 0 or (coords.dp < par.mesh.ep and ".experts." in name)


def owned_gradients(par: Parallel3D) -> list[torch.Tensor]:
    """The gradient elements this rank counts in the global norm (``counts_in_norm``)."""
    if par.fsdp is not None:
        return [g for name, g in par.fsdp.gradient_pieces() if counts_in_norm(par, name)]
    return [p.grad for name, p in par.module.named_parameters()
            if p.grad is not None and counts_in_norm(par, name)]


def all_gradients(par: Parallel3D) -> list[torch.Tensor]:
    """Every gradient the optimizer will read on this rank: what clipping scales."""
    if par.fsdp is not None:
        return [g for _, g in par.fsdp.gradient_pieces()]
    return [p.grad for p in par.module.parameters() if p.grad is not None]


@torch.no_grad()
def clip_grad_norm_(par: Parallel3D, max_norm: float) -> float:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), ``norm`` the whole model's gradient
    norm (the 2-norm of every element, once): as ``torch.nn.utils.clip_grad_norm_`` on one process.
    One all-reduce of a number over the world. Returns the norm before clipping."""
    squares = torch.zeros((), dtype=torch.float32, device=par.device)
    for g in owned_gradients(par):
        squares += g.float().pow(2).sum()
    # stages, slices, shards: disjoint pieces of one sum
    comm.all_reduce(squares, label="clip/norm")
    norm = squares.sqrt().item()
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        for g in all_gradients(par):
            g.mul_(coef)
    return norm


# -- the step --------------------------------------------------------------------------------------
def train_step(par: Parallel3D, tokens: torch.Tensor, targets: torch.Tensor, lr: float,
               clip: float) -> tuple[float | None, float, float]:
    """One optimizer step on the global batch: forward and backward (gradients averaged over the
    replicas), clip by the global norm, step at ``lr``. Returns (this replica's loss or None off the
    last stage, what this rank's stage adds to that loss, the norm before clipping). The loss is one
    process's: a MoE's is the cross-entropy plus coef · aux, which one stage computes whole, but
    under a pipeline each stage holds its own layers' part of aux (``Parallel3D.aux_per_step``): the
    second value, added up over the stages by ``_world_mean`` (0 without a MoE under a pipeline)."""
    par.optimizer.zero_grad(set_to_none=True)
    loss = par.forward_backward(tokens, targets)
    norm = clip_grad_norm_(par, clip)
    for group in par.optimizer.param_groups:
        group["lr"] = lr
    with _trace.span("optimizer"):
        par.optimizer.step()
    return loss, par.aux_loss_coef * par.aux_per_step, norm


def evaluate(par: Parallel3D, sampler: Sampler, batches: int) -> float:
    """The mean cross-entropy over ``batches`` validation batches, in nats per byte: how well the
    model predicts files it never trained on. A MoE's auxiliary (load-balancing) loss, which the
    training loss holds, is left out on every layout: it is a term of the objective, not of the
    prediction, and without it a MoE's validation compares with a dense model's. Each batch runs
    the step's own forward and backward (the layout's only path through a pipeline); the gradients
    are thrown away."""
    total = 0.0
    for i in range(batches):
        loss = par.forward_backward(*sampler.batch(i))
        par.optimizer.zero_grad(set_to_none=True)
        if loss is not None and par.pipeline is None:  # one stage: its loss also holds coef · aux
            loss -= par.aux_loss_coef * float(aux_loss(par.module))  # its layers' (0 without a MoE)
        total += _world_mean(loss, par.device)[0]  # a pipeline's loss: the cross-entropy only
    return total / batches


def _world_mean(loss: float | None, device, stop: bool = False,
                aux: float = 0.0) -> tuple[float, bool]:
    """The mean over the replicas of a loss only the last stage knows, and whether any rank asked to
    stop. ``aux``: what this rank's pipeline stage adds to its replica's loss (``train_step``). Each
    replica's last stage holds one loss and each of its stages adds its part, so the sum of every
    rank's ``aux`` over the number of losses is the mean over the replicas of their sums over the
    stages."""
    t = torch.tensor([loss or 0.0, loss is not None, stop, aux], dtype=torch.float64, device=device)
    dist.all_reduce(t)  # bookkeeping, not a message of the strategy: left out of the trace
    return ((t[0] + t[3]) / t[1]).item(), bool(t[2] > 0)


# -- the run on each rank --------------------------------------------------------------------------
def build(cfg: ModelConfig, seed: int) -> Transformer:
    """The plain model of ``cfg`` (dense or a MoE), the same on every rank for one ``seed``."""
    if isinstance(cfg, MoEConfig):
        return build_moe_model(cfg, seed=seed)
    return build_model(cfg, seed=seed)


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
    log = _Log(s, start, first)
    if first:
        log.write({"event": "start", "step": start, "world": mesh.world_size, "settings": asdict(s),
                   "params": cfg.num_params(), "corpus": corpus.describe()})
    flops_per_step = _flops_per_token(cfg, s.seq_len) * s.batch_size * s.seq_len
    bar = _bar(s, start, progress_fd) if first else None
    stop = _StopOnInterrupt()
    losses, norms, recording, stopping = [], [], _trace.current(), False
    try:
        for step in range(start, s.steps):
            if recording is not None:
                recording.clear()  # keep the last step's record only (``--trace-out``)
            last_rank = mesh.rank == mesh.world_size - 1
            if s.kill_at == step and last_rank and not os.path.exists(kill_mark(s)):
                open(kill_mark(s), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # a lost rank, planted: the run must notice
            t0 = time.perf_counter()
            loss, aux, norm = train_step(par, *train.batch(step), lr_at(step, s), s.clip)
            loss, stopping = _world_mean(loss, par.device, stop.asked, aux)
            seconds = time.perf_counter() - t0
            losses.append(loss)
            norms.append(norm)
            done = step + 1
            record = {"step": done, "loss": round(loss, 5), "grad_norm": round(norm, 5),
                      "lr": lr_at(step, s), "seconds": round(seconds, 4),
                      "tokens_per_s": round(s.batch_size * s.seq_len / seconds)}
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
    out = {"losses": losses, "norms": norms, "start": start, "stopped": stopping,
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


# -- the log: out/log.jsonl ------------------------------------------------------------------------
class _Log:
    """``out/log.jsonl``, written by the first rank, one record a line, each appended whole and
    flushed: a crash (a kill, a full disk) can tear only the last line, which ``read_log`` drops. A
    resumed run first drops the records of the steps after its checkpoint (a crashed run got
    further than it saved): they are run again. That rewrite goes to a temporary file renamed over
    the log, so a crash during it leaves the old log or the new one."""

    def __init__(self, s: Settings, start: int, first: bool):
        self.path = os.path.join(s.out, "log.jsonl") if s.out and first else None
        if self.path and os.path.exists(self.path):
            kept = []
            if start:
                kept = [record for record in read_log(self.path) if record.get("step", 0) <= start]
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(record) + "\n" for record in kept)
            os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")  # one write of a whole line


def read_log(path: str) -> list[dict]:
    """The records of a ``log.jsonl``. A last line cut short (the run was killed, or the disk was
    full, while writing it) is dropped, and said once; a damaged line before the last is refused,
    naming it."""
    with open(path, errors="replace") as f:
        lines = [line for line in f if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}, is not a JSON record: the log was "
                                 f"edited or damaged (only its last line can be torn by a crash)") \
                    from None
            print(f"minitp: {path}: its last line was cut short (a crash, or a full disk): dropped",
                  file=sys.stderr)
    return records


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


# -- the same run on one process: what every layout is checked against -----------------------------
def reference(s: Settings,
              steps: int | None = None) -> tuple[list[float], list[float], Transformer]:
    """The first ``steps`` steps of ``s`` on one process with the whole batch: the same model,
    batches, schedule and clipping (``torch.nn.utils.clip_grad_norm_``). Returns (losses, norms,
    model)."""
    cfg = s.config
    model = build(cfg, s.seed)
    loss = moe_loss(model) if isinstance(cfg, MoEConfig) else loss_fn
    optimizer = make_optimizer(model.parameters(), s.lr)
    corpus = load_corpus(s.corpus, max_files=s.max_files)
    train = Sampler(corpus.train, s.batch_size, s.seq_len, s.seed)
    max_norm = s.clip if s.clip > 0 else math.inf  # inf: the norm, measured, and nothing scaled
    losses, norms = [], []
    for step in range(steps or s.steps):
        optimizer.zero_grad(set_to_none=True)
        tokens, targets = train.batch(step)
        value = loss(model(tokens), targets)
        value.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s)
        optimizer.step()
        losses.append(value.item())
    return losses, norms, model
