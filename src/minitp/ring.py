"""Ring collectives written from point-to-point messages, the way bandwidth-optimal libraries do it.

The ranks of a group stand in a ring: each sends only to its right neighbour and receives only
from its left one. A buffer of B bytes is cut into n chunks of B/n.

* **reduce-scatter** (n-1 steps): at each step every rank passes one chunk to the right and adds
  the chunk arriving from the left into its own copy. After n-1 steps rank r holds the complete
  sum of chunk (r+1) mod n.
* **all-gather** (n-1 steps): the same ring, but the arriving chunk is copied, not added, so each
  complete chunk travels round until every rank has all of them.

An all-reduce is a reduce-scatter followed by an all-gather: 2(n-1) steps, each sending B/n, so
each rank sends 2(n-1)/n * B, almost 2B however many ranks there are (``minitp.cost``).

Every message goes through ``minitp.comm``, so the bytes show up in the trace. Each step posts
its send without blocking (``isend``) and then receives, so no rank waits on a neighbour that is
itself waiting to send.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minitp import comm


def _neighbours(group) -> tuple[int, int, int, int]:
    """(n, this rank's place in the group, global rank on the right, global rank on the left)."""
    ranks = comm.group_ranks(group)
    n, r = len(ranks), comm.group_rank(group)
    return n, r, ranks[(r + 1) % n], ranks[(r - 1) % n]


def _step(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group, label: str) -> None:
    """Send ``send`` to the right and receive ``recv`` from the left, both at once."""
    handle = comm.isend(send.contiguous(), right, group=group, label=label)
    comm.recv(recv, left, group=group, label=label)
    handle.wait()


def ring_reduce_scatter_(chunks: list[torch.Tensor], group=None, label: str = "ring",
                         on_step: Callable[[dict], None] | None = None) -> int:
    """Sum ``chunks`` (n views of one buffer) over the group in place, the ring way.

    Returns the index of the chunk this rank ends up holding complete: (r+1) mod n. The other
    chunks hold partial sums afterwards. ``on_step`` is called after each step with a dict saying
    what moved (phase, step, chunk sent, chunk received, to, from).
    """
    n, r, right, left = _neighbours(group)
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        _step(chunks[send_i], incoming, right, left, group, f"{label}/reduce_scatter/step{step}")
        chunks[recv_i] += incoming  # add what the left neighbour has summed so far
        if on_step is not None:
            on_step({"phase": "reduce_scatter", "step": step, "sent": send_i, "received": recv_i,
                     "to": right, "from": left})
    return (r + 1) % n


def ring_all_gather_(chunks: list[torch.Tensor], group=None, label: str = "ring",
                     on_step: Callable[[dict], None] | None = None, first: int | None = None) -> None:
    """Fill ``chunks`` (n views of one buffer) on every rank, the ring way, in place.

    ``first`` is the chunk this rank holds complete at the start: r for a plain all-gather,
    (r+1) mod n right after a ring reduce-scatter.
    """
    n, r, right, left = _neighbours(group)
    first = r if first is None else first
    for step in range(n - 1):
        send_i, recv_i = (first - step) % n, (first - step - 1) % n
        _step(chunks[send_i], chunks[recv_i], right, left, group, f"{label}/all_gather/step{step}")
        if on_step is not None:
            on_step({"phase": "all_gather", "step": step, "sent": send_i, "received": recv_i,
                     "to": right, "from": left})


def ring_all_reduce(tensor: torch.Tensor, group=None, label: str = "ring",
                    record: list | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group in place with a ring (reduce-scatter, then all-gather).

    Equal to ``comm.all_reduce(tensor)`` (up to the order of floating-point additions), built only
    from sends and receives. The number of elements need not divide by n: the chunks are then of
    nearly equal size. ``record``: a list that gets one dict for the start (phase "start") and one
    per step (phase, step, chunk sent, chunk received, to, from), each with ``tensor``: a copy of
    the tensor at that point, for drawing the ring step by step.
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor (it works on views of it)")
    n = comm.group_size(group)
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, n))  # views: writing a chunk writes the tensor
    on_step = None
    if record is not None:
        record.append({"phase": "start", "step": 0, "sent": None, "received": None, "to": None,
                       "from": None, "tensor": tensor.detach().clone()})

        def on_step(entry):
            record.append({**entry, "tensor": tensor.detach().clone()})

    owned = ring_reduce_scatter_(chunks, group, label, on_step)
    ring_all_gather_(chunks, group, label, on_step, first=owned)
    return tensor


def _equal_chunks(big: torch.Tensor, small: torch.Tensor, n: int, what: str) -> list[torch.Tensor]:
    if big.numel() != n * small.numel():
        raise ValueError(f"{what}: the full buffer has {big.numel()} elements, expected "
                         f"{n} ranks x {small.numel()} = {n * small.numel()}")
    if not big.is_contiguous():
        raise ValueError(f"{what} needs a contiguous full buffer (it works on views of it)")
    return list(big.view(-1).chunk(n))


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, label: str = "ring") -> torch.Tensor:
    """``comm.all_gather`` from sends and receives: rank i's ``input`` lands in chunk i of
    ``output`` on every rank. Each rank sends (n-1)/n * B, B being the bytes of ``output``."""
    n, r = comm.group_size(group), comm.group_rank(group)
    chunks = _equal_chunks(output, input, n, "ring_all_gather")
    chunks[r].copy_(input.reshape(-1))
    ring_all_gather_(chunks, group, label)
    return output


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None,
                        label: str = "ring") -> torch.Tensor:
    """``comm.reduce_scatter`` from sends and receives: rank i gets the sum over ranks of chunk i
    of ``input`` (``input`` is left untouched). Each rank sends (n-1)/n * B, B the bytes of
    ``input``."""
    n = comm.group_size(group)
    chunks = _equal_chunks(input, output, n, "ring_reduce_scatter")
    work = [c.clone() for c in chunks]
    # The ring leaves rank r with list entry (r+1) mod n complete; list chunk i-1 at entry i so
    # that this entry is chunk r itself.
    shifted = work[-1:] + work[:-1]
    owned = ring_reduce_scatter_(shifted, group, label)
    output.view(-1).copy_(shifted[owned])
    return output
