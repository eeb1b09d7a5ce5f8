"""The GPUs ``megatron-rl plan --hardware NAME`` knows, and the fractions of their peaks a run reaches.

Every figure of ``HARDWARE`` is a vendor's published peak (dense, i.e. without 2:4 sparsity) and
names its source; links are per GPU and per direction (a ring collective moves data both ways at
once, so its bus bandwidth is bounded by the one-direction figure). The achievable fractions below
are the only places where measured or assumed efficiency enters the step-time model
(``megatron_rl.planner.step_time``); each says whether it was read (a measurement or a paper),
assumed, or fitted -- exactly one is fitted, to one published run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = [
    "Hardware",
    "HARDWARE",
    "get_hardware",
    "DEFAULT_HARDWARE",
    "DENSE_GEMM_EFFICIENCY",
    "GROUPED_GEMM_EFFICIENCY",
    "ATTENTION_EFFICIENCY",
    "DECODE_HBM_EFFICIENCY",
    "HBM_COPY_EFFICIENCY",
    "NVLINK_EFFICIENCY",
    "NETWORK_EFFICIENCY",
    "HOST_LINK_EFFICIENCY",
    "DECODE_ALLREDUCE_LATENCY_S",
    "GLOO_BYTES_PER_S",
]

GB = 1e9
TB = 1e12


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Published peaks of one GPU (SI units: FLOP/s, bytes/s)."""

    name: str
    bf16_flops: float
    """Dense bf16 tensor-core peak."""
    fp8_flops: Optional[float]
    """Dense fp8 peak; None where the GPU has no fp8 tensor cores (A100)."""
    hbm_bytes_per_s: float
    memory_gib: float
    """HBM capacity (the datasheet's GB figure, which the driver reports as about that many GiB)."""
    nvlink_bytes_per_s: float
    """NVLink per GPU, one direction (half the datasheet's bidirectional total)."""
    nvlink_domain: int
    """GPUs one NVLink switch domain joins (8 on an HGX board, 72 in a GB200 NVL72 rack)."""
    network_bytes_per_s: float
    """Scale-out (InfiniBand / RoCE) per GPU, one direction: one NIC per GPU."""
    host_bytes_per_s: float
    """GPU <-> host link, one direction (PCIe x16; NVLink-C2C on GB200)."""
    source: str
    device: str = "cuda"
    """The ``trainer.device`` this row's runs use: ``cuda`` for the table's GPUs, ``cpu`` for the row
    ``megatron_rl.planner.cpu_row.cpu_hardware`` measures on the host a CPU run trains on."""
    decode_step_overhead_s: Optional[float] = None
    """The rollout engine's host work per decode step (None: vLLM's GPU figure,
    ``generation.VLLM_DECODE_STEP_OVERHEAD_S``); the CPU row measures it."""
    decode_seq_overhead_s: Optional[float] = None
    """The engine's host work per decode step and running sequence, beyond the step's fixed part (None: 0,
    the GPU figure counts none); the CPU row measures it."""
    call_overhead_s: Optional[float] = None
    """The trainer's fixed host work of one phase's call to a role's workers: dispatch, the batch's shards
    through Ray's object store, the results back (None: 0 -- milliseconds against a GPU cluster's phases of
    seconds); the CPU row measures it."""
    forward_micro_overhead_s: Optional[float] = None
    """Host work of one forward micro-batch of a Megatron pass beyond its FLOPs and bytes: packing, the
    pipeline schedule, every operator's dispatch (None: 0 -- a GPU's kernels run behind the host's launches);
    the CPU row measures it."""
    train_micro_overhead_s: Optional[float] = None
    """The same for an update's forward + backward micro-batch."""
    optimizer_step_overhead_s: Optional[float] = None
    """Host work of one optimizer step beyond Adam's bytes (the gradient norm, clipping, zeroing)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_overhead_s"):  # measured host work: none at all is a valid figure
                if value is not None and value < 0:
                    raise ValueError(f"Hardware {self.name}: {f.name}={value} must be >= 0")
            elif isinstance(value, float) and value <= 0:
                raise ValueError(f"Hardware {self.name}: {f.name}={value} must be > 0")


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "H100",
            bf16_flops=989 * TB,
            fp8_flops=1979 * TB,
            hbm_bytes_per_s=3.35 * TB,
            memory_gib=80.0,
            nvlink_bytes_per_s=450 * GB,
            nvlink_domain=8,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=64 * GB,
            source="NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (989 TFLOP/s bf16 and 1,979 fp8 dense, "
            "3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5 128 GB/s, both bidirectional); DGX H100: one "
            "400 Gb/s ConnectX-7 per GPU",
        ),
        Hardware(
            "H200",
            bf16_flops=989 * TB,
            fp8_flops=1979 * TB,
            hbm_bytes_per_s=4.8 * TB,
            memory_gib=141.0,
            nvlink_bytes_per_s=450 * GB,
            nvlink_domain=8,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=64 * GB,
            source="NVIDIA H200 Tensor Core GPU datasheet, SXM column (989 / 1,979 TFLOP/s bf16 / fp8 dense, "
            "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s); HGX H200: 400 Gb/s per GPU",
        ),
        Hardware(
            "H800",
            bf16_flops=989 * TB,
            fp8_flops=1979 * TB,
            hbm_bytes_per_s=3.35 * TB,
            memory_gib=80.0,
            nvlink_bytes_per_s=200 * GB,
            nvlink_domain=8,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=64 * GB,
            source="H100's compute and HBM with NVLink cut to 400 GB/s bidirectional (NVIDIA H800 SXM5 "
            "specification); DeepSeek-V3 technical report, section 3.2.2: one 400 Gb/s (50 GB/s) "
            "InfiniBand NIC per GPU",
        ),
        Hardware(
            "A100",
            bf16_flops=312 * TB,
            fp8_flops=None,
            hbm_bytes_per_s=2.039 * TB,
            memory_gib=80.0,
            nvlink_bytes_per_s=300 * GB,
            nvlink_domain=8,
            network_bytes_per_s=25 * GB,
            host_bytes_per_s=32 * GB,
            source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (312 TFLOP/s bf16 dense, 2,039 GB/s "
            "HBM2e, NVLink 600 GB/s, PCIe Gen4 64 GB/s, bidirectional); DGX A100: one 200 Gb/s "
            "ConnectX-6 per GPU",
        ),
        Hardware(
            "B200",
            bf16_flops=2250 * TB,
            fp8_flops=4500 * TB,
            hbm_bytes_per_s=8.0 * TB,
            memory_gib=180.0,
            nvlink_bytes_per_s=900 * GB,
            nvlink_domain=8,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=64 * GB,
            source="NVIDIA DGX B200 / HGX B200 specification (per GPU: 2.25 PFLOP/s bf16 and 4.5 fp8 dense, "
            "180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s bidirectional, PCIe Gen5); DGX B200: one 400 Gb/s "
            "ConnectX-7 per GPU",
        ),
        Hardware(
            "GB200",
            bf16_flops=2500 * TB,
            fp8_flops=5000 * TB,
            hbm_bytes_per_s=8.0 * TB,
            memory_gib=186.0,
            nvlink_bytes_per_s=900 * GB,
            nvlink_domain=72,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=450 * GB,
            source="NVIDIA GB200 NVL72 specification divided by its 72 GPUs (360 / 720 PFLOP/s bf16 / fp8 with "
            "sparsity -> 2.5 / 5 dense per GPU, 186 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s bidirectional "
            "across all 72, NVLink-C2C 900 GB/s bidirectional to the Grace CPU); 400 Gb/s per GPU scale-out",
        ),
    )
}
"""``--hardware NAME`` -> its published peaks."""
DEFAULT_HARDWARE = "H100"


def get_hardware(name: str) -> Hardware:
    """The table's row ``name`` (``ValueError`` naming ``--hardware`` and the allowed names)."""
    if name not in HARDWARE:
        raise ValueError(f"--hardware={name!r} is not a known GPU; choose one of {sorted(HARDWARE)}")
    return HARDWARE[name]


