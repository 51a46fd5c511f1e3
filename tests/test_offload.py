"""minitp.offload against one process and minitp.cost.offload: activation offload and op-level
selective checkpointing give the plain gradients, move and keep the bytes the formulas say, in the
order backward needs them; recomputation runs no matmul again under selective and a forward's
worth under full; on 2 ranks of DDP offload still equals one process; planted mistakes (a stack
for a store, a stale store, a policy that saves nothing, a threshold that moves the parameters) are
caught; and the planner's new modes at LLaMA-3's shapes equal a hand computation."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import FlopCounterMode

import minitp
from minitp import cost, offload, plan, runs
from minitp.ddp import DistributedDataParallel, split_batch
from minitp.measure.activations import SavedTensors, run_recomputed
from minitp.models import LLAMA3_8B, LLAMA3_70B, TINY, build_model, loss_fn
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches, train_reference

B, S = 2, 16
FUSED = TINY.with_(fused_attention=True)
BLOCK = cost.tiny_block_activation_bytes(TINY, B, S)  # 164,352 bytes: what a plain block saves


def _batch(seed=0):
    tokens = torch.randint(0, TINY.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _step(cfg=TINY, recompute_for=lambda model: None, seed=0, model=None):
    """One forward+backward of the tiny model; (gradients by name, the model, what ran the blocks)."""
    model = model or build_model(cfg)
    x, y = _batch(seed)
    recompute = recompute_for(model)
    loss_fn(model(x, recompute=recompute), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, model, recompute


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- offload --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [TINY, FUSED], ids=["written-out", "fused"])
def test_offloaded_blocks_give_the_plain_gradients_and_move_each_saved_byte_out_once_and_in_once(cfg):
    plain, _, _ = _step(cfg)
    store = offload.HostStore()
    grads, model, _ = _step(cfg, lambda m: offload.offload_blocks(store, m))
    assert _max_diff(grads, plain) == 0.0  # bit for bit: the same bytes come back
    block = cost.tiny_block_activation_bytes(cfg, B, S)
    assert sum(cost.tiny_block_saved_tensors(cfg, B, S).values()) == block
    assert store.bytes_out == store.bytes_in == cfg.n_layers * block
    assert store.host_peak == store.bytes_out  # after forward the host held every block's
    assert store.host_bytes == 0 and store.host == {}  # backward took them all back
    assert offload.offload_problems(store, model, expected_bytes=cfg.n_layers * block) == []


def test_a_threshold_keeps_the_small_tensors_on_the_device_and_the_allocator_agrees():
    tensors = cost.tiny_block_saved_tensors(TINY, B, S)
    split = cost.offloaded_block_bytes(tensors, min_bytes=1024)
    # the two 1/rms vectors (N fp32 each) and the causal mask (S·S bools) stay: 512 bytes
    assert split == {"moved": BLOCK - 512, "kept": 2 * B * S * 4 + S * S}
    assert split["kept"] <= sum(1 for n in tensors.values() if n < 1024) * 1024

    store = offload.HostStore()
    grads, _, run = _step(TINY, lambda m: offload.offload_blocks(store, m, min_bytes=1024))
    assert _max_diff(grads, _step()[0]) == 0.0
    assert run.kept_bytes == {f"layers.{i}": split["kept"] for i in range(TINY.n_layers)}
    for i in range(TINY.n_layers):
        assert sum(m.nbytes for m in store.moves if m.label == f"layers.{i}" and m.direction == "out") \
            == split["moved"]
    assert store.bytes_out == store.bytes_in == TINY.n_layers * split["moved"]

    # the allocator's count of one block's forward: its output, the host's copies, and what stayed
    model = build_model(TINY)
    x = torch.randn(B, S, TINY.dim, requires_grad=True)
    store = offload.HostStore()
    run = offload.offload_blocks(store, model, min_bytes=1024)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model.layers[0](x, model.rope_cos[:S], model.rope_sin[:S], recompute=run)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events())
    assert store.host_bytes == split["moved"]
    assert abs(allocated - store.host_bytes - out.numel() * 4 - split["kept"]) <= 16


def test_blocks_come_back_in_reverse_order_and_one_at_a_time():
    store = offload.HostStore()
    _step(TINY, lambda m: offload.offload_blocks(store, m))
    outs = [m for m in store.moves if m.direction == "out"]
    ins = [m for m in store.moves if m.direction == "in"]
    runs_of = lambda moves: [label for i, label in enumerate(m.label for m in moves)
                             if i == 0 or moves[i - 1].label != label]
    assert runs_of(outs) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert runs_of(ins) == ["layers.3", "layers.2", "layers.1", "layers.0"]  # each block in one run
    assert sorted(m.key for m in ins) == sorted(m.key for m in outs)  # each storage back once
    assert max(m.at_s for m in outs) < min(m.at_s for m in ins)  # out in forward, in in backward
    # backward frees a block's tensors as it goes: never a whole block's bytes back at once
    assert 0 < store.device_peak < BLOCK
    assert store.device_bytes == 0


def test_whole_model_offload_moves_what_autograd_saves_parameters_left_out():
    model = build_model(TINY)
    x, y = _batch()
    with SavedTensors(model) as counter:
        loss_fn(model(x), y)
    store = offload.HostStore()
    with offload.offloaded(store, keep=model):
        loss = loss_fn(model(x), y)
    loss.backward()
    plain, _, _ = _step()
    assert _max_diff({n: p.grad for n, p in model.named_parameters()}, plain) == 0.0
    # the blocks', the embedding's token ids, the final norm's, the head's input, the loss's
    # log-softmax: every storage the saved-tensor count sees, each once
    assert store.bytes_out == store.bytes_in == counter.bytes > TINY.n_layers * BLOCK
    assert offload.offload_problems(store, model) == []


# -- selective activation checkpointing ------------------------------------------------------------
@pytest.mark.parametrize("cfg", [TINY, FUSED], ids=["written-out", "fused"])
def test_selective_checkpointing_keeps_the_matmul_outputs_between_full_and_none(cfg):
    plain, _, _ = _step(cfg)
    grads, _, selective = _step(cfg, offload.SelectiveCheckpoint)
    assert _max_diff(grads, plain) <= 1e-6
    kept = cost.tiny_selective_block_bytes(cfg, B, S)
    assert selective.kept_bytes == [kept] * cfg.n_layers
    full = cost.tiny_block_activation_bytes(cfg, B, S, recompute=True)
    assert full < kept < cost.tiny_block_activation_bytes(cfg, B, S)
    # tiny, written out: the input and 7 linears' outputs, the scores and the weighted sum: 24,576 floats
    if cfg is TINY:
        assert kept == 4 * (B * S * (64 + 64 + 32 + 32 + 64 + 128 + 128 + 64 + 64) + B * 8 * S * S)
        assert selective.kept_ops == {"aten.mm.default": 7 * 4, "aten.bmm.default": 2 * 4}


@pytest.mark.parametrize("cfg", [TINY, FUSED], ids=["written-out", "fused"])
def test_the_allocator_sees_what_each_way_keeps_after_a_blocks_forward(cfg):
    model = build_model(cfg)
    block, cos, sin = model.layers[0], model.rope_cos[:S], model.rope_sin[:S]
    x = torch.randn(B, S, cfg.dim, requires_grad=True)
    want = {"none": cost.tiny_block_activation_bytes(cfg, B, S), "selective": cost.tiny_selective_block_bytes(cfg, B, S),
            "full": cost.tiny_block_activation_bytes(cfg, B, S, recompute=True)}
    for mode, recompute in [("none", None), ("selective", offload.SelectiveCheckpoint(model)),
                            ("full", run_recomputed)]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = block(x, cos, sin, recompute=recompute)
        allocated = sum(e.self_cpu_memory_usage for e in prof.events())
        # what the forward allocated and left: the output, and what is kept less the input (made before)
        assert abs(allocated - out.numel() * 4 - (want[mode] - x.numel() * 4)) <= 16, mode
        del out  # and what it holds, before the next way runs


def _backward_counts(cfg, recompute_for):
    model = build_model(cfg)
    x, y = _batch()
    loss = loss_fn(model(x, recompute=recompute_for(model)), y)
    with offload.counting_ops() as ops, FlopCounterMode(display=False) as flops:
        loss.backward()
    return ops.matmuls, flops.get_total_flops()


@pytest.mark.parametrize("cfg", [TINY, FUSED], ids=["written-out", "fused"])
def test_selective_recomputes_no_matmul_and_full_recomputation_a_whole_forward(cfg):
    plain = _backward_counts(cfg, lambda m: None)
    selective = _backward_counts(cfg, offload.SelectiveCheckpoint)
    full = _backward_counts(cfg, lambda m: run_recomputed)
    with offload.counting_ops() as forward:
        build_model(cfg)(_batch()[0])
    per_block = 7 + (1 if cfg.fused_attention else 2)  # the linears, and attention's kernel or two bmm
    assert forward.matmuls == cfg.n_layers * per_block + 1  # and the head
    assert selective[0] == plain[0]
    assert full[0] == plain[0] + cfg.n_layers * per_block
    if not cfg.fused_attention:  # the FLOP counter counts bmm, not the CPU's fused kernel
        assert selective[1] == plain[1]
        assert full[1] - plain[1] == B * S * cost.recompute_matmul_flops_per_token(cfg, S, "full")


# -- on 2 ranks ------------------------------------------------------------------------------------
TRAIN = TrainConfig(steps=3, batch_size=8)


def _ddp_offloaded():
    torch.set_num_threads(1)
    model = build_model(TINY, seed=TRAIN.seed)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model.parameters(), TRAIN.lr)
    store = offload.HostStore()
    problems = []
    for tokens, targets in synthetic_batches(TINY, TRAIN):
        x, y = split_batch(tokens), split_batch(targets)
        optimizer.zero_grad()
        loss_fn(ddp(x, recompute=offload.offload_blocks(store, model)), y).backward()
        optimizer.step()
        problems += offload.offload_problems(store, model)
        store.moves.clear()
    return {"state": model.state_dict(), "bytes_out": store.bytes_out, "bytes_in": store.bytes_in,
            "problems": problems, "batch": x.shape[0]}


def test_offload_under_ddp_on_two_ranks_equals_one_process():
    _, reference = train_reference(TINY, TRAIN)
    results = minitp.launch(_ddp_offloaded, 2, echo=False)
    for r in results:
        assert runs.max_abs_diff(r["state"], reference.state_dict()) <= 1e-5
        assert r["problems"] == []
        block = cost.tiny_block_activation_bytes(TINY, r["batch"], TRAIN.seq_len)
        assert r["bytes_out"] == r["bytes_in"] == TRAIN.steps * TINY.n_layers * block


# -- planted mistakes ------------------------------------------------------------------------------
class StackStore(offload.HostStore):
    """Planted: backward "runs in reverse", so each take pops the last storage put of the size asked
    for, not the one asked for (a stack instead of a lookup)."""

    def __init__(self):
        super().__init__()
        self.size_of = {}

    def put(self, flat, label=""):
        key = super().put(flat, label)
        self.size_of[key] = flat.numel()
        return key

    def take(self, key, device, label=""):
        last = max(k for k, host in self.host.items() if host.numel() == self.size_of[key])
        return super().take(last, device, label)


class StaleStore(offload.HostStore):
    """Planted: each step reuses last step's host buffers, slot by slot, and copies only into new
    ones: the second step gets the first step's activations back."""

    def __init__(self):
        super().__init__()
        self.slots, self.step_keys = [], []

    def put(self, flat, label=""):
        slot = len(self.step_keys)
        if slot == len(self.slots):
            self.slots.append(super().put(flat, label))
        self.step_keys.append(self.slots[slot])
        return self.slots[slot]

    def take(self, key, device, label=""):
        flat = self.host[key].to(device, copy=True)  # and keeps it for the next step
        self._record("in", key, flat.nbytes, label, flat.untyped_storage().data_ptr())
        return flat

    def next_step(self):
        self.step_keys = []


