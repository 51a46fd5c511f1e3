"""A plain LLaMA-style decoder: no parallel code anywhere in it.

Token embedding -> n_layers x [RMSNorm -> causal attention (RoPE, grouped-query heads) -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head. Module names follow Meta's LLaMA code
(``tok_embeddings``, ``layers.i.attention.wq``, ``layers.i.feed_forward.w1``, ``output``), so the
strategies in minitp can name the pieces they split.

Shapes: B batch, S sequence, D dim, H heads, Hkv key/value heads, Dh = D/H head dim, F hidden dim
of the MLP, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 8
    # grouped-query attention; None: as many as n_heads (multi-head attention)
    n_kv_heads: int | None = 4
    ffn_hidden: int = 128
    max_seq_len: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # True: attention by torch's fused kernel (``fused_attention``), which keeps no scores and reads
    # the shared key/value heads in place, as training at scale runs it (``minitp train``'s models);
    # False: softmax(q k^T) v written out (``causal_attention``), whose scores the chapters measure
    fused_attention: bool = False

    def __post_init__(self):
        kv = self.kv_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={kv}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count, from the shapes alone (works for 70B without building anything)."""
        d, f, v, kvd = self.dim, self.ffn_hidden, self.vocab_size, self.kv_heads * self.head_dim
        attention = d * d + 2 * d * kvd + d * d  # wq, wk, wv, wo
        mlp = 3 * d * f  # w1, w3: D->F; w2: F->D
        block = attention + mlp + 2 * d  # two RMSNorm weights
        return v * d + self.n_layers * block + d + d * v  # embedding, blocks, final norm, head

    def with_(self, **changes) -> ModelConfig:
        return replace(self, **changes)


# Presets. "tiny" trains on a laptop CPU in seconds; the LLaMA-3 shapes are for cost arithmetic and
# are never materialised.
TINY = ModelConfig()  # 8 query heads of 8, 4 key/value heads (GQA, as LLaMA-3): tp can be 1, 2 or 4
LLAMA3_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        ffn_hidden=14336, max_seq_len=8192, rope_theta=500000.0)
LLAMA3_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         ffn_hidden=28672, max_seq_len=8192, rope_theta=500000.0)
# "small": big enough that a pipeline stage's compute dwarfs the hand-over of a message (a block's
# forward on a (1, 64) micro-batch is a few ms on one core), still seconds per step on a laptop CPU
SMALL = ModelConfig(vocab_size=512, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=704,
                    max_seq_len=256)
# ``minitp train``'s byte-level model (vocabulary: the 256 byte values), sized for a laptop run;
# its attention by the fused kernel training runs on (the tiny model's is written out, measured)
BYTE = ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384,
                   max_seq_len=256, fused_attention=True)
