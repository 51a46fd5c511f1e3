"""``minitp grade FILE``: the final project's grader (``notebooks/project.py`` is the reference,
``student/project.py`` the learner's copy).

The project parallelizes GPT-2 (``minitp.models.gpt2``) on a (dp, pp, tp) mesh with its own code.
The grader runs it for real, on 2 to 8 processes, and prints a scorecard: one line per criterion, a
verdict, and when it fails the mistake named from what the run shows.

* **dp, tp, pp, 3-D** (2×1×1, 1×1×2, 1×2×1 and 2×2×2, as dp×pp×tp): three steps on the same
  batches as one process (``minitp.models.train.train_one_process``, clipping included) give the
  same losses and gradient norms and the same parameters, to ``TOLERANCE``; each parameter has the
  slice's shape the split asks; the replicas stay equal, and so do the tied embedding's two copies;
  the bytes each rank sends through each dimension equal ``expected_bytes``.
* **reshard**: what 2×2×2 saved after its three steps, loaded on 1×1×4, is every parameter and
  AdamW moment bit for bit, and two more steps there still equal one process.
* **restart**: on 2×1×2, saving every 2 steps, a rank killed at step 4 of 5; the run started again
  from its last checkpoint gives the losses of the uninterrupted one.
* **text**: trained on minitp's own source (bytes) on 2×1×1, the weights, put together on one
  process, reach ``TEXT_TARGET`` nats per byte on files the training never saw, within
  ``TEXT_SECONDS`` (``train_on_text`` also writes text with them).

A file that imports minitp's own ``Parallel3D``, trainer or checkpoint is refused before it runs.
The grader's own split (``split_of``, ``slice_shape``, ``unshard``) is written apart from the
project's, so each checks the other. Grading takes under 2 minutes on 2 cores, most of it the text.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from minitp import trace as _trace
from minitp.launcher import LaunchError, RankError, launch
from minitp.layout import AXES, stage_blocks
from minitp.mesh import Mesh
from minitp.models import loss_fn
from minitp.models.gpt2 import GPT2_BYTE, build_gpt2
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches, train_one_process

CFG = GPT2_BYTE
TRAIN = TrainConfig(steps=5, batch_size=8, seq_len=16, lr=3e-3, seed=0)
MAX_NORM = 0.5  # small enough that every step clips
MICROBATCHES = 2
GRADED_STEPS = 3  # of TRAIN.steps: the layouts' runs; reshard and restart go on to the end
TOLERANCE = 1e-5
LAYOUTS = {"dp": (2, 1, 1), "tp": (1, 1, 2), "pp": (1, 2, 1), "3-D": (2, 2, 2)}  # dp, pp, tp
RESHARD = ((2, 2, 2), (1, 1, 4))  # saved on, loaded on
RESTART = (2, 1, 2)
SAVE_EVERY, KILL_AT = 2, 3  # the restart's: a checkpoint at steps 2 and 4, a rank lost in step 4
# real text: GPT-2 on minitp's own source (bytes), warm-up then a cosine, on TEXT_LAYOUT; the
# validation loss of the trained weights on one process must reach TEXT_TARGET within TEXT_SECONDS
TEXT_LAYOUT = (2, 1, 1)
TEXT = {"steps": 300, "batch_size": 16, "seq_len": 128, "lr": 3e-3, "warmup": 30}
TEXT_TARGET = 2.45  # nats per byte (the solved project reaches 2.39 here)
TEXT_SECONDS = 240.0  # on a 2-core laptop
VAL_BATCHES = 8
CRITERIA = (*LAYOUTS, "reshard", "restart", "text")
REQUIRED = ("parallelize", "train_step", "save", "load")
FORBIDDEN = ("minitp.parallel3d", "minitp.trainer", "minitp.checkpoint", "minitp.runs")


class ProjectError(Exception):
    """The file cannot be graded at all (missing, not Python, a function missing, forbidden)."""


# -- the file --------------------------------------------------------------------------------------
def check_file(path: str) -> None:
    """Refuse, before anything runs, a file that is missing, is not Python, lacks one of the four
    functions, or hands the work to minitp's own Parallel3D, trainer or checkpoint."""
    if not os.path.isfile(path):
        raise ProjectError(f"{path}: no such file (expected your project, e.g. student/project.py; "
                           "make student writes it from the template)")
    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
    except SyntaxError as error:
        raise ProjectError(f"{path}, line {error.lineno}: not Python ({error.msg})") from None
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    missing = [name for name in REQUIRED if name not in defined]
    if missing:
        raise ProjectError(f"{path}: expected the functions {', '.join(REQUIRED)}; "
                           f"{', '.join(missing)} missing")
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN):
                raise ProjectError(f"{path}, line {node.lineno}: imports {name}: the project is to "
                                   "write the composition, the step and the checkpoint yourself "
                                   "(minitp's Parallel3D, trainer, checkpoint and runners are "
                                   "refused)")


