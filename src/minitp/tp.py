"""Tensor parallelism from scratch: every rank holds a slice of each weight matrix, computes its
slice of each layer, and collectives stitch the slices together.

A linear layer y = x Wᵀ (W: (out, in)) splits two ways:

* **column-parallel**: W split along the output dimension. Every rank reads the whole input and
  produces out/tp of the output features. Nothing to add up: the output is sharded.
* **row-parallel**: W split along the input dimension. Every rank reads in/tp of the input features
  (exactly what a column-parallel layer left it) and produces a partial sum of the whole output;
  an all-reduce adds the partials.

Column then row (Megatron-LM's pairing) costs an MLP or attention one all-reduce forward (g, after
the row layer) and one backward (f, at the input, whose gradient each column slice gives in part).
f and g are autograd functions in ``minitp.regions``: autograd sends (and traces) the backward's.

**Sequence parallel.** Between regions (norms, residual adds) every rank computes the same thing;
sequence parallel splits those positions over the ranks: g becomes a reduce-scatter along the
sequence, f an all-gather. The same bytes, but norms and residuals hold 1/tp of the activations: the
residual stream is (B, S/tp, D) from the embedding to the final norm; attention and the MLP see (B,
S, D).

Refused, not padded or replicated: a vocabulary tp does not divide (padding would change the
logits), fewer key/value heads than ranks (shared heads would need their gradients summed). Reading
order: the region entry/exit, the column and row linears, the MLP and attention (the core); then the
vocabulary, sequence-parallel norms, parallelize, split_dims / local_shards / unshard, generate (the
extras).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minitp import comm, regions
from minitp import trace as _trace
from minitp.layout import KV_HEADS_WHY, check_divisible, check_tp_config, check_vocab, shard_range
from minitp.models.llama import Attention, FeedForward, KVCache, RMSNorm, Transformer, rms_norm
from minitp.models.llama import generate as _generate


def _slice(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous slice of ``t`` along ``dim`` (a copy, detached); tp divides that
    dim."""
    mine = shard_range(t.shape[dim], comm.group_size(group), comm.group_rank(group))
    return t.detach().narrow(dim, mine.start, len(mine)).clone()


# -- entering and leaving a tensor-parallel region -------------------------------------------------
def enter_parallel_region(x: torch.Tensor, tp_group, sequence_parallel: bool = False,
                          label: str = "tp") -> torch.Tensor:
    """The input of column-parallel layers: the same full x on every rank.

    Plain: f, identity forward; backward all-reduces the partial input gradients of the column
    slices. Sequence parallel: x comes as (B, S/tp, D); all-gather the positions (backward:
    reduce-scatter).
    """
    if sequence_parallel:
        # (B, S/tp, D) → (B, S, D)
        return regions.gather_from_sequence_parallel(x, tp_group, dim=1, label=label)
    return regions.copy_to_parallel(x, tp_group, label=label)


def leave_parallel_region(x: torch.Tensor, tp_group, sequence_parallel: bool = False,
                          label: str = "tp") -> torch.Tensor:
    """The output of a row-parallel layer: every rank's partial sum → the sum.

    Plain: g, all-reduce forward, identity backward. Sequence parallel: reduce-scatter along the
    sequence, each rank keeping the sum at its S/tp positions (backward: all-gather).
    """
    if sequence_parallel:
        tp = comm.group_size(tp_group)
        if x.shape[1] % tp:
            raise ValueError(f"sequence length {x.shape[1]} is not divisible by tp={tp}: sequence "
                             f"parallel gives each rank S/tp positions")
        # → (B, S/tp, D)
        return regions.reduce_scatter_to_sequence_parallel(x, tp_group, dim=1, label=label)
    return regions.reduce_from_parallel(x, tp_group, label=label)


