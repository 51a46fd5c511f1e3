"""minitp.layout: the layout arithmetic every strategy, the cost model and the planner share, and its
refusals, each naming the value that came and what was expected."""

import subprocess
import sys

import pytest

from minitp import grid, layout
from minitp.models import LLAMA3_70B, TINY


def test_layout_sits_at_the_bottom_of_the_import_graph():
    # loaded alone, from its file: it needs no torch and no other minitp module
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('layout', sys.argv[1]); "
            "sys.modules['layout'] = module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'minitp')))")
    out = subprocess.run([sys.executable, "-c", code, layout.__file__], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- divisibility ----------------------------------------------------------------------------------
def test_check_divisible_names_the_size_and_the_divisor():
    layout.check_divisible("n_heads", 8, "tp", 4)  # divides: nothing raised
    with pytest.raises(ValueError, match="^n_heads=4 is not divisible by tp=3$"):
        layout.check_divisible("n_heads", 4, "tp", 3)
    with pytest.raises(ValueError, match="^hidden=10 is not divisible by tp=4: say why$"):
        layout.check_divisible("hidden", 10, "tp", 4, ": say why")


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2", None])
def test_check_positive_refuses_what_is_not_a_positive_integer(value):
    with pytest.raises(ValueError, match=f"^pp must be an integer >= 1, got {value!r}$"):
        layout.check_positive("pp", value)


def test_a_batch_must_split_evenly_over_the_data_parallel_ranks():
    layout.check_batch(8, 4)
    with pytest.raises(ValueError, match="^batch_size=6 is not divisible by nproc=4$"):
        layout.check_batch(6, 4)
    with pytest.raises(ValueError, match="nprocs must be an integer >= 1, got 0"):
        layout.check_batch(6, 0)


# -- the mesh --------------------------------------------------------------------------------------
def test_layouts_lists_every_factorisation_of_the_world_once():
    got = grid.layouts(8)
    assert len(got) == len(set(got)) == 10  # 2^3 into three ordered factors: C(5, 2)
    assert all(dp * pp * tp == 8 for dp, pp, tp in got)
    assert grid.layouts(1) == [(1, 1, 1)]
    assert grid.layouts(7) == [(7, 1, 1), (1, 7, 1), (1, 1, 7)]


def test_rank_of_places_tp_fastest_then_pp_then_dp():
    assert grid.rank_of(0, 0, 1, pp=2, tp=2) == 1  # next tp rank: next rank
    assert grid.rank_of(0, 1, 0, pp=2, tp=2) == 2  # next stage: tp ranks further
    assert grid.rank_of(1, 0, 0, pp=2, tp=2) == 4  # next replica: pp·tp ranks further
    assert grid.coordinates(5, 2, 2, 2) == grid.Coordinates(dp=1, pp=0, tp=1)


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 2), (1, 3, 2), (4, 1, 1), (2, 1, 3)])
def test_coordinates_invert_rank_of(dp, pp, tp):
    for rank in range(dp * pp * tp):
        c = grid.coordinates(rank, dp, pp, tp)
        assert grid.rank_of(c.dp, c.pp, c.tp, pp, tp) == rank


def test_coordinates_refuse_a_rank_outside_the_mesh():
    with pytest.raises(ValueError, match=r"^rank 8 is not in a mesh of dp\*pp\*tp = 8 ranks$"):
        grid.coordinates(8, 2, 2, 2)
    with pytest.raises(ValueError, match="rank -1 is not in a mesh"):
        grid.coordinates(-1, 2, 2, 2)


def test_each_group_fixes_two_coordinates_and_runs_the_third():
    groups = grid.group_lists(2, 3, 2)
    for dim, lists in groups.items():
        assert sorted(r for g in lists for r in g) == list(range(12)), dim
        for ranks in lists:
            coords = [grid.coordinates(r, 2, 3, 2) for r in ranks]
            assert [getattr(c, dim) for c in coords] == list(range(len(ranks)))
            others = {tuple(v for k, v in vars(c).items() if k != dim) for c in coords}
            assert len(others) == 1, (dim, ranks)


def test_check_layout_names_the_product_and_the_world():
    grid.check_layout(2, 2, 2, 8)
    with pytest.raises(ValueError, match=r"^dp\*pp\*tp = 2\*2\*3 = 12 but the world has 8 ranks$"):
        grid.check_layout(2, 2, 3, 8)
    with pytest.raises(ValueError, match="^tp must be an integer >= 1, got 0$"):
        grid.check_layout(8, 1, 0, 8)
    with pytest.raises(ValueError, match="^dp must be an integer >= 1, got True$"):
        grid.check_layout(True, 1, 1, 1)


def test_a_tensor_parallel_group_stays_inside_one_machine():
    grid.check_tp_within_node(4, 8)
    with pytest.raises(ValueError, match="tp=4 does not divide the 6 processes per node.*a multiple of 4"):
        grid.check_tp_within_node(4, 6)


def test_check_zero_defaults_to_3_and_to_1_with_a_pipeline():
    assert grid.check_zero("ddp", None, 2) is None
    assert grid.check_zero("fsdp", None, 1) == 3
    assert grid.check_zero("fsdp", None, 2) == 1
    assert grid.check_zero("fsdp", 2, 1) == 2
    with pytest.raises(ValueError, match="^zero must be 1, 2 or 3, got 0$"):
        grid.check_zero("fsdp", 0, 1)
    with pytest.raises(ValueError, match="FSDP with pp=2 needs zero=1, got zero=3"):
        grid.check_zero("fsdp", 3, 2)


