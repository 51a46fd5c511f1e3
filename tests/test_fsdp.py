"""minitp.fsdp against its three oracles: the one-process run, PyTorch's ``fully_shard``, and the
byte and memory formulas of ``minitp.cost``.

Every check of one world size runs in one launch (several configurations one after the other,
each with its own trace recording), so the whole file stays well under a minute and a half.

Which one-process run: the global batch cut into as many micro-batches as ranks, their gradients
averaged in fp32 (``references.microbatched``). It is the full-batch gradient, summed in
the order data parallel sums it; against the full batch itself AdamW magnifies last-bit
differences of nearly cancelling gradients (DDP on 3 ranks, batch 12, is 1.3e-4 off it). The
full-batch run is the oracle of the CLI test, at the default batch where it is well conditioned.
"""

import json

import pytest
import torch

from minitp import cli, cost, runs
from minitp.fsdp import FullyShardedDataParallel, plan_units, unit_numels
from minitp.launcher import launch
from minitp.models import build_model, get_config, loss_fn
from minitp.models.train import TrainConfig, synthetic_batches
from minitp.runs import references

CFG = get_config("tiny")
TRAIN = TrainConfig(steps=4, batch_size=12)  # 12 splits over 1, 2, 3 and 4 ranks
BF16_ULP = 2.0**-7  # one unit in the last place of a bf16 value x is at most |x| * 2^-7

ADAM_CONFIGS = [
    dict(zero=1), dict(zero=2), dict(zero=3),
    dict(zero=3, reshard_after_forward=False),
    dict(zero=3, prefetch=False),
    dict(zero=3, checkpoint=True),
    dict(zero=2, checkpoint=True),
    dict(zero=3, reshard_after_forward=False, prefetch=False, checkpoint=True),
    dict(zero=1, mixed_precision=torch.bfloat16),
    dict(zero=2, mixed_precision=torch.bfloat16),
    dict(zero=3, mixed_precision=torch.bfloat16, checkpoint=True),
    dict(zero=3, mixed_precision=torch.bfloat16, reshard_after_forward=False, prefetch=False),
]
SGD_CONFIGS = [dict(zero=1), dict(zero=3), dict(zero=2, mixed_precision=torch.bfloat16),
               dict(zero=3, mixed_precision=torch.bfloat16)]


def _fsdp_configs_worker(train, adam_configs, sgd_configs):
    """Train each configuration from the same seed; return what each rank saw and held."""
    import torch.distributed as dist

    from minitp import trace
    from minitp.ddp import split_batch
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.models import build_model, get_config, loss_fn
    from minitp.models.train import make_optimizer, synthetic_batches
    from minitp.runs import train_steps

    cfg, rank, out = get_config("tiny"), dist.get_rank(), {"adam": [], "sgd": []}
    for options in adam_configs:
        with trace.recording(rank) as tr:
            model = build_model(cfg, seed=train.seed)
            fsdp = FullyShardedDataParallel(model, **options)
            optimizer = fsdp.attach(make_optimizer(fsdp.parameters(), train.lr))
            train_steps(model, fsdp, synthetic_batches(cfg, train), split_batch, optimizer)
            memory, peak = fsdp.held_bytes(), fsdp.gathered_peak
            state = fsdp.full_state_dict()
        out["adam"].append({"state": state, "sent": tr.sent_bytes(), "memory": memory, "peak": peak,
                            "labels": sorted({e.label for e in tr.comm()})})
    tokens, targets = synthetic_batches(cfg, train)[0]
    for options in sgd_configs:  # one plain gradient step: p - 1.0 * grad shows the gradient itself
        model = build_model(cfg, seed=train.seed)
        fsdp = FullyShardedDataParallel(model, **options)
        optimizer = fsdp.attach(torch.optim.SGD(fsdp.parameters(), lr=1.0))
        loss_fn(fsdp(split_batch(tokens)), split_batch(targets)).backward()
        optimizer.step()
        out["sgd"].append(fsdp.full_state_dict())
    return out