def test_a_store_that_pops_the_last_tensor_instead_of_the_one_asked_for_is_caught():
    plain, _, _ = _step()
    store = StackStore()
    grads, _, _ = _step(TINY, lambda m: offload.offload_blocks(store, m))
    assert _max_diff(grads, plain) > 1e-3  # gradients computed from other tensors' values


def test_a_stale_store_that_returns_last_steps_activations_is_caught():
    model = build_model(TINY)
    store = StaleStore()
    _step(TINY, lambda m: offload.offload_blocks(store, m), seed=0, model=model)
    store.next_step()
    model.zero_grad()
    grads, _, _ = _step(TINY, lambda m: offload.offload_blocks(store, m), seed=1, model=model)
    plain, _, _ = _step(TINY, seed=1)
    assert _max_diff(grads, plain) > 1e-3  # step 2's gradients from step 1's activations
    problems = offload.offload_problems(store, model)
    assert any("came back more than once" in p for p in problems)  # step 1's keys came back twice
    # the real store gives step 2 its own activations
    real = offload.HostStore()
    model = build_model(TINY)
    _step(TINY, lambda m: offload.offload_blocks(real, m), seed=0, model=model)
    model.zero_grad()
    grads, _, _ = _step(TINY, lambda m: offload.offload_blocks(real, m), seed=1, model=model)
    assert _max_diff(grads, plain) == 0.0


