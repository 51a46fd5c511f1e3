"""Data parallel from scratch: every rank holds the whole model and sees a slice of the batch.

After backward each rank has the gradient of *its* slice; averaging the gradients over ranks gives
the gradient of the whole batch, so every replica takes the same optimizer step and they stay equal.

The averaging is an all-reduce, and how it is issued is the whole craft:

* Gradients are packed into **buckets** (a flat buffer of about ``bucket_mb`` each). One message per
  bucket instead of one per parameter: fewer, larger messages use the network better.
* A bucket is all-reduced **as soon as its last gradient is ready**, from a hook that autograd
  calls during backward, so communication overlaps the rest of backward. Parameters are bucketed in
  reverse order, roughly the order backward produces their gradients (the last layer's first).
* Buckets are launched strictly in order (bucket 3 waits for bucket 2): every rank must issue the
  same collectives in the same order, or they pair up wrongly and hang.
* At the end of backward (an autograd callback) the remaining buckets are launched and all are
  waited for. Each ``param.grad`` is a **view into its bucket** (PyTorch's
  ``gradient_as_bucket_view``), so the averaged values are already where the optimizer reads them:
  nothing is copied back. The hook on each parameter puts its gradient into the bucket divided by n
  as soon as backward has made it, in one pass (in place if backward accumulated straight into the
  view), so the tensor backward made is freed while backward goes on and the next gradients reuse
  its memory (as PyTorch's reducer does; filling each bucket once it was complete kept a bucket of
  gradients alive, and the small model's step ran 10 % slower, its matmuls writing to fresh pages).
* ``no_sync()`` turns the hooks off, so gradients just accumulate locally (gradient
  accumulation); the first backward outside it all-reduces the accumulated sum, or
  ``finish_gradients()`` does it at once (the data-parallel protocol, ``minitp.replicas``).
* A parameter that **no rank used** (a branch the forward skipped) keeps ``grad`` None, as on one
  process, so the optimizer skips it: weight decay does not move it, its step count stays. The ranks
  agree on it inside the bucket's own all-reduce, with no extra byte: a rank that did not use a
  parameter sends -0.0 for it. Adding -0.0 changes nothing (x + -0.0 = x), and only a sum of -0.0
  alone is -0.0, so an average that is -0.0 in every element was used by no rank. A rank that used a
  parameter adds +0.0 to its share (-0.0 + 0.0 = +0.0), so it never sends -0.0; only a rank that did
  not use a parameter looks at its average. A parameter used on some ranks gets the average, the
  other ranks counting as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from minitp import comm
from minitp import trace as _trace
from minitp.layout import bucket_ranges
from minitp.replicas import GradientSync, used_by_no_rank


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # flat: the gradients of ``params`` side by side
    views: list[torch.Tensor]  # each parameter's slice of ``buffer``, shaped like the parameter
    # positions of the params whose hook ran this pass
    arrived: set[int] = field(default_factory=set)
    handle: comm.Handle | None = field(default=None, repr=False)
    # positions of the params this rank did not use
    unused_here: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters (already in backward order) into buckets of at most ``bucket_bytes``; a
    parameter larger than a bucket gets one of its own (``minitp.layout.bucket_ranges``, which
    ``minitp.cost.num_buckets`` counts)."""
    ranges = bucket_ranges([p.numel() * p.element_size() for p in params], bucket_bytes)
    return [params[r.start:r.stop] for r in ranges]