def load_project(path: str):
    """Import the project file as a module of its own (each rank does)."""
    spec = importlib.util.spec_from_file_location("minitp_project", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the grader's own view of the split ------------------------------------------------------------
def split_of(name: str) -> int | None:
    """The dim tensor parallel splits ``name`` along (None: whole on every tp rank)."""
    if any(part in name for part in ("c_attn.", "c_fc.", "wte.", "lm_head.")):
        return 0
    return 1 if name.endswith("c_proj.weight") else None


def slice_shape(name: str, whole: tuple[int, ...], tp: int) -> tuple[int, ...]:
    dim = split_of(name)
    if dim is None:
        return whole
    return tuple(size // tp if d == dim else size for d, size in enumerate(whole))


def unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from tp ranks' slices; ``c_attn``'s rank r holds [q_r; k_r; v_r]."""
    dim = split_of(name)
    if dim is None:
        return pieces[0]
    if "c_attn." in name:
        thirds = [piece.chunk(3) for piece in pieces]
        return torch.cat([t[i] for i in range(3) for t in thirds])
    return torch.cat(pieces, dim=dim)


def expected_bytes(layout: tuple[int, int, int], stage: int, held: int) -> dict[str, float]:
    """Bytes one rank of stage ``stage`` sends per step through dp, pp and tp, fp32, each
    collective as a ring (2(n-1)/n of its size; ``minitp.trace.collective_sent_bytes``). ``held``:
    the elements of the parameters this rank holds (the tied copy once per stage).

    tp (n ranks; T = B/dp·S tokens of this replica, D the width): per block, the two outputs'
    all-reduces forward and the two inputs' backward, T·D each; the first stage's embedding
    all-reduce forward; the last stage's output layer input backward (T·D) and the cross-entropy's
    three numbers per token forward (3·T). pp: each micro-batch's (b, S, D) activation to the next
    stage and its gradient back to the previous one (T·D over the step), and the tied embedding's
    V/tp·D gradient between the first and the last stage, once each way. dp: the all-reduce of
    every gradient held."""
    dp, pp, tp = layout
    # an fp32 all-reduce of ``size`` elements over n ranks, as the trace counts it
    ring = lambda n, size: _trace.collective_sent_bytes("all_reduce", size * 4, n)
    T, D = TRAIN.batch_size // dp * TRAIN.seq_len, CFG.dim
    first, last = stage == 0, stage == pp - 1
    blocks = len(stage_blocks(CFG.n_layers, pp)[stage])
    tp_bytes = ring(tp, (4 * blocks + first + last) * T * D + last * 3 * T)
    pp_bytes = ((not last) + (not first)) * T * D * 4
    if pp > 1 and (first or last):
        pp_bytes += CFG.vocab_size // tp * D * 4
    return {"dp": ring(dp, held), "pp": pp_bytes, "tp": tp_bytes}


# -- a run of the project on each rank -------------------------------------------------------------
def project_worker(path: str, layout: tuple[int, int, int], steps: range,
                   save_to: str | None = None, save_every: int = 0, load_from: str | None = None,
                   kill_at: int | None = None) -> dict:
    """One rank of a graded run: the project's stage on ``layout``, ``steps`` of the synthetic
    batches (saving, loading, dying where asked). Returns its losses, norms, pieces, AdamW moments,
    and the bytes it sent per step through each dimension."""
    project = load_project(path)
    mesh = Mesh(*layout)
    stage = project.parallelize(build_gpt2(CFG, seed=TRAIN.seed), mesh)
    c = mesh.coords
    problem = shape_problem(dict(stage.named_parameters()), (c.dp, c.pp, c.tp), mesh.tp)
    if problem:  # before any step: a wrong split said as such, not as the numbers it spoils
        raise ProjectError(problem)
    optimizer = make_optimizer(stage.parameters(), TRAIN.lr)
    start = None
    if load_from is not None:
        start = project.load(stage, optimizer, mesh, load_from)
    batches = synthetic_batches(CFG, TRAIN)
    losses, norms = [], []
    recording = _trace.current()
    by_dim: dict[str, float] = {}
    for step in steps:
        if step == kill_at and mesh.rank == mesh.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank, planted
        recording.clear()
        loss, norm = project.train_step(stage, mesh, *batches[step], optimizer, MAX_NORM,
                                        MICROBATCHES)
        for event in recording.comm():
            if event.dim in AXES:
                by_dim[event.dim] = by_dim.get(event.dim, 0.0) + event.sent_bytes / len(steps)
        losses.append(None if loss is None else float(loss))
        norms.append(float(norm))
        if save_every and (step + 1) % save_every == 0 or save_to and step == steps[-1]:
            project.save(stage, optimizer, mesh, save_to, step + 1)
    params = dict(stage.named_parameters())
    held = sum(p.numel() for p in params.values())
    state = {name: {key: optimizer.state[p][key].detach().clone()
                    for key in ("exp_avg", "exp_avg_sq")}
             for name, p in params.items() if p in optimizer.state}
    return {"coords": (c.dp, c.pp, c.tp), "losses": losses, "norms": norms, "start": start,
            "params": {n: p.detach().clone() for n, p in params.items()}, "state": state,
            "bytes": {d: by_dim.get(d, 0.0) for d in AXES}, "held": held}


# -- real text -------------------------------------------------------------------------------------
def _text_worker(path: str, layout: tuple[int, int, int], settings: dict) -> dict:
    from minitp.data import COURSE_CORPUS, Sampler, load_corpus
    from minitp.trainer import Settings, lr_at

    project = load_project(path)
    mesh = Mesh(*layout)
    stage = project.parallelize(build_gpt2(CFG, seed=0), mesh)
    optimizer = make_optimizer(stage.parameters(), settings["lr"])
    schedule = Settings(**settings)  # the learning rate of each step (lr_at), nothing else
    corpus = load_corpus(COURSE_CORPUS)
    train = Sampler(corpus.train, settings["batch_size"], settings["seq_len"], seed=0)
    losses, t0 = [], time.perf_counter()
    for step in range(settings["steps"]):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        loss, _ = project.train_step(stage, mesh, *train.batch(step), optimizer, 1.0, 1)
        losses.append(None if loss is None else float(loss))
    c = mesh.coords
    return {"coords": (c.dp, c.pp, c.tp), "losses": losses, "seconds": time.perf_counter() - t0,
            "params": {n: p.detach().clone() for n, p in stage.named_parameters()}}


@dataclass
class TextRun:
    losses: list[float]  # training, per step (the mean over the replicas)
    val_loss: float  # nats per byte, on files the training never saw
    seconds: float  # the slowest rank's steps
    samples: dict[str, str]  # prompt -> what the trained model writes


def train_on_text(path: str, layout: tuple[int, int, int] = TEXT_LAYOUT,
                  settings: dict | None = None, prompts: tuple[str, ...] = ("def ", "import "),
                  new_tokens: int = 160) -> TextRun:
    """Train the project's GPT-2 on minitp's own source on ``layout``, put the weights together on
    one process (the grader's ``unshard``), measure the validation loss there and write text."""
    from minitp.data import COURSE_CORPUS, Sampler, load_corpus

    settings = {**TEXT, **(settings or {})}
    dp, pp, tp = layout
    results = launch(_text_worker, dp * pp * tp, path, layout, settings, echo=False,
                     timeout=3 * 3600)
    whole, problem = _whole(results, layout)
    if problem:
        raise ProjectError(problem)
    model = build_gpt2(CFG, seed=0)
    model.load_state_dict({**whole, "lm_head.weight": whole["wte.weight"]}, strict=True)
    model.eval()
    val = Sampler(load_corpus(COURSE_CORPUS).val, settings["batch_size"], settings["seq_len"])
    with torch.no_grad():
        val_loss = sum(loss_fn(model(t), y).item()
                       for t, y in (val.batch(i) for i in range(VAL_BATCHES))) / VAL_BATCHES
    losses = [_mean_loss(results, step) for step in range(settings["steps"])]
    window = settings["seq_len"]
    samples = {prompt: _sample(model, prompt, new_tokens, window) for prompt in prompts}
    return TextRun(losses, val_loss, max(r["seconds"] for r in results), samples)


@torch.no_grad()
def _sample(model, prompt: str, new_tokens: int, window: int, temperature: float = 0.8,
            seed: int = 0) -> str:
    """What the model writes after ``prompt``, a byte at a time, each from the last ``window``
    bytes at positions 0.. (what the training showed it: learned positions past its sequence length
    were never trained)."""
    from minitp.data import decode, encode

    tokens, g = encode(prompt)[None], torch.Generator().manual_seed(seed)
    for _ in range(new_tokens):
        last = model(tokens[:, -window:])[:, -1]
        scaled = (last - last.max(-1, keepdim=True).values) / temperature
        tokens = torch.cat([tokens, torch.multinomial(torch.softmax(scaled, -1), 1, generator=g)],
                           dim=1)
    return decode(tokens[0])


def _text(path: str) -> tuple[str | None, str]:
    try:
        run = train_on_text(path)
    except (LaunchError, ProjectError) as error:
        return (_one_line(error) if isinstance(error, LaunchError) else str(error)), ""
    detail = (f"validation {run.val_loss:.2f} ≤ {TEXT_TARGET} nats/byte after {TEXT['steps']} "
              f"steps in {run.seconds:.0f} s ≤ {TEXT_SECONDS:.0f} s")
    if run.val_loss > TEXT_TARGET:
        return (f"validation loss {run.val_loss:.2f} nats/byte after {TEXT['steps']} steps, more "
                f"than {TEXT_TARGET}: the model learns less than one process would"), ""
    if run.seconds > TEXT_SECONDS:
        return (f"{TEXT['steps']} steps took {run.seconds:.0f} s, more than {TEXT_SECONDS:.0f} s "
                f"on 2 cores (validation {run.val_loss:.2f}): a message or a copy too many in "
                f"each step?"), ""
    return None, detail


# -- the one-process reference ---------------------------------------------------------------------
@dataclass
class Reference:
    losses: list[float]
    norms: list[float]
    params: list[dict[str, torch.Tensor]]  # after each step


def reference() -> Reference:
    """GPT-2 on one process, the whole batch, the grader's clipping: ``TRAIN.steps`` steps, and the
    parameters after ``GRADED_STEPS`` of them and after all."""
    params = []
    for steps in (GRADED_STEPS, TRAIN.steps):
        model = build_gpt2(CFG, seed=TRAIN.seed)
        losses, norms = train_one_process(model, synthetic_batches(CFG, TRAIN)[:steps], TRAIN.lr,
                                          loss=loss_fn, clip=MAX_NORM)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return Reference(losses, norms, params)


# -- the scorecard ---------------------------------------------------------------------------------
@dataclass
class Scorecard:
    lines: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def add(self, criterion: str, label: str, problem: str | None, detail: str = "") -> None:
        """One line: ``label`` (what ``criterion`` ran), then the detail, or the problem."""
        if problem is None:
            self.lines.append(f"[ok]   {label}" + (f": {detail}" if detail else ""))
        else:
            self.lines.append(f"[FAIL] {label}: {problem}")
            self.failed.append(criterion)

    @property
    def ok(self) -> bool:
        return not self.failed

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _name(layout) -> str:
    return "×".join(map(str, layout))


def _one_line(error: Exception) -> str:
    if isinstance(error, RankError):
        kind, message = error.raised
        if kind.endswith("ProjectError"):
            return message
        if not kind:
            return f"rank {error.rank} died ({error})".splitlines()[0]
        return f"rank {error.rank} raised {kind.rsplit('.', 1)[-1]}: {message}"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _run(path: str, layout, steps: range, save_to: str | None = None, save_every: int = 0,
         load_from: str | None = None, kill_at: int | None = None):
    dp, pp, tp = layout
    return launch(project_worker, dp * pp * tp, path, layout, steps, save_to, save_every, load_from,
                  kill_at, echo=False, timeout=180)


@functools.cache
def _whole_shapes() -> dict[str, tuple[int, ...]]:
    """{name: shape} of the plain GPT-2 (built once), and the tied copy a last stage holds."""
    shapes = {n: tuple(p.shape) for n, p in build_gpt2(CFG).named_parameters()}
    shapes["lm_head.weight"] = shapes["wte.weight"]  # the tied copy a last stage holds
    return shapes


def shape_problem(params: dict[str, torch.Tensor], coords: tuple[int, int, int],
                  tp: int) -> str | None:
    """The first of a rank's pieces that is not a GPT-2 parameter's tp slice, said (None: none)."""
    whole_shapes = _whole_shapes()
    _, s, t = coords
    for name, tensor in params.items():
        if name not in whole_shapes:
            return (f"{name} (stage {s}, tp rank {t}) is not a parameter of GPT-2: name each "
                    "piece as the plain model does (wte.weight, h.0.attn.c_attn.weight, ...)")
        want = slice_shape(name, whole_shapes[name], tp)
        if tuple(tensor.shape) != want:
            dim = split_of(name)
            how = ("whole on every tp rank" if dim is None
                   else f"split along dim {dim} over the tp ranks")
            return (f"{name} is {tuple(tensor.shape)} on stage {s}, tp rank {t}; expected {want}: "
                    f"{how}")
    return None


def _whole(results, layout) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """The whole parameters from a run's dp-0 ranks, or the first shape problem."""
    _, _, tp = layout
    whole_shapes = _whole_shapes()
    pieces: dict[str, list] = {}
    for r in sorted(results, key=lambda r: r["coords"][2]):
        problem = shape_problem(r["params"], r["coords"], tp)
        if problem:
            return None, problem
        if r["coords"][0] == 0:
            for name, tensor in r["params"].items():
                pieces.setdefault(name, []).append(tensor)
    whole = {name: unshard(name, parts) for name, parts in pieces.items()}
    missing = sorted(set(whole_shapes) - set(whole) - {"lm_head.weight"})
    if missing:
        return None, (f"no rank holds {', '.join(missing[:3])}: every parameter of the model "
                      f"lives on some stage")
    return whole, None


def _mean_loss(results, step: int) -> float:
    """The mean over the replicas of the loss of ``step``, read where the loss is whole: each
    replica's last stage, tp rank 0 (its tp ranks compute the same)."""
    last = max(r["coords"][1] for r in results)
    losses = [r["losses"][step] for r in results if r["coords"][1:] == (last, 0)]
    if any(loss is None for loss in losses):
        raise ProjectError("train_step returned no loss on the last stage: it returns this "
                           "replica's loss there (None elsewhere)")
    return sum(losses) / len(losses)


def _compare(results, layout, ref: Reference, steps: int) -> tuple[str | None, str]:
    """The first problem of a run against one process (None: none), and the detail line."""
    dp, pp, tp = layout
    whole, problem = _whole(results, layout)
    if problem:
        return problem, ""
    # the replicas: each dp rank's pieces equal dp rank 0's
    first = {r["coords"][1:]: r for r in results if r["coords"][0] == 0}
    for r in results:
        twin = first[r["coords"][1:]]
        for name, tensor in r["params"].items():
            if not torch.equal(tensor, twin["params"][name]):
                return (f"the dp replicas differ after {steps} steps ({name} on dp rank "
                        f"{r['coords'][0]}): average the gradients over the dp group (all-reduce, "
                        f"then / dp) before the step"), ""
    if "lm_head.weight" in whole and pp > 1:
        gap = (whole["lm_head.weight"] - whole["wte.weight"]).abs().max().item()
        if gap > 0:
            return (f"the last stage's lm_head.weight differs from the first stage's wte.weight "
                    f"by {gap:.1e} after {steps} steps: the tied embedding's two copies must "
                    f"each get the sum of both stages' gradients"), ""
    losses = [_mean_loss(results, s) for s in range(steps)]
    norms = [results[0]["norms"][s] for s in range(steps)]
    loss_gap = [abs(a - b) for a, b in zip(losses, ref.losses)]
    norm_gap = [abs(a - b) / max(b, 1e-12) for a, b in zip(norms, ref.norms)]
    if loss_gap[0] > TOLERANCE:
        return (f"the loss before any update is {losses[0]:.6f}, one process's "
                f"{ref.losses[0]:.6f}: the forward differs (a split, or where a bias or the "
                f"GELU goes)"), ""
    if norm_gap[0] > TOLERANCE:
        ratio = norms[0] / ref.norms[0]
        if abs(ratio - dp) < 1e-3 and dp > 1:
            why = "the replicas' gradients were summed, not averaged (divide by dp)"
        elif ratio > 1:
            why = ("an element counted more than once: a weight every tp rank holds whole "
                   "(LayerNorm, wpe, a row layer's bias) counts on one tp rank only, a dp "
                   "replica's not at all")
        else:
            why = ("an element left out, or a gradient missing a part (the tied embedding's, "
                   "or a sum over tp)")
        return (f"the gradient norm of step 1 is {norms[0]:.6f}, one process's "
                f"{ref.norms[0]:.6f} ({ratio:.3f}×): {why}"), ""
    worst = max(range(steps), key=lambda s: max(loss_gap[s], norm_gap[s]))
    if max(loss_gap[worst], norm_gap[worst]) > TOLERANCE:
        return (f"step 1 equals one process but step {worst + 1} does not (loss {losses[worst]:.6f}"
                f" vs {ref.losses[worst]:.6f}): the first update made a difference the "
                f"zero-initialized biases hid: a row-parallel layer's bias added on every tp rank "
                f"before the sum counts tp times"), ""
    want = ref.params[0] if steps == GRADED_STEPS else ref.params[1]
    diffs = {n: (whole[n] - want[n]).abs().max().item() for n in want}
    name = max(diffs, key=diffs.get)
    if diffs[name] > TOLERANCE:
        return (f"the losses match but {name} ends {diffs[name]:.1e} from one process's: its "
                f"update differs (clipping scales every gradient it holds?)"), ""
    return None, f"losses, gradient norms, parameters ≤ {TOLERANCE:g} of one process"


def _bytes(results, layout) -> str | None:
    for r in results:
        want = expected_bytes(layout, r["coords"][1], r["held"])
        for dim in AXES:
            got = r["bytes"][dim]
            if not math.isclose(got, want[dim], rel_tol=1e-9, abs_tol=1e-6):
                return (f"rank at dp={r['coords'][0]} pp={r['coords'][1]} tp={r['coords'][2]} "
                        f"sent {got:,.0f} bytes a step through {dim}, the formula "
                        f"{want[dim]:,.0f} (minitp.exercises.grade.expected_bytes); messages go "
                        f"through minitp.comm, each as the formula counts it")
    return None


def grade(path: str, only: tuple[str, ...] | None = None, echo: bool = True) -> Scorecard:
    """Grade the project file ``path`` on ``only`` of ``CRITERIA`` (default: all). Prints each line
    as it is decided when ``echo``."""
    chosen = CRITERIA if only is None else only
    unknown = [c for c in chosen if c not in CRITERIA]
    if unknown:
        raise ValueError(f"unknown criteria {unknown}; expected some of {', '.join(CRITERIA)}")
    card = Scorecard()

    def add(criterion, label, problem, detail=""):
        card.add(criterion, label, problem, detail)
        if echo:
            print(card.lines[-1], flush=True)

    try:
        check_file(path)
    except ProjectError as error:
        add("your own code", "your own code", str(error))
        return card
    add("your own code", "your own code", None, "no Parallel3D, trainer or checkpoint of minitp's")
    ref = reference()
    saved: list | str = "nothing saved"
    with tempfile.TemporaryDirectory(prefix="minitp-grade-") as tmp:
        for criterion, layout in LAYOUTS.items():
            if criterion not in chosen and not (criterion == "3-D" and "reshard" in chosen):
                continue
            label = f"{criterion} ({_name(layout)}, dp×pp×tp)"
            keep = os.path.join(tmp, "saved") if layout == RESHARD[0] else None
            try:
                results = _run(path, layout, range(GRADED_STEPS), keep)
            except LaunchError as error:
                saved = f"nothing saved: the {_name(layout)} run failed: {_one_line(error)}"
                if criterion in chosen:
                    add(criterion, label, _one_line(error))
                continue
            if layout == RESHARD[0]:
                saved = results
            if criterion not in chosen:
                continue
            try:
                problem, detail = _compare(results, layout, ref, GRADED_STEPS)
            except ProjectError as error:
                problem, detail = str(error), ""
            problem = problem or _bytes(results, layout)
            detail = detail and detail + "; bytes per dimension = the formula"
            add(criterion, label, problem, detail)
        if "reshard" in chosen:
            add("reshard", f"reshard (saved on {_name(RESHARD[0])}, loaded on {_name(RESHARD[1])})",
                _reshard(path, tmp, saved, ref), "every parameter and AdamW moment bit for bit, "
                f"then {TRAIN.steps - GRADED_STEPS} more steps ≤ {TOLERANCE:g} of one process")
        if "restart" in chosen:
            add("restart", f"restart (a rank killed in step {KILL_AT + 1} on {_name(RESTART)})",
                _restart(path, tmp, ref), f"from the step-{SAVE_EVERY} checkpoint, the "
                f"uninterrupted curve ≤ {TOLERANCE:g}")
        if "text" in chosen:
            problem, detail = _text(path)
            add("text", f"text (minitp's own source on {_name(TEXT_LAYOUT)})", problem, detail)
    return card


def _reshard(path: str, tmp: str, saved, ref: Reference) -> str | None:
    if isinstance(saved, str):
        return saved  # why nothing was saved
    folder = os.path.join(tmp, "saved")
    try:
        loaded = _run(path, RESHARD[1], range(GRADED_STEPS, GRADED_STEPS), None,
                      load_from=folder)
    except LaunchError as error:
        return (f"the load on {_name(RESHARD[1])} failed ({_one_line(error)}): a checkpoint loads "
                f"on any layout: rebuild each whole tensor from the saved slices, then cut this "
                f"layout's")
    if loaded[0]["start"] != GRADED_STEPS:
        return f"load returned step {loaded[0]['start']!r}; the checkpoint was saved at step 3"
    before, problem = _whole(saved, RESHARD[0])
    after, problem_after = _whole(loaded, RESHARD[1])
    if problem or problem_after:
        return problem or problem_after
    for name in after:  # the plain model's parameters (no tied copy at pp = 1)
        if not torch.equal(before[name], after[name]):
            return (f"{name} after the load is not what was saved (largest difference "
                    f"{(before[name] - after[name]).abs().max().item():.1e})")
    for key in ("exp_avg", "exp_avg_sq"):
        was, _ = _whole(_moments(saved, key), RESHARD[0])
        now, _ = _whole(_moments(loaded, key), RESHARD[1])
        if was is None or now is None or any(not torch.equal(was[n], now[n]) for n in now):
            return (f"AdamW's {key} is not restored bit for bit: save the optimizer's state with "
                    f"the parameters, and load it split as the new layout splits them")
    try:
        go_on = _run(path, RESHARD[1], range(GRADED_STEPS, TRAIN.steps), None, load_from=folder)
    except LaunchError as error:
        return f"the steps after the load failed: {_one_line(error)}"
    losses = [_mean_loss(go_on, i) for i in range(TRAIN.steps - GRADED_STEPS)]
    gaps = [abs(a - b) for a, b in zip(losses, ref.losses[GRADED_STEPS:])]
    if max(gaps) > TOLERANCE:
        return (f"after the load the losses leave one process's by {max(gaps):.1e}: something "
                f"the step needs was not saved or not loaded")
    return None


def _moments(results, key: str) -> list[dict]:
    """A run's AdamW ``key`` as ``_whole`` reads parameters."""
    return [{"coords": r["coords"], "params": {n: state[key] for n, state in r["state"].items()}}
            for r in results]


def _restart(path: str, tmp: str, ref: Reference) -> str | None:
    folder = os.path.join(tmp, "restart")
    try:
        _run(path, RESTART, range(TRAIN.steps), folder, save_every=SAVE_EVERY, kill_at=KILL_AT)
        return f"the rank planted to die in step {KILL_AT + 1} did not stop the run"
    except RankError:
        pass  # the planted loss of a rank
    except LaunchError as error:
        return _one_line(error)
    try:
        resumed = _run(path, RESTART, range(SAVE_EVERY, TRAIN.steps), None, load_from=folder)
    except LaunchError as error:
        return f"the restart from the step-{SAVE_EVERY} checkpoint failed: {_one_line(error)}"
    losses = [_mean_loss(resumed, i) for i in range(TRAIN.steps - SAVE_EVERY)]
    gaps = [abs(a - b) for a, b in zip(losses, ref.losses[SAVE_EVERY:])]
    if resumed[0]["start"] != SAVE_EVERY:
        return f"load returned step {resumed[0]['start']!r}; the last checkpoint was step 2"
    if max(gaps) > TOLERANCE:
        return (f"the restarted run's losses leave the uninterrupted curve by {max(gaps):.1e}")
    return None


def main(path: str, only: tuple[str, ...] | None = None) -> int:
    """Grade ``path``, print the scorecard and a last line; 0 when every criterion is met."""
    card = grade(path, only)
    total = len(card.lines)
    print(f"{total - len(card.failed)} of {total} criteria met" +
          ("" if card.ok else f"; failed: {', '.join(card.failed)}"))
    return 0 if card.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
