"""Activation memory measured with saved-tensor hooks, block by block, next to the formulas."""

import pytest
import torch

from minitp import cost
from minitp import tp as tensor_parallel
from minitp.launcher import launch
from minitp.measure import activations
from minitp.models import TINY, build_model, loss_fn
from minitp.runs.measuring import measure_activations

B, S = 2, 16


@pytest.mark.parametrize("tp, sequence_parallel, recompute", [
    (1, False, False), (2, False, False), (2, True, False), (2, False, True), (2, True, True), (4, True, False),
])
def test_what_each_block_saves_on_each_rank_is_the_tiny_formula(tp, sequence_parallel, recompute):
    measured = measure_activations(tp, sequence_parallel, recompute, batch=B, seq=S)
    formula = cost.tiny_block_activation_bytes(TINY, B, S, tp, sequence_parallel, recompute)
    assert measured == [[formula] * TINY.n_layers] * tp


@pytest.mark.parametrize("tp, sequence_parallel, recompute", [(1, False, False), (2, True, False), (2, False, True)])
def test_a_fused_kernel_keeps_no_scores_and_no_repeated_heads_only_its_log_sum_exp(tp, sequence_parallel, recompute):
    fused = TINY.with_(fused_attention=True)
    measured = measure_activations(tp, sequence_parallel, recompute, model=fused, batch=B, seq=S)
    formula = cost.tiny_block_activation_bytes(fused, B, S, tp, sequence_parallel, recompute)
    assert measured == [[formula] * TINY.n_layers] * tp
    written = cost.tiny_block_activation_bytes(TINY, B, S, tp, sequence_parallel, recompute)
    if not recompute:  # the scores (B, H/t, S, S) and the mask, and K and V copied to every query head, gone
        h, kv = TINY.n_heads // tp, TINY.kv_heads // tp
        gone = 4 * B * h * S * S + S * S + 2 * 4 * B * S * (h - kv) * TINY.head_dim - 4 * B * S * h
        assert written - formula == gone
    else:
        assert formula == written


def test_tensor_and_sequence_parallel_and_recomputation_each_shrink_what_a_block_keeps():
    keep = {args: cost.tiny_block_activation_bytes(TINY, B, S, *args)
            for args in [(1, False, False), (2, False, False), (2, True, False), (2, True, True)]}
    assert keep[(1, False, False)] > keep[(2, False, False)] > keep[(2, True, False)] > keep[(2, True, True)]
    assert keep[(2, True, True)] == B * S * TINY.dim * 4 // 2  # the block's input, its S/tp positions


def test_a_tensor_saved_twice_counts_once_and_parameters_not_at_all():
    model = build_model(TINY)
    x = torch.randn(B, S, TINY.dim, requires_grad=True)
    with activations.SavedTensors(model) as saved:
        y = model.layers[0].feed_forward.w1(x)  # saves x (and its weight, a parameter)
        (y * y).sum()  # saves y twice
    assert saved.bytes == x.numel() * 4 + y.numel() * 4


