"""Layout arithmetic: how a model and a batch are cut over ranks, and the checks that refuse a cut
that cannot work. Pure integer arithmetic, no process group, no tensor: the planner, the parent
process before it starts any worker, the strategies and the tests all ask here, so a size is
computed, and a bad one refused, in one place with one message.

Top to bottom: divisibility, the mesh (rank <-> coordinates, its groups, its checks), the
pipeline's stage split, the tensor-parallel checks, FSDP's padded shards, DDP's buckets.

Every refusal names the value that came and what was expected: ``tp=3 does not divide n_heads=4``.
"""

from __future__ import annotations

# The five dimensions, named once: the mesh's three axes (slowest to fastest), then the two that
# split the dp axis further (context parallel's cp ranks, expert parallel's ep groups).
DIMS = ("dp", "pp", "tp", "cp", "ep")
AXES = DIMS[:3]  # the grid: rank = (dp_rank · pp + pp_rank) · tp + tp_rank
# HSDP splits the dp axis in two: its shard groups (FSDP inside, shard varying fastest) and its
# replicate groups (the all-reduce of each gradient shard across the replicas)
DP_HALVES = ("dp_shard", "dp_replicate")


# -- divisibility ----------------------------------------------------------------------------------
def check_positive(name: str, value) -> None:
    """Refuse a size that is not an integer >= 1 (a bool is not a size)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_divisible(what: str, size: int, by: str, n: int, why: str = "") -> None:
    """Refuse ``size`` that ``n`` does not divide: ``n_heads=4 is not divisible by tp=3``.
    ``why`` (": ..." or "; ...") is appended to say what the split needs."""
    if size % n:
        raise ValueError(f"{what}={size} is not divisible by {by}={n}{why}")


def check_batch(batch_size: int, data_parallel: int) -> None:
    """Refuse a global batch that does not split evenly over the data-parallel ranks."""
    if not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {data_parallel}")
    check_divisible("batch_size", batch_size, "nproc", data_parallel)


# -- pipeline: which blocks each stage holds -------------------------------------------------------
def check_stages(n_layers: int, num_stages: int) -> None:
    """Refuse a number of stages that is not a positive integer or leaves a stage with no block."""
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"the number of stages must be an integer >= 1, got {num_stages!r}")
    if num_stages > n_layers:
        raise ValueError(f"pp={num_stages} stages but the model has {n_layers} blocks: every stage "
                         f"needs at least one block")


def stage_blocks(n_layers: int, num_stages: int) -> list[range]:
    """Which blocks each stage holds: consecutive, as even as possible, the spare ones to the first
    stages (the last one already carries the output layer and the loss)."""
    check_stages(n_layers, num_stages)
    size, spare = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + size + (s < spare)
        out.append(range(start, end))
        start = end
    return out


def stage_num_blocks(n_layers: int, pp: int, stage: int) -> int:
    """How many blocks stage ``stage`` of ``pp`` holds (``stage_blocks``)."""
    return len(stage_blocks(n_layers, pp)[stage])


# -- tensor parallel: what tp must divide ----------------------------------------------------------
KV_HEADS_WHY = ": minitp splits key/value heads and refuses to replicate them"


def tp_split_sizes(cfg) -> list[tuple[str, int]]:
    """The sizes of a ``ModelConfig`` that tensor parallel splits over tp ranks, by name."""
    return [("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads), ("ffn_hidden", cfg.ffn_hidden),
            ("vocab_size", cfg.vocab_size)]


def check_vocab(vocab_size: int, tp: int) -> None:
    """Refuse a vocabulary tp does not divide, naming the size that would work (minitp never pads
    it: padding would change the parameter count and the logits the one-process model is checked
    against)."""
    check_divisible("vocab_size", vocab_size, "tp", tp,
                    f"; minitp refuses rather than pads: build the model with "
                    f"vocab_size={padded_numel(vocab_size, tp)} (the next multiple of {tp})")


def check_tp_config(cfg, tp: int) -> None:
    """Refuse a model that does not split over ``tp`` ranks: heads, key/value heads, MLP width,
    vocabulary."""
    check_divisible("n_heads", cfg.n_heads, "tp", tp)
    check_divisible("n_kv_heads", cfg.kv_heads, "tp", tp, KV_HEADS_WHY)
    check_divisible("ffn_hidden", cfg.ffn_hidden, "tp", tp)
    check_vocab(cfg.vocab_size, tp)


# -- FSDP: flat buffers padded to a multiple of the world, one equal shard per rank ----------------
def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``: a unit's flat buffer, padding
    included."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return -(-numel // world_size) * world_size


def shard_range(numel: int, world_size: int, rank: int) -> range:
    """The elements of the padded flat buffer (``padded_numel``) that ``rank`` holds: the rank-th of
    ``world_size`` equal slices. Also a tp rank's rows of a divisible dimension (then no
    padding)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of world_size={world_size} ranks")
    size = padded_numel(numel, world_size) // world_size
    return range(rank * size, (rank + 1) * size)


# -- DDP: gradients grouped into buckets -----------------------------------------------------------
def bucket_ranges(param_bytes: list[int], bucket_bytes: int) -> list[range]:
    """Which parameters (by index, in backward order) share each bucket: a bucket fills until the
    next parameter would pass ``bucket_bytes``; a parameter larger than a bucket gets one to
    itself."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    starts, filled = [], 0
    for i, size in enumerate(param_bytes):
        if not starts or filled + size > bucket_bytes:
            starts.append(i)
            filled = 0
        filled += size
    return [range(a, b) for a, b in zip(starts, [*starts[1:], len(param_bytes)])]


def num_buckets(param_bytes: list[int], bucket_bytes: int) -> int:
    """How many buckets DDP forms from parameters of these sizes (``bucket_ranges``)."""
    return len(bucket_ranges(param_bytes, bucket_bytes))


# -- context parallel: which positions of the sequence each rank holds -----------------------------
# ring attention cuts a diagonal (masked) chunk pair longer than this in four (minitp.cp)
CP_TILE = 64
CP_ATTENTIONS = ("ring", "ulysses", "allgather")  # the ways minitp.cp attends across a cp group


def cp_chunks(seq_len: int, cp: int, rank: int, balanced: bool = True) -> list[range]:
    """The positions ``rank`` of ``cp`` holds, as ranges in the order the rank stores them.
    Contiguous: the rank-th of cp equal slices. Balanced (causal attention): the sequence is cut
    into 2·cp chunks and rank i holds chunks i and 2cp-1-i, one early (little to attend to) and one
    late (much), so every rank does the same work."""
    check_positive("cp", cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not one of cp={cp} ranks")
    pieces = 2 * cp if balanced else cp
    check_divisible("seq_len", seq_len, "2*cp" if balanced else "cp", pieces,
                    ": load-balanced context parallel cuts the sequence into 2*cp equal chunks"
                    if balanced
                    else ": context parallel gives each rank seq_len/cp positions")
    size = seq_len // pieces
    order = (rank, 2 * cp - 1 - rank) if balanced else (rank,)
    return [range(i * size, (i + 1) * size) for i in order]


def cp_positions(seq_len: int, cp: int, rank: int, balanced: bool = True) -> list[int]:
    """Every position ``rank`` holds, in its local order (``cp_chunks`` flattened)."""
    return [p for chunk in cp_chunks(seq_len, cp, rank, balanced) for p in chunk]