# ----------------------------------------------------------------------------- achievable fractions
DENSE_GEMM_EFFICIENCY = 0.80
"""Read: one H200 ran the bf16 output-layer matrix products (8,192 x 4,096 x 151,936) at ~790 of
989 TFLOP/s (docs/benchmarks.md, "GPU reference figures"). Used for every dense projection, the head and prefill."""
GROUPED_GEMM_EFFICIENCY = 0.40
"""Assumed, not measured or fitted: half the dense figure for the routed experts' grouped GEMMs,
whose per-expert matrices are thin (Qwen3-30B-A3B: 2,048 x 768 with ~1/16 of the tokens each) and
whose permute / unpermute around them is memory-bound. (This project's local-spec MoE ran its experts
one after another at ~5 % MFU; TransformerEngine's grouped GEMM is what a GPU run uses.)"""
ATTENTION_EFFICIENCY = 0.40
"""Read: FlashAttention-3 (Shah et al., 2024), figures of forward + backward at head dim 128 on H100:
FlashAttention-2 reaches ~350-400 of 989 TFLOP/s (causal, 4k-16k tokens)."""
HBM_COPY_EFFICIENCY = 0.79
"""Read: a device-to-device copy on one H200 ran at ~3.8 of 4.8 TB/s (docs/benchmarks.md). Used where
bytes are streamed in bulk: the engine loading synced weights, the optimizer step."""
DECODE_HBM_EFFICIENCY = 0.33
"""Fitted -- the one constant fitted -- to one data point, NeMo-RL v0.6's GRPO on Qwen3-30B-A3B (4 x 8 H100,
192 s per step, 1,102 tokens/s/GPU; ``step_time.CALIBRATION``), with every other constant fixed beforehand:
the fraction of HBM bandwidth a vLLM decode step reaches while it reads the weight shard, the touched experts
and the KV cache, i.e. the engine step's GPU-side overhead (fused-MoE kernels on a few tokens per expert, paged
attention, sampling over the vocabulary) expressed as bandwidth. The host-side per-step cost is
``generation.VLLM_DECODE_STEP_OVERHEAD_S``, not fitted.

Refit (2026-12-04) after that overhead term and async scheduling (``generation``: a decode step is
``max(GPU step, overhead)`` with it on, vLLM 0.32's default and the calibration recipe's) were added: the
bisection on the published step time gives 0.3287 (the first fit, before the overhead term, gave 0.329; the
overhead term summed on top of the unrefitted 0.33 had given 204.3 s, +6.4 %, and 1,042 tokens/s/GPU, -5.4 %).
At 0.33 the model gives 191.4 s (residual -0.3 %) and 1,113 tokens/s/GPU (+1.0 %; the two published figures
differ by 0.7 % between themselves: 2,048 x 3,328 tokens / (192 s x 32 GPUs) = 1,109), a decode step of 37.5 ms
of GPU time that hides the 3 ms of host work. Had the published run scheduled synchronously (its vLLM's
setting is not published), the same fit gives 0.358 (192.0 s, 1,109 tokens/s/GPU): the sensitivity of this
constant to that unknown. Read, not fitted: the device-to-device copy of docs/benchmarks.md's GPU figures
(3.8 of 4.8 TB/s on an H200, ``HBM_COPY_EFFICIENCY``) bounds it from above -- a decode step streams at 42 %
of a bulk copy's rate; no vLLM decode ran on that card (vLLM's wheels exceed what a device call carries), so
those figures hold no decode point to fit, and issue 30 fits the constants to the one published run only.

Not refitted (2026-12-07) when the passes gained their element-wise memory traffic (``activation_traffic``) and
the head its response-only positions: at 0.33 the model gives 195.6 s (+1.9 %) and 1,089 tokens/s/GPU (-1.2 %);
generation is unchanged (162.2 s), the passes grew 4.95 -> 5.79 s per forward."""
NVLINK_EFFICIENCY = 0.80
"""Read: nccl-tests ``all_reduce_perf`` bus bandwidth on an 8-GPU HGX H100 board levels off at
~360 of 450 GB/s for large messages."""
NETWORK_EFFICIENCY = 0.80
"""Assumed as NVLink's: large NCCL collectives over 400 Gb/s InfiniBand reach ~40 of 50 GB/s per NIC."""
HOST_LINK_EFFICIENCY = 0.80
"""Read: pinned-memory ``cudaMemcpy`` over PCIe Gen5 x16 runs at ~50-55 of 64 GB/s per direction
(nvbandwidth / bandwidthTest on H100 hosts)."""
DECODE_ALLREDUCE_LATENCY_S = 10e-6
"""Assumed: one small tensor-parallel all-reduce of a decode step (vLLM's custom all-reduce over
NVLink, a few KB) costs ~10 us; a layer has two."""
GLOO_BYTES_PER_S = 5 * GB
"""Assumed: the ``broadcast`` transport's gloo (TCP) stream, host to host, including the copies from
and to the GPU (~40 Gb/s: a single TCP stream over a 100-400 Gb/s fabric)."""