def _recomputed_step(sequence_parallel):
    torch.set_num_threads(1)
    model = tensor_parallel.parallelize(build_model(TINY, seed=0), torch.distributed.group.WORLD, sequence_parallel)
    block = model.layers[0]
    x = torch.randn(B, S // (2 if sequence_parallel else 1), TINY.dim, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    cos, sin = model.rope_cos[:S], model.rope_sin[:S]
    block(x, cos, sin, recompute=activations.run_recomputed).sum().backward()
    return {name: p.grad.clone() for name, p in block.named_parameters()}, x.grad.clone()


def _plain_step(sequence_parallel):
    torch.set_num_threads(1)
    model = tensor_parallel.parallelize(build_model(TINY, seed=0), torch.distributed.group.WORLD, sequence_parallel)
    block = model.layers[0]
    x = torch.randn(B, S // (2 if sequence_parallel else 1), TINY.dim, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    block(x, model.rope_cos[:S], model.rope_sin[:S]).sum().backward()
    return {name: p.grad.clone() for name, p in block.named_parameters()}, x.grad.clone()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recomputation_gives_the_same_gradients_and_sends_forwards_collectives_again(sequence_parallel):
    again = launch(_recomputed_step, 2, sequence_parallel, echo=False)
    plain = launch(_plain_step, 2, sequence_parallel, echo=False)
    for (g1, x1), (g2, x2) in zip(again, plain):
        assert torch.allclose(x1, x2, atol=1e-6) and all(torch.allclose(g1[k], g2[k], atol=1e-6) for k in g1)
    sent = again.sent_bytes()
    want = cost.tp_block_bytes(B, S, TINY.dim, 2, sequence_parallel, 4, recompute=True)
    assert sent == [pytest.approx(want)] * 2  # 6 all-reduces (or RS+AG pairs) of B·S·D instead of 4
    assert plain.sent_bytes() == [pytest.approx(cost.tp_block_bytes(B, S, TINY.dim, 2, sequence_parallel, 4))] * 2


def _output_and_loss_saved_bytes(sequence_parallel: bool) -> int:
    """What the final norm, the output layer and the loss save on this rank, measured with hooks around them alone
    (the blocks run before, uncounted); tp = 1 trains with ``loss_fn``, tp > 1 with the vocabulary-parallel loss."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    model = build_model(TINY, seed=0)
    tp = dist.get_world_size()
    if tp > 1 or sequence_parallel:
        tensor_parallel.parallelize(model, dist.group.WORLD, sequence_parallel)
    tokens = torch.randint(0, TINY.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    h = model.run_blocks(model.tok_embeddings(tokens), seq_len=S)  # (B, S or S/tp, D)
    with activations.SavedTensors(model) as saved:
        logits = model.output(model.norm(h))  # (B, S, V/tp)
        if tp > 1:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, tokens, dist.group.WORLD)
        else:
            loss = loss_fn(logits, tokens)
    loss.backward()
    return saved.bytes


def test_the_output_layer_and_the_loss_keep_one_fp32_copy_of_the_logits_on_one_process():
    model = build_model(TINY)
    h = torch.randn(B, S, TINY.dim, requires_grad=True)
    targets = torch.randint(0, TINY.vocab_size, (B, S))
    with activations.SavedTensors(model) as saved:
        loss = loss_fn(model.output(model.norm(h)), targets)
    assert saved.bytes == cost.output_activation_bytes(TINY, B, S, dtype_bytes=4)
    n = B * S  # the norm's input, normalised output and 1/rms, the output layer's input; log-probs; targets
    assert saved.bytes == (3 * n * TINY.dim + n) * 4 + n * TINY.vocab_size * 4 + n * 8 + 4
    loss.backward()


@pytest.mark.parametrize("tp, sequence_parallel", [(2, False), (2, True)])
def test_the_vocabulary_parallel_loss_keeps_each_ranks_slice_of_the_logits(tp, sequence_parallel):
    measured = launch(_output_and_loss_saved_bytes, tp, sequence_parallel, echo=False)
    assert list(measured) == [cost.output_activation_bytes(TINY, B, S, tp, sequence_parallel, 4)] * tp


def test_the_logits_of_a_llama3_sequence_at_tp_1_are_four_gib_kept_and_ten_at_the_losss_forward():
    from minitp.models import LLAMA3_8B

    logits = 8192 * LLAMA3_8B.vocab_size  # one sequence's
    kept = cost.output_activation_bytes(LLAMA3_8B, 1, 8192)
    assert round(logits * 4 / 2**30, 1) == 3.9 and round(logits * 10 / 2**30, 1) == 9.8  # the docstring's
    assert 0 < kept - logits * 4 < 0.4 * 2**30  # the rest: the final norm's and the output layer's input
    assert cost.output_activation_bytes(LLAMA3_8B, 1, 8192, tp=8) < kept / 4  # the vocabulary split over tp