class DistributedDataParallel(GradientSync, nn.Module):
    """Wrap a model so that backward leaves every rank with the gradient averaged over ``group``.

    module: the plain model, built the same way on every rank (its parameters are broadcast from
        the group's first rank anyway, as a start-up guarantee).
    group: the data-parallel process group (None: the world).
    bucket_mb: bucket size in MiB (2**20 bytes).
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None,
                 bucket_mb: float = 25.0):
        super().__init__()
        if not bucket_mb or bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module = module
        self.group = group
        comm.name_group(group, "dp", unless_named=True)  # its messages' Event.dim
        self.world_size = comm.group_size(group)
        self.bucket_bytes = int(bucket_mb * 2**20)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no parameters that require a gradient")
        self._broadcast_parameters(params)

        # Buckets in backward order: the last parameters registered are the first to get gradients.
        self.buckets: list[Bucket] = []
        for i, group_params in enumerate(make_buckets(params[::-1], self.bucket_bytes)):
            sizes = [p.numel() for p in group_params]
            buffer = torch.zeros(sum(sizes), dtype=group_params[0].dtype,
                                 device=group_params[0].device)
            # side by side
            views = [v.view_as(p) for v, p in zip(buffer.split(sizes), group_params)]
            self.buckets.append(Bucket(i, group_params, buffer, views))
        self._slot_of = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._zero, self._share = torch.zeros((), dtype=params[0].dtype), 1.0 / self.world_size
        self._next_bucket = 0  # the next bucket to launch, so they go out in order
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- start-up ------------------------------------------------------------------------------
    @torch.no_grad()
    def _broadcast_parameters(self, params: list[nn.Parameter]) -> None:
        """Make every replica start from the first rank's weights: one flat broadcast."""
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        with _trace.tagged(phase="init"):
            comm.broadcast(flat, src=comm.group_ranks(self.group)[0], group=self.group,
                           label="ddp/init")
        offset = 0
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    # -- during backward -----------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        self.queue_finish()  # finish_gradients, once, when this whole backward pass is over
        bucket, i = self._slot_of[param]
        # into the bucket now, while backward has not moved on: the tensor backward made is freed
        # at once, and the next layers' gradients reuse its memory (filling a bucket only once it is
        # complete kept a bucket's worth of them alive: the small model's step 10 % slower)
        self._fill(param, param.grad, bucket.views[i])
        bucket.arrived.add(i)
        while self._next_bucket < len(self.buckets):
            nxt = self.buckets[self._next_bucket]
            if len(nxt.arrived) < len(nxt.params):
                break
            self._launch(nxt)

    def _fill(self, param: nn.Parameter, grad: torch.Tensor, view: torch.Tensor) -> None:
        """This rank's share of the average into the bucket, view = 0.0 + grad/n (never -0.0: see
        the top), in one pass (in place where backward accumulated into the view already); from
        now on the gradient is its view."""
        torch.add(self._zero, grad, alpha=self._share, out=view)
        param.grad = view

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        """Fill what did not arrive during backward (gradients accumulated under ``no_sync``, or
        -0.0 for a parameter this rank did not use) and start the bucket's all-reduce. Each
        gradient is then its view: backward accumulates in the bucket itself."""
        bucket.unused_here = []
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            if i in bucket.arrived:
                continue
            if p.grad is None:  # took no part in this forward: -0.0 says so
                view.fill_(-0.0)
                bucket.unused_here.append(i)
            else:
                self._fill(p, p.grad, view)
        with _trace.tagged(phase="backward"):  # the gradients' all-reduce, whenever it is launched
            bucket.handle = comm.all_reduce(bucket.buffer, group=self.group,
                                            label=f"ddp/bucket{bucket.index}", async_op=True)
        self._next_bucket += 1

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Launch what is left, wait for every bucket: at the end of backward, or at once after
        backward passes under ``no_sync`` (a pipeline's micro-batches), sending the accumulated
        sum."""
        while self._next_bucket < len(self.buckets):  # buckets holding unused parameters
            self._launch(self.buckets[self._next_bucket])
        for bucket in self.buckets:
            bucket.handle.wait()
            # a parameter used here is used: only these can be unused by all
            for i in bucket.unused_here:
                p, averaged = bucket.params[i], bucket.views[i]
                # (used elsewhere: the average)
                p.grad = None if used_by_no_rank(averaged) else averaged
            bucket.handle = None
            bucket.arrived.clear()
        self._next_bucket = 0


# -- the data side ---------------------------------------------------------------------------------
def split_batch(batch: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (dim 0).

    The batch must divide evenly: with equal slices the average of the ranks' mean losses is the
    mean loss of the whole batch, which is what makes data parallel equal one process. An uneven
    split would need the slices weighted by their sizes, so it is refused rather than silently off.
    """
    n, r = comm.group_size(group), comm.group_rank(group)
    if batch.shape[0] % n:
        raise ValueError(
            f"a batch of {batch.shape[0]} rows is not divisible by the {n} ranks of the "
            f"data-parallel group; use a batch size that is a multiple of {n}")
    rows = batch.shape[0] // n
    return batch[r * rows:(r + 1) * rows]


class DistributedSampler:
    """Which dataset indices this rank reads each epoch: a shuffled order (the same on every rank,
    from ``seed`` and the epoch), dealt out like cards so the ranks' index sets never overlap.

    ``len(dataset)`` must divide by the number of ranks (see ``split_batch`` for why).
    """

    def __init__(self, dataset_size: int, group: dist.ProcessGroup | None = None,
                 shuffle: bool = True, seed: int = 0):
        self.n, self.rank = comm.group_size(group), comm.group_rank(group)
        if dataset_size % self.n:
            raise ValueError(
                f"a dataset of {dataset_size} samples is not divisible by the {self.n} "
                f"ranks of the data-parallel group")
        self.dataset_size, self.shuffle, self.seed, self.epoch = dataset_size, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=g).tolist()
        else:
            order = list(range(self.dataset_size))
        return iter(order[self.rank::self.n])

    def __len__(self) -> int:
        return self.dataset_size // self.n


def all_reduce_mean(value: torch.Tensor | float, group: dist.ProcessGroup | None = None,
                    label: str = "ddp/metric") -> float:
    """The mean of a metric over the ranks (e.g. each rank's evaluation loss)."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone().reshape(1).to(comm.device())
    comm.all_reduce(t, group=group, label=label)
    return t.item() / comm.group_size(group)