def test_a_policy_that_saves_nothing_recomputes_the_matmuls_and_keeps_only_the_input():
    def save_nothing(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    plain = _backward_counts(TINY, lambda m: None)
    nothing = _backward_counts(TINY, lambda m: offload.SelectiveCheckpoint(m, policy=save_nothing))
    assert nothing[0] > plain[0] and nothing[1] > plain[1]  # matmuls again, as full recomputation
    _, _, run = _step(TINY, lambda m: offload.SelectiveCheckpoint(m, policy=save_nothing))
    assert run.kept_bytes == [cost.tiny_block_activation_bytes(TINY, B, S, recompute=True)] * 4


def test_a_threshold_that_offloads_the_parameters_is_caught():
    model = build_model(TINY)
    store = offload.HostStore()
    x, y = _batch()
    with offload.offloaded(store, keep=None):  # planted: the parameters are not kept
        loss = loss_fn(model(x), y)
    loss.backward()
    problems = offload.offload_problems(store, model)
    assert any("parameters or buffers were offloaded" in p for p in problems), problems
    right = offload.HostStore()
    with offload.offloaded(right, keep=model):
        loss = loss_fn(model(x), y)
    loss.backward()
    weights = sum(p.numel() * 4 for p in model.parameters()) + TINY.max_seq_len * 4 * 4  # and rope
    assert store.bytes_out > right.bytes_out and store.bytes_out - right.bytes_out <= weights


# -- the planner's new modes at LLaMA-3's shapes, by hand ------------------------------------------
def test_the_planner_offloads_8b_at_tp_8_and_the_pcie_link_does_not_hide_it():
    row = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, recompute="offload")
    none = plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192)
    n, d, f, t = 8 * 8192, 4096, 14336, 8  # 64 sequences over dp = 8: 8 sequences a replica
    block = 2 * (2 * (3 * n * d + n) + 2 * n * d // t + 2 * n * 1024 // t + 4 * n * f // t)  # bf16
    assert block == 4_328_783_872
    # outside the blocks, never offloaded: the final norm and the output layer's input (bf16), the vocabulary-parallel
    # loss's fp32 logits (N, V/t) and per position its log-sum-exp, local target and whether this rank holds it
    output = 2 * (3 * n * d + n) + 4 * n * 128256 // t + (4 + 8 + 1) * n
    assert row["memory"]["activations"] == 2 * block + output  # the block in use and the one on the link
    assert none["memory"]["activations"] == 32 * block + output
    host = row["host"]
    assert host["out"] == host["in"] == host["host"] == 32 * block  # 138.5 GB each way per step
    assert host["out_s"] == pytest.approx(32 * block / 64e9)  # PCIe Gen5 x16: 64 GB/s each way
    compute = none["time"]["compute_s"]
    assert host["forward_s"] == pytest.approx(compute / 3) and not host["hidden"]
    exposed = (32 * block / 64e9 - compute / 3) + (32 * block / 64e9 - 2 * compute / 3)
    assert host["exposed_s"] == pytest.approx(exposed)
    assert row["step_s"] == pytest.approx(none["step_s"] + exposed) == row["time"]["step_s"]
    assert row["mfu"] == pytest.approx(none["mfu"] * none["step_s"] / row["step_s"])
    assert row["recompute"] == "offload" and row["bytes_per_step"] == none["bytes_per_step"]


def test_the_planner_keeps_the_matmul_outputs_of_70b_under_sequence_parallel_by_hand():
    row = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True, recompute="selective-op")
    none = plan.plan_layout(LLAMA3_70B, 2, 4, 8, 64, 8192, sequence_parallel=True)
    n, d, f, t, kvd = 8192, 8192, 28672, 8, 1024
    block = 2 * (n * d // t  # the input, its S/t positions
                 + n * d // t + 2 * n * kvd // t + n * d // t  # x·W_Q, x·W_K, x·W_V, the kernel's output
                 + n * d // t + 2 * n * f // t + n * d // t  # W_O's and W2's slices, x·W1, x·W3
                 + 2 * n * d)  # the column-parallel linears' gathered inputs
    assert sum(cost.selective_block_tensors(LLAMA3_70B, 1, 8192, 8, True).values()) == block
    stage = row["worst_stage"]
    blocks, in_flight = 20, min(4 - stage, 32)  # 80 blocks over 4 stages; 1F1B's micro-batches in flight
    assert row["memory"]["activations"] == block * blocks * in_flight
    assert row["memory"]["activations"] < none["memory"]["activations"]
    assert row["step_s"] == none["step_s"] and row["bytes_per_step"] == none["bytes_per_step"]
    assert "host" not in row and "host" not in none and none["recompute"] == "none"


