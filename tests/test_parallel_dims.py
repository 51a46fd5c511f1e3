"""minitp.grid.ParallelDims: which dimensions are on, how big, and what composes with what, written
once and checked as the object is made; ``check_model`` adds what a model must allow. The CLI,
``trainer.Settings``, the 3D runner and ``Parallel3D`` ask it (the last test reads their source)."""

import ast
from pathlib import Path

import pytest

from minitp.grid import ParallelDims
from minitp.layout import DIMS
from minitp.models import TINY
from minitp.models.moe import moe_config

SRC = Path(__file__).resolve().parents[1] / "src" / "minitp"


def test_the_defaults_are_one_process_and_zero_comes_out_resolved():
    one = ParallelDims()
    assert (one.world, one.mesh_dp, one.on, one.replicas, one.zero) == (1, 1, (), None, None)
    assert ParallelDims(dp=2, data_parallel="fsdp").zero == 3  # FSDP alone: ZeRO-3
    assert ParallelDims(dp=2, pp=2, data_parallel="fsdp").zero == 1  # with a pipeline: ZeRO-1
    assert ParallelDims(dp=2, data_parallel="fsdp", zero=2).zero == 2
    assert ParallelDims(dp=2).zero is None  # DDP has no stage
    # HSDP: FSDP inside each shard group, the same stages
    assert ParallelDims(dp=4, data_parallel="hsdp", dp_shard=2).zero == 3
    assert ParallelDims(dp=4, pp=2, data_parallel="hsdp", dp_shard=2).zero == 1
    assert ParallelDims(dp=4, data_parallel="hsdp", dp_shard=2).replicas == "hsdp"


def test_sizes_world_and_the_replicas_wrapper():
    dims = ParallelDims(dp=2, pp=2, tp=2, cp=2)
    assert (dims.world, dims.mesh_dp, dims.on) == (16, 4, ("dp", "pp", "tp", "cp"))
    assert dims.replicas == "ddp"
    assert ParallelDims(cp=2, data_parallel="fsdp").replicas == "fsdp"  # dp = 1, but dp·cp = 2
    assert ParallelDims(dp=4, ep=2).replicas == "expert_parallel"  # in DDP's place
    assert ParallelDims(tp=4, pp=2).replicas is None


@pytest.mark.parametrize("dims, message", [
    (dict(dp=0), "dp must be an integer >= 1, got 0"),
    (dict(tp=True), "tp must be an integer >= 1, got True"),
    (dict(data_parallel="zero"), "data_parallel must be 'ddp', 'fsdp' or 'hsdp', got 'zero'"),
    (dict(cp=2, cp_attention="mesh"), "attention must be one of ring, ulysses, allgather"),
    (dict(dp=4, ep=2, tp=2), "ep=2 composes with dp \\(DDP\\) and pp: tp must be 1"),
    (dict(dp=4, ep=2, data_parallel="fsdp"), "ep=2 composes with dp"),
    (dict(dp=6, ep=4), "dp=6 is not divisible by ep=4"),
    (dict(pp=2, virtual_stages=2), "virtual_stages=2 is for schedule='interleaved'"),
    (dict(pp=2, schedule="interleaved"), "needs virtual_stages >= 2"),
    (dict(schedule="interleaved", virtual_stages=2), "needs pp > 1 and DDP"),
    (dict(dp=2, pp=2, data_parallel="fsdp", schedule="zb"), "schedule='zb' with fsdp"),
    (dict(dp=2, pp=2, data_parallel="fsdp", zero=3), "FSDP with pp=2 needs zero=1, got zero=3"),
    (dict(dp=2, data_parallel="fsdp", zero=4), "zero must be 1, 2 or 3, got 4"),
    (dict(dp=4, dp_shard=2), "dp_shard=2 is HSDP's shard group; it needs data_parallel 'hsdp'"),
    (dict(dp=4, data_parallel="hsdp"), "data_parallel 'hsdp' needs dp_shard"),
    (dict(dp=4, data_parallel="hsdp", dp_shard=3), "dp=4 is not divisible by dp_shard=3"),
    (dict(dp=4, data_parallel="hsdp", dp_shard=0), "dp_shard must be an integer >= 1, got 0"),
    (dict(dp=2, cp=2, data_parallel="hsdp", dp_shard=2), "composes with dp, pp and tp"),
    (dict(dp=2, pp=2, data_parallel="hsdp", dp_shard=2, zero=3), "with pp=2 needs zero=1"),
    (dict(dp=2, pp=2, data_parallel="hsdp", dp_shard=2, schedule="zb"), "'zb' with fsdp"),
])
def test_what_does_not_compose_is_refused_as_the_object_is_made(dims, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**dims)


@pytest.mark.parametrize("dims, cfg, extra, message", [
    (dict(tp=3), TINY, {}, "tp=3 does not divide"),
    (dict(pp=TINY.n_layers + 1), TINY, {}, f"pp={TINY.n_layers + 1} stages but the model has"),
    (dict(pp=2, schedule="interleaved", virtual_stages=TINY.n_layers), TINY, {},
     f"pp={2 * TINY.n_layers} stages but the model has {TINY.n_layers} blocks"),
    (dict(dp=2, pp=2), TINY, dict(world_size=8), "dp\\*pp\\*tp = 2\\*2\\*1 = 4 but the world has 8"),
    (dict(cp=4, cp_attention="ulysses"), TINY.with_(n_kv_heads=2), {}, "Ulysses splits each tp rank's"),
    (dict(cp=2), TINY, dict(seq_len=6), "seq_len=6 is not divisible by 2\\*cp=4"),
    (dict(dp=2, ep=2), TINY, {}, "ep=2 needs a mixture of experts"),
    (dict(tp=2), moe_config(n_experts=4), {}, "a mixture of experts trains with tp = 1 and cp = 1"),
    (dict(dp=3, ep=3), moe_config(n_experts=4), {}, "n_experts=4 is not divisible by ep=3"),
])
def test_what_the_model_cannot_take_is_refused(dims, cfg, extra, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**dims).check_model(cfg, **extra)


def test_a_model_that_fits_passes():
    ParallelDims(dp=2, pp=2, tp=2).check_model(TINY, world_size=8, seq_len=16)
    ParallelDims(dp=2, cp=2, cp_attention="ulysses").check_model(TINY, seq_len=16)
    ParallelDims(dp=4, pp=2, ep=2).check_model(moe_config(n_experts=4))


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def test_the_cli_settings_the_3d_runner_and_parallel3d_ask_it_and_no_one_else_holds_the_rules():
    for asker in ("trainer.py", "runs/threed.py", "parallel3d.py"):
        assert "ParallelDims" in _names(SRC / asker), asker
    assert "dims" in _names(SRC / "cli" / "train.py")  # Settings.dims
    # the rules' sentences are written in grid.py and nowhere else
    sentences = ["composes with dp (DDP) and pp", "is for schedule='interleaved'",
                 "schedule='interleaved' needs virtual_stages", "needs pp > 1 and DDP", "schedule='zb' with fsdp",
                 "trains with tp = 1 and cp = 1"]
    for sentence in sentences:
        holders = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
                   if sentence in p.read_text()]
        assert holders == ["grid.py"], (sentence, holders)
    assert set(DIMS) <= set(ParallelDims.__dataclass_fields__)
