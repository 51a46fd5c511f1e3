"""The devices the time model runs on: a ``Link`` (α–β) and a ``Device`` (FLOP/s, memory, links,
and the fixed costs ``minitp calibrate`` measures), the GPU presets, and this machine's figures
turned into a ``Device`` (``device_from_calibration``). Read by ``minitp.cost.time``, which
re-exports every name here.

**The hardware sheet.** ``H100`` and ``A100`` are the one place the course and the planner take a
GPU's figures from: dense BF16 FLOP/s, HBM capacity and bandwidth, NVLink, InfiniBand and PCIe (to
the host's memory) bandwidth per GPU and **per direction**, each with its datasheet in a comment.
Units: **GB is 10⁹ bytes, GiB 2³⁰** (GB/s 10⁹ bytes per second, Gb/s 10⁹ bits), everywhere in
minitp. A datasheet's "80GB" of HBM is 80 GiB: five stacks of 16 GiB each (the HBM3 of an H100 SXM,
the HBM2e of an A100 SXM 80GB), so ``memory_bytes`` is 80·2³⁰ = 85.9·10⁹ bytes (the driver keeps a
little of it for itself). Link and memory bandwidths are decimal, as datasheets give them: 450 GB/s
is 450·10⁹ bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass


# -- devices -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One kind of connection between ranks: α seconds per message step, β bytes/s per direction."""

    name: str
    alpha_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class Device:
    """What the time model needs of one accelerator and the machine it sits in.

    flops_per_s: the dense rate at the training precision (published peak for the GPUs);
    efficiency: the share of it large matrix multiplies reach in practice (an assumption, not a
    published figure: compute time is F / (flops_per_s · efficiency); MFU still divides by the
    peak); intra / inter: the link inside one machine and between machines, per GPU, per direction;
    memory_bytes / memory_bytes_per_s: the GPU's HBM, how much it holds and how fast it is read
    (flops_per_s / memory_bytes_per_s is the arithmetic intensity above which a kernel is
    compute-bound); overhead_s: what a step costs once beyond its FLOPs and its micro-batches (the
    optimizer's loop over tensors, zeroing the gradients): measured by ``minitp calibrate`` as the
    tiny model's step at one micro-batch less its FLOPs and its micro-batch's fixed cost; 0 for the
    GPU presets, whose large kernels hide their launches (as for the three figures below);
    microbatch_overhead_s: what each forward+backward costs beyond its FLOPs (Python, autograd,
    a few hundred small operations): measured as the growth of the tiny model's step from one
    micro-batch to eight, per micro-batch added;
    op_s: the fixed cost of one small tensor operation, for the operations a strategy adds to the
    plain model's (``strategy_ops``): measured as ``microbatch_overhead_s`` over the number of
    operations the tiny model's forward+backward dispatches (counted by ``minitp calibrate``);
    shared_link: the link as measured with twice as many ranks as cores (all-reduces at 2·cores
    ranks), what messages cost when ranks wait for a core (``link_on_machine``); None: not measured;
    shared_slowdown: how many times slower the same compute ran at 2·cores ranks than at ``cores``
    ranks, measured beside ``shared_link`` (None: ranks/cores, the cores shared evenly).
    busy_slowdown: how many times slower the tiny model's step ran with a rank on every core than on
    one rank alone (caches, memory bandwidth, the cores' shared clock; None: not at all).
    ddp_own_s / fsdp_own_s / tp_own_s: what minitp's DDP, FSDP (ZeRO-3) and tensor parallel add to
    each forward+backward with their own code (hooks, autograd Functions, gathers and releases of
    units, trace records), beyond the plain model and their collectives: measured by ``minitp
    calibrate`` at one rank; 0 for the GPU presets.
    cp_op_s / ep_op_s: what one operation ring attention / a MoE adds costs (``ring_ops``,
    ``moe_ops``), measured by ``minitp calibrate`` at one rank as their forward+backward's growth
    over the plain model's per operation added: their operations index, mask and scatter small
    tensors, and cost about twice the plain model's average (``op_s``, used where these are 0).
    """

    name: str
    flops_per_s: float
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    memory_bytes: float = 80 * 2**30
    efficiency: float = 1.0
    cores: int | None = None  # CPU only: ranks beyond this many share the cores (this machine)
    overhead_s: float = 0.0  # fixed seconds per step of a whole model, beyond its micro-batches
    # HBM bandwidth (0: not known, as for this machine's calibration)
    memory_bytes_per_s: float = 0.0
    # fixed seconds per forward+backward of a whole model and micro-batch
    microbatch_overhead_s: float = 0.0
    op_s: float = 0.0  # fixed seconds per small tensor operation a strategy adds
    shared_link: Link | None = None  # CPU only: the link measured at 2·cores ranks
    # CPU only: compute at 2·cores ranks against at cores ranks
    shared_slowdown: float | None = None
    # CPU only: a step with every core running a rank against one rank alone
    busy_slowdown: float | None = None
    ddp_own_s: float = 0.0  # CPU only: fixed seconds per micro-batch of minitp's DDP's own code
    fsdp_own_s: float = 0.0  # CPU only: the same for its FSDP (ZeRO-3)
    tp_own_s: float = 0.0  # CPU only: the same for its tensor parallel
    cp_op_s: float = 0.0  # CPU only: one operation ring attention adds (0: op_s)
    ep_op_s: float = 0.0  # CPU only: one operation a MoE adds (0: op_s)
    # CPU only: seconds per element of a rank's activations that its forward+backward works through
    # outside the matmuls (norms, RoPE, SwiGLU's gate, residuals, softmax; ``activation_elements``):
    # what makes a step at training shapes slower than its FLOPs say (0: hidden in ``efficiency``)
    element_s: float = 0.0
    # the attention kernel skips a causal mask's empty half (FlashAttention's blocks above the
    # diagonal, on the GPU sheets); minitp's attention on this machine computes every score, then
    # masks (False)
    causal_skip: bool = True
    # the link between the GPU and its host's memory (PCIe), per direction: what activation offload
    # crosses (``minitp.cost.offload``); None: not known (this machine: its "host" is its memory)
    host_link: Link | None = None
    # how many times the ring model's time (α, β as fitted to all-reduces) an all-gather and a
    # reduce-scatter take: 1 for NCCL's rings (the GPU sheets); gloo on this machine runs each kind
    # its own way (``minitp.measure.collectives``)
    gather_factor: float = 1.0
    scatter_factor: float = 1.0
    # CPU only: seconds a rank's collectives wait for the others per second of compute before them
    # (ranks that ran the same work arrive apart; ``minitp.measure.collectives.fit_wait``)
    wait_per_compute: float = 0.0


