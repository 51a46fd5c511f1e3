"""The final project: GPT-2 trained on a (dp, pp, tp) mesh by your own code.

minitp's second model family (``minitp.models.gpt2``) has never been parallelized: no helper of
minitp knows it. Here you split it yourself, write its training step, save it sharded and load it
onto another layout. ``minitp grade student/project.py`` runs your file on 2 to 8 processes (four
layouts, a load onto another, a restart after a planted kill, a run on real text) and prints a
scorecard, one line per criterion, naming the mistake when one fails. Chapter 13 teaches what is
new.

What the grader calls, the same on every rank, whatever the layout::

    stage = parallelize(model, mesh)       # this rank's pieces of the plain GPT-2
    optimizer = make_optimizer(stage.parameters(), lr)   # the grader's AdamW
    loss, norm = train_step(stage, mesh, tokens, targets, optimizer, max_norm, microbatches)
    save(stage, optimizer, mesh, folder, step)           # every rank calls it
    step = load(stage, optimizer, mesh, folder)          # on any layout, a fresh stage

What the grader expects (and checks):

* **Names**: ``stage.named_parameters()`` uses the plain model's names (``wte.weight``,
  ``h.3.attn.c_attn.bias``, ``ln_f.weight``...) for the parameters this rank holds, each its tp
  slice. Column-parallel (``c_attn``, ``c_fc``): rank r keeps rows r of tp of its weight and bias;
  ``c_attn`` stacks q, k and v, so rank r keeps its heads of each of the three, [q_r; k_r; v_r].
  Row-parallel (``c_proj``): columns r of tp, the bias whole. The embedding ``wte``: rows (tokens)
  r of tp. Everything else (LayerNorms, ``wpe``) whole on every tp rank.
* **Stages**: stage s holds blocks ``minitp.layout.stage_blocks(n_layers, pp)[s]``; the first also
  ``wte`` and ``wpe``, the last ``ln_f`` and the output layer, which is ``wte`` itself (tied): with
  pp > 1 the last stage holds a copy of its slice named ``lm_head.weight``, and the two copies must
  stay equal: each gets the sum of both stages' gradients.
* **Messages** go through ``minitp.comm`` (the grader counts their bytes per dimension and compares
  them with the formula in ``minitp.exercises.grade.expected_bytes``).
* **The step**: the global batch (B, S) is the same on every rank; dp rank d takes rows d of dp,
  cut into ``microbatches`` micro-batches through the pipeline; the loss is the mean cross-entropy
  (``minitp.tp.vocab_parallel_cross_entropy`` computes it from logits split over the vocabulary).
  Gradients averaged over dp, clipped by the global norm (as ``torch.nn.utils.clip_grad_norm_``
  on one process: each element counted once), then ``optimizer.step()``. Returns this replica's
  loss (None off the last stage) and the norm before clipping.
* **The checkpoint**: ``save`` writes what is needed to go on (parameters, AdamW's state, the
  step) so that ``load`` on any other layout continues bit for bit.

Yours to use: ``minitp.comm``, ``minitp.regions`` (Megatron's f and g), ``minitp.layout``,
``minitp.mesh``, ``minitp.pp`` (the pipeline runtime; or your chapter-05 one),
``minitp.tp.vocab_parallel_cross_entropy``. Not: ``Parallel3D``, ``minitp.trainer``,
``minitp.checkpoint`` (the grader refuses a file that imports them).
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from minitp import comm, regions
from minitp.layout import stage_blocks
from minitp.mesh import Mesh
from minitp.models.gpt2 import GPT2, gelu
from minitp.models.llama import causal_attention
from minitp.pp import Pipeline, StageSpec
from minitp.tp import vocab_parallel_cross_entropy


# -- 1. tensor parallel: which parameter splits how ------------------------------------------------
def shard(name: str, whole: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s slice of parameter ``name`` (a copy)."""
    ### BEGIN SOLUTION
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        # q, k, v stacked along the rows: this rank's heads of each
        return torch.cat([part.chunk(tp)[rank] for part in whole.chunk(3)]).clone()
    if name in ("wte.weight", "lm_head.weight") or name.endswith("mlp.c_fc.weight") or \
            name.endswith("mlp.c_fc.bias"):
        return whole.chunk(tp)[rank].clone()  # column-parallel, and the vocabulary's rows
    if name.endswith("c_proj.weight"):
        return whole.chunk(tp, dim=1)[rank].clone()  # row-parallel: the input columns
    return whole.clone()  # LayerNorms, wpe, a row-parallel layer's bias: whole on every rank
    ### END SOLUTION


