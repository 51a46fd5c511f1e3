"""Activation memory, measured: what autograd keeps for backward, block by block, on each rank.

Between forward and backward a model holds, besides its parameters, every tensor an operation saved
to compute its gradient (``ctx.save_for_backward`` and the built-in ops' own). PyTorch lets us see
each one as it is saved: ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` calls ``pack``
on every saved tensor. We count each distinct storage once (a tensor saved by two ops, or a view of
one already saved, costs nothing more), and leave out parameters and buffers (held anyway).

``run_recomputed`` is full activation recomputation written out: forward runs the block without
keeping anything but its input; backward runs the block's forward again, then its backward. So what
the hooks see is the input alone, and under tensor parallel the re-run forward sends its collectives
again (6 per block instead of 4: ``minitp.cost.tp_block_bytes(recompute=True)``).

``minitp.cost.tiny_block_activation_bytes`` is the formula, tensor by tensor, for a block of
``minitp.models``; ``minitp.cost.block_activation_bytes`` is Korthikanti et al.'s for large models.
The run that counts them on each rank of tensor parallel builds a strategy, so it is a runner's:
``minitp.runs.measuring.measure_activations``.
"""

from __future__ import annotations

import torch
from torch import nn


class SavedTensors:
    """Counts the bytes of distinct storages autograd saves while active (parameters left out)."""

    def __init__(self, module: nn.Module):
        self.held = {t.untyped_storage().data_ptr() for t in [*module.parameters(),
                                                              *module.buffers()]}
        self.storages: dict[int, int] = {}  # data_ptr -> nbytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.held:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_bytes_per_block(model: nn.Module, run) -> list[int]:
    """Bytes autograd saves inside each block of ``model.layers`` while ``run()`` does a forward."""
    counters = [SavedTensors(model) for _ in model.layers]
    handles = []
    for block, counter in zip(model.layers, counters):
        # a hook's return value would replace the block's input or output: return None
        handles.append(block.register_forward_pre_hook(lambda _m, _a, c=counter: c.__enter__()
                                                       and None))
        handles.append(block.register_forward_hook(
            lambda _m, _a, _o, c=counter: c.__exit__(None, None, None)))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return [c.bytes for c in counters]


class _Recompute(torch.autograd.Function):
    """Keep only the input x; in backward run ``forward`` again with gradients on, then its
    backward."""

    @staticmethod
    def forward(ctx, x, forward, args):
        ctx.forward, ctx.args = forward, args
        ctx.save_for_backward(x)  # (B, S, D): all that is kept
        with torch.no_grad():
            return forward(x, *args)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.forward(x, *ctx.args)  # forward again: its collectives too
        torch.autograd.backward(y, grad)  # the parameters' gradients accumulate here
        return x.grad, None, None


def run_recomputed(forward, x, *args):
    """Run a block's ``forward`` under full activation recomputation: what ``TransformerBlock``
    takes as ``recompute=`` (``model(tokens, recompute=run_recomputed)``)."""
    return _Recompute.apply(x, forward, args)