# -- the two splits of a linear layer --------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with its output features split over the ranks: rank r holds rows
    [r·out/tp, (r+1)·out/tp) of the weight and of the bias.

    gather_output: all-gather the output features, so every rank has the full layer's output;
        else it stays (..., out/tp), ready for a row-parallel layer.
    enter: apply the region's entry to the input (f, or the sequence all-gather). Layers that read
        the same input (wq/wk/wv, w1/w3) pass False and their module enters once: one message
        backward instead of three.
    """

    split_dims = {"weight": 0, "bias": 0}  # which dim of each parameter is split (see local_shards)

    def __init__(self, linear: nn.Linear, tp_group: dist.ProcessGroup | None, *,
                 gather_output: bool = False, enter: bool = True, sequence_parallel: bool = False,
                 label: str = "tp"):
        super().__init__()
        tp = comm.group_size(tp_group)
        check_divisible("out_features", linear.out_features, "tp", tp)
        self.tp_group, self.gather_output, self.enter = tp_group, gather_output, enter
        comm.name_group(tp_group, "tp", unless_named=True)  # its messages' Event.dim
        self.sequence_parallel, self.label = sequence_parallel, label
        self.in_features, self.out_features = linear.in_features, linear.out_features // tp
        self.weight = nn.Parameter(_slice(linear.weight, 0, tp_group))  # (out/tp, in)
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(_slice(linear.bias, 0, tp_group))  # (out/tp,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter:
            x = enter_parallel_region(x, self.tp_group, self.sequence_parallel, self.label)
        # x: (..., in) the same on every rank → (..., out/tp)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            # → (..., out)
            y = regions.gather_from_parallel(y, self.tp_group, dim=-1, label=self.label)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (this rank's slice)")


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with its input features split over the ranks: rank r holds columns
    [r·in/tp, (r+1)·in/tp) of the weight, and the whole bias.

    Each rank's product is a partial sum of the full output; leaving the region adds them up (g's
    all-reduce, or a reduce-scatter under sequence parallel). The bias is added once, after the
    sum: added to each partial it would be counted tp times.

    input_is_parallel: the input comes as (..., in/tp), from a column-parallel layer; else it is
        the full (..., in) and this rank keeps its slice (backward all-gathers the gradient).
    """

    split_dims = {"weight": 1}

    def __init__(self, linear: nn.Linear, tp_group: dist.ProcessGroup | None, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 label: str = "tp"):
        super().__init__()
        tp = comm.group_size(tp_group)
        check_divisible("in_features", linear.in_features, "tp", tp)
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        comm.name_group(tp_group, "tp", unless_named=True)  # its messages' Event.dim
        self.sequence_parallel, self.label = sequence_parallel, label
        self.in_features, self.out_features = linear.in_features // tp, linear.out_features
        self.weight = nn.Parameter(_slice(linear.weight, 1, tp_group))  # (out, in/tp)
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(linear.bias.detach().clone())  # (out,) replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            # (..., in) → (..., in/tp)
            x = regions.split_to_parallel(x, self.tp_group, dim=-1, label=self.label)
        y = F.linear(x, self.weight)  # (..., in/tp) → (..., out): this rank's partial sum
        y = leave_parallel_region(y, self.tp_group, self.sequence_parallel, self.label)  # summed
        if self.bias is not None:
            bias = self.bias
            # the bias meets only this rank's S/tp positions: f sums its gradient
            if self.sequence_parallel:
                bias = regions.copy_to_parallel(bias, self.tp_group, label=self.label + "/bias")
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (this rank's slice), out_features={self.out_features}")


# -- the MLP and attention -------------------------------------------------------------------------
class ParallelFeedForward(nn.Module):
    """SwiGLU with its hidden units split over the ranks: w1 and w3 column-parallel, w2
    row-parallel.

    SiLU and the product act on each hidden unit alone, so they run on this rank's F/tp units with
    no message: one all-reduce forward (after w2), one backward (at the input).
    """

    def __init__(self, feed_forward: FeedForward, tp_group: dist.ProcessGroup | None,
                 sequence_parallel: bool = False, label: str = "tp"):
        super().__init__()
        self.tp_group, self.sequence_parallel, self.label = tp_group, sequence_parallel, label
        self.w1 = ColumnParallelLinear(feed_forward.w1, tp_group, enter=False, label=label)
        self.w3 = ColumnParallelLinear(feed_forward.w3, tp_group, enter=False, label=label)
        self.w2 = RowParallelLinear(feed_forward.w2, tp_group, sequence_parallel=sequence_parallel,
                                    label=label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, S, D) everywhere
        x = enter_parallel_region(x, self.tp_group, self.sequence_parallel, self.label)
        h = F.silu(self.w1(x)) * self.w3(x)  # (B, S, F/tp): this rank's hidden units
        return self.w2(h)  # (B, S, D) summed over ranks; (B, S/tp, D) under sequence parallel


class ParallelAttention(Attention):
    """Attention with its heads split over the ranks: rank r computes heads [r·H/tp, (r+1)·H/tp)
    from start to end, since heads only mix in wo.

    wq, wk, wv are column-parallel (a head's Dh features are contiguous, so a slice of features is a
    slice of heads), wo row-parallel. The plain forward then runs unchanged: it reads the head
    counts off wq and wk, and a KV cache holds this rank's heads only. Grouped-query attention
    splits the key/value heads the same way; with fewer of them than ranks it is refused.
    """

    def __init__(self, attention: Attention, tp_group: dist.ProcessGroup | None,
                 sequence_parallel: bool = False, label: str = "tp"):
        # built from a layer, not a config: Attention.__init__ would allocate full weights
        nn.Module.__init__(self)
        tp = comm.group_size(tp_group)
        check_divisible("n_heads", attention.n_heads, "tp", tp)
        check_divisible("n_kv_heads", attention.n_kv_heads, "tp", tp, KV_HEADS_WHY)
        self.tp_group, self.sequence_parallel, self.label = tp_group, sequence_parallel, label
        # on this rank
        self.n_heads, self.n_kv_heads = attention.n_heads // tp, attention.n_kv_heads // tp
        self.head_dim, self.fused = attention.head_dim, attention.fused
        # D → H/tp · Dh
        self.wq = ColumnParallelLinear(attention.wq, tp_group, enter=False, label=label)
        # D → Hkv/tp · Dh
        self.wk = ColumnParallelLinear(attention.wk, tp_group, enter=False, label=label)
        self.wv = ColumnParallelLinear(attention.wv, tp_group, enter=False, label=label)
        self.wo = RowParallelLinear(attention.wo, tp_group, sequence_parallel=sequence_parallel,
                                    label=label)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, attend=None):
        # (B, S, D) everywhere
        x = enter_parallel_region(x, self.tp_group, self.sequence_parallel, self.label)
        return super().forward(x, cos, sin, cache, attend)  # this rank's heads; wo sums over ranks


