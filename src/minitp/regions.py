"""Messages whose backward is a message: each one small autograd Function, so the layers of tensor,
context and expert parallel read as the textbook does and gradients come out right without hooks.

* Megatron's f and g: ``copy_to_parallel`` (identity forward, all-reduce backward) and
  ``reduce_from_parallel`` (all-reduce forward, identity backward);
* ``gather_from_parallel`` / ``split_to_parallel``: all-gather one way, keep a slice the other;
* sequence parallel's pair: all-gather the positions forward / reduce-scatter backward, and the
  reverse;
* ``all_to_all_rows``: rows to other ranks forward, their gradients back the same way backward.

Every message goes through ``minitp.comm``, so it is traced like any other, with its phase
(``Event.phase``: "forward" or "backward", the pass that sent it).
"""

from __future__ import annotations

import torch

from minitp import comm
from minitp import trace as _trace


# -- tensor parallel: Megatron's f and g, gather and split -------------------------------------
def _split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = comm.group_size(group), comm.group_rank(group)
    if x.shape[dim] % n:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    return x.chunk(n, dim=dim)[r].contiguous()


def _gather_along(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    n = comm.group_size(group)
    x = x.contiguous()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out.view(-1), x.view(-1), group=group, label=label)
    return torch.cat(out.unbind(0), dim=dim)


class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        with _trace.tagged(phase="backward"):
            comm.all_reduce(grad, group=ctx.group, label=ctx.label + "/f.backward")
        return grad, None, None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, label):
        x = x.contiguous().clone()
        with _trace.tagged(phase="forward"):
            comm.all_reduce(x, group=group, label=label + "/g.forward")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather along ``dim`` forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim = group, dim
        with _trace.tagged(phase="forward"):
            return _gather_along(x, dim, group, label + "/gather.forward")

    @staticmethod
    def backward(ctx, grad):
        return _split_along(grad, ctx.dim, ctx.group), None, None, None


class _SplitToParallel(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim, ctx.label = group, dim, label
        return _split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        with _trace.tagged(phase="backward"):
            return _gather_along(grad, ctx.dim, ctx.group,
                                 ctx.label + "/split.backward"), None, None, None


def copy_to_parallel(x: torch.Tensor, group=None, label: str = "tp") -> torch.Tensor:
    """Megatron's f: enters a parallel region. Forward: identity. Backward: all-reduce."""
    return _CopyToParallel.apply(x, group, label)


def reduce_from_parallel(x: torch.Tensor, group=None, label: str = "tp") -> torch.Tensor:
    """Megatron's g: leaves a parallel region by summing partial results. Backward: identity."""
    return _ReduceFromParallel.apply(x, group, label)


def gather_from_parallel(x: torch.Tensor, group=None, dim: int = -1,
                         label: str = "tp") -> torch.Tensor:
    """All-gather shards along ``dim`` (forward); backward keeps this rank's slice of the
    gradient."""
    return _GatherFromParallel.apply(x, group, dim, label)


def split_to_parallel(x: torch.Tensor, group=None, dim: int = -1,
                      label: str = "tp") -> torch.Tensor:
    """Keep this rank's slice along ``dim`` (forward); backward all-gathers the gradient."""
    return _SplitToParallel.apply(x, group, dim, label)


# Sequence parallel: between tensor-parallel regions the activations are split along the sequence
# instead of copied, so g's all-reduce becomes a reduce-scatter and f's identity an all-gather.
def _reduce_scatter_along(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    n = comm.group_size(group)
    if x.shape[dim] % n:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    chunks = torch.stack(x.chunk(n, dim=dim))  # (n, *chunk): rank i keeps the sum of row i
    out = torch.empty_like(chunks[0])
    comm.reduce_scatter(out.view(-1), chunks.view(-1), group=group, label=label)
    return out


class _GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather along ``dim`` forward, reduce-scatter of the gradient backward.

    Backward is a reduce-scatter, not a split: every rank feeds the gathered tensor to its own slice
    of a column-parallel layer, so each holds a partial gradient for every position, and the
    gradient of this rank's positions is the sum of those partials.
    """

    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim, ctx.label = group, dim, label
        with _trace.tagged(phase="forward"):
            return _gather_along(x, dim, group, label + "/sequence_gather.forward")

    @staticmethod
    def backward(ctx, grad):
        with _trace.tagged(phase="backward"):
            return _reduce_scatter_along(grad.contiguous(), ctx.dim, ctx.group,
                                         ctx.label + "/sequence_gather.backward"), None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward (sum the partial results, keep this rank's positions),
    all-gather of the gradient backward (every position's gradient reaches every partial)."""

    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim, ctx.label = group, dim, label
        with _trace.tagged(phase="forward"):
            return _reduce_scatter_along(x.contiguous(), dim, group,
                                         label + "/sequence_scatter.forward")

    @staticmethod
    def backward(ctx, grad):
        with _trace.tagged(phase="backward"):
            return _gather_along(grad, ctx.dim, ctx.group,
                                 ctx.label + "/sequence_scatter.backward"), None, None, None


def gather_from_sequence_parallel(x: torch.Tensor, group=None, dim: int = 1,
                                  label: str = "tp") -> torch.Tensor:
    """Sequence parallel's f: all-gather the positions along ``dim``; backward reduce-scatters."""
    return _GatherFromSequenceParallel.apply(x, group, dim, label)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None, dim: int = 1,
                                        label: str = "tp") -> torch.Tensor:
    """Sequence parallel's g: sum partial results and keep this rank's positions along ``dim``;
    backward all-gathers the gradient."""
    return _ReduceScatterToSequenceParallel.apply(x, group, dim, label)


# -- the all-to-all of rows (expert parallel's dispatch and combine; Ulysses) ----------------------
class _AllToAll(torch.autograd.Function):
    """all_to_all of rows forward; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, label):
        ctx.splits, ctx.group, ctx.label = (output_splits, input_splits), group, label
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        with _trace.tagged(phase="forward"):
            comm.all_to_all(out, x.contiguous(), output_splits, input_splits, group=group,
                            label=label)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        with _trace.tagged(phase="backward"):
            comm.all_to_all(out, grad.contiguous(), input_splits, output_splits, group=ctx.group,
                            label=ctx.label + "/backward")
        return out, None, None, None, None


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None,
                    label: str = "ep") -> torch.Tensor:
    """Send ``input_splits[j]`` rows of x (A, D) to rank j of the group, receive
    ``output_splits[i]`` from rank i -> (sum(output_splits), D); autograd-aware (backward is the
    reverse all-to-all)."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group, label)