def _reference_sgd_step(n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One process: the first batch in n micro-batches, gradients averaged in fp32 (rounded to
    bf16 in mixed precision), one SGD step of size 1 on the fp32 weights."""
    master, work = build_model(CFG, seed=TRAIN.seed), build_model(CFG, seed=TRAIN.seed)
    for p in work.parameters():
        p.data = p.data.to(dtype)
    tokens, targets = synthetic_batches(CFG, TRAIN)[0]
    total = [torch.zeros_like(p) for p in master.parameters()]
    for x, y in zip(tokens.chunk(n), targets.chunk(n)):
        for t, g in zip(total, torch.autograd.grad(loss_fn(work(x), y), list(work.parameters()))):
            t += g.float() / n
    names = [name for name, _ in master.named_parameters()]
    return {name: (p - t.to(dtype).float()).detach() for name, p, t in zip(names, master.parameters(), total)}


def _max_diff(state, reference) -> float:
    return max((state[k] - v).abs().max().item() for k, v in reference.items())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fsdp_matches_single_process_and_formulas_at_each_world_size(world_size):
    n = world_size
    fp32_ref = references.microbatched(CFG, TRAIN, n)
    bf16_ref = references.microbatched(CFG, TRAIN, n, torch.bfloat16)
    # bf16: the recipe's own sensitivity to the order of the sum over ranks (see run_fsdp)
    bf16_tolerance = max(1e-5, 2 * _max_diff(
        references.microbatched(CFG, TRAIN, n, torch.bfloat16, reverse_sum=True), bf16_ref))
    results = launch(_fsdp_configs_worker, n, TRAIN, ADAM_CONFIGS, SGD_CONFIGS, echo=False)
    numels = unit_numels(build_model(CFG), n)
    assert len(numels) == 1 + CFG.n_layers  # the root, then one unit per block

    for i, options in enumerate(ADAM_CONFIGS):
        mixed = options.get("mixed_precision") is not None
        reshard, prefetch = options.get("reshard_after_forward", True), options.get("prefetch", True)
        precision, param_bytes = ("bf16", 2) if mixed else ("fp32", 4)
        reference, tolerance = (bf16_ref, bf16_tolerance) if mixed else (fp32_ref, 1e-5)
        sent = cost.fsdp_run_bytes(numels, n, TRAIN.steps, options["zero"], reshard, param_bytes)
        memory = cost.fsdp_memory_per_rank(numels, n, options["zero"], precision)
        peak = cost.fsdp_gathered_peak_bytes(numels, n, options["zero"], reshard, prefetch, param_bytes)
        for rank, r in enumerate(results):
            got = r["adam"][i]
            where = f"{options} rank {rank}"
            assert _max_diff(got["state"], reference) <= tolerance, where
            assert got["sent"] == pytest.approx(sent, rel=1e-12, abs=1e-6), where
            assert got["memory"] == pytest.approx(memory), where
            assert got["peak"] == peak, where
        if n > 1:  # forward and backward gathers carry different labels
            labels = results[0]["adam"][i]["labels"]
            assert "fsdp/layers.1/reduce_scatter" in labels
            if options["zero"] == 3:
                assert "fsdp/layers.1/all_gather.forward" in labels
                assert ("fsdp/layers.1/all_gather.backward" in labels) == reshard
                assert "fsdp/root/all_gather.backward" not in labels  # backward starts with the root
            else:
                assert "fsdp/layers.1/all_gather.step" in labels

    for i, options in enumerate(SGD_CONFIGS):  # the gradient itself, with no AdamW to rescale it
        dtype = options.get("mixed_precision") or torch.float32
        reference = _reference_sgd_step(n, dtype)
        for rank, r in enumerate(results):
            for name, expected in reference.items():
                got = r["sgd"][i][name]
                step = (build_model(CFG, seed=TRAIN.seed).get_parameter(name) - expected).abs()
                # fp32: the same sum in another order; bf16: it may round to the neighbouring value
                bound = 1e-6 if dtype == torch.float32 else BF16_ULP * step + 1e-6
                assert torch.all((got - expected).abs() <= bound), f"{options} rank {rank} {name}"


def test_fsdp_padding_is_what_the_formula_counts():
    # 3 ranks: the root unit (16,448 elements) pads to 16,449, each block (36,992: attention with
    # 4 key/value heads for 8 query heads) to 36,993
    numels = unit_numels(build_model(CFG), 3)
    assert numels[0] == 16448 and numels[1:] == [36992] * 4
    assert sum(cost.padded_numel(p, 3) for p in numels) == CFG.num_params() + 5
    mem = cost.fsdp_memory_per_rank(numels, 3, zero=3, precision="bf16")
    assert cost.total_memory(mem) == 16 * (CFG.num_params() + 5) / 3 + 4 * len(numels)


def test_fsdp_counts_the_bytes_it_holds_as_measure_memory_counts_them():
    from minitp.fsdp import _storage_bytes
    from minitp.measure.memory import storage_bytes

    flat, other, empty = torch.zeros(12), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(0)
    cases = [[flat], [flat, flat[:6], flat.view(3, 4)], [flat, None, other], [empty, other[2:]], [None], []]
    assert [_storage_bytes(c) for c in cases] == [storage_bytes(c) for c in cases] == [48, 48, 58, 10, 0, 0]


def _against_fully_shard_worker(train, mixed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from minitp.ddp import split_batch
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.models import build_model, get_config, loss_fn
    from minitp.models.train import make_optimizer, synthetic_batches

    cfg = get_config("tiny")
    ours_model = build_model(cfg, seed=train.seed)
    ours = FullyShardedDataParallel(ours_model, zero=3, mixed_precision=torch.bfloat16 if mixed else None)
    ours_opt = ours.attach(make_optimizer(ours.parameters(), train.lr))
    theirs = build_model(cfg, seed=train.seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    for block in theirs.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)
    theirs_opt = make_optimizer(theirs.parameters(), train.lr)
    for tokens, targets in synthetic_batches(cfg, train):
        for model, opt in ((ours, ours_opt), (theirs, theirs_opt)):
            opt.zero_grad()
            loss_fn(model(split_batch(tokens)), split_batch(targets)).backward()
            opt.step()
    full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    mine = ours.full_state_dict()
    return max((mine[k] - full[k]).abs().max().item() for k in full)


@pytest.mark.parametrize("world_size", [3, 4])
def test_fsdp_matches_fully_shard_on_the_same_seed_and_data(world_size):
    diffs = launch(_against_fully_shard_worker, world_size, TrainConfig(steps=4, batch_size=12), False,
                   echo=False)
    assert max(diffs) <= 1e-5, diffs


def test_minitp_run_fsdp_zero3_matches_reference_bytes_and_holds_a_quarter_of_ddp(tmp_path):
    path = tmp_path / "r.json"
    assert cli.main(["run", "fsdp", "--nprocs", "4", "--zero", "3", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert runs.check(report) == []
    assert report["max_abs_param_diff"] <= 1e-5  # the full-batch one-process run
    assert report["comm_bytes_traced"] == pytest.approx(report["comm_bytes_expected"], rel=1e-12)
    ddp = runs.run_ddp(nproc=4, steps=1)
    ddp_bytes = sum(ddp["memory"][0].values())
    for held in report["memory"]:
        assert sum(held.values()) <= 0.27 * ddp_bytes, (held, ddp_bytes)
    assert set(report) >= set(ddp) - {"bucket_mb", "num_buckets"}  # ddp's report keys, plus its own


def test_bad_input_gets_a_clear_error():
    model = build_model(CFG)
    model.layers[3] = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"a unit with no parameters: layers\.3 \(Identity\)"):
        plan_units(model, 2, wrap=lambda name, m: name.startswith("layers.") and name.count(".") == 1)
    tiny = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(2))  # the root: 20 elements
    with pytest.raises(ValueError, match=r"unit 1 has 4 elements, fewer than the 8 ranks"):
        plan_units(tiny, 8, wrap=lambda name, m: isinstance(m, torch.nn.LayerNorm))
    # a parameter smaller than the world (the 4-element bias, the 2-element norm) is fine inside a larger unit
    assert [p.numel for p in plan_units(tiny, 8, wrap=lambda name, m: False)] == [24]
    with pytest.raises(ValueError, match=r"unsupported dtype: tok_embeddings.weight is torch.float16"):
        plan_units(build_model(CFG).half(), 2)
    shared = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    shared[1].weight = shared[0].weight
    with pytest.raises(ValueError, match=r"a parameter shared between 0.weight and 1.weight"):
        plan_units(shared, 2)
    with pytest.raises(ValueError, match=r"unsupported dtype: mixed_precision=torch.float16"):
        FullyShardedDataParallel(build_model(CFG), mixed_precision=torch.float16)
    with pytest.raises(ValueError, match=r"zero must be 1, 2 or 3, got 4"):
        FullyShardedDataParallel(build_model(CFG), zero=4)


# -- a parameter no rank used ---------------------------------------------------------------------------
class _WithUnused(torch.nn.Module):
    """Two linear layers (40 elements: on 3 ranks the shards cut through the second one); the
    second is used only when ``use_second`` says so."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_second=False):
        return self.used(x) + self.unused(x) if use_second else self.used(x)


def _adamw_with_unused(configs: list, use_second_on: tuple[int, ...], parts: int, steps: int = 2) -> list[dict]:
    """AdamW steps (weight decay 0.1) of ``_WithUnused`` under each configuration: a dict of FSDP
    options, "fully_shard" (PyTorch's), or "one process" (every rank's part of the batch on one
    process, the mean of their losses). Part r uses the second layer when r is in ``use_second_on``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    out = []
    for options in configs:
        torch.manual_seed(0)
        model, fsdp = _WithUnused(), None
        if options == "fully_shard":
            fully_shard(model)
        elif options != "one process":
            fsdp = FullyShardedDataParallel(model, **options)
        optimizer = torch.optim.AdamW((fsdp or model).parameters(), lr=1e-2, weight_decay=0.1)
        if fsdp:
            fsdp.attach(optimizer)
        ranks = range(parts) if options == "one process" else [dist.get_rank()]
        dtype = fsdp.compute_dtype if fsdp else torch.float32
        for step in range(steps):
            x = torch.randn(4 * parts, 4, generator=torch.Generator().manual_seed(step)).to(dtype).chunk(parts)
            optimizer.zero_grad()
            losses = [(fsdp or model)(x[r], r in use_second_on).float().pow(2).mean() for r in ranks]
            (sum(losses) / len(ranks)).backward()
            optimizer.step()
        if fsdp:
            state = fsdp.full_state_dict()
            pieces = [p for p in fsdp.local_pieces() if p.name == "unused.weight"]
        else:
            state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
            pieces = None
        out.append({"state": state, "unused_pieces": pieces})
    return out


FSDP_UNUSED_CONFIGS = [dict(zero=1), dict(zero=2), dict(zero=3), dict(zero=3, mixed_precision=torch.bfloat16)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_leaves_a_parameter_no_rank_used_as_one_process_and_fully_shard_do(world_size):
    """No rank used it: weight decay 0.1 does not move it, its AdamW moments stay zero (what the
    fsdp docstring promises). Documented difference: AdamW counts one step per shard, so the
    shard's count advances (one process keeps no state for the parameter)."""
    one = launch(_adamw_with_unused, 1, ["one process"], (), world_size, echo=False)[0][0]
    results = launch(_adamw_with_unused, world_size, [*FSDP_UNUSED_CONFIGS, "fully_shard"], (), world_size,
                     echo=False)
    torch.manual_seed(0)
    initial = _WithUnused().unused.weight.detach()
    assert torch.equal(one["state"]["unused.weight"], initial)
    for rank in results:
        *ours, theirs = rank
        assert torch.equal(theirs["state"]["unused.weight"], initial)
        for options, r in zip(FSDP_UNUSED_CONFIGS, ours):
            assert torch.equal(r["state"]["unused.weight"], initial), options  # moved by exactly 0
            tolerance = 1e-2 if "mixed_precision" in options else 1e-6
            assert _max_diff(r["state"], one["state"]) <= tolerance, options
            for piece in r["unused_pieces"]:
                assert not piece.tensors["exp_avg"].any() and not piece.tensors["exp_avg_sq"].any()
                assert piece.step == 2  # the shard's count: one per shard in a flat unit


def test_fsdp_averages_a_parameter_one_rank_used_as_one_process_does():
    one = launch(_adamw_with_unused, 1, ["one process"], (0,), 2, echo=False)[0][0]
    torch.manual_seed(0)
    assert not torch.equal(one["state"]["unused.weight"], _WithUnused().unused.weight)  # it did move
    for rank in launch(_adamw_with_unused, 2, FSDP_UNUSED_CONFIGS[:3], (0,), 2, echo=False):
        for r in rank:
            assert _max_diff(r["state"], one["state"]) <= 1e-6