# -- the vocabulary --------------------------------------------------------------------------------
class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with its rows (the vocabulary) split over the ranks: rank r holds tokens
    [r·V/tp, (r+1)·V/tp).

    A rank looks up the tokens it holds and writes zeros for the others; summing over ranks (g)
    gives every rank every embedding. Backward sends nothing: g passes the gradient through, and
    each rank's rows take the gradient of the positions holding its tokens.
    """

    split_dims = {"weight": 0}

    def __init__(self, embedding: nn.Embedding, tp_group: dist.ProcessGroup | None,
                 sequence_parallel: bool = False, label: str = "tp"):
        super().__init__()
        tp = comm.group_size(tp_group)
        check_vocab(embedding.num_embeddings, tp)
        self.tp_group, self.sequence_parallel, self.label = tp_group, sequence_parallel, label
        comm.name_group(tp_group, "tp", unless_named=True)  # its messages' Event.dim
        # this rank's V/tp
        tokens = shard_range(embedding.num_embeddings, tp, comm.group_rank(tp_group))
        self.vocab_start, self.num_embeddings = tokens.start, len(tokens)
        self.weight = nn.Parameter(_slice(embedding.weight, 0, tp_group))  # (V/tp, D)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start  # tokens: (B, S), the same on every rank
        mine = (local >= 0) & (local < self.num_embeddings)
        h = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # (B, S, D)
        h = h.masked_fill(~mine.unsqueeze(-1), 0.0)  # zeros where another rank holds the token
        # (B, S or S/tp, D)
        return leave_parallel_region(h, self.tp_group, self.sequence_parallel, self.label)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy from vocab-sharded logits. Forward all-reduces N numbers per message; backward
    is local, and computes (softmax - onehot) / N the way PyTorch's log-softmax backward does, so
    that at tp=1 it rounds like ``F.cross_entropy`` (AdamW magnifies last-bit differences)."""

    @staticmethod
    def forward(ctx, logits, targets, tp_group, label):
        # logits: (N, V/tp) this rank's slice of the vocabulary; targets: (N,) replicated
        v_local = logits.shape[-1]
        max_logit = logits.max(dim=-1).values  # (N,): a shift for a stable exp
        with _trace.tagged(phase="forward"):
            comm.all_reduce(max_logit, tp_group, op=comm.ReduceOp.MAX, label=label + "/max")
        shifted = logits - max_logit[:, None]
        local = targets - comm.group_rank(tp_group) * v_local
        mine = (local >= 0) & (local < v_local)  # the targets this rank's vocabulary holds
        local = local.clamp(0, v_local - 1)
        target_logit = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(~mine, 0.0)
        # (2, N): over this rank's tokens
        sums = torch.stack([shifted.exp().sum(dim=-1), target_logit])
        with _trace.tagged(phase="forward"):
            # one message for both: over the whole vocabulary
            comm.all_reduce(sums, tp_group, label=label)
        log_sum_exp = sums[0].log()
        ctx.save_for_backward(shifted, log_sum_exp, local, mine)
        return (log_sum_exp - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        shifted, log_sum_exp, local, mine = ctx.saved_tensors
        scale = grad / shifted.shape[0]
        grad_logits = (shifted - log_sum_exp[:, None]).exp() * scale  # softmax, this rank's slice
        rows = torch.arange(len(local), device=local.device)[mine]
        # minus the one-hot target, where this rank holds it
        grad_logits[rows, local[mine]] -= scale
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 tp_group: dist.ProcessGroup | None,
                                 label: str = "tp/loss") -> torch.Tensor:
    """Mean cross-entropy from logits sharded over the vocabulary, (..., V/tp), never gathering
    them.

    log-softmax needs two numbers per position from the whole vocabulary, the max (for a stable exp)
    and the sum of exps, and the target's logit lives on one rank: all-reduce those, N = B·S numbers
    per message instead of N·V. The gradient, softmax minus one-hot, needs nothing more: backward
    sends no message.
    """
    # (B, S, V/tp) → (N, V/tp), in fp32 at least, like minitp.models.loss_fn
    logits = logits.flatten(0, -2)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return _VocabParallelCrossEntropy.apply(logits, targets.flatten(), tp_group, label)


