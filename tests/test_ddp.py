"""minitp.ddp against its three oracles: one process, PyTorch's DDP, and minitp.cost."""

import statistics

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import minitp
from minitp import cost, runs
from minitp.ddp import DistributedDataParallel, DistributedSampler, all_reduce_mean, split_batch
from minitp.models import TINY, build_model, loss_fn
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches, train_reference

TRAIN = TrainConfig(steps=4, batch_size=8)
PARAM_BYTES = [p.numel() * 4 for p in build_model(TINY).parameters()][::-1]  # backward order
BUCKETS = {"one": 100.0, "two": 0.45, "many": 1e-4}  # MiB


@pytest.fixture(scope="module")
def reference():
    losses, model = train_reference(TINY, TRAIN)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _train(bucket_mb, micro_batches=1, train=TRAIN):
    """Train the tiny model with minitp DDP; with micro_batches > 1 accumulate under no_sync."""
    model = build_model(TINY, seed=train.seed)
    ddp = DistributedDataParallel(model, bucket_mb=bucket_mb)
    optimizer = make_optimizer(model.parameters(), train.lr)
    losses = []
    for tokens, targets in synthetic_batches(TINY, train):
        x, y = split_batch(tokens), split_batch(targets)
        optimizer.zero_grad()
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = i == micro_batches - 1
            with minitp.trace.span("backward") if last else ddp.no_sync():
                loss = loss_fn(ddp(xm), ym) / micro_batches
                loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return {"state": model.state_dict(), "losses": losses, "num_buckets": len(ddp.buckets)}


def _global_losses(results):
    return [statistics.fmean(r["losses"][s] for r in results) for s in range(TRAIN.steps)]


@pytest.mark.parametrize("buckets", list(BUCKETS))
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ddp_matches_single_process(world_size, buckets, reference):
    ref_losses, ref_state = reference
    results = minitp.launch(_train, world_size, BUCKETS[buckets], echo=False)
    for r in results:
        assert runs.max_abs_diff(r["state"], ref_state) <= 1e-5
    assert _global_losses(results) == pytest.approx(ref_losses, abs=1e-5)
    expected_buckets = cost.num_buckets(PARAM_BYTES, int(BUCKETS[buckets] * 2**20))
    assert results[0]["num_buckets"] == expected_buckets
    assert {"one": 1, "two": 2, "many": len(PARAM_BYTES)}[buckets] == expected_buckets
    psi = TINY.num_params()
    for rank, tr in enumerate(results.traces):
        buckets_sent = [e for e in tr.comm() if e.op == "all_reduce"]
        assert len(buckets_sent) == TRAIN.steps * expected_buckets
        assert tr.sent_bytes() == pytest.approx(cost.ddp_run_bytes(psi, world_size, TRAIN.steps, rank))


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_with_no_sync_accumulation_matches_single_process(world_size, reference):
    ref_losses, ref_state = reference
    results = minitp.launch(_train, world_size, 0.45, 2, echo=False)
    for r in results:
        assert runs.max_abs_diff(r["state"], ref_state) <= 1e-5
    assert _global_losses(results) == pytest.approx(ref_losses, abs=1e-5)
    # only the last micro-batch of each step communicates
    ar = [e for e in results.traces[0].comm() if e.op == "all_reduce"]
    assert len(ar) == TRAIN.steps * results[0]["num_buckets"]


def _train_with_both():
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    out = {}
    for name, wrap in (("minitp", lambda m: DistributedDataParallel(m, bucket_mb=0.45)),
                       ("torch", lambda m: TorchDDP(m, bucket_cap_mb=0.45))):
        model = build_model(TINY, seed=TRAIN.seed)
        wrapped = wrap(model)
        optimizer = make_optimizer(model.parameters(), TRAIN.lr)
        for tokens, targets in synthetic_batches(TINY, TRAIN):
            optimizer.zero_grad()
            loss_fn(wrapped(split_batch(tokens)), split_batch(targets)).backward()
            optimizer.step()
        out[name] = model.state_dict()
    return out


def test_ddp_matches_pytorch_ddp(reference):
    results = minitp.launch(_train_with_both, 4, echo=False)
    for r in results:
        assert runs.max_abs_diff(r["minitp"], r["torch"]) <= 1e-5
        assert runs.max_abs_diff(r["torch"], reference[1]) <= 1e-5


