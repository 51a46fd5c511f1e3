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

``ring_all_reduce`` is **pipelined**: a chunk larger than ``sub_chunk_bytes`` travels as several
sub-chunks. The chunk a rank receives at step s is the one it sends at step s+1, so as soon as one
sub-chunk has arrived and been added it goes on to the right, while the next sub-chunks are still
on the wire; the receives of the next step are posted a step ahead. The bytes are the same (the
same chunks, cut finer); what changes is that a rank no longer waits for a whole chunk, nor for its
slowest neighbour to finish a step, before the next transfer starts: the latency of each step is
hidden behind the transfers of the others.
"""

from __future__ import annotations

import math

import torch

from minitp import comm

# A chunk above this travels as several sub-chunks (ring_all_reduce). Each sub-chunk is one more
# message, and on a CPU shared by more ranks than cores each message costs a wake-up of a process
# that waits. Measured there (16 MB on 4 ranks, 2 cores, 40 rounds against gloo's all_reduce): whole
# 4 MiB chunks 1.03-1.09x gloo, 2 MiB sub-chunks 0.99-1.14x, 1 MiB 1.17-1.19x; with the inboxes
# kept between calls (16 rounds, three runs), whole chunks 0.91-0.96x, 1 MiB 1.03-1.12x. On real
# links, with a core per rank, smaller sub-chunks hide more.
SUB_CHUNK_BYTES = 4 * 2**20


def _neighbours(group) -> tuple[int, int, int, int]:
    """(n, this rank's place in the group, global rank on the right, global rank on the left)."""
    ranks = comm.group_ranks(group)
    n, r = len(ranks), comm.group_rank(group)
    return n, r, ranks[(r + 1) % n], ranks[(r - 1) % n]


_INBOXES: dict = {}


def _inboxes(pieces: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Two buffers shaped like ``pieces``, the same ones each call with the same shapes (the last
    size only)."""
    key = tuple((p.shape, p.dtype, p.device) for p in pieces)
    if key not in _INBOXES:
        _INBOXES.clear()
        _INBOXES[key] = [[torch.empty_like(p) for p in pieces] for _ in range(2)]
    return _INBOXES[key]


def _step(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group, label: str) -> None:
    """Send ``send`` to the right and receive ``recv`` from the left, both at once."""
    handle = comm.isend(send.contiguous(), right, group=group, label=label)
    comm.recv(recv, left, group=group, label=label)
    handle.wait()


def ring_all_gather_(chunks: list[torch.Tensor], group=None, label: str = "ring") -> None:
    """Fill ``chunks`` (n views of one buffer) on every rank, the ring way, in place: this rank
    starts with chunk r complete."""
    n, r, right, left = _neighbours(group)
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        _step(chunks[send_i], chunks[recv_i], right, left, group, f"{label}/all_gather/step{step}")


def ring_all_reduce(tensor: torch.Tensor, group=None, label: str = "ring",
                    record: list | None = None,
                    sub_chunk_bytes: int = SUB_CHUNK_BYTES) -> torch.Tensor:
    """Sum ``tensor`` over the group in place with a ring (reduce-scatter, then all-gather).

    Equal to ``comm.all_reduce(tensor)`` (up to the order of floating-point additions), built only
    from sends and receives. The number of elements need not divide by n: the chunks are then of
    nearly equal size. Chunks above ``sub_chunk_bytes`` are pipelined as sub-chunks (see the top);
    the sums are the same, element by element. ``record``: a list that gets one dict for the start
    (phase "start") and one per step (phase, step, chunk sent, chunk received, to, from), each with
    ``tensor``: a copy of the tensor at that point, for drawing the ring step by step.
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor (it works on views of it)")
    if sub_chunk_bytes <= 0:
        raise ValueError(f"sub_chunk_bytes must be > 0, got {sub_chunk_bytes}")
    n, r, right, left = _neighbours(group)
    if n == 1:
        return tensor
    chunks = torch.tensor_split(tensor.view(-1), n)  # views: writing a chunk writes the tensor
    k = max(1, math.ceil(chunks[0].numel() * tensor.element_size() / sub_chunk_bytes))
    pieces = [torch.tensor_split(c, k) for c in chunks]  # pieces[c][j]: sub-chunk j of chunk c
    if record is not None:
        record.append({"phase": "start", "step": 0, "sent": None, "received": None, "to": None,
                       "from": None, "tensor": tensor.detach().clone()})
    # reduce-scatter, then all-gather; at step s chunk (r-s) leaves, (r-s-1) comes
    steps = 2 * (n - 1)
    # Two inboxes of sub-chunks, used in turn by the reduce-scatter steps: step s fills one while
    # step s-1's is being added from. Kept for the next call of the same size: fresh ones cost the
    # kernel's zeroing of their pages at first touch (5 % of a 16 MB all-reduce on 4 ranks,
    # measured).
    inbox = _inboxes(pieces[0])
    sends: list[list[comm.Handle]] = []

    def phase(s):
        return ("reduce_scatter", s) if s < n - 1 else ("all_gather", s - (n - 1))

    def post_receives(s):
        name, t = phase(s)
        if name == "reduce_scatter":
            targets = [buf[:p.numel()] for buf, p in zip(inbox[s % 2], pieces[(r - s - 1) % n])]
        else:  # straight into the chunk, once it has left at reduce-scatter step t
            for handle in sends[t]:
                handle.wait()
            targets = pieces[(r - s - 1) % n]
        return [comm.irecv(x, left, group=group, label=f"{label}/{name}/step{t}") for x in targets]

    def send(s, j):
        name, t = phase(s)
        sends[s].append(comm.isend(pieces[(r - s) % n][j], right, group=group,
                                   label=f"{label}/{name}/step{t}"))

    # Receives are posted a step ahead, so the left neighbour never waits on us; not when recording,
    # since an all-gather receive lands in the tensor itself and a snapshot would catch it early.
    ahead = record is None
    receives = post_receives(0)
    sends.append([])
    for j in range(k):
        send(0, j)
    for s in range(steps):
        name, t = phase(s)
        incoming = receives if ahead or s == 0 else post_receives(s)
        if s + 1 < steps:
            if ahead:
                receives = post_receives(s + 1)
            sends.append([])
        arrived = pieces[(r - s - 1) % n]
        for j in range(k):
            incoming[j].wait()
            if name == "reduce_scatter":
                # add the partial sum from the left
                arrived[j].add_(inbox[s % 2][j][:arrived[j].numel()])
            if s + 1 < steps:
                send(s + 1, j)  # this sub-chunk goes on while the next ones are still arriving
        if record is not None:
            record.append({"phase": name, "step": t, "sent": (r - s) % n,
                           "received": (r - s - 1) % n, "to": right, "from": left,
                           "tensor": tensor.detach().clone()})
    for handles in sends:
        for handle in handles:
            handle.wait()
    return tensor


def _equal_chunks(big: torch.Tensor, small: torch.Tensor, n: int, what: str) -> list[torch.Tensor]:
    if big.numel() != n * small.numel():
        raise ValueError(f"{what}: the full buffer has {big.numel()} elements, expected "
                         f"{n} ranks x {small.numel()} = {n * small.numel()}")
    if not big.is_contiguous():
        raise ValueError(f"{what} needs a contiguous full buffer (it works on views of it)")
    return list(big.view(-1).chunk(n))


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None,
                    label: str = "ring") -> torch.Tensor:
    """``comm.all_gather`` from sends and receives: rank i's ``input`` lands in chunk i of
    ``output`` on every rank. Each rank sends (n-1)/n * B, B being the bytes of ``output``."""
    n, r = comm.group_size(group), comm.group_rank(group)
    chunks = _equal_chunks(output, input, n, "ring_all_gather")
    chunks[r].copy_(input.reshape(-1))
    ring_all_gather_(chunks, group, label)
    return output

