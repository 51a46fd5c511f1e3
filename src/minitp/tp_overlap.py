"""The collective matmul: tensor parallel's messages hidden behind its own matmuls (Wang et al.
2022, "Overlap communication with dependent computation via decomposition"; torchtitan's async
tensor parallel).

Under sequence parallel (``minitp.tp``) a column-parallel linear starts with an all-gather of the
sequence shards and a row-parallel linear ends with a reduce-scatter. Done whole, each message
must finish before the matmul that needs it starts (or after the matmul that feeds it ends): the
ranks sit idle while the bytes travel. But the matmul splits along the sequence as the message
does: the rows of chunk c of the output need only chunk c of the input. So cut both into the n
chunks of the ranks and run them as one ring, each rank sending only to its right neighbour and
receiving only from its left one:

* **all-gather, then matmul** (``all_gather_matmul``, a column-parallel forward). Rank r starts
  with its own chunk, r. At step k it holds chunk (r - k) mod n; it posts that chunk's send to the
  right and the receive of the next one from the left, multiplies the chunk it holds by its weight
  slice (the rows of chunk (r - k) of the output), and only then waits for the messages. After n
  steps every chunk has passed through every rank once.
* **matmul, then reduce-scatter** (``matmul_reduce_scatter``, a row-parallel forward). What
  travels is a running sum. At step k rank r computes its partial product for chunk
  (r - k - 1) mod n while the running sum of that chunk comes in from the left, adds the two and
  sends the sum on to the right. The chunk of the last step, n - 1, is r itself: the sum arriving
  then holds every other rank's partial, and adding its own finishes this rank's positions.

**What is hidden, what is not.** Every message is posted before a matmul chunk starts and waited
for only after it ends, so it travels while that chunk computes. All-gather: the first chunk is
this rank's own, so the first matmul needs no message, and the chunk for step k + 1 travels during
matmul k; only the last matmul has no message beside it. Reduce-scatter: the first matmul has no
sum to wait for yet, and the sum for step k travels during matmul k. What stays exposed is each
message's time beyond its matmul chunk, nothing when a chunk computes longer than a message
takes; done whole, all n - 1 chunks' messages are exposed, back to back. Hiding needs the bytes to
move on something other than what multiplies (a GPU's copy engines, a network card): on a CPU over
loopback the same cores copy them, and less is won.

**What it costs.** The same bytes as the all-gather or reduce-scatter it replaces: each rank sends
n - 1 messages (and receives n - 1), each a chunk of 1/n of the gathered tensor: (n - 1)/n of it,
the ring collective's own count. It holds the same activations too (the gathered input, kept for
the weight gradient). What changes is the number of messages (n - 1 point-to-point ones, each a
latency) and that the matmul runs as n smaller ones, each a little less efficient on a real
device.

**Backward is the dual.** The input gradient of an all-gather-then-matmul is a matmul then a
reduce-scatter (every rank holds a partial gradient for every position), and the reverse; so each
backward runs the other ring, and computes its weight gradient chunk by chunk on the way, from the
gathered input chunks kept from forward (column) or the gradient chunks as they arrive (row). An
input that needs no gradient (a model's first layer) sends nothing backward, as in ``minitp.tp``.

In the trace each ring step's messages and matmul carry ``Event.ring_step``; the matmul chunks and
the waits are compute spans ("matmul", "wait") under the same label as the messages:
"tp/overlap/all_gather_matmul.forward/step0", ... The group is tensor parallel's (``Event.dim``
"tp"), so a byte table counts these with the layer's tp messages.

Reading order: the two rings, the two autograd Functions, their checks, then the layers:
``OverlappedColumnParallelLinear``, ``OverlappedRowParallelLinear`` (``minitp.tp``'s two linears
under sequence parallel, the same weights and the same split, only the forward changed),
``forward_together`` (several column layers reading one input, one ring for all) and
``OverlappedFeedForward`` (SwiGLU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from minitp import comm, regions, tp
from minitp import trace as _trace
from minitp.models.llama import FeedForward


def _neighbours(group) -> tuple[int, int, int, int]:
    """(n, this rank's place in the group, global rank on the right, global rank on the left)."""
    ranks = comm.group_ranks(group)
    n, r = len(ranks), comm.group_rank(group)
    return n, r, ranks[(r + 1) % n], ranks[(r - 1) % n]


def _wait(handles: list[comm.Handle], label: str) -> None:
    """Wait for messages, timed as a span: the time a rank spends here is what the overlap left
    exposed."""
    with _trace.span("wait", label):
        for handle in handles:
            handle.wait()


# -- the two rings ---------------------------------------------------------------------------------
def _gather_ring(shard: torch.Tensor, group, label: str,
                 use: Callable[[int, torch.Tensor], None]) -> None:
    """Pass every rank's ``shard`` round the ring, calling ``use(c, chunk)`` on each chunk c as it
    is held, this rank's own first, while the next one travels."""
    n, r, right, left = _neighbours(group)
    held = shard.contiguous()
    for k in range(n):
        step = f"{label}/step{k}"
        with _trace.tagged(ring_step=k):
            if k < n - 1:  # pass the held chunk on and fetch the next, before multiplying
                incoming = torch.empty_like(held)
                handles = [comm.isend(held, right, group, label=step),
                           comm.irecv(incoming, left, group, label=step)]
            with _trace.span("matmul", step):
                use((r - k) % n, held)
            if k < n - 1:
                _wait(handles, step)
                held = incoming


def _scatter_ring(group, label: str, partial: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Sum ``partial(c)`` over the ranks for every chunk c, each rank keeping the sum of its own:
    the running sum of chunk (r - k - 1) mod n comes from the left while this rank computes its
    part of it."""
    n, r, right, left = _neighbours(group)
    sends: list[comm.Handle] = []
    total = torch.empty(0)
    for k in range(n):
        step = f"{label}/step{k}"
        with _trace.tagged(ring_step=k):
            if k > 0:  # the left neighbour's running sum of the chunk this step computes
                incoming = torch.empty_like(total)
                recv = comm.irecv(incoming, left, group, label=step)
            with _trace.span("matmul", step):
                mine = partial((r - k - 1) % n)  # (B, S/n, out)
            if k > 0:
                _wait([recv, *sends], step)  # the send of the last step freed its buffer too
                mine += incoming
        if k < n - 1:  # on to the right, beside the next step's matmul
            with _trace.tagged(ring_step=k + 1):
                sends = [comm.isend(mine, right, group, label=f"{label}/step{k + 1}")]
        total = mine
    return total  # (B, S/n, out): every rank's partials of this rank's positions, summed


# -- the two autograd Functions --------------------------------------------------------------------
class _AllGatherMatmul(torch.autograd.Function):
    """y_j = all_gather(x_shard) W_jᵀ for each weight W_j, as one gather ring; backward: the input
    gradient as one reduce-scatter ring (sum_j g_j W_j), the weight gradients on the way."""

    @staticmethod
    def forward(ctx, x_shard, group, label, *weights):
        # x_shard: (B, S/n, D) this rank's positions; W_j: (out_j/n, D)
        n = comm.group_size(group)
        batch, local = x_shard.shape[0], x_shard.shape[1]
        outputs = [x_shard.new_empty(batch, n * local, w.shape[0]) for w in weights]
        chunks: list[torch.Tensor] = [x_shard] * n  # every rank's positions, as they come round

        def multiply(c: int, chunk: torch.Tensor) -> None:
            chunks[c] = chunk
            rows = slice(c * local, (c + 1) * local)  # chunk c's positions in the whole sequence
            for w, y in zip(weights, outputs):
                y[:, rows] = F.linear(chunk, w)  # (B, S/n, out_j/n)

        with _trace.tagged(phase="forward"):
            _gather_ring(x_shard, group, f"{label}/overlap/all_gather_matmul.forward", multiply)
        ctx.save_for_backward(*chunks, *weights)  # the gathered input, for the weight gradient
        ctx.group, ctx.label, ctx.n = group, label, n
        return tuple(outputs) if len(outputs) > 1 else outputs[0]  # each (B, S, out_j/n)

    @staticmethod
    def backward(ctx, *grads):
        # grads: one (B, S, out_j/n) per weight, every position
        saved = ctx.saved_tensors
        chunks, weights = saved[:ctx.n], saved[ctx.n:]
        local = chunks[0].shape[1]
        grad_weights = [torch.zeros_like(w) for w in weights]

        def partial(c: int) -> torch.Tensor:
            rows = slice(c * local, (c + 1) * local)
            x_c = chunks[c].reshape(-1, chunks[c].shape[-1])  # (B·S/n, D)
            out = None
            for g, w, grad_w in zip(grads, weights, grad_weights):
                g_c = g[:, rows]  # (B, S/n, out_j/n)
                grad_w += g_c.reshape(-1, g_c.shape[-1]).t() @ x_c  # (out_j/n, D)
                if ctx.needs_input_grad[0]:
                    part = g_c @ w  # (B, S/n, D): this rank's share of chunk c's input gradient
                    out = part if out is None else out.add_(part)
            return out

        if not ctx.needs_input_grad[0]:  # the first layer's input: weight gradients, no message
            for c in range(ctx.n):
                partial(c)
            return None, None, None, *grad_weights
        with _trace.tagged(phase="backward"):
            grad_x = _scatter_ring(ctx.group, f"{ctx.label}/overlap/all_gather_matmul.backward",
                                   partial)
        return grad_x, None, None, *grad_weights  # grad_x: (B, S/n, D)


class _MatmulReduceScatter(torch.autograd.Function):
    """reduce_scatter(x Wᵀ) along the sequence, as one scatter ring; backward: the input gradient
    as one gather ring of the output gradient (times W), the weight gradient on the way."""

    @staticmethod
    def forward(ctx, x, weight, group, label):
        # x: (B, S, in/n) every position, this rank's input features; weight: (out, in/n)
        local = x.shape[1] // comm.group_size(group)

        def partial(c: int) -> torch.Tensor:
            return F.linear(x[:, c * local:(c + 1) * local], weight)  # (B, S/n, out)

        with _trace.tagged(phase="forward"):
            y = _scatter_ring(group, f"{label}/overlap/matmul_reduce_scatter.forward", partial)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.label = group, label
        return y  # (B, S/n, out): the sum over ranks at this rank's positions

    @staticmethod
    def backward(ctx, grad):
        # grad: (B, S/n, out) this rank's positions
        x, weight = ctx.saved_tensors
        local = grad.shape[1]
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None  # (B, S, in/n)
        grad_w = torch.zeros_like(weight)  # (out, in/n)

        def multiply(c: int, g_c: torch.Tensor) -> None:
            rows = slice(c * local, (c + 1) * local)
            if grad_x is not None:
                grad_x[:, rows] = g_c @ weight  # (B, S/n, in/n)
            x_c = x[:, rows].reshape(-1, x.shape[-1])  # (B·S/n, in/n)
            grad_w.add_(g_c.reshape(-1, g_c.shape[-1]).t() @ x_c)

        with _trace.tagged(phase="backward"):
            _gather_ring(grad, ctx.group, f"{ctx.label}/overlap/matmul_reduce_scatter.backward",
                         multiply)
        return grad_x, grad_w, None, None


# -- the checks and the two functions --------------------------------------------------------------
def _check_input(call: str, x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{call}: the input should be {what}, 3 dims, got {got}")


def _check_weight(call: str, weight: torch.Tensor, x: torch.Tensor, name: str = "weight") -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        got = (f"shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor)
               else type(weight).__name__)
        raise ValueError(f"{call}: {name} should be (out, {x.shape[-1]}), its columns matching the "
                         f"last dim of the input {tuple(x.shape)}; got {got}")


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor],
                      group=None, label: str = "tp"):
    """F.linear(all_gather(x_shard along the sequence), weight) as one ring, the gather hidden
    behind the matmul: a column-parallel forward under sequence parallel. Differentiable.

    x_shard: (B, S/n, D), this rank's positions; weight: (out/n, D), this rank's output features,
    or a list of such weights (layers reading the same input: every chunk travels once) -> (B, S,
    out/n), or one such output per weight. No bias: add it after.
    """
    call = "all_gather_matmul"
    _check_input(call, x_shard, "(B, S/tp, D), this rank's positions")
    weights = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
    if not weights:
        raise ValueError(f"{call}: no weight given; expected one (out/tp, D) weight or a list")
    for i, w in enumerate(weights):
        _check_weight(call, w, x_shard, "weight" if len(weights) == 1 else f"weight {i}")
    comm.name_group(group, "tp", unless_named=True)  # its messages' Event.dim
    return _AllGatherMatmul.apply(x_shard, group, label, *weights)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None,
                          label: str = "tp") -> torch.Tensor:
    """reduce_scatter(F.linear(x, weight)) along the sequence as one ring, the reduce-scatter
    hidden behind the matmul: a row-parallel forward under sequence parallel. Differentiable.

    x: (B, S, in/n), every position, this rank's input features; weight: (out, in/n) -> (B, S/n,
    out), the sum over the ranks at this rank's positions. No bias: add it after (once).
    """
    call = "matmul_reduce_scatter"
    _check_input(call, x, "(B, S, in/tp), every position")
    n = comm.group_size(group)
    if x.shape[1] % n:
        raise ValueError(f"{call}: sequence length S={x.shape[1]} (dim 1 of the input "
                         f"{tuple(x.shape)}) is not divisible by tp={n}: each rank keeps S/tp "
                         f"positions")
    _check_weight(call, weight, x)
    comm.name_group(group, "tp", unless_named=True)
    return _MatmulReduceScatter.apply(x, weight, group, label)


# -- the layers ------------------------------------------------------------------------------------
class OverlappedColumnParallelLinear(tp.ColumnParallelLinear):
    """``tp.ColumnParallelLinear`` under sequence parallel (the same weight slice, the same split),
    whose forward runs the sequence all-gather and the matmul as one ring: (B, S/tp, D) ->
    (B, S, out/tp)."""

    def __init__(self, linear: nn.Linear, tp_group, *, label: str = "tp"):
        super().__init__(linear, tp_group, sequence_parallel=True, label=label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, S/tp, D) this rank's positions → (B, S, out/tp) every position
        y = all_gather_matmul(x, self.weight, self.tp_group, self.label)
        return y if self.bias is None else y + self.bias


class OverlappedRowParallelLinear(tp.RowParallelLinear):
    """``tp.RowParallelLinear`` under sequence parallel (the same weight slice, the same
    replicated bias), whose forward runs the matmul and the reduce-scatter as one ring:
    (B, S, in/tp) -> (B, S/tp, out)."""

    def __init__(self, linear: nn.Linear, tp_group, *, input_is_parallel: bool = True,
                 label: str = "tp"):
        super().__init__(linear, tp_group, input_is_parallel=input_is_parallel,
                         sequence_parallel=True, label=label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            # (B, S, in) → (B, S, in/tp)
            x = regions.split_to_parallel(x, self.tp_group, dim=-1, label=self.label)
        y = matmul_reduce_scatter(x, self.weight, self.tp_group, self.label)  # (B, S/tp, out)
        if self.bias is None:
            return y
        # the bias meets only this rank's S/tp positions: f sums its gradient, as in tp
        bias = regions.copy_to_parallel(self.bias, self.tp_group, label=self.label + "/bias")
        return y + bias


def forward_together(x: torch.Tensor,
                     *columns: OverlappedColumnParallelLinear) -> tuple[torch.Tensor, ...]:
    """Several column layers that read the same input (w1 and w3; wq, wk and wv) in one ring:
    each chunk of x travels once and meets every layer's weight, so they send what one
    all-gather sends (and backward one reduce-scatter of their summed input gradients, as Megatron's
    f does for them). x: (B, S/tp, D) -> one (B, S, out_i/tp) per layer."""
    first = columns[0]
    if any(c.tp_group is not first.tp_group for c in columns):
        raise ValueError("forward_together: the layers should share one tp group")
    outputs = all_gather_matmul(x, [c.weight for c in columns], first.tp_group, first.label)
    outputs = outputs if len(columns) > 1 else (outputs,)
    return tuple(y if c.bias is None else y + c.bias for c, y in zip(columns, outputs))


class OverlappedFeedForward(nn.Module):
    """``tp.ParallelFeedForward`` under sequence parallel with both its messages hidden: w1 and w3
    (column) gather the positions in one ring, w2 (row) reduce-scatters its sum in another.
    (B, S/tp, D) -> (B, S/tp, D). Parameter names are the plain model's."""

    def __init__(self, feed_forward: FeedForward, tp_group, label: str = "tp"):
        super().__init__()
        self.tp_group, self.label = tp_group, label
        self.w1 = OverlappedColumnParallelLinear(feed_forward.w1, tp_group, label=label)
        self.w3 = OverlappedColumnParallelLinear(feed_forward.w3, tp_group, label=label)
        self.w2 = OverlappedRowParallelLinear(feed_forward.w2, tp_group, label=label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, S/tp, D) → (B, S, F/tp), twice, from one ring
        gate, up = forward_together(x, self.w1, self.w3)
        return self.w2(F.silu(gate) * up)  # (B, S/tp, D), summed over ranks
