"""minitp.parallel3d: a plain model trained on a (dp, pp, tp) mesh against the one-process reference and
the byte formulas, the pipeline driving its data-parallel wrapper through a stage description, and the
device the run is given."""

import json

import pytest
import torch

from minitp import cli, cost, runs
from minitp.launcher import launch
from minitp.models import get_config
from minitp.models.train import TrainConfig, train_reference
from minitp.trainer import train_step

# -- 3D training against the one-process reference ---------------------------------------------------------
LAYOUTS = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (2, 4, 1)]  # dp × tp × pp


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("dp,tp,pp", LAYOUTS, ids=[f"dp{a}xtp{b}xpp{c}" for a, b, c in LAYOUTS])
def test_3d_matches_single_process_with_traced_bytes_equal_to_the_formulas(dp, tp, pp, fsdp):
    report = runs.run_3d(nproc=8, dp=dp, tp=tp, pp=pp, fsdp=fsdp, steps=3)
    assert runs.check(report) == []
    assert report["max_abs_param_diff"] <= 1e-5
    assert max(abs(a - b) for a, b in zip(report["loss"], report["reference_loss"])) < 1e-5
    for traced, expected in zip(report["comm_bytes_traced_by_dim"], report["comm_bytes_expected_by_dim"]):
        assert traced == pytest.approx(expected, rel=1e-12, abs=1e-6)
    for dim, size in (("tp", tp), ("pp", pp), ("dp", dp)):  # a dimension of size 1 sends nothing, others do
        assert all((b[dim] > 0) == (size > 1) for b in report["comm_bytes_traced_by_dim"]), dim


def test_3d_with_the_gpipe_schedule_matches_too():
    report = runs.run_3d(nproc=8, dp=2, tp=2, pp=2, schedule="gpipe", microbatches=2, steps=2)
    assert runs.check(report) == [] and report["schedule"] == "gpipe" and report["microbatches"] == 2


def test_fsdp_with_a_pipeline_needs_zero_1_and_says_why():
    with pytest.raises(ValueError, match="FSDP with pp=2 needs zero=1, got zero=3"):
        runs.run_3d(nproc=8, dp=2, tp=2, pp=2, fsdp=True, zero=3)


def test_bad_layouts_are_refused_in_the_parent_with_the_numbers():
    with pytest.raises(ValueError, match=r"dp\*pp\*tp = 2\*2\*3 = 12 but the world has 8 ranks"):
        runs.run_3d(nproc=8, dp=2, tp=3, pp=2)
    with pytest.raises(ValueError, match="tp=8 does not divide n_kv_heads=4"):
        runs.run_3d(nproc=8, dp=1, tp=8, pp=1)
    with pytest.raises(ValueError, match="pp=8 stages but the model has 4 blocks"):
        runs.run_3d(nproc=8, dp=1, tp=1, pp=8)
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by nproc=4"):
        runs.run_3d(nproc=8, dp=4, tp=2, pp=1, batch_size=6)
    with pytest.raises(ValueError, match="tp=3 does not divide n_heads=8"):
        cost.check_3d_layout(get_config("tiny"), 1, 1, 3)


def test_cli_run_3d_writes_the_report_and_exits_zero(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = cli.main(["run", "3d", "--nprocs", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "2",
                   "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["layout"] == {"dp": 2, "tp": 2, "pp": 2}
    assert report["comm_bytes_traced"] == report["comm_bytes_expected"]
    assert "matches the reference" in capsys.readouterr().out
    assert cli.main(["run", "3d", "--nprocs", "8", "--dp", "2", "--tp", "2", "--pp", "3"]) == 2
    assert "dp*pp*tp = 2*3*2 = 12 but the world has 8 ranks" in capsys.readouterr().err


# -- the stage description and the device ----------------------------------------------------------------
def _fsdp_pipeline_on_an_explicit_device(train):
    """dp=2 × pp=2 under FSDP (ZeRO-1), on the device passed in (the CPU here; ``cuda:LOCAL_RANK``
    under NCCL takes the same path)."""
    import torch.distributed as dist

    from minitp.mesh import Mesh
    from minitp.models import build_model, get_config
    from minitp.models.train import synthetic_batches
    from minitp.parallel3d import Parallel3D

    cfg, device = get_config("tiny"), torch.device("cpu")
    par = Parallel3D(build_model(cfg, seed=train.seed), Mesh(2, 2, 1), "fsdp", microbatches=2, lr=train.lr,
                     device=device)
    losses = [train_step(par, tokens, targets).loss for tokens, targets in synthetic_batches(cfg, train)]
    stage = par.pipeline.spec
    shards = par.local_shards()
    return {"rank": dist.get_rank(), "losses": losses, "shards": shards, "device": par.device,
            "stage": (stage.index, stage.num_stages, stage.device, stage.dtype),
            "forward_is_fsdp": stage.forward is par.fsdp and stage.module is par.module,
            "fsdp_patched": [a for a in ("is_first", "is_last", "dim") if hasattr(par.fsdp, a)],
            "tensor_devices": {str(t.device) for t, _ in shards.values()} | {str(par.module.rope_cos.device)}}


def test_3d_on_an_explicit_device_drives_fsdp_through_the_stage_description_and_matches_one_process():
    from minitp.parallel3d import unshard_3d

    train = TrainConfig(steps=2, batch_size=8)
    results = launch(_fsdp_pipeline_on_an_explicit_device, 4, train, echo=False)
    ref_losses, ref_model = train_reference(get_config("tiny"), train)
    for r in results:
        assert r["device"] == torch.device("cpu") and r["tensor_devices"] == {"cpu"}
        assert r["forward_is_fsdp"], "the pipeline calls the FSDP wrapper its stage description names"
        assert r["fsdp_patched"] == [], "FSDP carries no pipeline attribute"
    # ranks (dp, pp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    assert [r["stage"][:2] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert {r["stage"][2:] for r in results} == {(torch.device("cpu"), torch.float32)}
    reference = {k: v.detach() for k, v in ref_model.state_dict().items()}
    for d in range(2):
        replica = unshard_3d([[results[2 * d + s]["shards"]] for s in range(2)])
        assert runs.max_abs_diff(replica, reference) <= 1e-5, f"replica {d}"
    # each replica's last stage reports the loss of its half of the batch: their mean is the batch's
    means = [(a + b) / 2 for a, b in zip(results[1]["losses"], results[3]["losses"])]
    assert means == pytest.approx(ref_losses, abs=1e-6)
