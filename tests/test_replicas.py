"""One data-parallel protocol: DDP, FSDP, expert parallel and context parallel all keep replicas in step
the same way (``minitp.replicas.GradientSync``): a backward under ``no_sync()`` sends nothing, and
``finish_gradients()`` then gives exactly what a synchronised backward gives."""

import pytest
import torch

from minitp import comm, cp, ddp, ep, fsdp, trace
from minitp.launcher import launch
from minitp.models import TINY, build_model, loss_fn
from minitp.models.moe import build_moe_model, moe_config
from minitp.replicas import GradientSync

B, S = 4, 8


def _wrap(kind):
    if kind == "ddp":
        model = build_model(TINY, seed=0)
        return model, ddp.DistributedDataParallel(model), lambda m: m.parameters()
    if kind == "fsdp":
        model = build_model(TINY, seed=0)
        wrapped = fsdp.FullyShardedDataParallel(model, zero=1)
        wrapped.attach(torch.optim.SGD(wrapped.parameters(), lr=0.0))
        return model, wrapped, lambda m: [u.grad_shard for u in m.units]
    if kind == "ep":
        model = build_moe_model(moe_config(TINY, n_experts=4), seed=0)
        return model, ep.ExpertParallel(model), lambda m: [p for p in m.parameters() if p.grad is not None]
    model = build_model(TINY, seed=0)
    return model, cp.parallelize(model, None), lambda m: m.parameters()


def _grads(kind, deferred):
    torch.set_num_threads(1)
    model, wrapped, held = _wrap(kind)
    tokens = torch.randint(0, TINY.vocab_size, (B, S), generator=torch.Generator().manual_seed(comm.group_rank()))
    if kind == "cp":
        tokens = cp.shard_sequence(tokens, None)
    with trace.recording() as tr:
        with wrapped.no_sync() if deferred else torch.enable_grad():
            loss_fn(wrapped(tokens[:, :-1] if kind != "cp" else tokens), tokens[:, 1:] if kind != "cp" else tokens)\
                .backward()
        # the averaging messages (the experts' all-to-alls and the ring's sends are the strategies' own)
        sent_in_backward = sum(e.op in ("all_reduce", "reduce_scatter") for e in tr.comm())
        if deferred:
            wrapped.finish_gradients()
    out = [g.detach().clone() if isinstance(g, torch.Tensor) and not isinstance(g, torch.nn.Parameter)
           else g.grad.detach().clone() for g in held(wrapped)]
    return {"protocol": isinstance(wrapped, GradientSync), "sent_in_backward": sent_in_backward, "grads": out}


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "ep", "cp"])
def test_no_sync_then_finish_gradients_equals_a_synchronised_backward(kind):
    synced = launch(_grads, 2, kind, False, echo=False)
    deferred = launch(_grads, 2, kind, True, echo=False)
    for a, b in zip(synced, deferred):
        assert a["protocol"] and b["protocol"]
        assert b["sent_in_backward"] == 0 < a["sent_in_backward"]  # under no_sync: nothing left the rank
        assert len(a["grads"]) == len(b["grads"]) > 0
        for x, y in zip(a["grads"], b["grads"]):
            assert torch.allclose(x, y, atol=1e-7, rtol=1e-6)
