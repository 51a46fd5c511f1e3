"""Context parallel: the sequence split over the ranks of a cp group, attention as a ring.

Every layer but attention treats positions independently, so each rank runs them on its own
positions only. Attention needs every key: each rank keeps its queries and passes its keys and
values around the ring (to rank+1, from rank-1), one block per step, sending the next block while it
computes with the current one (``isend``/``irecv``). After cp steps every query has met every key.
The blocks' results are combined by the online softmax of flash attention (a running max ``m``, a
running sum ``row_sum`` of exponentials and an unnormalised output), so the full S x S score matrix
never exists anywhere: that is what lifts the memory wall of long sequences.

Causal masking makes the work uneven when rank i holds the i-th contiguous slice (rank 0 attends to
one block, rank cp-1 to all). Cutting the sequence into 2·cp chunks and giving rank i chunks i and
2cp-1-i evens it out (``minitp.layout.cp_chunks``); RoPE rotates each position by its true index.

Backward is written by hand (``RingAttention``): queries stay, keys and values go around the ring
again, and their gradients dK, dV travel with them, gathering each rank's contribution, one more
hop bringing them home. Messages per attention call, with KV = B·Hkv·(S/cp)·Dh·b bytes (keys or
values of one rank): forward (cp-1)·2KV, backward (cp-1)·2KV for the blocks plus cp·2KV for their
gradients (``minitp.cost.cp_attention_bytes``).

Reading order, the textbook core first: this rank's positions, the online softmax and the blocks of
attention, the ring (``RingAttention``), the model under context parallel (``Context``,
``ContextParallel``). The extras after: Ulysses' all-to-all way, LLaMA 3's all-gather way, the
measured memory wall.

Shapes: B batch, H query heads, Hkv key/value heads, Dh head dim, S sequence, Sl = S/cp local.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from minitp import comm, layout
from minitp import trace as _trace
from minitp.models.llama import causal_attention
from minitp.regions import all_to_all_rows, gather_from_sequence_parallel
from minitp.replicas import GradientSync, all_reduce_mean


# -- the layout: this rank's positions -------------------------------------------------------------
def ring_peers(group=None) -> tuple[int, int]:
    """The global ranks this rank sends to (next) and receives from (previous) on the ring."""
    ranks, me = comm.group_ranks(group), comm.group_rank(group)
    return ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]


def shard_sequence(x: torch.Tensor, group=None, balanced: bool = True,
                   dim: int = 1) -> torch.Tensor:
    """This rank's positions of ``x`` along ``dim``: (B, S, ...) -> (B, Sl, ...)."""
    n, rank = comm.group_size(group), comm.group_rank(group)
    index = torch.tensor(layout.cp_positions(x.shape[dim], n, rank, balanced), device=x.device)
    return x.index_select(dim, index).contiguous()


def local_positions(local_len: int, group=None, balanced: bool = True) -> torch.Tensor:
    """(Sl,) the positions of the whole sequence this rank's ``local_len`` ones are
    (``shard_sequence``'s index): what RoPE rotates them by."""
    n, rank = comm.group_size(group), comm.group_rank(group)
    return torch.tensor(layout.cp_positions(local_len * n, n, rank, balanced and n > 1))