def test_check_3d_layout_names_the_number_that_does_not_fit():
    grid.check_3d_layout(TINY, 2, 2, 2, 8)
    grid.check_3d_layout(TINY, 3, 1, 1)  # no world given: the sizes alone
    with pytest.raises(ValueError, match=r"dp\*pp\*tp = 2\*2\*2 = 8 but the world has 4 ranks"):
        grid.check_3d_layout(TINY, 2, 2, 2, 4)
    with pytest.raises(ValueError, match="^tp=3 does not divide n_heads=8$"):
        grid.check_3d_layout(TINY, 1, 1, 3)
    with pytest.raises(ValueError, match="^tp=4 does not divide ffn_hidden=102$"):
        grid.check_3d_layout(TINY.with_(ffn_hidden=102), 1, 1, 4)
    with pytest.raises(ValueError, match="^pp=5 stages but the model has 4 blocks"):
        grid.check_3d_layout(TINY, 1, 5, 1)
    with pytest.raises(ValueError, match="^dp must be an integer >= 1, got 0$"):
        grid.check_3d_layout(TINY, 0, 1, 1)


# -- pipeline stages -------------------------------------------------------------------------------
def test_stage_blocks_are_consecutive_and_the_spare_ones_go_first():
    assert layout.stage_blocks(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert layout.stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    blocks = layout.stage_blocks(LLAMA3_70B.n_layers, 3)
    assert [len(b) for b in blocks] == [27, 27, 26]
    assert [i for b in blocks for i in b] == list(range(80))


def test_stage_num_blocks_counts_what_stage_blocks_hands_out():
    for n_layers, pp in ((4, 1), (4, 3), (7, 4), (80, 6)):
        blocks = layout.stage_blocks(n_layers, pp)
        assert [layout.stage_num_blocks(n_layers, pp, s) for s in range(pp)] == [len(b) for b in blocks]


def test_a_stage_without_a_block_is_refused():
    with pytest.raises(ValueError, match="^pp=5 stages but the model has 4 blocks: every stage needs at least one"):
        layout.stage_blocks(4, 5)
    with pytest.raises(ValueError, match="the number of stages must be an integer >= 1, got 0"):
        layout.stage_blocks(4, 0)
    with pytest.raises(ValueError, match="pp=5 stages but the model has 4 blocks"):
        layout.stage_num_blocks(4, 5, 0)


# -- tensor parallel -------------------------------------------------------------------------------
def test_tp_split_sizes_are_what_tensor_parallel_cuts():
    cfg = TINY.with_(n_kv_heads=2)
    assert dict(layout.tp_split_sizes(cfg)) == {"n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 128,
                                                "vocab_size": 128}


def test_check_tp_config_names_each_size_tp_must_divide():
    layout.check_tp_config(TINY, 4)
    with pytest.raises(ValueError, match="^n_heads=8 is not divisible by tp=3$"):
        layout.check_tp_config(TINY, 3)
    with pytest.raises(ValueError, match="^n_kv_heads=2 is not divisible by tp=4: minitp splits key/value heads"):
        layout.check_tp_config(TINY.with_(n_kv_heads=2), 4)
    with pytest.raises(ValueError, match="^ffn_hidden=130 is not divisible by tp=4$"):
        layout.check_tp_config(TINY.with_(ffn_hidden=130), 4)
    with pytest.raises(ValueError, match="^vocab_size=130 is not divisible by tp=4; minitp refuses"):
        layout.check_tp_config(TINY.with_(vocab_size=130), 4)


def test_a_vocabulary_tp_does_not_divide_is_refused_with_the_size_that_would_work():
    layout.check_vocab(128, 4)
    with pytest.raises(ValueError, match=r"^vocab_size=130 is not divisible by tp=4; minitp refuses rather "
                                         r"than pads: build the model with vocab_size=132 \(the next multiple of 4\)$"):
        layout.check_vocab(130, 4)


# -- FSDP shards -----------------------------------------------------------------------------------
def test_padded_numel_rounds_up_to_a_multiple_of_the_world():
    assert layout.padded_numel(16, 4) == 16
    assert layout.padded_numel(17, 4) == 20
    assert layout.padded_numel(1, 3) == 3
    assert layout.padded_numel(0, 3) == 0
    with pytest.raises(ValueError, match="^world_size must be >= 1, got 0$"):
        layout.padded_numel(10, 0)


@pytest.mark.parametrize("numel,n", [(16, 4), (17, 4), (10, 3), (5, 1)])
def test_the_shards_tile_the_padded_buffer_in_rank_order(numel, n):
    shards = [layout.shard_range(numel, n, r) for r in range(n)]
    assert [i for s in shards for i in s] == list(range(layout.padded_numel(numel, n)))
    assert len({len(s) for s in shards}) == 1  # equal shards


def test_shard_range_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="^rank 4 is not one of world_size=4 ranks$"):
        layout.shard_range(16, 4, 4)


# -- DDP buckets -----------------------------------------------------------------------------------
def test_buckets_fill_until_the_next_parameter_would_pass_the_size():
    assert layout.bucket_ranges([40, 40, 40], 100) == [range(0, 2), range(2, 3)]
    assert layout.bucket_ranges([40, 40, 40], 120) == [range(0, 3)]
    assert layout.bucket_ranges([10, 500, 10], 100) == [range(0, 1), range(1, 2), range(2, 3)]  # big: alone
    assert layout.bucket_ranges([], 100) == []
    assert layout.num_buckets([10] * 7, 1) == 7
    assert layout.num_buckets([40, 40, 40], 100) == 2


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="^bucket_bytes must be > 0, got 0$"):
        layout.bucket_ranges([10], 0)
