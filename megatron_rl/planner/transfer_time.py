"""The weight sync and offload phases of the step-time model: the engine's weights over the transport's
link plus vLLM's load, and the schedule's onloads / offloads / sleep over the host link (``step_time``'s docstring)."""

from __future__ import annotations

from megatron_rl.config.model import ModelConfig
from megatron_rl.planner.generation import engine_weights, lora_slot
from megatron_rl.planner.hardware import GLOO_BYTES_PER_S, HBM_COPY_EFFICIENCY, HOST_LINK_EFFICIENCY
from megatron_rl.planner.memory import GIB, rollout_weight_bytes
from megatron_rl.planner.step_run import PhaseTime, Run, link

__all__ = ["weight_sync", "offload", "VLLM_LOAD_S_PER_TENSOR"]

VLLM_LOAD_S_PER_TENSOR = 50e-6
"""Assumed: vLLM's ``load_weights`` handles each HF-named tensor in Python (name mapping, the weight
loader's shard selection) for ~50 us, on top of the bytes' copy; MoE checkpoints have tens of thousands."""


def _hf_tensor_count(m: ModelConfig) -> int:
    """HF-named tensors of the checkpoint: per layer the attention projections (+ biases, QK norms), two norms,
    the MLP's gate/up/down (each routed expert's own three, the router, a shared expert); embedding, norm, head."""
    per_attention = 4 + (3 if m.add_qkv_bias else 0) + (2 if m.qk_layernorm else 0)
    count = 3
    for layer in range(m.num_layers):
        moe = m.layer_is_moe(layer) if hasattr(m, "layer_is_moe") else m.is_moe
        mlp = 3 * m.num_moe_experts + 1 + (3 if m.moe_shared_expert_intermediate_size else 0) if moe else 3
        count += per_attention + 2 + mlp
    return count


def weight_sync(run: Run) -> PhaseTime:
    """Seconds of one sync of the rollout engines' weights (or, ``lora.merge: false``, of the adapter)."""
    hw = run.hw
    if run.lora_slot_rank:  # lora.merge: false: the compact adapter, through host memory, into vLLM's LoRA slot
        move = 2 * run.adapter_sync_bytes / (hw.host_bytes_per_s * HOST_LINK_EFFICIENCY)
        load = 2 * lora_slot(run) / (hw.hbm_bytes_per_s * HBM_COPY_EFFICIENCY)
        load += run.adapter_sync_tensors * VLLM_LOAD_S_PER_TENSOR
        return PhaseTime(
            move + load,
            "communication" if move >= load else "engine load",
            f"{run.adapter_sync_bytes / GIB:.2f} GiB of LoRA adapters only (lora.merge=false) over host "
            f"memory, load {load:.2f} s",
        )
    total = rollout_weight_bytes(run.model, run.rollout_dtype, run.quantization)
    shard = engine_weights(run)[0]
    load = 2 * shard / (hw.hbm_bytes_per_s * HBM_COPY_EFFICIENCY)  # the engine copies each tensor into place
    load += _hf_tensor_count(run.model) * VLLM_LOAD_S_PER_TENSOR
    if run.backend in ("colocated", "cuda_ipc"):
        a = run.passes[-1].sizes  # the actor's layout: its model-parallel group holds one full copy
        bw, via = link(hw, a["world"] if a["pp"] > 1 else max(a["tp"] * a["cp"], a["ep"] * a["etp"]))
        move = shard / bw
    elif run.backend == "nccl":
        bw, via = link(hw, run.world if run.colocated else run.world + run.rollout_gpus)
        move = total / bw
    elif run.backend == "broadcast":
        via, move = "gloo over TCP", total / GLOO_BYTES_PER_S
    else:  # shm / bytes: through host memory, down and up again
        via, move = "host memory", 2 * total / (hw.host_bytes_per_s * HOST_LINK_EFFICIENCY)
    bound = "communication" if move >= load else "engine load"
    return PhaseTime(move + load, bound, f"{total / GIB:.1f} GiB over {via} ({run.backend}), load {load:.2f} s")


def offload(run: Run) -> PhaseTime:
    """Seconds of the step's moves over the host link: the schedule's onloads / offloads and vLLM's sleep."""
    engine = (
        2 * engine_weights(run)[0] if run.sleeps and run.sleep_level == 1 else 0
    )  # level 1: weights to host and back
    moved = run.offload_bytes + engine
    seconds = moved / (run.hw.host_bytes_per_s * HOST_LINK_EFFICIENCY)
    return PhaseTime(seconds, "PCIe", f"{moved / GIB:.1f} GiB per GPU moved over the host link per step")
