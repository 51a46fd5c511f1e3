"""minitp.models.gpt2, the second model family: GPT-2 small's published size from the shapes, the
tied output layer, and the whole model equal to the same weights run through PyTorch's own
pre-LayerNorm encoder layers under a causal mask (the oracle)."""

import pytest
import torch
import torch.nn as nn

from minitp.models import loss_fn
from minitp.models.gpt2 import GPT2_124M, GPT2_BYTE, GPT2Config, build_gpt2, gelu

SMALL = GPT2Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def test_gpt2_small_has_its_published_124_million_parameters():
    assert GPT2_124M.num_params() == 124_439_808  # with the position embedding, the head tied
    for cfg in (SMALL, GPT2_BYTE):
        model = build_gpt2(cfg)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_the_output_layer_is_the_token_embedding_and_gets_both_gradients():
    model = build_gpt2(SMALL, seed=1)
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # one parameter, named once
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens), tokens).backward()
    # rows of tokens never seen as input still get the output layer's gradient
    unseen = sorted(set(range(SMALL.vocab_size)) - set(tokens.flatten().tolist()))
    assert model.wte.weight.grad[unseen].abs().sum() > 0


def _torch_oracle(model) -> nn.Module:
    """The same weights in torch.nn.TransformerEncoderLayer (norm_first: GPT-2's pre-LN blocks)."""
    cfg = model.config
    layers = []
    for block in model.h:
        layer = nn.TransformerEncoderLayer(cfg.dim, cfg.n_heads, cfg.ffn_hidden, dropout=0.0,
                                           activation=gelu, layer_norm_eps=cfg.norm_eps,
                                           batch_first=True, norm_first=True)
        with torch.no_grad():
            layer.self_attn.in_proj_weight.copy_(block.attn.c_attn.weight)
            layer.self_attn.in_proj_bias.copy_(block.attn.c_attn.bias)
            layer.self_attn.out_proj.weight.copy_(block.attn.c_proj.weight)
            layer.self_attn.out_proj.bias.copy_(block.attn.c_proj.bias)
            for ours, theirs in ((block.ln_1, layer.norm1), (block.ln_2, layer.norm2),
                                 (block.mlp.c_fc, layer.linear1), (block.mlp.c_proj, layer.linear2)):
                theirs.weight.copy_(ours.weight)
                theirs.bias.copy_(ours.bias)
        layers.append(layer)
    return nn.ModuleList(layers)


@pytest.mark.parametrize("start_pos", [0, 5])
def test_the_model_equals_pytorchs_encoder_layers_under_a_causal_mask(start_pos):
    model = build_gpt2(SMALL, seed=2)
    # non-zero biases and norms, so that a bias or a norm weight in the wrong place shows, and
    # weights large enough that the MLP's GELU sees values of order 1 (where its forms differ)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
            elif "h." in name:
                p.mul_(25)
    oracle = _torch_oracle(model).eval()
    tokens = torch.randint(0, SMALL.vocab_size, (3, 9), generator=torch.Generator().manual_seed(3))
    S = tokens.shape[1]
    mask = nn.Transformer.generate_square_subsequent_mask(S)
    with torch.no_grad():
        h = model.wte(tokens) + model.wpe(torch.arange(start_pos, start_pos + S))
        for layer in oracle:
            h = layer(h, src_mask=mask, is_causal=True)
        want = model.ln_f(h) @ model.wte.weight.T
        got = model(tokens, start_pos=start_pos)
    assert (got - want).abs().max() <= 1e-5


def test_a_position_past_the_table_is_refused():
    model = build_gpt2(SMALL)
    with pytest.raises(ValueError, match="positions 10..17 are past max_seq_len=16"):
        model(torch.zeros(1, 8, dtype=torch.long), start_pos=10)
    with pytest.raises(ValueError, match="dim=30 is not divisible by n_heads=4"):
        GPT2Config(dim=30)