def test_recomputation_costs_a_third_of_a_step_under_full_and_next_to_nothing_under_selective():
    full = cost.recompute_share(LLAMA3_8B, 8192, "full")
    assert full == pytest.approx((2 * 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4 * 32 * 4096 * 8192)
                                 / cost.training_flops_per_token(LLAMA3_8B, 8192))
    assert 0.29 < full < 0.31
    assert cost.recompute_share(LLAMA3_8B, 8192, "selective-op") < 1e-4
    assert cost.recompute_share(LLAMA3_8B, 8192, "offload") == 0.0


def test_defaults_are_unchanged_and_bad_modes_and_links_are_refused():
    assert plan.plan(LLAMA3_70B, 64, 80) == plan.plan(LLAMA3_70B, 64, 80, recompute="none") == []
    with pytest.raises(ValueError, match="activation mode must be one of 'none', 'selective', 'full', "
                                         "'selective-op', 'offload', got 'sometimes'"):
        plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, recompute="sometimes")
    with pytest.raises(ValueError, match="has no host link figure"):
        plan.plan_layout(LLAMA3_8B, 8, 1, 8, 64, 8192, recompute="offload",
                         device=cost.Device("no pcie", 1e15, cost.H100.intra, cost.H100.inter))
    with pytest.raises(ValueError, match="counted for a dense model without context parallel"):
        plan.plan_layout(LLAMA3_8B, 4, 1, 8, 64, 8192, recompute="offload", cp=2)
