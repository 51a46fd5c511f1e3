"""``minitp run STRATEGY --impl torch``: PyTorch's own DDP, ``fully_shard``, ``parallelize_module``,
pipelining and their 3-D composition on the same model and batches equal one process (≤ 1e-5), as
minitp's run does, and the bytes they hand to ``torch.distributed`` stand beside minitp's traced
ones, each difference the one PyTorch's design explains."""

import torch

from minitp import cli, trace
from minitp.models import build_model, get_config
from minitp.runs import pytorch
from minitp.runs.pytorch import CommCounter, run_torch

STEPS = 1  # what each side sends at the start and in a step; the counts scale with steps


def _both_equal_one_process(run, dims):
    assert run.check() == [], run.check()
    assert run.max_abs_param_diff <= 1e-5
    assert max(abs(a - b) for a, b in zip(run.loss, run.minitp_report.reference_loss)) <= 1e-5
    for torch_side, minitp_side in zip(run.sent_by_dim, run.minitp_sent_by_dim):
        assert set(dims) <= set(torch_side) and set(dims) <= set(minitp_side)  # both sides report each


def test_ddp_sends_the_gradients_as_minitp_does_and_a_few_bytes_of_its_own_bookkeeping():
    run = run_torch("ddp", nproc=2, steps=STEPS, timed=False)
    _both_equal_one_process(run, ["dp"])
    for torch_side, minitp_side in zip(run.sent_by_dim, run.minitp_sent_by_dim):
        # the same weights broadcast at the start and gradients all-reduced; PyTorch adds the
        # check of the parameters' shapes across ranks and the broadcast of its rebuilt buckets
        assert 0 <= torch_side["dp"] - minitp_side["dp"] <= 2048


def test_fully_shard_gathers_the_root_again_in_backward_and_minitps_run_gathers_its_state_at_the_end():
    run = run_torch("fsdp", nproc=2, steps=STEPS, timed=False)
    _both_equal_one_process(run, ["dp"])
    from minitp.fsdp import unit_numels
    from minitp.layout import padded_numel

    root, *blocks = unit_numels(build_model(get_config("tiny")), 2)

    def gathered(numel):  # one all-gather of a unit's fp32 weights on 2 ranks, as sent
        return trace.collective_sent_bytes("all_gather", padded_numel(numel, 2) * 4, 2)

    # minitp keeps its root unit gathered from forward to backward (fully_shard frees it and
    # gathers it again: one more per step) and its run ends with the state dict: one all-gather
    # of every unit
    explained = sum(gathered(n) for n in (root, *blocks)) - STEPS * gathered(root)
    for torch_side, minitp_side in zip(run.sent_by_dim, run.minitp_sent_by_dim):
        assert minitp_side["dp"] - torch_side["dp"] == explained


def test_parallelize_module_sends_minitps_bytes_once_rank_0_has_scattered_the_shards():
    run = run_torch("tp", nproc=2, steps=STEPS, timed=False)
    _both_equal_one_process(run, ["tp"])
    cfg = get_config("tiny")
    split = sum(p.numel() * 4 for name, p in build_model(cfg).named_parameters() if "norm" not in name)
    # DTensor's distribute_tensor scatters each split weight from rank 0 (minitp's ranks cut
    # their slices from their own copy); every message of the steps is minitp's, loss included
    assert run.sent_by_dim[0]["tp"] - run.minitp_sent_by_dim[0]["tp"] == split / 2
    assert run.sent_by_dim[1]["tp"] == run.minitp_sent_by_dim[1]["tp"]


def test_pipelining_sends_the_activations_and_gradients_and_its_shapes_once():
    run = run_torch("pp", nproc=2, steps=STEPS, microbatches=4, timed=False)
    _both_equal_one_process(run, ["pp"])
    for torch_side, minitp_side in zip(run.sent_by_dim, run.minitp_sent_by_dim):
        # the same (b, S, D) each way per micro-batch; PyTorch's stages also tell each other the
        # shapes once (a few bytes of metadata), minitp's work them out (pp.StageSpec)
        assert 0 <= torch_side["pp"] - minitp_side["pp"] <= 512


def test_a_3d_device_mesh_composed_as_torchtitan_does_equals_one_process():
    run = run_torch("3d", dp=2, pp=2, tp=2, steps=STEPS, timed=False)
    _both_equal_one_process(run, ["dp", "pp", "tp"])
    for torch_side, minitp_side in zip(run.sent_by_dim, run.minitp_sent_by_dim):
        assert 0 <= torch_side["pp"] - minitp_side["pp"] <= 512


def test_the_counter_sizes_each_call_and_refuses_what_it_cannot():
    """(DTensor's collectives, sent from inside its own dispatch, come back through the counter:
    the tp test's rank 1 matches minitp's bytes to the byte, the loss's three all-reduces
    included.) An unknown c10d call is named, never dropped; one with no payload is let through."""
    import minitp

    def worker():
        import torch.distributed as dist

        with CommCounter() as counter:
            dist.all_reduce(torch.ones(4, 8))
            dist.all_gather([torch.zeros(2), torch.zeros(2)], torch.ones(2))
            dist.barrier()
            dist.reduce(torch.ones(2), dst=0)
        return counter.calls, sorted(counter.unknown)

    calls, unknown = minitp.launch(worker, 2, echo=False)[0]
    assert [(op, ranks, nbytes) for op, ranks, nbytes, _ in calls] == [
        ("all_reduce", (0, 1), 128), ("all_gather", (0, 1), 16)]
    assert [sent for *_, sent in calls] == [128.0, 8.0]  # ring: 2(n-1)/n and (n-1)/n of the buffer
    assert unknown == ["c10d.reduce_"]


def test_the_command_line_prints_both_runs_and_refuses_what_torch_does_not_run(capsys):
    assert cli.main(["run", "tp", "--nprocs", "2", "--steps", "1", "--impl", "torch"]) == 0
    out = capsys.readouterr().out
    assert "the same in PyTorch (parallelize_module, loss_parallel)" in out and "tp torch" in out
    assert cli.main(["run", "tp", "--nprocs", "2", "--sequence-parallel", "--impl", "torch"]) == 2
    assert "--sequence-parallel is minitp's alone: --impl torch runs tp with the common options only" \
        in capsys.readouterr().err
    assert cli.main(["run", "pp", "--schedule", "zb", "--impl", "torch"]) == 2
    assert "--impl torch runs pp with --schedule gpipe or 1f1b, not zb" in capsys.readouterr().err
    assert cli.main(["run", "ddp", "--impl", "torch", "--trace-out", "x.json"]) == 2
    assert "--impl torch counts PyTorch's calls without one" in capsys.readouterr().err
    assert cli.main(["run", "swiglu", "--impl", "torch"]) == 2  # no PyTorch twin here: no --impl
    assert "unrecognized arguments: --impl torch" in capsys.readouterr().err
    assert set(pytorch.STRATEGIES) == {"ddp", "fsdp", "tp", "pp", "3d"}