PRESETS = {"tiny": TINY, "small": SMALL, "llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


def get_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x divided by its root mean square over the last dim (in fp32, for stability), times
    ``weight``. x: (..., D), weight: (D,). Tensor parallel's sequence-parallel norm calls this
    too."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # (..., D)


def rope_tables(head_dim: int, seq_len: int, theta: float,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary position angles: two (S, Dh/2) tables."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, S, H, Dh); rotate each (even, odd) pair of features by its position's angle
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.fused = cfg.fused_attention
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                attend=None) -> torch.Tensor:
        # attend: how q, k, v become the output (default: this layer's causal attention); context
        # parallel passes its ring here (``minitp.cp``), with no change to the layer
        B, S, _ = x.shape
        # The head counts come from the weights, so a layer holding a slice of the heads works as
        # is.
        n_heads, n_kv = self.wq.out_features // self.head_dim, self.wk.out_features // self.head_dim
        q = self.wq(x).view(B, S, n_heads, self.head_dim)  # (B, S, H, Dh)
        k = self.wk(x).view(B, S, n_kv, self.head_dim)  # (B, S, Hkv, Dh)
        v = self.wv(x).view(B, S, n_kv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # generation: append this step's keys and values to the cache
            k, v = cache.update(k, v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, Dh); k, v: (B, Hkv, Sk, Dh)
        out = (attend or self.attend)(q, k, v)  # (B, H, S, Dh)
        return self.wo(out.transpose(1, 2).reshape(B, S, n_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(Dh)) v under the causal mask: the one step of the layer that mixes
        positions (``causal_attention``, or ``fused_attention`` when the config asks for it).
        Context parallel passes its ring in place of it (``forward(attend=)``, ``minitp.cp``)."""
        return (fused_attention if self.fused else causal_attention)(q, k, v)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh)) v under the causal mask.
    q: (B, H, S, Dh); k, v: (B, Hkv, Sk, Dh), the last S of the Sk keys at q's positions."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if n_kv != n_heads:  # grouped-query attention: each key/value head serves H/Hkv query heads
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
    S, Sk = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, S, Sk)
    # causal mask: query i (at absolute position Sk-S+i) sees keys 0..Sk-S+i
    mask = torch.ones(S, Sk, dtype=torch.bool, device=q.device).tril(diagonal=Sk - S)
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v  # (B, H, S, Dh)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``causal_attention`` by torch's ``scaled_dot_product_attention`` (on a CPU its
    FlashAttention-style kernel): the same result to float rounding, without the (B, H, S, Sk)
    scores in memory (backward computes them again from q, k, v and a log-sum-exp per row) and
    without copying a key/value head for each query head it serves. Same shapes as
    ``causal_attention``."""
    S, Sk = q.shape[2], k.shape[2]
    # the kernel's own causal mask aligns query i with key i: right when S = Sk; a query of a
    # generation step (S < Sk, its keys cached) sees the keys up to its own position
    mask = None if S == Sk else torch.ones(S, Sk, dtype=torch.bool, device=q.device).tril(Sk - S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=S == Sk,
                                          enable_gqa=k.shape[1] != q.shape[1])  # (B, H, S, Dh)


class FeedForward(nn.Module):
    """SwiGLU: (SiLU(x W1) * (x W3)) W2."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, S, D) -> (B, S, F) -> (B, S, D)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x, cos, sin, cache=None, attend=None, recompute=None):
        # recompute: None, or how to run the block so that backward recomputes its activations,
        # (forward, *args) -> output (FSDP's checkpointing, ``minitp.measure.activations``'
        # recomputation), or some of them (``minitp.offload.SelectiveCheckpoint``), or finds them
        # where it put them (``minitp.offload.offload_blocks``: in the host's memory)
        if recompute is not None:
            return recompute(self.compute, x, cos, sin, cache, attend)
        return self.compute(x, cos, sin, cache, attend)

    def compute(self, x, cos, sin, cache=None, attend=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, attend)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, caches=None,
                positions: torch.Tensor | None = None, attend=None, recompute=None) -> torch.Tensor:
        # tokens: (B, S) -> logits (B, S, V); positions: (S,) where they are not start_pos..,
        # attend: the attention of every block when not its own, recompute: how blocks recompute
        # (see run_blocks)
        h = self.tok_embeddings(tokens)  # (B, S, D); (B, S/tp, D) under sequence parallel
        # the positions RoPE reaches
        S = tokens.shape[1] if positions is None else int(positions.max()) + 1
        h = self.run_blocks(h, start_pos, caches, S, positions, attend, recompute)
        return self.output(self.norm(h))  # (B, S, V)

    def run_blocks(self, h: torch.Tensor, start_pos: int = 0, caches=None,
                   seq_len: int | None = None, positions: torch.Tensor | None = None, attend=None,
                   recompute=None) -> torch.Tensor:
        """The blocks, in order, on hidden states h (B, S, D) at positions start_pos.. -> (B, S, D).

        It reads only ``layers`` (block i by its name, ``layers.i``), the rope tables and
        ``config``, so a pipeline stage holding some of the blocks under their names runs this same
        loop (``minitp.pp.PipelineStage``). seq_len: the positions S the rope tables cover, when h
        holds fewer (tensor parallel's sequence parallel keeps S/tp of them between attention and
        MLP). positions: (S,) the positions h holds when they are not start_pos.. in order (context
        parallel's chunks of a longer sequence, ``seq_len`` positions in all). attend: (q, k, v) ->
        out, what every block's attention runs in place of its own (context parallel's ring).
        recompute: see ``TransformerBlock.forward``."""
        S, limit = seq_len or h.shape[1], self.config.max_seq_len
        if start_pos + S > limit:
            where = f"of {S} positions" if start_pos == 0 else f"reaching position {start_pos + S}"
            raise ValueError(f"sequence {where} is past max_seq_len={limit}")
        if positions is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            cos = self.rope_cos[start_pos:start_pos + S]
            sin = self.rope_sin[start_pos:start_pos + S]
        for name, block in self.layers.named_children():  # "0", "1", ...; a stage's: "2", "3"
            h = block(h, cos, sin, None if caches is None else caches[int(name)], attend, recompute)
        return h


def build_model(cfg: ModelConfig = TINY, seed: int = 0) -> Transformer:
    """The model with weights drawn from ``seed``: every rank that calls this gets the same
    model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg)
        for p in model.parameters():
            if p.dim() == 2:  # small normal init keeps the tiny model's first losses near log(V)
                nn.init.normal_(p, mean=0.0, std=0.02)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position: (B, S, V), (B, S) -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class KVCache:
    """Keys and values of the positions seen so far, for one layer: (B, S_so_far, Hkv, Dh) each."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """The most likely next token after the last position: (B, S, V) -> (B, 1)."""
    return logits[:, -1].argmax(dim=-1, keepdim=True)


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int,
             next_token: Callable[[torch.Tensor], torch.Tensor] = greedy_token,
             caches: list[KVCache] | None = None) -> torch.Tensor:
    """Greedy decoding with a KV cache: the prompt once, then one token per step. (B, P) -> (B,
    P+N).

    next_token: logits (B, S, V) -> tokens (B, 1); a parallel model whose logits are sharded passes
    its own (``minitp.tp.generate``). caches: one empty ``KVCache`` per layer to fill; fresh if
    None.
    """
    caches = [KVCache() for _ in range(model.config.n_layers)] if caches is None else caches
    logits = model(prompt, start_pos=0, caches=caches)
    out = [prompt]
    for step in range(new_tokens):
        out.append(next_token(logits))  # (B, 1)
        if step + 1 < new_tokens:
            logits = model(out[-1], start_pos=prompt.shape[1] + step, caches=caches)
    return torch.cat(out, dim=1)