# -- sequence parallel norms -----------------------------------------------------------------------
class SequenceParallelRMSNorm(nn.Module):
    """RMSNorm on this rank's S/tp positions. The normalisation is per position, so it needs no
    message, but the (replicated) weight now sees only S/tp positions: its gradient is partial, and
    f on the weight (identity forward, all-reduce backward) sums the ranks' parts."""

    def __init__(self, norm: RMSNorm, tp_group: dist.ProcessGroup | None, label: str = "tp"):
        super().__init__()
        self.tp_group, self.label, self.eps = tp_group, label, norm.eps
        comm.name_group(tp_group, "tp", unless_named=True)  # its messages' Event.dim
        self.weight = nn.Parameter(norm.weight.detach().clone())  # (D,) replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = regions.copy_to_parallel(self.weight, self.tp_group, label=self.label + "/weight")
        return rms_norm(x, weight, self.eps)  # x: (B, S/tp, D)


# they declare split_dims
SPLIT_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


# -- a whole model ---------------------------------------------------------------------------------
def parallelize(model: Transformer, tp_group: dist.ProcessGroup | None,
                sequence_parallel: bool = False) -> Transformer:
    """Turn a plain ``Transformer`` (the same weights on every rank) into its tensor-parallel form,
    in place, and return it. Parameter names stay those of the plain model.

    Embedding and output layer split the vocabulary (the logits stay (B, S, V/tp): train with
    ``vocab_parallel_cross_entropy``); each block's attention splits its heads and its MLP its
    hidden units. The norms are replicated, or split along the sequence with ``sequence_parallel``.
    """
    check_tp_config(model.config, comm.group_size(tp_group))  # before anything is changed
    sp = sequence_parallel
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, tp_group, sp,
                                                  label="tp/tok_embeddings")
    for i, block in enumerate(model.layers):
        name = f"tp/layers.{i}"
        block.attention = ParallelAttention(block.attention, tp_group, sp,
                                            label=f"{name}.attention")
        block.feed_forward = ParallelFeedForward(block.feed_forward, tp_group, sp,
                                                 label=f"{name}.feed_forward")
        if sp:
            block.attention_norm = SequenceParallelRMSNorm(block.attention_norm, tp_group,
                                                           f"{name}.attention_norm")
            block.ffn_norm = SequenceParallelRMSNorm(block.ffn_norm, tp_group, f"{name}.ffn_norm")
    if sp:
        model.norm = SequenceParallelRMSNorm(model.norm, tp_group, "tp/norm")
    # logits: (B, S, V/tp), this rank's slice of the vocabulary
    model.output = ColumnParallelLinear(model.output, tp_group, sequence_parallel=sp,
                                        label="tp/output")
    return model


