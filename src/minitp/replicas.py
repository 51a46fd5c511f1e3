"""What every wrapper that keeps replicas in step shares: one data-parallel protocol.

DDP, FSDP, and the replicated parts of expert and context parallel all average gradients over a
group of ranks after backward. Each exposes the same two things, so a trainer
(``minitp.parallel3d.Parallel3D``) calls them without asking which one it holds:

* ``no_sync()``: backward passes inside accumulate gradients locally and send nothing (gradient
  accumulation; a pipeline's micro-batches, each running its own backward);
* ``finish_gradients()``: average what has accumulated, now. Outside ``no_sync`` it runs by itself,
  once, when a backward pass is over; after backward passes under ``no_sync``, call it yourself.

The mechanics they share are written once, here: the ``no_sync`` flag, queueing the finish at the
end of backward (autograd's ``queue_callback``, from the first gradient hook of the pass), one flat
all-reduce of a list of gradients, and how a -0.0 average tells that no rank used a parameter
(``minitp.ddp`` explains that trick).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from minitp import comm


class GradientSync:
    """The protocol, with its shared mechanics. A subclass writes ``finish_gradients`` and calls
    ``queue_finish()`` from its gradient hooks (or ``self.sync`` to skip work under ``no_sync``)."""

    sync: bool = True  # False inside no_sync(): gradients accumulate, nothing is sent
    _finish_queued: bool = False

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally and send nothing; call
        ``finish_gradients()`` after them."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def queue_finish(self) -> None:
        """From a gradient hook: run ``finish_gradients`` once, when this backward pass is over
        (nothing under ``no_sync``)."""
        if self.sync and not self._finish_queued:
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_from_backward)

    def _finish_from_backward(self) -> None:
        self._finish_queued = False
        self.finish_gradients()

    def finish_gradients(self) -> None:
        raise NotImplementedError


@torch.no_grad()
def all_reduce_mean(grads: list[torch.Tensor], group, divide_by: int, label: str,
                    divide_first: bool = True) -> None:
    """Sum ``grads`` over ``group`` in one flat all-reduce and divide them by ``divide_by``, in
    place (flatten, all-reduce, copy back: one message instead of one per tensor). ``divide_first``:
    divide before the sum (as DDP does) or after it; the two round differently in the last bit."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if divide_first:
        flat.div_(divide_by)
    comm.all_reduce(flat, group=group, label=label)
    if not divide_first:
        flat.div_(divide_by)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def used_by_no_rank(averaged: torch.Tensor) -> bool:
    """Did every rank send -0.0 for every element, i.e. did no rank use this parameter? (-0.0 stays
    -0.0 through the division by n and a sum of -0.0 alone; any rank's 0.0 or value makes it
    not.)"""
    return not averaged.any() and bool(averaged.signbit().all())
