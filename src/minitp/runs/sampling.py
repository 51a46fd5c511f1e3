"""``minitp sample``: text written by the model of a ``minitp train`` checkpoint, on one process."""

from __future__ import annotations

import torch

from minitp import checkpoint
from minitp.data import decode, encode
from minitp.models import ModelConfig, Transformer
from minitp.models.llama import generate
from minitp.models.moe import MoEConfig
from minitp.trainer import build


def load_for_sampling(path: str) -> Transformer:
    """The model of a ``minitp train`` checkpoint (any layout) on one process."""
    saved = checkpoint.load_full(path)
    cfg = (MoEConfig if "n_experts" in saved["config"] else ModelConfig)(**saved["config"])
    model = build(cfg, 0)
    model.load_state_dict(saved["params"], strict=True)
    return model.eval()


@torch.no_grad()
def sample(model: Transformer, prompt: str, new_tokens: int = 200, temperature: float = 0.8,
           seed: int = 0) -> str:
    """Text the model writes after ``prompt`` (bytes), one token at a time with its KV cache."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one character, e.g. --prompt 'def '")
    tokens = encode(prompt)[None, -model.config.max_seq_len // 2:]
    new_tokens = min(new_tokens, model.config.max_seq_len - tokens.shape[1])
    g = torch.Generator().manual_seed(seed)

    def next_token(logits: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return logits[:, -1].argmax(-1, keepdim=True)
        last = logits[:, -1]
        # the top byte 0, the rest <= 0: no inf/inf
        scaled = (last - last.max(-1, keepdim=True).values) / temperature
        return torch.multinomial(torch.softmax(scaled, -1), 1, generator=g)

    return decode(generate(model, tokens, new_tokens, next_token)[0])