def _three_linears(bucket_bytes):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    ddp = DistributedDataParallel(model, bucket_mb=bucket_bytes / 2**20)
    ddp(torch.randn(4, 10)).sum().backward()
    return [[p.numel() * 4 for p in b.params] for b in ddp.buckets]


@pytest.mark.parametrize("bucket_bytes, expected", [
    # backward order: bias3 (40 B), weight3 (400 B), bias2, weight2, bias1, weight1
    (440, [[40, 400], [40, 400], [40, 400]]),
    (1000, [[40, 400, 40, 400, 40], [400]]),
    (10_000, [[40, 400, 40, 400, 40, 400]]),
    (100, [[40], [400], [40], [400], [40], [400]]),
])
def test_number_of_buckets_follows_the_bucket_size(bucket_bytes, expected):
    results = minitp.launch(_three_linears, 2, bucket_bytes, echo=False)
    assert results[0] == expected
    sent = [e.bytes for e in results.traces[0].comm() if e.op == "all_reduce"]
    assert sent == [sum(b) for b in expected]  # one all-reduce per bucket, in bucket order


def test_buckets_are_sent_during_backward_not_after(reference):
    results = minitp.launch(_train, 2, BUCKETS["many"], echo=False)
    events = results.traces[0].events
    for step in range(TRAIN.steps):
        backward = [e for e in events if e.op == "backward"][step]
        first = min((e for e in events if e.op == "all_reduce" and backward.start <= e.start),
                    key=lambda e: e.start)
        assert first.start < backward.end - 0.25 * backward.duration  # launched well before backward ends


class _WithUnused(nn.Module):
    """Two linear layers; the second is used only when ``use_second`` says so."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_second=False):
        return self.used(x) + self.unused(x) if use_second else self.used(x)


def _unused_parameter():
    torch.manual_seed(dist.get_rank())
    model = _WithUnused()
    ddp = DistributedDataParallel(model, bucket_mb=1e-4)
    ddp(torch.randn(2, 4)).sum().backward()
    return model.unused.weight.grad, model.used.weight.grad


def test_a_parameter_without_gradient_does_not_hang_the_others():
    results = minitp.launch(_unused_parameter, 2, timeout=30, echo=False)
    assert results[0][0] is None and results[1][0] is None  # no rank used it: no gradient, as on one process
    torch.testing.assert_close(results[0][1], results[1][1])  # the used one is averaged


def _used_with_a_negative_zero_gradient():
    """Rank 0 uses the second layer, but its weight's gradient is -0.0 in every element; rank 1 does
    not use it. Rank 0 used it: on both ranks it must have a gradient (zeros), not None."""
    torch.manual_seed(0)
    model = _WithUnused()
    if dist.get_rank() == 0:
        model.unused.weight.register_hook(lambda grad: torch.full_like(grad, -0.0))
    ddp = DistributedDataParallel(model, bucket_mb=1e-4)
    ddp(torch.randn(2, 4), dist.get_rank() == 0).sum().backward()
    return model.unused.weight.grad


def test_a_parameter_used_with_a_negative_zero_gradient_counts_as_used_on_every_rank():
    grads = minitp.launch(_used_with_a_negative_zero_gradient, 2, timeout=30, echo=False)
    assert all(g is not None and not g.any() for g in grads)  # zeros, on both ranks alike
    assert not any(bool(g.signbit().any()) for g in grads)  # +0.0: rank 0 sent no -0.0


def _adamw_with_unused(wrapper: str, use_second_on: tuple[int, ...], parts: int = 2, steps: int = 2):
    """AdamW steps (weight decay 0.1) of ``_WithUnused``: the batch is cut into ``parts``, part r
    uses the second layer when r is in ``use_second_on``. Under DDP rank r runs part r; with no
    wrapper one process runs every part and averages their losses, as DDP averages gradients."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.manual_seed(0)
    model = _WithUnused()
    wrapped = {"minitp": lambda: DistributedDataParallel(model, bucket_mb=1e-4), "none": lambda: model,
               "torch": lambda: TorchDDP(model, find_unused_parameters=True)}[wrapper]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ranks = range(parts) if wrapper == "none" else [dist.get_rank()]
    for step in range(steps):
        x = torch.randn(4 * parts, 4, generator=torch.Generator().manual_seed(step)).chunk(parts)
        optimizer.zero_grad()
        sum(wrapped(x[r], r in use_second_on).pow(2).mean() for r in ranks).div(len(ranks)).backward()
        optimizer.step()
    return {"state": model.state_dict(), "unused_step": optimizer.state.get(model.unused.weight, {}).get("step")}