def unshard_sequence(shards: list[torch.Tensor], balanced: bool = True,
                     dim: int = 1) -> torch.Tensor:
    """Put every rank's positions back in sequence order: the inverse of ``shard_sequence``."""
    n = len(shards)
    seq = shards[0].shape[dim] * n
    order = [p for rank in range(n) for p in layout.cp_positions(seq, n, rank, balanced)]
    out = torch.cat(shards, dim=dim)
    inverse = torch.empty(seq, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(seq)
    return out.index_select(dim, inverse.to(out.device))


# -- the online softmax ----------------------------------------------------------------------------
def online_softmax_update(m: torch.Tensor, row_sum: torch.Tensor, acc: torch.Tensor,
                          scores: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block of keys into the running softmax of each query row.

    m: (..., Sq) running max of the scores seen so far (-inf before any); row_sum: (..., Sq) running
    sum of exp(score - m); acc: (..., Sq, Dh) running sum of exp(score - m) · v. scores: (..., Sq,
    Sk) of this block (-inf where masked), v: (..., Sk, Dh). Rescaling the old sums by exp(m_old -
    m_new) keeps every exponent <= 0, so nothing overflows; at the end softmax(scores) @ v = acc /
    row_sum."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    # a row with no key yet
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    correction = torch.exp(m - m_safe)  # 0 where m was -inf
    p = torch.exp(scores - m_safe.unsqueeze(-1))  # (..., Sq, Sk), 0 where masked
    return m_new, row_sum * correction + p.sum(-1), acc * correction.unsqueeze(-1) + p @ v


def _visible(q_chunk: range, k_chunk: range, causal: bool) -> str:
    """How much of a (query chunk, key chunk) pair causal attention needs: "none", "all" or
    "mask"."""
    if not causal or k_chunk.stop <= q_chunk.start:
        return "all"
    if k_chunk.start > q_chunk.stop - 1:
        return "none"
    return "mask"


# a diagonal (masked) pair larger than this is cut in tiles, as flash attention does
TILE = layout.CP_TILE


def _tiles(qc: range, kc: range, causal: bool):
    """The pieces of a (query chunk, key chunk) pair that have work: (queries, keys, masked?). A
    diagonal pair is cut in four: its upper-right quarter is all masked and skipped, the lower-left
    needs no mask, the two diagonal quarters recurse; so causal work is about half a full pair."""
    kind = _visible(qc, kc, causal)
    if kind == "none":
        return
    if kind == "mask" and qc == kc and len(qc) > TILE:
        h = len(qc) // 2
        lo, hi = range(qc.start, qc.start + h), range(qc.start + h, qc.stop)
        yield from _tiles(lo, lo, causal)
        yield hi, lo, False
        yield from _tiles(hi, hi, causal)
        return
    yield qc, kc, kind == "mask"


def _pairs(q_chunks: list[range], k_chunks: list[range], causal: bool):
    """(query rows, key columns, causal mask or None), as slices of the local tensors, of each
    piece of each pair of chunks that has work."""
    qa = 0
    for qc in q_chunks:
        ka = 0
        for kc in k_chunks:
            for qt, kt, masked in _tiles(qc, kc, causal):
                mask = torch.arange(qt.start,
                                    qt.stop)[:, None] >= torch.arange(kt.start, kt.stop)[None, :] \
                    if masked else None  # (sq, sk): query position >= key position
                rows = slice(qa + qt.start - qc.start, qa + qt.stop - qc.start)
                yield rows, slice(ka + kt.start - kc.start, ka + kt.stop - kc.start), mask
            ka += len(kc)
        qa += len(qc)


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: (B, Hkv, S, Dh) -> (B, H, S, Dh), each key/value head serving its
    group."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The transpose of ``_expand``: add the gradients of a group's copies. (B, H, S, Dh) -> (B,
    Hkv, S, Dh)."""
    if groups == 1:
        return grad
    B, H, S, Dh = grad.shape
    return grad.view(B, H // groups, groups, S, Dh).sum(2)


def block_attention_forward(q, k, v, q_chunks, k_chunks, causal, state):
    """Fold the key block (k, v) into ``state`` = (m, row_sum, acc) for every chunk pair that has
    work. q: (B, H, Sq, Dh); k, v: (B, H, Sk, Dh), already expanded. Returns the new state."""
    m, row_sum, acc = state
    scale = 1.0 / math.sqrt(q.shape[-1])
    for rows, cols, mask in _pairs(q_chunks, k_chunks, causal):
        scores = (q[:, :, rows] @ k[:, :, cols].transpose(-2, -1)) * scale  # (B, H, sq, sk)
        if mask is not None:
            scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
        m[:, :, rows], row_sum[:, :, rows], acc[:, :, rows] = online_softmax_update(
            m[:, :, rows], row_sum[:, :, rows], acc[:, :, rows], scores, v[:, :, cols])
    return m, row_sum, acc


def block_attention_backward(q, k, v, lse, grad_out, delta, q_chunks, k_chunks, causal):
    """Gradients of one key block: (dq, dk, dv) with dq (B, H, Sq, Dh) and dk, dv (B, H, Sk, Dh).
    lse: (B, H, Sq) log-sum-exp of every score of each row; delta = rowsum(grad_out · out)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, mask in _pairs(q_chunks, k_chunks, causal):
        qr, kc, vc, go = q[:, :, rows], k[:, :, cols], v[:, :, cols], grad_out[:, :, rows]
        # softmax probs
        p = torch.exp((qr @ kc.transpose(-2, -1)) * scale - lse[:, :, rows].unsqueeze(-1))
        if mask is not None:
            p = p.masked_fill(~mask.to(p.device), 0.0)
        dv[:, :, cols] += p.transpose(-2, -1) @ go
        ds = p * (go @ vc.transpose(-2, -1) - delta[:, :, rows].unsqueeze(-1))  # (B, H, sq, sk)
        dq[:, :, rows] += (ds @ kc) * scale
        dk[:, :, cols] += (ds.transpose(-2, -1) @ qr) * scale
    return dq, dk, dv


# -- the ring --------------------------------------------------------------------------------------
def _exchange(buffer: torch.Tensor, group, label: str, phase: str,
              step: int) -> tuple[torch.Tensor, list[comm.Handle]]:
    """Post the send of ``buffer`` to the next rank and the receive of the previous rank's (their
    events carry the phase and the ring step: ``Event.phase``, ``Event.ring_step``)."""
    nxt, prev = ring_peers(group)
    incoming = torch.empty_like(buffer)
    with _trace.tagged(phase=phase, ring_step=step):
        return incoming, [comm.isend(buffer, nxt, group, label=label),
                          comm.irecv(incoming, prev, group, label=label)]


def _wait(handles: list[comm.Handle]) -> None:
    for h in handles:
        h.wait()


class RingAttention(torch.autograd.Function):
    """Causal or full attention of this rank's queries against every rank's keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, group, seq_len, balanced, causal, label):
        # q: (B, H, Sl, Dh); k, v: (B, Hkv, Sl, Dh), this rank's positions
        n, rank = comm.group_size(group), comm.group_rank(group)
        groups = q.shape[1] // k.shape[1]
        chunks = [layout.cp_chunks(seq_len, n, r, balanced) for r in range(n)]
        m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (B, H, Sl)
        row_sum, acc = torch.zeros_like(m), torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()  # (2, B, Hkv, Sl, Dh): what travels
        for step in range(n):
            source = (rank - step) % n  # whose keys this rank holds at this step
            if step < n - 1:  # send this block on while computing with it
                incoming, handles = _exchange(kv, group, f"{label}/forward/step{step}", "forward",
                                              step)
            with _trace.tagged(phase="forward", ring_step=step), \
                    _trace.span("attention", f"{label}/forward/step{step}"):
                m, row_sum, acc = block_attention_forward(q, _expand(kv[0], groups),
                                                          _expand(kv[1], groups),
                                                    chunks[rank], chunks[source], causal,
                                                    (m, row_sum, acc))
            if step < n - 1:
                _wait(handles)
                kv = incoming
        out = acc / row_sum.unsqueeze(-1)  # (B, H, Sl, Dh)
        lse = m + torch.log(row_sum)  # (B, H, Sl)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.seq_len, ctx.balanced, ctx.causal, ctx.label = (
            group, seq_len, balanced, causal, label)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, label, causal = ctx.group, ctx.label, ctx.causal
        n, rank = comm.group_size(group), comm.group_rank(group)
        groups = q.shape[1] // k.shape[1]
        chunks = [layout.cp_chunks(ctx.seq_len, n, r, ctx.balanced) for r in range(n)]
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)  # (B, H, Sl)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()  # (2, B, Hkv, Sl, Dh)
        dkv = torch.zeros_like(kv)  # gradients of the block held now, gathered as it travels
        for step in range(n):
            source = (rank - step) % n
            if step < n - 1:
                incoming, handles = _exchange(kv, group, f"{label}/backward/step{step}", "backward",
                                              step)
            with _trace.tagged(phase="backward", ring_step=step), \
                    _trace.span("attention", f"{label}/backward/step{step}"):
                dq_s, dk_s, dv_s = block_attention_backward(
                    q, _expand(kv[0], groups), _expand(kv[1], groups), lse, grad_out, delta,
                    chunks[rank], chunks[source], causal)
            dq += dq_s
            dkv = dkv + torch.stack([_fold(dk_s, groups), _fold(dv_s, groups)])
            if n == 1:
                break
            # pass the block's gradients on with it; the last hop brings each rank's own home
            dkv_in, dkv_handles = _exchange(dkv.contiguous(), group, f"{label}/backward/grad{step}",
                                            "backward", step)
            if step < n - 1:
                _wait(handles)
                kv = incoming
            _wait(dkv_handles)
            dkv = dkv_in
        return dq, dkv[0], dkv[1], None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = True, balanced: bool = True, label: str = "cp") -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh)) v over the whole sequence, each rank holding its positions.
    q: (B, H, Sl, Dh), k and v: (B, Hkv, Sl, Dh) -> (B, H, Sl, Dh). Differentiable."""
    if q.shape[2] != k.shape[2] or k.shape != v.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected the same "
            f"local positions (dim 2) and k, v of one shape")
    comm.name_group(group, "cp", unless_named=True)
    seq_len = q.shape[2] * comm.group_size(group)
    if comm.group_size(group) == 1:
        return RingAttention.apply(q, k, v, group, seq_len, False, causal, label)
    return RingAttention.apply(q, k, v, group, seq_len, balanced, causal, label)


