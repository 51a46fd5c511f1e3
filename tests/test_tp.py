"""minitp.tp against its oracles: the unsharded module on one process, PyTorch's DTensor tensor
parallel, and minitp.cost.

Each worker runs a tensor-parallel piece on every rank and returns its output and its gradients,
sharded as the rank holds them; the test puts the shards together (``tp.unshard``) and compares
them with the plain module run here, on one process.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import minitp
from minitp import cost, runs, tp
from minitp.models import TINY, KVCache, build_model, generate

TP_SIZES = [1, 2, 4]
B, S = 2, 8  # batch and sequence of the module checks
TOL = 1e-5  # fp32: max |tensor-parallel - plain|


def _assert_close(actual, expected, what=""):
    diff = (actual - expected).abs().max().item()
    assert diff <= TOL, f"{what}: max |difference| = {diff:.3g} > {TOL:g}"


def _assert_grads_match(shards: list[dict], plain: nn.Module):
    """Every parameter's gradient, put together from the ranks' shards, equals the plain module's
    (the replicated ones as each rank holds them)."""
    for rank in range(len(shards)):
        grads = tp.unshard(shards, rank)
        assert set(grads) == {name for name, _ in plain.named_parameters()}
        for name, p in plain.named_parameters():
            _assert_close(grads[name], p.grad, f"rank {rank} gradient of {name}")


def _sent(results) -> list[float]:
    return [t.sent_bytes() for t in results.traces]


# -- the two linears -----------------------------------------------------------------------------------
def _linears():
    torch.manual_seed(0)
    column, row = nn.Linear(8, 12), nn.Linear(12, 6)
    x = torch.randn(3, 5, 8, requires_grad=True)
    out = {}
    # column, output gathered: the full layer's output on every rank
    gathered = tp.ColumnParallelLinear(column, None, gather_output=True)
    y = gathered(x)
    y.pow(2).sum().backward()
    out["gathered"] = (y.detach(), x.grad.clone(), tp.local_shards(gathered, grads=True))
    # column (output sharded) then row (input already sharded): Megatron's pair
    x.grad = None
    col, rw = tp.ColumnParallelLinear(column, None), tp.RowParallelLinear(row, None)
    h = col(x)  # (3, 5, 12/tp)
    z = rw(h)
    z.pow(2).sum().backward()
    out["pair"] = (h.detach(), z.detach(), x.grad.clone(), tp.local_shards(col, grads=True),
                   tp.local_shards(rw, grads=True))
    # row with the full input, split here
    full = torch.randn(3, 5, 12, requires_grad=True)
    split_here = tp.RowParallelLinear(row, None, input_is_parallel=False)
    w = split_here(full)
    w.pow(2).sum().backward()
    out["split_here"] = (w.detach(), full.grad.clone(), tp.local_shards(split_here, grads=True))
    return out


@pytest.mark.parametrize("n", TP_SIZES)
def test_column_and_row_parallel_linear_match_nn_linear(n):
    results = minitp.launch(_linears, n, echo=False)
    torch.manual_seed(0)
    column, row = nn.Linear(8, 12), nn.Linear(12, 6)
    x = torch.randn(3, 5, 8, requires_grad=True)
    y = column(x)
    y.pow(2).sum().backward()
    for r in results:
        _assert_close(r["gathered"][0], y, "gathered output")
        _assert_close(r["gathered"][1], x.grad, "input gradient")
    _assert_grads_match([r["gathered"][2] for r in results], column)

    column.zero_grad()
    x.grad = None
    h = column(x)
    z = row(h)
    z.pow(2).sum().backward()
    _assert_close(torch.cat([r["pair"][0] for r in results], dim=-1), h, "column output shards")
    for r in results:
        _assert_close(r["pair"][1], z, "row output (bias added once)")
        _assert_close(r["pair"][2], x.grad, "input gradient through the pair")
    _assert_grads_match([r["pair"][3] for r in results], column)
    _assert_grads_match([r["pair"][4] for r in results], row)

    row.zero_grad()
    full = torch.randn(3, 5, 12, requires_grad=True)
    w = row(full)
    w.pow(2).sum().backward()
    for r in results:
        _assert_close(r["split_here"][0], w, "row output, input split inside")
        _assert_close(r["split_here"][1], full.grad, "gradient of the split input")
    _assert_grads_match([r["split_here"][2] for r in results], row)


# -- the MLP and attention -------------------------------------------------------------------------------
def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, TINY.dim, generator=g).requires_grad_()


def _mlp():
    mlp = tp.ParallelFeedForward(build_model(TINY).layers[0].feed_forward, None)
    x = _inputs()
    y = mlp(x)
    y.pow(2).sum().backward()
    return {"out": y.detach(), "x_grad": x.grad, "grads": tp.local_shards(mlp, grads=True)}


@pytest.mark.parametrize("n", TP_SIZES)
def test_parallel_mlp_matches_feed_forward_and_sends_one_all_reduce_each_way(n):
    results = minitp.launch(_mlp, n, echo=False)
    plain = build_model(TINY).layers[0].feed_forward
    x = _inputs()
    y = plain(x)
    y.pow(2).sum().backward()
    for r in results:
        _assert_close(r["out"], y, "MLP output")
        _assert_close(r["x_grad"], x.grad, "MLP input gradient")
    _assert_grads_match([r["grads"] for r in results], plain)
    for trace in results.traces:
        assert [(e.op, e.label) for e in trace.comm()] == [("all_reduce", "tp/g.forward"),
                                                          ("all_reduce", "tp/f.backward")]
    assert _sent(results) == [pytest.approx(cost.tp_mlp_bytes(B, S, TINY.dim, n))] * n


def _attention(cfg):
    model = build_model(cfg)
    attention = tp.ParallelAttention(model.layers[0].attention, None)
    x = _inputs()
    y = attention(x, model.rope_cos[:S], model.rope_sin[:S])
    y.pow(2).sum().backward()
    return {"out": y.detach(), "x_grad": x.grad, "grads": tp.local_shards(attention, grads=True),
            "heads": (attention.n_heads, attention.n_kv_heads)}


# grouped-query attention (2 key/value heads) at tp=4 is refused: see test_bad_input_is_refused_with_the_numbers
@pytest.mark.parametrize("n, kv_heads", [(n, 4) for n in TP_SIZES] + [(1, 2), (2, 2)])
def test_parallel_attention_matches_attention(n, kv_heads):
    cfg = TINY.with_(n_kv_heads=kv_heads)
    results = minitp.launch(_attention, n, cfg, echo=False)
    model = build_model(cfg)
    plain = model.layers[0].attention
    x = _inputs()
    y = plain(x, model.rope_cos[:S], model.rope_sin[:S])
    y.pow(2).sum().backward()
    for r in results:
        assert r["heads"] == (cfg.n_heads // n, kv_heads // n)
        _assert_close(r["out"], y, "attention output")
        _assert_close(r["x_grad"], x.grad, "attention input gradient")
    _assert_grads_match([r["grads"] for r in results], plain)
    assert _sent(results) == [pytest.approx(cost.tp_region_bytes(B, S, TINY.dim, n))] * n


# -- the vocabulary --------------------------------------------------------------------------------------
def _tokens():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, TINY.vocab_size, (B, S), generator=g), torch.randn(B, S, TINY.dim, generator=g)


def _vocabulary():
    n, rank = dist.get_world_size(), dist.get_rank()
    tokens, weights = _tokens()
    embedding = tp.VocabParallelEmbedding(build_model(TINY).tok_embeddings, None)
    h = embedding(tokens)
    (h * weights).sum().backward()
    out = {"embedded": h.detach(), "grads": tp.local_shards(embedding, grads=True)}
    with minitp.trace.scope("loss"):
        torch.manual_seed(3)
        logits = torch.randn(B, S, TINY.vocab_size)
        mine = logits.chunk(n, dim=-1)[rank].clone().requires_grad_()  # (B, S, V/tp)
        loss = tp.vocab_parallel_cross_entropy(mine, tokens, None)
        loss.backward()
    return {**out, "loss": loss.detach(), "logits_grad": mine.grad}


@pytest.mark.parametrize("n", TP_SIZES)
def test_vocab_parallel_embedding_and_cross_entropy_match(n):
    results = minitp.launch(_vocabulary, n, echo=False)
    tokens, weights = _tokens()
    plain = build_model(TINY).tok_embeddings
    h = plain(tokens)
    (h * weights).sum().backward()
    torch.manual_seed(3)
    logits = torch.randn(B, S, TINY.vocab_size, requires_grad=True)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    for r in results:
        _assert_close(r["embedded"], h, "embeddings")
        _assert_close(r["loss"], loss, "cross-entropy")
    _assert_grads_match([r["grads"] for r in results], plain)
    _assert_close(torch.cat([r["logits_grad"] for r in results], dim=-1), logits.grad, "logits gradient")
    # the loss sends N = B·S numbers (max) and 2N (sums of exps, target logits), never the (N, V) logits
    loss_msgs = [e for e in results.traces[0].comm() if e.label.startswith("loss")]
    assert [(e.op, e.shape) for e in loss_msgs] == [("all_reduce", (B * S,)), ("all_reduce", (2, B * S))]
    positions = B * S
    assert sum(e.sent_bytes for e in loss_msgs) == pytest.approx(
        cost.collective_sent_bytes("all_reduce", 4 * positions, n)
        + cost.collective_sent_bytes("all_reduce", 8 * positions, n))


# -- a whole block, with and without sequence parallel ------------------------------------------------------
def _parallel_block(sequence_parallel):
    n, rank = dist.get_world_size(), dist.get_rank()
    model = tp.parallelize(build_model(TINY), None, sequence_parallel)
    block = model.layers[1]
    x = _inputs()
    mine = x.chunk(n, dim=1)[rank] if sequence_parallel else x  # (B, S/tp, D) under sequence parallel
    y = block(mine, model.rope_cos[:S], model.rope_sin[:S])
    y.pow(2).sum().backward()
    return {"out": y.detach(), "x_grad": x.grad, "grads": tp.local_shards(block, grads=True),
            "norm": type(block.ffn_norm).__name__}


@pytest.mark.parametrize("n", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated-norms", "sequence-parallel"])
def test_block_matches_plain_block(n, sequence_parallel):
    results = minitp.launch(_parallel_block, n, sequence_parallel, echo=False)
    model = build_model(TINY)
    x = _inputs()
    y = model.layers[1](x, model.rope_cos[:S], model.rope_sin[:S])
    y.pow(2).sum().backward()
    if sequence_parallel:  # each rank holds its S/tp positions of the output
        assert all(r["norm"] == "SequenceParallelRMSNorm" for r in results)
        _assert_close(torch.cat([r["out"] for r in results], dim=1), y, "block output (positions)")
        x_grad = torch.cat([r["x_grad"].chunk(n, dim=1)[rank] for rank, r in enumerate(results)], dim=1)
        _assert_close(x_grad, x.grad, "block input gradient (positions)")
    else:
        for r in results:
            _assert_close(r["out"], y, "block output")
            _assert_close(r["x_grad"], x.grad, "block input gradient")
    _assert_grads_match([r["grads"] for r in results], model.layers[1])
    expected = cost.tp_block_bytes(B, S, TINY.dim, n, sequence_parallel)
    assert _sent(results) == [pytest.approx(expected)] * n
    ops = {e.op for t in results.traces for e in t.comm() if e.bytes == B * S * TINY.dim * 4}
    if n > 1:
        assert ops == ({"all_gather", "reduce_scatter"} if sequence_parallel else {"all_reduce"})


# -- the whole model ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, sequence_parallel", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_whole_model_trained_matches_one_process(n, sequence_parallel):
    report = runs.run_tp(nproc=n, steps=3, sequence_parallel=sequence_parallel)
    assert runs.check(report) == []  # parameters, traced bytes and memory against their oracles
    assert report["max_abs_param_diff"] <= TOL  # fp32, against one process with the whole batch
    assert report["loss"] == pytest.approx(report["reference_loss"], abs=TOL)
    assert report["comm_bytes_traced"] == [pytest.approx(cost.tp_run_bytes(TINY, 8, 16, n, 3, sequence_parallel))] * n
    # every matrix split over the ranks, the 2·4+1 norm weights (D each) replicated
    norms = (2 * TINY.n_layers + 1) * TINY.dim
    assert report["memory"][0]["params"] == 4 * ((TINY.num_params() - norms) // n + norms)


@pytest.mark.parametrize("n", [2, 4])
def test_swiglu_run_matches_one_process(n):
    report = runs.run_swiglu(nproc=n, steps=3)
    assert runs.check(report) == []
    assert report["max_abs_param_diff"] <= TOL  # fp32, against the plain MLP trained on one process
    assert report["memory"][0]["params"] == 4 * 3 * TINY.dim * TINY.ffn_hidden // n


def _generate(prompt, new_tokens):
    model = tp.parallelize(build_model(TINY, seed=5), None)
    caches = [KVCache() for _ in range(TINY.n_layers)]
    tokens = tp.generate(model, prompt, new_tokens, None, caches=caches)
    return tokens, tuple(caches[0].k.shape)


@pytest.mark.parametrize("n", [2, 4])
def test_generation_matches_plain_model_token_for_token(n):
    prompt = torch.randint(0, TINY.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    expected = generate(build_model(TINY, seed=5), prompt, 12)
    results = minitp.launch(_generate, n, prompt, 12, echo=False)
    for tokens, cache_shape in results:
        assert tokens.tolist() == expected.tolist()
        assert cache_shape == (2, 5 + 12 - 1, TINY.kv_heads // n, TINY.head_dim)  # this rank's heads only


# -- PyTorch's tensor parallel ---------------------------------------------------------------------------
def _against_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    out = {}
    for name in ("minitp", "dtensor"):
        model = build_model(TINY)
        block = model.layers[0]
        if name == "minitp":
            block = tp.parallelize(model, None).layers[0]
        else:  # use_local_output (the default) hands back plain tensors, so the residual adds work
            parallelize_module(block, mesh, plan)
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv):
                linear.out_features //= n  # the plain forward reads its local head count off these
        x = _inputs()
        y = block(x, model.rope_cos[:S], model.rope_sin[:S])
        y.pow(2).sum().backward()
        grads = {k: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for k, p in block.named_parameters()}
        out[name] = (y.detach(), x.grad, grads)
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_block_matches_dtensor_parallelize_module(n):
    results = minitp.launch(_against_dtensor, n, echo=False)
    for r in results:
        (y, x_grad, grads), (y_dt, x_grad_dt, grads_dt) = r["minitp"], r["dtensor"]
        _assert_close(y, y_dt, "block output")
        _assert_close(x_grad, x_grad_dt, "input gradient")
        assert set(grads) == set(grads_dt)
        for k in grads:  # the same local shard on the same rank
            _assert_close(grads[k], grads_dt[k], f"gradient of {k}")


# -- bad input ----------------------------------------------------------------------------------------
def _refusals():
    def message(make):
        try:
            make()
        except ValueError as e:
            return str(e)
        return "accepted"

    six_positions = torch.zeros(1, 6, dtype=torch.long)  # not divisible by 4
    sp_model = tp.parallelize(build_model(TINY), None, sequence_parallel=True)
    return {
        "column": message(lambda: tp.ColumnParallelLinear(nn.Linear(4, 10), None)),
        "row": message(lambda: tp.RowParallelLinear(nn.Linear(6, 4), None)),
        "heads": message(lambda: tp.parallelize(build_model(TINY.with_(n_heads=2, n_kv_heads=2)), None)),
        "kv_heads": message(lambda: tp.parallelize(build_model(TINY.with_(n_kv_heads=2)), None)),
        "vocab": message(lambda: tp.parallelize(build_model(TINY.with_(vocab_size=130)), None)),
        "sequence": message(lambda: sp_model(six_positions)),
    }


def test_bad_input_is_refused_with_the_numbers():
    got = minitp.launch(_refusals, 4, echo=False)[0]
    assert got["column"] == "out_features=10 is not divisible by tp=4"
    assert got["row"] == "in_features=6 is not divisible by tp=4"
    assert got["heads"] == "n_heads=2 is not divisible by tp=4"
    assert got["kv_heads"] == ("n_kv_heads=2 is not divisible by tp=4: minitp splits key/value heads "
                               "and refuses to replicate them")
    assert got["vocab"] == ("vocab_size=130 is not divisible by tp=4; minitp refuses rather than pads: "
                            "build the model with vocab_size=132 (the next multiple of 4)")
    assert got["sequence"].startswith("sequence length 6 is not divisible by tp=4")
    # the run refuses in the parent, before starting any process
    with pytest.raises(ValueError, match="n_heads=8 is not divisible by tp=3"):
        runs.run_tp(nproc=3)
    with pytest.raises(ValueError, match="seq_len=10 is not divisible by tp=4"):
        runs.run_tp(nproc=4, seq_len=10, sequence_parallel=True)
