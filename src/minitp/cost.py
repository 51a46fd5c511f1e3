"""Analytic bytes and memory, the third oracle every strategy is checked against.

Notation (used in every chapter):

* ``n``: the number of ranks in the group a collective runs over;
* ``B``: the bytes of the collective's logical buffer (``minitp.trace`` says which buffer);
* ``Ψ`` (``num_params``): the number of parameters of the model.

Communication is counted as **payload bytes a rank sends**, under the ring algorithms (the ones
bandwidth-optimal collectives use, and the model behind NCCL's "bus bandwidth"):

=================  ======================  ============================================
collective         bytes each rank sends   why
=================  ======================  ============================================
all-reduce         2(n-1)/n · B            a reduce-scatter then an all-gather
all-gather         (n-1)/n · B             n-1 steps, each passing one of n chunks on
reduce-scatter     (n-1)/n · B             the same steps, adding as it goes
broadcast          B (0 for the chain end)  a pipelined chain from the source
send / recv        B / 0
=================  ======================  ============================================

Headers and the backend's own choice of algorithm are not counted: the numbers are a model of the
payload that a recorded call implies, so traced totals compare exactly with the formulas below.

Memory is counted as the bytes a rank **holds between steps**, right after the optimizer step
with gradients still held: parameters, gradients and optimizer state (AdamW: two fp32 moments per
parameter, ``exp_avg`` and ``exp_avg_sq``, plus one 4-byte ``step`` counter per parameter tensor).
"""

from __future__ import annotations

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def collective_sent_bytes(op: str, nbytes: int, n: int, position: int = 0) -> float:
    """Bytes one rank sends for one call of ``op`` on a buffer of ``nbytes`` over ``n`` ranks.

    ``position`` is only used by broadcast: the rank's place along the chain that starts at the
    source (0 for the source, n-1 for the last rank, which forwards nothing).
    """
    if op == "send":
        return float(nbytes)
    if op == "recv" or n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if op == "broadcast":
        return float(nbytes) if position < n - 1 else 0.0
    raise ValueError(f"unknown collective {op!r}; expected all_reduce, all_gather, reduce_scatter, "
                     "broadcast, send or recv")


# -- data parallel ---------------------------------------------------------------------------------
def ddp_step_bytes(num_params: int, world_size: int, grad_bytes: int = 4) -> float:
    """Bytes each rank sends in one DDP step: one all-reduce of every gradient, 2(n-1)/n · Ψ·b."""
    return collective_sent_bytes("all_reduce", num_params * grad_bytes, world_size)


def ddp_run_bytes(num_params: int, world_size: int, steps: int, rank: int,
                  param_bytes: int = 4, grad_bytes: int = 4, broadcast_at_init: bool = True) -> float:
    """Bytes ``rank`` sends over a DDP run: the start-up broadcast of the parameters from rank 0
    (a chain: every rank but the last forwards Ψ·b), then ``steps`` gradient all-reduces.

    Steps inside ``no_sync`` send nothing; count only the steps that synchronise.
    """
    total = steps * ddp_step_bytes(num_params, world_size, grad_bytes)
    if broadcast_at_init:
        total += collective_sent_bytes("broadcast", num_params * param_bytes, world_size, position=rank)
    return total


def num_buckets(param_bytes: list[int], bucket_bytes: int) -> int:
    """How many buckets DDP forms from parameters of these sizes (in backward order), filling each
    bucket until adding the next parameter would pass ``bucket_bytes`` (a parameter larger than a
    bucket gets one to itself)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    count, filled = 0, 0
    for size in param_bytes:
        if count == 0 or filled + size > bucket_bytes:
            count, filled = count + 1, 0
        filled += size
    return count


# -- memory ----------------------------------------------------------------------------------------
def memory_per_rank(num_params: int, world_size: int = 1, zero: int = 0, precision: str = "fp32",
                    num_tensors: int = 0) -> dict[str, float]:
    """Bytes one rank holds in parameters, gradients and AdamW state, per ZeRO stage.

    ``zero=0`` is plain data parallel (every rank holds everything); 1 shards the optimizer state,
    2 the gradients too, 3 the parameters too. ``precision="fp32"``: 4-byte parameters and
    gradients, 8 bytes of moments. ``"bf16"`` (mixed precision): 2-byte parameters and gradients,
    and an fp32 master copy next to the moments, 12 bytes of optimizer state: 16Ψ in all, the
    ZeRO paper's 2Ψ + 2Ψ + 12Ψ. ``num_tensors`` adds AdamW's 4-byte step counter per optimizer
    tensor (pass how many tensors the optimizer holds on this rank; 0 to leave them out).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if precision == "fp32":
        p, g, o = 4, 4, 8
    elif precision in ("bf16", "fp16"):
        p, g, o = 2, 2, 12
    else:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    n = world_size
    params = num_params * p / (n if zero >= 3 else 1)
    grads = num_params * g / (n if zero >= 2 else 1)
    optimizer = num_params * o / (n if zero >= 1 else 1) + 4 * num_tensors
    return {"params": params, "grads": grads, "optimizer": optimizer}


def total_memory(memory: dict[str, float]) -> float:
    return memory["params"] + memory["grads"] + memory["optimizer"]