# NVIDIA H100 SXM5 datasheet (H100 Tensor Core GPU, SXM form factor):
# * 989 TFLOP/s dense BF16 tensor core (the datasheet's 1,979 is with 2:4 sparsity);
# * 80 GB HBM3 (five stacks of 16 GiB: 80 GiB) at 3.35 TB/s;
# * NVLink 4, 900 GB/s per GPU in both directions together, so 450 GB/s each way;
# * one ConnectX-7 NDR InfiniBand NIC per GPU (DGX H100), 400 Gb/s = 50 GB/s each way;
# * PCIe Gen5 x16 to the host, 128 GB/s both directions together, so 64 GB/s each way.
# The α values (a few microseconds) are typical of NCCL rings, not published figures; efficiency 0.6
# is an assumed share of peak for large bf16 matmuls in training.
H100 = Device("H100 SXM", 989e12, Link("NVLink 4", 5e-6, 900e9 / 2),
              Link("InfiniBand NDR 400", 10e-6, 400e9 / 8), gpus_per_node=8,
              memory_bytes=80 * 2**30, efficiency=0.6, memory_bytes_per_s=3.35e12,
              host_link=Link("PCIe Gen5 x16", 10e-6, 128e9 / 2))
# NVIDIA A100 SXM4 80 GB datasheet (A100 Tensor Core GPU):
# * 312 TFLOP/s dense BF16 (624 with sparsity);
# * 80 GB HBM2e (five stacks of 16 GiB: 80 GiB) at 2,039 GB/s;
# * NVLink 3, 600 GB/s both directions together, 300 GB/s each way;
# * one HDR InfiniBand NIC per GPU (DGX A100), 200 Gb/s = 25 GB/s each way;
# * PCIe Gen4 x16 to the host, 64 GB/s both directions together, so 32 GB/s each way.
A100 = Device("A100 SXM 80GB", 312e12, Link("NVLink 3", 5e-6, 600e9 / 2),
              Link("InfiniBand HDR 200", 10e-6, 200e9 / 8), gpus_per_node=8,
              memory_bytes=80 * 2**30, efficiency=0.6, memory_bytes_per_s=2.039e12,
              host_link=Link("PCIe Gen4 x16", 10e-6, 64e9 / 2))