@pytest.mark.parametrize("use_second_on", [(), (0,)], ids=["used-by-no-rank", "used-by-rank-0-only"])
def test_an_unused_parameter_is_left_as_one_process_and_pytorch_ddp_leave_it(use_second_on):
    """Used by no rank: no gradient, so AdamW skips it (weight decay 0.1 does not move it, no step
    counted). Used by one rank: the others count as zeros in the average, as in PyTorch's DDP."""
    one = minitp.launch(_adamw_with_unused, 1, "none", use_second_on, echo=False)[0]
    ours = minitp.launch(_adamw_with_unused, 2, "minitp", use_second_on, echo=False)
    theirs = minitp.launch(_adamw_with_unused, 2, "torch", use_second_on, echo=False)
    for r in (*ours, *theirs):
        assert runs.max_abs_diff(r["state"], one["state"]) <= 1e-6
        assert r["unused_step"] == one["unused_step"]
    if not use_second_on:
        torch.manual_seed(0)
        assert torch.equal(ours[0]["state"]["unused.weight"], _WithUnused().unused.weight)  # moved by exactly 0
        assert one["unused_step"] is None


def _split(batch_rows):
    return split_batch(torch.arange(batch_rows))


def test_split_batch_gives_disjoint_contiguous_slices():
    results = minitp.launch(_split, 4, 8, echo=False)
    assert [r.tolist() for r in results] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_batch_that_does_not_divide_is_refused_with_the_numbers():
    with pytest.raises(minitp.RankError, match="a batch of 10 rows is not divisible by the 4 ranks"):
        minitp.launch(_split, 4, 10, echo=False)


def _sampler_and_metric(epoch):
    sampler = DistributedSampler(12, seed=1)
    sampler.set_epoch(epoch)
    return list(sampler), all_reduce_mean(float(dist.get_rank()))


def test_sampler_deals_every_index_once_and_metrics_average():
    results = minitp.launch(_sampler_and_metric, 3, 0, echo=False)
    indices = [i for r in results for i in r[0]]
    assert sorted(indices) == list(range(12))
    assert [r[1] for r in results] == [1.0, 1.0, 1.0]
    again = minitp.launch(_sampler_and_metric, 3, 1, echo=False)
    assert [r[0] for r in again] != [r[0] for r in results]  # a new epoch shuffles anew


def _bad_bucket(mb):
    DistributedDataParallel(nn.Linear(2, 2), bucket_mb=mb)


@pytest.mark.parametrize("mb", [0, -1.0])
def test_bucket_size_must_be_positive(mb):
    with pytest.raises(minitp.RankError, match=f"bucket_mb must be > 0, got {mb}"):
        minitp.launch(_bad_bucket, 1, mb, echo=False)


def _gradient_storage(set_to_none):
    """Train with minitp DDP; after each step, where each gradient lives."""
    model = build_model(TINY, seed=TRAIN.seed)
    ddp = DistributedDataParallel(model, bucket_mb=BUCKETS["two"])
    optimizer = make_optimizer(model.parameters(), TRAIN.lr)
    addresses = []
    for tokens, targets in synthetic_batches(TINY, TRAIN):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss_fn(ddp(split_batch(tokens)), split_batch(targets)).backward()
        optimizer.step()
        addresses.append([p.grad.data_ptr() for p in model.parameters()])
    buckets = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes) for b in ddp.buckets]
    in_a_bucket = [any(lo <= p.grad.data_ptr() < hi for lo, hi in buckets) for p in model.parameters()]
    return {"in_a_bucket": in_a_bucket, "addresses": addresses, "state": model.state_dict()}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_views_into_the_buckets_so_no_step_allocates_one(set_to_none, reference):
    """As PyTorch's gradient_as_bucket_view: each param.grad is its slice of a bucket, the same
    memory every step; training still matches one process."""
    results = minitp.launch(_gradient_storage, 2, set_to_none, echo=False)
    for r in results:
        assert all(r["in_a_bucket"])
        assert all(step == r["addresses"][0] for step in r["addresses"])
        assert runs.max_abs_diff(r["state"], reference[1]) <= 1e-5