# -- the model under context parallel (from outside, the torchtitan way) ---------------------------
def _check_whole_sequences(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            "context parallel trains on whole sequences; generation with a KV cache is not "
            f"supported (queries at {q.shape[2]} positions, keys at {k.shape[2]})")


class RingAttend:
    """The ring over the cp group, as a layer's attention (``Attention.forward(attend=)``): the
    layer's projections, RoPE and output run as they are, on this rank's positions, so a
    tensor-parallel layer (its heads split over tp) takes it just the same."""

    def __init__(self, group=None, balanced: bool = True):
        self.group, self.balanced = group, balanced

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (B, H, Sl, Dh); k, v: (B, Hkv, Sl, Dh) -> (B, H, Sl, Dh)
        _check_whole_sequences(q, k)
        return ring_attention(q, k, v, self.group, causal=True, balanced=self.balanced,
                              label="cp/ring")


ATTENTIONS = layout.CP_ATTENTIONS


class Context:
    """What a model needs to run under context parallel, besides its weights: the attention every
    block runs (the ring, or Ulysses' all-to-alls) and the positions this rank holds. Both go to the
    plain model as arguments, ``model(tokens, **context.inputs(tokens))``: nothing in it is
    replaced. A pipeline stage takes the same object (``minitp.pp.PipelineStage(context=)``)."""

    def __init__(self, group=None, balanced: bool = True, attention: str = "ring"):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        comm.name_group(group, "cp", unless_named=True)
        self.group, self.size, self.balanced = group, comm.group_size(group), balanced
        on = balanced and self.size > 1
        self.attend = (RingAttend(group, on) if attention == "ring" else AllGatherAttend(group, on)
                       if attention == "allgather" else UlyssesAttend(causal_attention, group, on))

    def positions(self, local_len: int) -> torch.Tensor:
        return local_positions(local_len, self.group, self.balanced)

    def inputs(self, tokens: torch.Tensor) -> dict:
        """The model's arguments for this rank's (B, Sl) tokens: RoPE at their true positions, the
        attention."""
        return {"positions": self.positions(tokens.shape[1]).to(tokens.device),
                "attend": self.attend}