def _linear(linear: nn.Linear, prefix: str, tp: int, rank: int) -> nn.Linear:
    """A new ``nn.Linear`` holding this rank's slice of ``linear`` (its name is ``prefix``)."""
    weight = shard(prefix + ".weight", linear.weight.detach(), tp, rank)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
    out.weight = nn.Parameter(weight)
    if linear.bias is not None:
        out.bias = nn.Parameter(shard(prefix + ".bias", linear.bias.detach(), tp, rank))
    return out


class Attention(nn.Module):
    """Causal multi-head attention, this rank's heads: c_attn column-parallel, c_proj
    row-parallel."""

    def __init__(self, attn: nn.Module, prefix: str, mesh: Mesh):
        super().__init__()
        self.group, self.head_dim = mesh.tp_group, attn.head_dim
        self.c_attn = _linear(attn.c_attn, prefix + ".c_attn", mesh.tp, mesh.coords.tp)
        self.c_proj = _linear(attn.c_proj, prefix + ".c_proj", mesh.tp, mesh.coords.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        B, S, _ = x.shape
        x = regions.copy_to_parallel(x, self.group)  # f: backward sums the input's gradient
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # (B, S, 3D/tp) -> three (B, S, D/tp)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, S, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = causal_attention(q, k, v).transpose(1, 2).reshape(B, S, heads * self.head_dim)
        partial = F.linear(out, self.c_proj.weight)  # this rank's part of the sum
        # g: the sum over tp, then the bias, once
        return regions.reduce_from_parallel(partial, self.group) + self.c_proj.bias
        ### END SOLUTION


class MLP(nn.Module):
    """c_fc column-parallel, GELU on this rank's 4D/tp features, c_proj row-parallel."""

    def __init__(self, mlp: nn.Module, prefix: str, mesh: Mesh):
        super().__init__()
        self.group = mesh.tp_group
        self.c_fc = _linear(mlp.c_fc, prefix + ".c_fc", mesh.tp, mesh.coords.tp)
        self.c_proj = _linear(mlp.c_proj, prefix + ".c_proj", mesh.tp, mesh.coords.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        x = regions.copy_to_parallel(x, self.group)
        partial = F.linear(gelu(self.c_fc(x)), self.c_proj.weight)  # GELU before the sum
        return regions.reduce_from_parallel(partial, self.group) + self.c_proj.bias
        ### END SOLUTION


class Block(nn.Module):
    def __init__(self, block: nn.Module, prefix: str, mesh: Mesh):
        super().__init__()
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2  # whole on every tp rank
        self.attn = Attention(block.attn, prefix + ".attn", mesh)
        self.mlp = MLP(block.mlp, prefix + ".mlp", mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# -- 2. the pipeline stage -------------------------------------------------------------------------
class Stage(nn.Module):
    """This rank's pieces: its blocks (tp-split), the embeddings on the first stage, the final norm
    and the tied output layer on the last. (b, S) tokens or (b, S, D) -> (b, S, D), or the logits
    (b, S, V/tp) on the last stage."""

    def __init__(self, model: GPT2, mesh: Mesh):
        super().__init__()
        cfg, tp, rank = model.config, mesh.tp, mesh.coords.tp
        self.mesh, self.config = mesh, cfg
        self.first, self.last = mesh.coords.pp == 0, mesh.coords.pp == mesh.pp - 1
        self.vocab_start = rank * cfg.vocab_size // tp
        blocks = stage_blocks(cfg.n_layers, mesh.pp)[mesh.coords.pp]
        self.h = nn.ModuleDict({str(i): Block(model.h[i], f"h.{i}", mesh) for i in blocks})
        # the first stage: wte (this rank's vocabulary rows) and wpe; the last: ln_f and lm_head,
        # tied: the same Parameter as wte on a single stage, a copy named lm_head.weight otherwise
        ### BEGIN SOLUTION
        if self.first:
            self.wte = nn.Embedding(cfg.vocab_size // tp, cfg.dim)
            self.wte.weight = nn.Parameter(shard("wte.weight", model.wte.weight.detach(), tp, rank))
            self.wpe = model.wpe
        if self.last:
            self.ln_f = model.ln_f
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size // tp, bias=False)
            # the tied output layer: the same parameter on one stage, a copy on another
            self.lm_head.weight = self.wte.weight if self.first else nn.Parameter(
                shard("lm_head.weight", model.wte.weight.detach(), tp, rank))
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # first stage: this rank's tokens looked up (zeros for the others), summed over tp, + wpe;
        # then the blocks; last stage: ln_f, f (copy_to_parallel), the logits (b, S, V/tp)
        ### BEGIN SOLUTION
        group = self.mesh.tp_group
        if self.first:  # x: (b, S) tokens
            local = x - self.vocab_start
            mine = (local >= 0) & (local < self.wte.weight.shape[0])
            h = self.wte(local.clamp(0, self.wte.weight.shape[0] - 1))
            h = regions.reduce_from_parallel(h.masked_fill(~mine.unsqueeze(-1), 0.0), group)
            x = h + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h.values():
            x = block(x)
        if self.last:
            x = regions.copy_to_parallel(self.ln_f(x), group)
            x = self.lm_head(x)  # (b, S, V/tp)
        return x
        ### END SOLUTION

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.mesh.tp_group)


def parallelize(model: GPT2, mesh: Mesh) -> Stage:
    """This rank's stage of the plain ``model``, split over tp."""
    return Stage(model, mesh)


# -- 3. the step -----------------------------------------------------------------------------------
def replicated_over_tp(name: str) -> bool:
    """Whether every tp rank holds parameter ``name`` whole."""
    ### BEGIN SOLUTION
    split = ("c_attn.", "c_fc.", "c_proj.weight", "wte.", "lm_head.")
    return not any(part in name for part in split)
    ### END SOLUTION


def counts_in_norm(stage: Stage, name: str) -> bool:
    """Whether this rank's gradient of ``name`` counts in the global norm: each element once."""
    ### BEGIN SOLUTION
    coords = stage.mesh.coords
    if coords.dp != 0 or (replicated_over_tp(name) and coords.tp != 0):
        return False  # a dp replica, or a copy another tp rank holds too
    return name != "lm_head.weight"  # the tied copy: the first stage's wte counts
    ### END SOLUTION


def train_step(stage: Stage, mesh: Mesh, tokens: torch.Tensor, targets: torch.Tensor,
               optimizer: torch.optim.Optimizer, max_norm: float,
               microbatches: int) -> tuple[float | None, float]:
    """One optimizer step on the global batch: (this replica's loss or None, the norm before
    clipping)."""
    # this replica's rows; the pipeline over micro-batches; the tied gradient between the first and
    # the last stage; the mean over dp; the global norm, clipping; the optimizer's step
    ### BEGIN SOLUTION
    optimizer.zero_grad(set_to_none=True)
    tokens = tokens.chunk(mesh.dp)[mesh.coords.dp]  # this replica's rows: (B/dp, S)
    targets = targets.chunk(mesh.dp)[mesh.coords.dp]
    cfg = stage.config
    spec = StageSpec(mesh.coords.pp, mesh.pp, stage, stage, cfg.dim, torch.float32,
                     torch.device("cpu"))
    pipe = Pipeline(spec, mesh.pp_group, "1f1b", microbatches, loss=stage.loss)
    loss = pipe.forward_backward(tokens, targets).loss
    params = dict(stage.named_parameters())
    # the tied embedding: the first and the last stage each add the other's gradient
    if mesh.pp > 1 and (stage.first or stage.last):
        mine = params["wte.weight" if stage.first else "lm_head.weight"].grad
        peer = mesh.group_ranks["pp"][-1 if stage.first else 0]
        theirs = torch.empty_like(mine)
        sent = comm.isend(mine.clone(), peer, mesh.pp_group, label="pp/tied")
        comm.recv(theirs, peer, mesh.pp_group, label="pp/tied")
        sent.wait()
        mine += theirs
    # data parallel: the mean over the replicas
    for p in params.values():
        comm.all_reduce(p.grad, mesh.dp_group, label="dp/grad")
        p.grad /= mesh.dp
    # the global norm: each element once, summed over the whole world
    squares = sum(p.grad.pow(2).sum() for name, p in params.items()
                  if counts_in_norm(stage, name)) + torch.zeros(())
    comm.all_reduce(squares, label="clip/norm")
    norm = squares.sqrt().item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    for p in params.values():
        p.grad.mul_(coef)
    optimizer.step()
    return loss, norm
    ### END SOLUTION


# -- 4. the checkpoint -----------------------------------------------------------------------------
def save(stage: Stage, optimizer: torch.optim.Optimizer, mesh: Mesh, folder: str,
         step: int) -> None:
    """Write this rank's pieces to ``folder`` so that ``load`` can continue on any layout."""
    # dp rank 0 of each (stage, tp rank): its pieces with AdamW's moments and step, one file; then,
    # once every file is on disk, an index naming them and the step
    ### BEGIN SOLUTION
    os.makedirs(folder, exist_ok=True)
    c = mesh.coords
    if c.dp == 0:  # the replicas hold the same: one writes
        pieces = {}
        for name, p in stage.named_parameters():
            if name == "lm_head.weight":
                continue  # the tied copy: wte holds it
            state = optimizer.state[p]
            pieces[name] = {"param": p.detach().clone(), "exp_avg": state["exp_avg"].clone(),
                            "exp_avg_sq": state["exp_avg_sq"].clone(),
                            "step": state["step"].clone()}
        path = os.path.join(folder, f"pp{c.pp}-tp{c.tp}.pt")
        torch.save({"tp": mesh.tp, "tp_rank": c.tp, "pieces": pieces}, path + ".tmp")
        os.replace(path + ".tmp", path)
    comm.barrier()  # every piece on disk before the index says the checkpoint is whole
    if mesh.rank == 0:
        files = [f"pp{s}-tp{t}.pt" for s in range(mesh.pp) for t in range(mesh.tp)]
        with open(os.path.join(folder, "index.json.tmp"), "w") as f:
            json.dump({"step": step, "files": files}, f)
        os.replace(os.path.join(folder, "index.json.tmp"), os.path.join(folder, "index.json"))
    comm.barrier()
    ### END SOLUTION


def unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor of ``name`` from its tp slices, in tp-rank order (``shard``'s inverse)."""
    ### BEGIN SOLUTION
    tp = len(pieces)
    if name.endswith("c_attn.weight") or name.endswith("c_attn.bias"):
        parts = [piece.chunk(3) for piece in pieces]  # each rank's [q_r; k_r; v_r]
        return torch.cat([torch.cat([parts[r][i] for r in range(tp)]) for i in range(3)])
    if replicated_over_tp(name):
        return pieces[0]
    return torch.cat(pieces, dim=1 if name.endswith("c_proj.weight") else 0)
    ### END SOLUTION


def load(stage: Stage, optimizer: torch.optim.Optimizer, mesh: Mesh, folder: str) -> int:
    """Fill a fresh ``stage`` and ``optimizer`` (any layout) from ``folder``; return its step."""
    # every file the index names; each whole tensor from its slices (unshard), then this layout's
    # slice (shard) of the parameter and of both moments
    ### BEGIN SOLUTION
    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    files = [torch.load(os.path.join(folder, name), weights_only=True) for name in index["files"]]
    by_name: dict[str, list] = {}
    for saved in sorted(files, key=lambda saved: saved["tp_rank"]):
        for name, piece in saved["pieces"].items():
            by_name.setdefault(name, []).append(piece)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            pieces = by_name["wte.weight" if name == "lm_head.weight" else name]
            state = {}
            for key in ("param", "exp_avg", "exp_avg_sq"):
                whole = unshard(name, [piece[key] for piece in pieces])
                state[key] = shard(name, whole, mesh.tp, mesh.coords.tp)
            p.copy_(state.pop("param"))
            optimizer.state[p] = {"step": pieces[0]["step"].clone(), **state}
    return index["step"]
    ### END SOLUTION
