"""A plain GPT-2-style decoder, minitp's second model family: no parallel code anywhere in it.

Token embedding + learned position embedding -> n_layers x [LayerNorm -> causal multi-head
attention -> residual, LayerNorm -> GELU MLP -> residual] -> LayerNorm -> the output layer, which is
the token embedding itself (tied). Names follow GPT-2's own (``wte``, ``wpe``, ``h.i.attn.c_attn``,
``h.i.mlp.c_fc``, ``ln_f``, ``lm_head``), with ``nn.Linear`` weights (out, in).

It differs from ``minitp.models.llama`` exactly where parallelism has to think again:

* **biases** on every linear: a column-parallel layer splits its bias with its outputs; a
  row-parallel layer's partial sums must get its bias once, after the sum, not once per rank;
* **LayerNorm** with a weight and a bias (LLaMA's RMSNorm has a weight only): both replicated over
  tp, and both need their gradients summed over tp under sequence parallelism;
* **one fused q, k, v projection** (``c_attn``, D -> 3D): splitting it over tp by rows cuts through
  q, k and v at once; each rank must take its heads of each of the three;
* **learned positions** (``wpe``, an embedding, not RoPE's rotation): the first pipeline stage holds
  them, and a context-parallel rank looks up its own positions;
* **a tied output layer**: ``lm_head.weight`` *is* ``wte.weight``, one parameter used at both ends;
  across pipeline stages the first and the last each hold a copy and must sum their gradients;
* **multi-head attention** (as many key/value heads as query heads) and a 4·D MLP.

Shapes: B batch, S sequence, D dim, H heads, Dh = D/H, V vocabulary, P max positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from minitp.models.llama import causal_attention


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 256  # bytes
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 256  # P: the positions wpe holds
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.dim

    def num_params(self) -> int:
        """Parameter count from the shapes: the tied embedding counted once (GPT-2 small: 124 M)."""
        d, f = self.dim, self.ffn_hidden
        attention = (d * 3 * d + 3 * d) + (d * d + d)  # c_attn, c_proj, with biases
        mlp = (d * f + f) + (f * d + d)  # c_fc, c_proj
        block = attention + mlp + 2 * 2 * d  # ln_1, ln_2: a weight and a bias each
        return self.vocab_size * d + self.max_seq_len * d + self.n_layers * block + 2 * d

    def with_(self, **changes) -> GPT2Config:
        return replace(self, **changes)


# "gpt2-byte" trains on a laptop CPU (bytes in, 0.8 M parameters); "gpt2-124m" is GPT-2 small's
# shape, for arithmetic only
GPT2_BYTE = GPT2Config()
GPT2_124M = GPT2Config(vocab_size=50257, dim=768, n_layers=12, n_heads=12, max_seq_len=1024)
GPT2_PRESETS = {"gpt2-byte": GPT2_BYTE, "gpt2-124m": GPT2_124M}


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, the tanh approximation."""
    return F.gelu(x, approximate="tanh")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)  # q, k and v, side by side along the rows
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # (B, S, 3D) -> three (B, S, D)
        # the head count from the weights, so a layer holding some of the heads works as is
        n_heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, S, n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = causal_attention(q, k, v)  # (B, H, S, Dh)
        return self.c_proj(out.transpose(1, 2).reshape(B, S, n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, cfg.ffn_hidden)
        self.c_proj = nn.Linear(cfg.ffn_hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(gelu(self.c_fc(x)))  # (B, S, D) -> (B, S, 4D) -> (B, S, D)


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, (V, D), used at both ends

    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        # tokens: (B, S) -> logits (B, S, V)
        S = tokens.shape[1]
        if start_pos + S > self.config.max_seq_len:
            raise ValueError(f"positions {start_pos}..{start_pos + S - 1} are past "
                             f"max_seq_len={self.config.max_seq_len}")
        positions = torch.arange(start_pos, start_pos + S, device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)  # (B, S, D)
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))  # (B, S, V)


def build_gpt2(cfg: GPT2Config = GPT2_BYTE, seed: int = 0) -> GPT2:
    """The model with weights drawn from ``seed`` as GPT-2 draws them: normal(0, 0.02) matrices and
    embeddings, the two projections into the residual stream at 0.02/sqrt(2·n_layers) (each block
    adds two), zero biases, LayerNorms at 1 and 0. Every rank that calls this gets the same
    model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2(cfg)
        for name, p in model.named_parameters():  # the tied weight once, as wte.weight
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))
            elif p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
    return model