class ContextParallel(GradientSync, nn.Module):
    """A plain ``Transformer`` under context parallel: takes this rank's tokens (B, Sl) and returns
    their logits (B, Sl, V). After backward it averages the gradients over the cp group (the
    data-parallel protocol, ``minitp.replicas``): each rank's loss is the mean over its Sl
    positions, so the mean of the ranks' gradients is the gradient of the mean over all S; the
    ring's backward already brought back the keys' and values' share of other ranks' losses."""

    def __init__(self, model: nn.Module, group=None, balanced: bool = True,
                 attention: str = "ring"):
        super().__init__()
        self.model, self.context = model, Context(group, balanced, attention)
        self.group, self.balanced = group, balanced
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.queue_finish())

    def positions(self, local_len: int) -> torch.Tensor:
        return self.context.positions(local_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, **self.context.inputs(tokens))  # (B, Sl, V)

    @torch.no_grad()
    def finish_gradients(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        all_reduce_mean(grads, self.group, self.context.size, "cp/grads", divide_first=False)


def parallelize(model: nn.Module, group=None, balanced: bool = True,
                attention: str = "ring") -> ContextParallel:
    """A ``Transformer`` (plain, or already tensor parallel) in its context-parallel form: every
    attention runs the ring (or, ``attention="ulysses"``, the all-to-alls of ``UlyssesAttend``), at
    this rank's positions; parameters and their names are the model's. Feed it
    ``shard_sequence(tokens, group, balanced)``."""
    return ContextParallel(model, group, balanced, attention)


def replica_share(batch: torch.Tensor, mesh, balanced: bool = True) -> torch.Tensor:
    """This rank's part of a global batch on a mesh whose dp axis holds dp·cp ranks: its replica's
    rows, then its positions. (B, S) -> (B/dp, S/cp)."""
    replicas, replica = mesh.dp // mesh.cp, mesh.coords.dp // mesh.cp
    layout.check_batch(batch.shape[0], replicas)
    rows = batch.shape[0] // replicas
    return shard_sequence(batch[replica * rows:(replica + 1) * rows], mesh.cp_group, balanced)


# -- extras: the other way, all-to-all (DeepSpeed-Ulysses) -----------------------------------------
def _heads_to_sequence(x: torch.Tensor, group, inverse: torch.Tensor, label: str) -> torch.Tensor:
    """(B, Hx, Sl, Dh), every head at this rank's positions -> (B, Hx/n, S, Dh), this rank's n-th of
    the heads at every position, in sequence order: chunk j of the heads goes to rank j."""
    n = comm.group_size(group)
    B, Hx, Sl, Dh = x.shape
    # (n, B, Hx/n, Sl, Dh): chunk j for rank j
    chunks = x.reshape(B, n, Hx // n, Sl, Dh).transpose(0, 1)
    # chunk i: rank i's positions, my heads
    got = all_to_all_rows(chunks, [1] * n, [1] * n, group, label)
    seq = got.permute(1, 2, 0, 3, 4).reshape(B, Hx // n, n * Sl, Dh)  # positions in rank order
    return seq.index_select(2, inverse)


def _sequence_to_heads(x: torch.Tensor, group, order: torch.Tensor, label: str) -> torch.Tensor:
    """The inverse: (B, H/n, S, Dh) in sequence order -> (B, H, Sl, Dh) at this rank's positions."""
    n = comm.group_size(group)
    B, Hn, S, Dh = x.shape
    # (n, B, H/n, Sl, Dh)
    by_rank = x.index_select(2, order).reshape(B, Hn, n, S // n, Dh).permute(2, 0, 1, 3, 4)
    # chunk j: rank j's heads, my positions
    got = all_to_all_rows(by_rank, [1] * n, [1] * n, group, label)
    return got.transpose(0, 1).reshape(B, n * Hn, S // n, Dh)


class UlyssesAttend:
    """The all-to-all way to context parallel (DeepSpeed-Ulysses, Jacobs et al. 2023), in place of a
    layer's ``attend``: an all-to-all turns (every head, S/n positions) into (H/n heads, every
    position) for q, k and v; the layer's own attention runs on its heads over the whole sequence;
    a last all-to-all turns the output back. Four all-to-alls forward, their four transposes
    backward, each sending (n-1)/n of its tensor (``minitp.cost.ulysses_attention_bytes``): the
    bytes shrink with n, where the ring's do not, but n can be at most the number of key/value
    heads. ``inner``: the layer's own ``attend``, run on the gathered heads."""

    def __init__(self, inner, group=None, balanced: bool = True):
        self.inner, self.group, self.balanced = inner, group, balanced

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = comm.group_size(self.group)
        _check_whole_sequences(q, k)
        for name, heads in (("query", q.shape[1]), ("key/value", k.shape[1])):
            if heads % n:
                raise ValueError(
                    f"Ulysses splits the heads over cp: {heads} {name} heads are not divisible by "
                    f"cp={n}")
        seq = q.shape[2] * n
        order = torch.tensor([p for r in range(n)
                              for p in layout.cp_positions(seq, n, r, self.balanced)],
                             device=q.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(seq, device=q.device)
        q, k, v = (_heads_to_sequence(t, self.group, inverse, f"cp/ulysses/{name}") for t, name in
                   ((q, "q"), (k, "k"), (v, "v")))
        out = self.inner(q, k, v)  # (B, H/n, S, Dh): the layer's own causal attention, on its heads
        return _sequence_to_heads(out, self.group, order, "cp/ulysses/out")


# -- extras: all-gather the keys and values (LLaMA 3) ----------------------------------------------
class AllGatherAttend:
    """All-gather context parallel (LLaMA 3's way to 128K tokens, Dubey et al. 2024), in place of a
    layer's ``attend``: every rank all-gathers the keys and values of the whole sequence, then
    attends its own queries to them under the causal mask of their true positions; backward
    reduce-scatters the keys' and values' gradients to the ranks that hold those positions. Per
    attention call a rank sends (cp-1)·2KV forward and as much back
    (``minitp.cost.allgather_attention_bytes``): fewer bytes than the ring's (3cp-2)·2KV, in two
    collectives that nothing overlaps here, and it holds the whole sequence's keys and values (small
    under grouped-query attention: Hkv of H heads)."""

    def __init__(self, group=None, balanced: bool = True):
        self.group, self.balanced = group, balanced

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (B, H, Sl, Dh); k, v: (B, Hkv, Sl, Dh) -> (B, H, Sl, Dh)
        _check_whole_sequences(q, k)
        n, Sl = comm.group_size(self.group), q.shape[2]
        k, v = (gather_from_sequence_parallel(t, self.group, dim=2, label=f"cp/allgather/{name}")
                for t, name in ((k, "k"), (v, "v")))  # (B, Hkv, S, Dh): the ranks' in rank order
        keys = torch.tensor([layout.cp_positions(n * Sl, n, r, self.balanced) for r in range(n)])
        visible = local_positions(Sl, self.group, self.balanced)[:, None] >= keys.view(1, -1)
        k, v = _expand(k, q.shape[1] // k.shape[1]), _expand(v, q.shape[1] // v.shape[1])
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Sl, S)
        return scores.masked_fill(~visible.to(q.device), float("-inf")).softmax(dim=-1) @ v


# -- measured, for the memory wall -----------------------------------------------------------------
def saved_activation_bytes(fn, *args, exclude=()) -> tuple[object, int]:
    """Run ``fn(*args)`` and count the bytes autograd keeps for backward (each storage once): what
    activation memory is. Storages of the tensors in ``exclude`` (pass the model's parameters, which
    a layer also saves) are not counted. Returns (fn's result, bytes)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args)
    return result, sum(seen.values())