DEVICES = {"h100": H100, "a100": A100}


# -- this machine: figures measured by ``minitp calibrate`` ----------------------------------------
# Reading them from where they are stored (and checking them) is ``minitp.measure.calibrate``'s:
# nothing here touches a file. A calibration is a dict of figures, handed in.
def device_from_calibration(cal: dict) -> Device:
    """A Device from a calibration's figures: one rank's matmul rate, gloo's α and β (both links),
    the fixed costs of a step, of a micro-batch and of one small operation, and the link and compute
    as measured with twice as many ranks as cores. Where the calibration measured a second, larger
    model (``element_s``), the matmuls run at the large rate and every activation element costs
    ``element_s``; where it timed all-gathers and reduce-scatters, their factors and the waits. A
    calibration from before ``microbatch_overhead_s`` was measured charges its whole
    ``step_overhead_s`` per micro-batch, as the time model then did."""
    link = Link("gloo loopback", cal["alpha_s"], cal["bytes_per_s"])
    shared = None
    if cal.get("alpha_shared_s") is not None and cal.get("bytes_per_s_shared") is not None:
        shared = Link("gloo loopback, 2 ranks per core", cal["alpha_shared_s"],
                      cal["bytes_per_s_shared"])
    step, microbatch = cal.get("step_overhead_s", 0.0), cal.get("microbatch_overhead_s")
    if microbatch is None:
        step, microbatch = 0.0, step
    flops, element = cal["flops_per_s"], 0.0
    if cal.get("element_s") is not None:  # measured at two shapes: the large matmuls' rate, and
        # what each element beyond them costs (``minitp.measure.calibrate.fit_element_cost``)
        flops, element = cal["flops_per_s_large"], cal["element_s"]
        step = cal["element_step_overhead_s"]
    return Device("this machine (" + cal.get("name", "calibrated") + ")", flops, link,
                  link, gpus_per_node=10**6, memory_bytes=cal.get("memory_bytes", 0.0),
                  efficiency=1.0, cores=cal.get("cores"), overhead_s=step,
                  microbatch_overhead_s=microbatch, op_s=cal.get("op_s", 0.0), shared_link=shared,
                  shared_slowdown=cal.get("shared_slowdown"),
                  busy_slowdown=cal.get("busy_slowdown"), ddp_own_s=cal.get("ddp_own_s", 0.0),
                  fsdp_own_s=cal.get("fsdp_own_s", 0.0), tp_own_s=cal.get("tp_own_s", 0.0),
                  # null: not measured
                  cp_op_s=cal.get("cp_op_s") or 0.0, ep_op_s=cal.get("ep_op_s") or 0.0,
                  element_s=element, causal_skip=False,
                  gather_factor=cal.get("all_gather_factor") or 1.0,
                  scatter_factor=cal.get("reduce_scatter_factor") or 1.0,
                  wait_per_compute=cal.get("wait_per_compute") or 0.0)