def split_dims(module: nn.Module) -> dict[str, int | None]:
    """{parameter name: the dim tensor parallel split it along, or None where it is replicated},
    from the ``split_dims`` each parallel layer declares."""
    return {f"{m}.{n}" if m else n: sub.split_dims.get(n) if isinstance(sub, SPLIT_LAYERS) else None
            for m, sub in module.named_modules() for n, _ in sub.named_parameters(recurse=False)}


def local_shards(module: nn.Module,
                 grads: bool = False) -> dict[str, tuple[torch.Tensor | None, int | None]]:
    """This rank's piece of every parameter (or of its gradient), by the plain model's name, with
    the dimension it is split along (None: replicated, every rank holds all of it)."""
    dims = split_dims(module)
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p
        out[name] = (None if t is None else t.detach().clone(), dims[name])
    return out


def unshard(per_rank: list[dict], rank: int = 0) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's ``local_shards``, in rank order: split ones concatenated along
    their dimension, replicated ones as ``rank`` holds them. No message: run it where the shards
    are."""
    full = {}
    for name, (tensor, dim) in per_rank[rank].items():
        if tensor is not None:
            full[name] = tensor if dim is None else torch.cat([r[name][0] for r in per_rank],
                                                              dim=dim)
    return full


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, new_tokens: int,
             tp_group: dist.ProcessGroup | None,
             caches: list[KVCache] | None = None) -> torch.Tensor:
    """Greedy decoding of a model from ``parallelize`` (without sequence parallel), like
    ``minitp.models.generate``: (B, P) → (B, P+N), the same on every rank.

    Each rank's attention caches its own heads' keys and values, (B, S, Hkv/tp, Dh) per layer. The
    next token is the argmax over the sharded vocabulary: each rank's best (logit, token) pair is
    all-gathered and the largest logit wins, ties going to the lowest token as in ``torch.argmax``.
    ``caches``: one empty ``KVCache`` per layer to fill (to look at afterwards); fresh ones if None.
    """
    rank = comm.group_rank(tp_group)

    def next_token(logits: torch.Tensor) -> torch.Tensor:
        best, index = logits[:, -1].double().max(dim=-1)  # (B,) over this rank's V/tp tokens
        token = index + rank * logits.shape[-1]
        # (B, 1, 2); float64 holds any token id
        pairs = torch.stack([best, token.double()], dim=-1)[:, None]
        # (B, tp, 2)
        pairs = regions.gather_from_parallel(pairs, tp_group, dim=1, label="tp/generate/argmax")
        # the first largest: the lowest rank, so the lowest token
        winner = pairs[..., 0].argmax(dim=1)
        return pairs[torch.arange(len(pairs)), winner, 1].long()[:, None]  # (B, 1)

    # logits (B, S, V/tp) at each step
    return _generate(model, prompt, new_tokens, next_token, caches)
