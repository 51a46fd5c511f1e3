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
all-to-all         B - B_self              each chunk goes straight to its rank; its own stays
send / recv        B / 0
=================  ======================  ============================================

Headers and the backend's own choice of algorithm are not counted: the numbers are a model of the
payload that a recorded call implies (``collective_sent_bytes``, which ``minitp.trace`` records with
every message), so traced totals compare exactly with the formulas of the modules below.

Memory is counted as the bytes a rank **holds between steps**, right after the optimizer step
with gradients still held: parameters, gradients and optimizer state (AdamW: two fp32 moments per
parameter, ``exp_avg`` and ``exp_avg_sq``, plus one 4-byte ``step`` counter per parameter tensor).

The formulas live in eight modules, each importing only those before it (at the top of the file),
so they read in this order: ``strategies`` (DDP, FSDP, tensor and pipeline parallel, each alone)
→ ``activations`` (what autograd keeps) → ``threed`` (a rank of the dp × pp × tp mesh) → ``context``
(ring attention; the dp·cp·pp·tp mesh) → ``experts`` (MoE and the all-to-alls) → ``devices`` (the
hardware sheet) → ``time`` (FLOPs and messages in seconds) → ``offload`` (activations sent to the
host or selectively recomputed). Nothing here reads a file or the environment: this machine's
calibration is read by ``minitp.measure.calibrate`` and comes in as a ``Device``. Every public name
is re-exported here.
"""

from __future__ import annotations

from minitp.cost.activations import (
    activation_bytes_per_rank,
    attention_weight_shapes,
    block_activation_bytes,
    kv_cache_bytes,
    llama_block_activation_bytes,
    output_activation_bytes,
    output_activation_bytes_per_rank,
    recompute_mode,
    tiny_block_activation_bytes,
)
from minitp.cost.context import (
    allgather_attention_bytes,
    cp3d_step_bytes,
    cp_activation_bytes_per_rank,
    cp_attention_bytes,
    cp_attention_flops_per_rank,
    cp_kv_block_bytes,
    cp_memory_per_rank,
    cp_mesh_step_bytes,
    cp_run_bytes,
    cp_step_bytes,
    ulysses_attention_bytes,
)
from minitp.cost.experts import (
    COUNT_BYTES,
    active_params,
    check_ep,
    ep3d_run_bytes,
    ep_layer_bytes,
    ep_memory_per_rank,
    ep_mesh_memory_per_rank,
    ep_mesh_step_bytes,
    ep_params_per_rank,
    ep_run_bytes,
    ep_stage_unit_numels,
    expected_nodes_per_token,
    moe_activation_bytes_per_rank,
    moe_all_to_all_bytes,
    moe_block_activation_bytes,
    moe_internode_bytes,
    moe_param_split,
    tokens_between_ranks,
)
from minitp.cost.offload import (
    ACTIVATION_MODES,
    OFFLOAD_BLOCKS_ON_DEVICE,
    activation_mode,
    block_saved_tensors,
    cheap_recompute_flops_per_token,
    device_activation_bytes_per_rank,
    host_link_bytes_per_step,
    host_link_time,
    offloaded_block_bytes,
    recompute_matmul_flops_per_token,
    recompute_share,
    selective_block_tensors,
    tiny_block_saved_tensors,
    tiny_selective_block_bytes,
)
from minitp.cost.strategies import (
    DTYPE_BYTES,
    ddp_run_bytes,
    ddp_step_bytes,
    float8_all_gather_bytes,
    fsdp_gathered_peak_bytes,
    fsdp_memory_per_rank,
    fsdp_run_bytes,
    fsdp_step_bytes,
    hsdp_memory_per_rank,
    hsdp_step_bytes,
    memory_per_rank,
    pp_bubble_fraction,
    pp_memory_per_rank,
    pp_peak_microbatches_in_flight,
    pp_run_bytes,
    pp_stage_params,
    pp_step_bytes,
    total_memory,
    tp_block_bytes,
    tp_memory_per_rank,
    tp_mlp_bytes,
    tp_mlp_params_per_rank,
    tp_params_per_rank,
    tp_region_bytes,
)
from minitp.cost.threed import (
    check_hsdp_shard,
    rank_num_blocks,
    stage_num_tensors,
    stage_unit_numels,
    threed_memory_per_rank,
    threed_params_per_rank,
    threed_step_bytes,
    tp_run_bytes,
    tp_step_bytes,
)
from minitp.cost.time import (
    A100,
    DEVICES,
    H100,
    Device,
    Link,
    StepTime,
    activation_elements,
    arithmetic_intensity,
    collective_time,
    compute_time,
    device_from_calibration,
    links_of_layout,
    overlap_budget_bytes,
    recompute_flops_per_token,
    ring_exposed_s,
    step_time,
    training_flops_per_token,
)
from minitp.grid import check_3d_layout  # reached as cost.X too
from minitp.layout import num_buckets, padded_numel, stage_num_blocks
from minitp.trace import collective_sent_bytes  # the payload model, recorded with every message

__all__ = [
    # strategies: one collective, and each strategy alone
    "DTYPE_BYTES", "collective_sent_bytes", "ddp_step_bytes", "ddp_run_bytes", "memory_per_rank",
    "total_memory", "fsdp_step_bytes", "fsdp_run_bytes", "fsdp_memory_per_rank",
    "fsdp_gathered_peak_bytes", "hsdp_step_bytes", "hsdp_memory_per_rank",
    "float8_all_gather_bytes", "tp_region_bytes",
    "tp_mlp_bytes", "tp_block_bytes",
    "tp_params_per_rank", "tp_memory_per_rank", "tp_mlp_params_per_rank", "pp_step_bytes",
    "pp_run_bytes", "pp_stage_params", "pp_memory_per_rank", "pp_bubble_fraction",
    "pp_peak_microbatches_in_flight",
    # activations
    "recompute_mode", "block_activation_bytes", "llama_block_activation_bytes",
    "activation_bytes_per_rank", "tiny_block_activation_bytes",
    "kv_cache_bytes", "attention_weight_shapes", "output_activation_bytes",
    "output_activation_bytes_per_rank",
    # threed
    "rank_num_blocks", "stage_unit_numels", "stage_num_tensors", "threed_params_per_rank",
    "threed_step_bytes", "threed_memory_per_rank", "check_hsdp_shard", "tp_step_bytes",
    "tp_run_bytes",
    # context
    "cp_kv_block_bytes", "cp_attention_bytes", "cp_step_bytes", "cp_run_bytes",
    "cp_memory_per_rank", "allgather_attention_bytes",
    "cp_activation_bytes_per_rank", "cp_attention_flops_per_rank", "cp3d_step_bytes",
    "cp_mesh_step_bytes", "ulysses_attention_bytes",
    # experts
    "COUNT_BYTES", "check_ep", "tokens_between_ranks", "ep_layer_bytes", "ep_run_bytes",
    "ep3d_run_bytes", "moe_param_split", "ep_params_per_rank", "ep_memory_per_rank",
    "moe_all_to_all_bytes", "active_params", "ep_stage_unit_numels", "ep_mesh_memory_per_rank",
    "ep_mesh_step_bytes", "moe_block_activation_bytes", "expected_nodes_per_token",
    "moe_internode_bytes", "moe_activation_bytes_per_rank",
    # time
    "Link", "Device", "H100", "A100", "DEVICES", "device_from_calibration",
    "training_flops_per_token", "activation_elements", "recompute_flops_per_token", "compute_time",
    "collective_time", "ring_exposed_s", "links_of_layout", "StepTime", "step_time",
    "arithmetic_intensity", "overlap_budget_bytes",
    # offload
    "ACTIVATION_MODES", "activation_mode", "block_saved_tensors", "tiny_block_saved_tensors",
    "offloaded_block_bytes", "selective_block_tensors", "tiny_selective_block_bytes",
    "recompute_matmul_flops_per_token", "cheap_recompute_flops_per_token", "recompute_share",
    "OFFLOAD_BLOCKS_ON_DEVICE", "device_activation_bytes_per_rank", "host_link_bytes_per_step",
    "host_link_time",
    # from minitp.layout
    "check_3d_layout", "num_buckets", "padded_numel", "stage_num_blocks",
]
