"""minitp.models: the plain model, its presets, data and reference loop."""

import pytest
import torch

from minitp.models import (
    LLAMA3_8B,
    LLAMA3_70B,
    TINY,
    KVCache,
    ModelConfig,
    RMSNorm,
    build_model,
    generate,
    get_config,
    rms_norm,
)
from minitp.models.llama import causal_attention, fused_attention
from minitp.models.train import TrainConfig, synthetic_batches, train_reference


@pytest.mark.parametrize("cfg", [TINY, TINY.with_(n_kv_heads=2), TINY.with_(n_layers=1, ffn_hidden=96)])
def test_parameter_count_formula_matches_the_built_model(cfg):
    model = build_model(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_llama3_presets_have_the_published_sizes():
    assert round(LLAMA3_8B.num_params() / 1e9, 2) == 8.03
    assert round(LLAMA3_70B.num_params() / 1e9, 1) == 70.6
    assert get_config("llama3-8b") is LLAMA3_8B
    with pytest.raises(ValueError, match="unknown model preset 'gpt2'"):
        get_config("gpt2")


def test_bad_config_names_the_numbers():
    with pytest.raises(ValueError, match="dim=30 is not divisible by n_heads=8"):
        ModelConfig(dim=30)
    with pytest.raises(ValueError, match="n_heads=8 is not divisible by n_kv_heads=3"):
        ModelConfig(n_kv_heads=3)


def test_same_seed_same_model_and_data():
    a, b = build_model(TINY, seed=3), build_model(TINY, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.output.weight, build_model(TINY, seed=4).output.weight)
    train = TrainConfig(steps=2)
    for (t1, y1), (t2, y2) in zip(synthetic_batches(TINY, train), synthetic_batches(TINY, train)):
        assert torch.equal(t1, t2) and torch.equal(y1, y2)
        assert torch.equal(t1[:, 1:], y1[:, :-1])  # targets are the tokens shifted by one


def test_the_model_is_causal():
    model = build_model(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % TINY.vocab_size
    torch.testing.assert_close(model(tokens)[:, :6], model(changed)[:, :6])


def test_generation_with_the_cache_equals_recomputing_everything():
    model = build_model(TINY.with_(n_kv_heads=2))
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    out = generate(model, prompt, 6)
    full = prompt
    with torch.no_grad():
        for _ in range(6):
            full = torch.cat([full, model(full)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, full)


@pytest.mark.parametrize("heads, kv_heads, seq, keys", [(8, 8, 12, 12), (8, 4, 12, 12), (8, 2, 3, 12), (4, 4, 1, 9)])
def test_the_fused_kernel_equals_attention_written_out(heads, kv_heads, seq, keys):
    # the same values and gradients: whole sequences (S = Sk), grouped heads, and a generation step's
    # queries at the end of their cached keys (S < Sk)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, keys, 16, generator=g, requires_grad=True) for _ in range(2))
    written, fused = causal_attention(q, k, v), fused_attention(q, k, v)
    torch.testing.assert_close(fused, written, atol=1e-5, rtol=0)
    grad = torch.randn(written.shape, generator=g)
    for a, b in zip(torch.autograd.grad(fused, (q, k, v), grad), torch.autograd.grad(written, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_model_with_fused_attention_trains_as_the_written_out_one():
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for fused in (False, True):
        model = build_model(TINY.with_(fused_attention=fused), seed=2)
        assert model.layers[0].attention.fused is fused
        model(tokens).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    fused = build_model(TINY.with_(fused_attention=True, n_kv_heads=2))
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    with torch.no_grad():  # its generation with the cache (S < Sk at each step) is its generation without
        full = prompt
        for _ in range(4):
            full = torch.cat([full, fused(full)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generate(fused, prompt, 4), full)


def test_generate_takes_its_next_token_step_and_its_caches_from_the_caller():
    model = build_model(TINY)
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    caches = [KVCache() for _ in range(TINY.n_layers)]
    out = generate(model, prompt, 3, next_token=lambda logits: torch.full((2, 1), 7), caches=caches)
    assert out[:, 5:].tolist() == [[7, 7, 7], [7, 7, 7]]
    assert caches[0].k.shape[1] == 5 + 2  # the prompt and every new token but the last went through


def test_rms_norm_divides_by_the_root_mean_square_then_scales():
    x = torch.tensor([[3.0, 4.0]])  # root mean square sqrt(12.5)
    weight = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(rms_norm(x, weight, 0.0), x / 12.5**0.5 * weight)
    norm = RMSNorm(2, eps=0.0)
    torch.testing.assert_close(norm(x), rms_norm(x, norm.weight, 0.0))


def test_the_reference_loop_learns():
    losses, _ = train_reference(TINY, TrainConfig(steps=80))
    assert losses[0] == pytest.approx(torch.log(torch.tensor(128.0)).item(), abs=0.1)  # uniform guess
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
