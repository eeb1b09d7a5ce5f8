"""``estimate_step_time``: how long one training step takes, phase by phase, before anything runs.

One estimate per phase of the trainer's own ``StepSchedule`` (``megatron_rl.trainer.schedule``, the
phases the memory plan sums), each with the bound that decides it, from the published peaks of
``--hardware`` (``megatron_rl.planner.hardware``) and the named achievable fractions there:

* **gen** (memory bandwidth): prefill is compute (``2 x active params`` per prompt token, prompts
  shared by their ``rollout.n`` samples through prefix caching); every decode step of an engine reads
  its weight shard -- only the experts its running tokens touch, ``E (1 - (1 - k/E)^B)`` of ``E`` --
  and the KV cache of its running sequences, at ``DECODE_HBM_EFFICIENCY`` of HBM bandwidth, plus two
  tensor-parallel all-reduces per layer and the engine's fixed ``VLLM_DECODE_STEP_OVERHEAD_S``. The KV cache holds what ``gpu_memory_utilization`` leaves
  after the weights and ``VLLM_NON_KV_GIB``. A batch larger than the sequences of ``prompt + p99``
  tokens it holds at once runs in waves (a warning says so); blocks are taken as sequences grow, so
  ``capacity / (prompt + mean)`` run at once on average and an engine's ``S`` sequences take
  ``S / running x mean`` decode steps plus ``p99 - mean`` for the last to finish its longest
  (``partial_rollout`` carries unfinished ones over and cuts that tail). A rollout PP > 1 splits the layers
  as vLLM does (``vllm_stage_layers``), the embedding on the first stage and the head on the last; the
  stages decode different micro-batches at once, so the slowest stage's step sets the pace, and every
  stage gets as many KV blocks as the tightest worker holds.
* **log-prob and update passes** (compute): FLOPs per token ``2 x`` the active dense parameters
  (attention projections, shared experts, dense MLPs, the head; the embedding is a lookup) at
  ``DENSE_GEMM_EFFICIENCY``, ``2 x top-k`` routed experts at ``GROUPED_GEMM_EFFICIENCY``, causal
  attention ``2 x layers x heads x head_dim x sequence`` at ``ATTENTION_EFFICIENCY``; an update is 3
  forwards' worth, full recompute one more. Each pipeline stage is counted with its own layers (Megatron's
  uneven ``num_layers_in_first/last_pipeline_stage`` or ``account_for_embedding/loss_in_pipeline_split``),
  the output layer on the last; the slowest stage decides the pass, plus the bubble ``(pp - 1) / (vpp x
  microbatches)`` of it.
  Exposed communication: TP all-reduce / reduce-scatter + all-gather (2 per layer and direction),
  the EP all-to-all (dispatch + combine, per MoE layer and direction), the distributed optimizer's
  parameter all-gather per optimizer step; the CP ring and the DP gradient reduce-scatter overlap the
  compute (only their excess counts). Over NVLink inside a domain, the network beyond.
* **weight sync** (communication): the engine's weights over the transport's link (``cuda_ipc`` /
  ``colocated``: gathered from the training shards over NVLink; ``nccl``: NVLink or network;
  ``broadcast``: gloo over TCP; ``shm`` / ``bytes``: through host memory), plus the engine copying
  them into place.
* **LoRA** (``lora.rank > 0``, ``megatron_rl.planner.lora``): the frozen base computes no weight gradients
  (Megatron's ``linear_with_frozen_weight``), so an update's base GEMMs are 2 forwards' worth (3 with full
  recompute), attention's 3 as before, and the adapters' own ``2 x r x (in + out)`` FLOPs per token and
  linear are added at 3 passes; the gradient reduce-scatter, the distributed optimizer's all-gather and Adam
  move only the adapters. The reference log-prob pass runs on the actor (adapters off), in its layout. With
  ``merge: false`` vLLM keeps a LoRA slot per linear (``vllm_lora_slot_bytes``): it takes KV-cache room and
  every decode step reads it; the sync moves the compact adapter only (through Ray's object store into a
  file vLLM loads: host memory, down and up) plus vLLM's per-tensor load.
* **offload** (PCIe): every onload / offload / sleep / wake of the schedule's transitions around the
  step (``StepSchedule.transitions``): the bytes of the parts moved; vLLM sleep level 1 moves its
  weights to host and back, level 2 drops them (the sync refills them).

Composition: ``sync`` and ``colocate_async`` sum the phases (colocated, generation and training take
turns on the same GPUs); ``separate_async`` overlaps the rollout pool's generation with the trainer's
passes -- the step is the slower of the two, plus the sync that pauses both -- unless the staleness
bound is 0 (``trainer.v1.sampler.max_off_policy_threshold=0``: strictly on-policy, no overlap).

Calibration (``CALIBRATION``): NeMo-RL v0.6's published GRPO run on Qwen3-30B-A3B; only
``DECODE_HBM_EFFICIENCY`` was fitted to it (before ``VLLM_DECODE_STEP_OVERHEAD_S`` was added, which is
read from vLLM's published measurements, not fitted). Figures read, not fitted: the hardware table's peaks
and every other fraction in ``hardware.py`` (each says where it came from).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from megatron_rl.config.model import ModelConfig
from megatron_rl.planner.hardware import (ATTENTION_EFFICIENCY, DECODE_ALLREDUCE_LATENCY_S, DECODE_HBM_EFFICIENCY,
                                          DENSE_GEMM_EFFICIENCY, GLOO_BYTES_PER_S, GROUPED_GEMM_EFFICIENCY,
                                          HBM_COPY_EFFICIENCY, HOST_LINK_EFFICIENCY, NETWORK_EFFICIENCY,
                                          NVLINK_EFFICIENCY, Hardware, get_hardware)
from megatron_rl.models.gpt import padded_vocab_size
from megatron_rl.planner.memory import DTYPE_BYTES, GIB, count_params, rollout_weight_bytes
from megatron_rl.utils.engine_map import engine_weight_bytes_per_gpu

__all__ = ["PhaseTime", "KVCache", "StepTime", "estimate_step_time", "format_step_time", "step_time_json",
           "kv_bytes_per_token", "vllm_stage_layers", "CALIBRATION", "VLLM_NON_KV_GIB", "VLLM_LOAD_S_PER_TENSOR",
           "VLLM_DECODE_STEP_OVERHEAD_S"]

VLLM_LOAD_S_PER_TENSOR = 50e-6
"""Assumed: vLLM's ``load_weights`` handles each HF-named tensor in Python (name mapping, the weight
loader's shard selection) for ~50 us, on top of the bytes' copy; MoE checkpoints have tens of thousands."""
VLLM_DECODE_STEP_OVERHEAD_S = 3e-3
"""Assumed from published measurements, not fitted: what one vLLM decode step costs beyond its GPU work --
scheduling, preparing the step's inputs, launching the CUDA graph, syncing and processing the sampled tokens.
vLLM's multi-step RFC (github.com/vllm-project/vllm/issues/6854) profiles ~4 ms of GPU idle per decode step
(5-13 ms in the cases it cites); issue #10634 measures a 5-6 ms gap between two decode steps of Llama-2-7B at
batch 256 and estimates 2-3 ms of it removable. V1 (persistent batch, CUDA graphs, detokenisation in its own
process) keeps scheduling and input preparation between steps unless async scheduling overlaps them
(PR #19970; with PP=4, PR #32618 gains 31.8 % TPOT from it): 3 ms, the low end of the measured gaps. Recent
vLLM releases turn async scheduling on by default (not at PP > 1 on the V1 model runner), which hides part
of it: an upper figure for those."""
VLLM_NON_KV_GIB = 2.0
"""Assumed: what a vLLM engine keeps per GPU besides weights and KV cache (CUDA graphs, the profiled
activation peak of ``max_num_batched_tokens``, sampler scratch)."""

CALIBRATION = {
    "source": "NeMo-RL v0.6 performance summary (docs.nvidia.com/nemo/rl/0.6.0/about/performance-summary.html), "
              "recipe examples/configs/recipes/llm/performance/grpo-qwen3-30ba3b-4n8g.yaml",
    "published": {"step_time_s": 192.0, "tokens_per_s_per_gpu": 1102.0},
    "recipe": "gpu/qwen3_30b_a3b_grpo",
    # 4 x 8 H100, colocated, on-policy; 64 prompts x 32 = 2,048 generations, training batches of 512;
    # training TP=1 PP=1 EP=8 without recompute, generation TP=2 at gpu_memory_utilization 0.6;
    # sequences of at most 4,096 tokens (a ~128-token prompt), ~3,200 generated tokens on average.
    "overrides": ["trainer.nnodes=4", "trainer.n_gpus_per_node=8", "data.train_batch_size=64",
                  "actor_rollout_ref.rollout.n=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                  "data.max_prompt_length=128", "data.max_response_length=3968",
                  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                  "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                  "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8",
                  "actor_rollout_ref.actor.megatron.sequence_parallel=false",
                  "actor_rollout_ref.actor.megatron.override_transformer_config={}",
                  "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                  "actor_rollout_ref.rollout.checkpoint_engine.backend=cuda_ipc"],
    "response_length_mean": 3200,
}
"""The one published run the constants are calibrated against (a test pins the model within 20 %)."""


@dataclasses.dataclass(frozen=True)
class PhaseTime:
    """Seconds of one phase and what bounds it (compute, memory bandwidth, communication, PCIe)."""

    seconds: float
    bound: str
    detail: str = ""
    stages: tuple = ()
    """Seconds of each pipeline stage of a Megatron pass, first to last (compute + exposed per-layer
    communication, before the bubble): the slowest decides the pass."""


@dataclasses.dataclass(frozen=True)
class KVCache:
    """One rollout engine's KV cache against the batch it generates."""

    bytes_per_token: int
    """KV bytes one token takes on each GPU of the engine (its share of heads and layers)."""
    capacity_tokens: int
    """Tokens the engine's KV cache holds."""
    free_bytes_per_gpu: int
    """What ``gpu_memory_utilization`` leaves per GPU after the weights and ``VLLM_NON_KV_GIB``."""
    fits_at_once: int
    """Sequences of ``prompt + p99 response`` tokens the cache holds at once (at most ``max_num_seqs``)."""
    sequences_per_engine: int
    waves: int


@dataclasses.dataclass
class StepTime:
    """The predicted step: phases in the schedule's order, their composition and the largest lever."""

    hardware: str
    mode: str
    phases: dict[str, PhaseTime]
    step_time_s: float
    tokens_per_step: float
    gpus: int
    kv: KVCache
    response_mean: float
    response_p99: float
    lever: str = ""
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Prompt + response tokens of the step per second and GPU (NeMo-RL's definition)."""
        return self.tokens_per_step / (self.step_time_s * self.gpus)


# ----------------------------------------------------------------------------- the run's figures
@dataclasses.dataclass(frozen=True)
class _Pass:
    """One Megatron pass of a phase: which model, its layout, forward only or an update."""

    phase: str
    model: ModelConfig
    sizes: dict
    trainable: bool
    value_head: bool
    recompute: str
    distributed_optimizer: bool
    micro_tokens: int
    """Tokens per micro-batch (for the pipeline bubble)."""
    stage_layers: tuple
    """Decoder layers of each pipeline stage (``parallel.config.pipeline_stage_layers``: Megatron's uneven
    first / last stages or the embedding / loss counted as a layer)."""
    repeats: int = 1
    """ppo_epochs of an update."""
    skipped: bool = False
    """Rollout-correction bypass mode: the rollout's log-probs are the old ones, no actor forward."""
    frozen_base: bool = False
    """LoRA: the base weights take no gradient (no weight-gradient GEMMs; only the adapters are optimised)."""
    adapter_work: tuple = ()
    """LoRA: per pipeline stage, the adapter parameters a token multiplies there (routed experts: top-k of them)."""
    adapter_local: tuple = (0, 0)
    """LoRA: ``(dense, expert)`` adapter parameters of one rank of the most loaded stage (the optimizer's)."""


@dataclasses.dataclass(frozen=True)
class _Run:
    """Everything the model reads from the config; a lever is a ``dataclasses.replace`` of it."""

    model: ModelConfig
    hw: Hardware
    gpus_per_node: int
    world: int
    sequences: int
    prompts: int
    extra_generations: int
    """Generated but not trained on: ReMax's greedy baseline, one per prompt."""
    prompt_length: int
    response_mean: float
    response_p99: float
    mini_batches: int
    rollout_tp: int
    rollout_pp: int
    rollout_dp: int
    rollout_ep: int
    rollout_gpus: int
    colocated: bool
    nodes_per_engine: int
    vllm_bytes: int
    rollout_dtype: str
    quantization: Optional[str]
    kv_dtype_bytes: int
    max_num_seqs: int
    prefix_caching: bool
    backend: str
    passes: tuple
    offload_bytes: int
    sleep_level: int
    sleeps: bool
    mode: str
    overlap: bool
    partial_rollout: bool
    lora_slot_rank: int = 0
    """vLLM's ``max_lora_rank`` with ``lora.merge: false`` (0: no LoRA slot; the merged weights are synced)."""
    adapter_sync_bytes: int = 0
    """``lora.merge: false``: bytes of the compact adapter each sync moves."""
    adapter_sync_tensors: int = 0
    lora_slot_embeddings: bool = False
    """vLLM's LoRA slot covers the embedding and the head too (``planner.lora.vllm_embedding_lora``)."""

    @property
    def decode_groups(self) -> int:
        """Engines x their data-parallel ranks: each decodes its own share of the batch."""
        return max(self.rollout_gpus // (self.rollout_tp * self.rollout_pp), 1)


def kv_bytes_per_token(m: ModelConfig, *, tp: int = 1, pp: int = 1, dtype_bytes: int = 2) -> int:
    """KV-cache bytes of one token on one GPU of an engine with ``tp`` x ``pp``: per layer K and V of
    its share of the KV heads (a head replicated when there are fewer than TP), or MLA's compressed
    latent plus the rotary key (``kv_lora_rank + qk_pos_emb_head_dim``, replicated over TP)."""
    layers = math.ceil(m.num_layers / pp)
    if getattr(m, "multi_latent_attention", False):
        return layers * (m.kv_lora_rank + m.qk_pos_emb_head_dim) * dtype_bytes
    kv_heads = m.num_query_groups or m.num_attention_heads
    return layers * 2 * max(kv_heads // tp, 1) * m.head_dim * dtype_bytes


def _attention_width(m: ModelConfig) -> int:
    """``heads x (qk dim + v dim) / 2``: attention FLOPs per token and context position are ``2 x`` this."""
    if getattr(m, "multi_latent_attention", False):
        return m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) // 2
    return m.num_attention_heads * m.head_dim


def _stage_work(m: ModelConfig, stage_layers: tuple, value_head: bool = False) -> list[tuple[int, int, int, int]]:
    """Per pipeline stage, what one token costs there: ``(dense, routed expert)`` parameters it multiplies,
    its decoder layers and MoE layers. The first stage's embedding is a lookup; the last stage's output layer
    (the value head of a critic) is a matmul there, tied to the embedding or not."""
    pp = len(stage_layers)
    embed = padded_vocab_size(m.vocab_size, 1, m.make_vocab_size_divisible_by) * m.hidden_size
    out, first = [], 0
    for s, layers in enumerate(stage_layers):
        dense, expert = count_params(m, pp=pp, stage=s, stage_layers=stage_layers, value_head=value_head)
        dense -= embed if s == 0 else 0
        if s == pp - 1 and pp == 1 and m.tie_word_embeddings and not value_head:
            dense += embed  # count_params stores a tied head once, as the embedding; its matmul still runs
        moe = sum(m.layer_is_moe(i) for i in range(first, first + layers)) if hasattr(m, "layer_is_moe") else \
            (layers if m.is_moe else 0)
        routed = expert * m.moe_router_topk // m.num_moe_experts if m.is_moe else 0
        out.append((dense, routed, layers, moe))
        first += layers
    return out


def _link(hw: Hardware, span: int) -> tuple[float, str]:
    """Achievable bytes/s of a group of ``span`` consecutive GPUs: NVLink inside a domain, else the network."""
    if span <= hw.nvlink_domain:
        return hw.nvlink_bytes_per_s * NVLINK_EFFICIENCY, "NVLink"
    return hw.network_bytes_per_s * NETWORK_EFFICIENCY, "network"


# ----------------------------------------------------------------------------- phases
def _engine_weights(run: _Run) -> tuple[int, int]:
    """``(all, routed-expert)`` weight bytes one engine GPU holds (``engine_map.engine_weight_bytes_per_gpu``,
    as the memory plan counts them: experts over vLLM's EP when it is on)."""
    total = rollout_weight_bytes(run.model, run.rollout_dtype, run.quantization)
    per_param = DTYPE_BYTES[run.rollout_dtype] if run.quantization is None else 1 + 4 / 128 ** 2
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


def _engine_stages(run: _Run) -> list[_EngineStage]:
    """The engine's stages (one at PP=1): each holds its layers' share of the weights (``_engine_weights`` at
    PP=1) and of the KV cache; the first also the embedding, the last the head."""
    m, split = run.model, vllm_stage_layers(run.model.num_layers, run.rollout_pp)
    total = rollout_weight_bytes(m, run.rollout_dtype, run.quantization)
    per_param = DTYPE_BYTES[run.rollout_dtype] if run.quantization is None else 1 + 4 / 128 ** 2
    all_dense, all_expert = count_params(m)
    experts = int(all_expert * per_param)
    kw = dict(tp=run.rollout_tp, dp=run.rollout_dp, pp=1, ep=run.rollout_ep)
    kv_layer = kv_bytes_per_token(m, tp=run.rollout_tp, dtype_bytes=run.kv_dtype_bytes) // m.num_layers
    out = []
    for s, (dense, routed, layers, _) in enumerate(_stage_work(m, split)):
        held_dense, held_expert = count_params(m, pp=len(split), stage=s, stage_layers=split)
        stage_experts = int(experts * held_expert / all_expert) if all_expert else 0
        stage_total = int((total - experts) * held_dense / all_dense) + stage_experts
        weights = engine_weight_bytes_per_gpu(stage_total, stage_experts, **kw)
        slot = _lora_slot(run) * layers // m.num_layers  # read every decode step like the weights
        out.append(_EngineStage(weights + slot, weights - engine_weight_bytes_per_gpu(stage_total - stage_experts, 0, **kw),
                                kv_layer * layers, layers, dense, routed))
    return out


def _lora_slot(run: _Run) -> int:
    """Bytes of vLLM's LoRA slot on one engine GPU at PP = 1 (``lora.merge: false``; else 0)."""
    from megatron_rl.planner.lora import vllm_lora_slot_bytes

    return vllm_lora_slot_bytes(run.model, run.lora_slot_rank, DTYPE_BYTES[run.rollout_dtype], tp=run.rollout_tp,
                                ep=run.rollout_ep, embeddings=run.lora_slot_embeddings)


def _generation(run: _Run) -> tuple[PhaseTime, KVCache, list[str]]:
    m, hw, tp, pp = run.model, run.hw, run.rollout_tp, run.rollout_pp
    stages = _engine_stages(run)
    # vLLM sizes the cache by its most constrained worker: the same number of blocks on every stage
    free_of = [int(run.vllm_bytes - st.weights - VLLM_NON_KV_GIB * GIB) for st in stages]
    tight = min(range(pp), key=lambda i: max(free_of[i], 0) // max(stages[i].kv_per_token, 1))
    free, per_token = free_of[tight], stages[tight].kv_per_token
    capacity = max(free, 0) // max(per_token, 1)
    per_engine = math.ceil((run.sequences + run.extra_generations) / run.decode_groups)
    longest = run.prompt_length + run.response_p99
    fits = min(run.max_num_seqs, int(capacity // longest))
    warnings = []
    if fits < 1:
        warnings.append(f"generation: the KV cache holds {capacity} tokens per engine ({max(free, 0) / GIB:.1f} GiB per "
                        f"GPU), less than one sequence of {longest:.0f} tokens: vLLM would refuse to start; raise "
                        "actor_rollout_ref.rollout.gpu_memory_utilization or tensor_model_parallel_size")
    waves = math.ceil(per_engine / max(fits, 1))
    # blocks are taken as sequences grow and freed as they finish: on average a sequence holds prompt + mean
    concurrent = max(1.0, min(per_engine, run.max_num_seqs, capacity / (run.prompt_length + run.response_mean)))
    if waves > 1:
        warnings.append(f"generation runs in {waves} waves: each engine's KV cache ({capacity:,} tokens, "
                        f"{per_token:,} B per token per GPU) holds {fits} sequences of {longest:.0f} tokens at once but "
                        f"gets {per_engine}; raise gpu_memory_utilization or the rollout TP, or use fewer sequences")
    # continuous batching: per_engine x mean sequence-steps at `concurrent` at once; the last ones wait for
    # the longest (p99) unless partial rollouts carry the unfinished ones over to the next step
    steps = per_engine / concurrent * run.response_mean
    if not run.partial_rollout:
        steps += run.response_p99 - run.response_mean
    context = run.prompt_length + run.response_mean / 2
    touched = 1.0 - (1.0 - m.moe_router_topk / m.num_moe_experts) ** concurrent if m.is_moe else 1.0
    width = _attention_width(m)
    bw, _ = _link(hw, tp if run.nodes_per_engine == 1 else hw.nvlink_domain + 1)
    timings = []  # per stage: (memory, compute, communication) seconds of one decode step
    for st in stages:  # stages work on different micro-batches at once: the slowest sets the pace
        read = st.weights - st.expert_weights + st.expert_weights * touched + concurrent * context * st.kv_per_token
        flops = concurrent * (2 * (st.dense + st.routed) + 4 * st.layers * width * context) / tp
        t_comm = st.layers * 2 * (DECODE_ALLREDUCE_LATENCY_S + 2 * (tp - 1) / tp * concurrent * m.hidden_size * 2 / bw) \
            if tp > 1 else 0.0
        timings.append((read / (hw.hbm_bytes_per_s * DECODE_HBM_EFFICIENCY),
                        flops / (hw.bf16_flops * DENSE_GEMM_EFFICIENCY), t_comm))
    slowest = max(range(pp), key=lambda i: max(timings[i][:2]) + timings[i][2])
    t_mem, t_compute, t_comm = timings[slowest]
    step = max(t_mem, t_compute) + t_comm + VLLM_DECODE_STEP_OVERHEAD_S
    prompt_tokens = (math.ceil(run.prompts / run.decode_groups) if run.prefix_caching else per_engine) * run.prompt_length
    t_prefill = max(prompt_tokens * (2 * (st.dense + st.routed) + 2 * st.layers * width * run.prompt_length)
                    for st in stages) / tp / (hw.bf16_flops * DENSE_GEMM_EFFICIENCY)
    seconds = t_prefill + steps * step
    bound = "compute" if t_compute > t_mem else "memory bandwidth"
    if t_comm > max(t_mem, t_compute):
        bound = "communication"
    if VLLM_DECODE_STEP_OVERHEAD_S > max(t_mem, t_compute, t_comm):
        bound = "engine overhead"
    where = f", slowest stage {slowest} of {pp} ({stages[slowest].layers} layers)" if pp > 1 else ""
    detail = (f"{run.decode_groups} engines x {concurrent:.0f} sequences, {steps:.0f} decode steps of {step * 1e3:.1f} ms "
              f"({VLLM_DECODE_STEP_OVERHEAD_S * 1e3:.0f} ms of them vLLM's per-step overhead; "
              f"weights {stages[slowest].weights / GIB:.1f} GiB/GPU, {touched:.0%} of experts touched{where}), "
              f"prefill {t_prefill:.1f} s")
    kv = KVCache(bytes_per_token=per_token, capacity_tokens=int(capacity), free_bytes_per_gpu=max(free, 0),
                 fits_at_once=max(fits, 0), sequences_per_engine=per_engine, waves=waves)
    return PhaseTime(seconds, bound, detail), kv, warnings


def _megatron_pass(run: _Run, p: _Pass) -> PhaseTime:
    if p.skipped:
        return PhaseTime(0.0, "skipped", "bypass mode: the rollout's log-probs are the old ones")
    m, hw, s = p.model, run.hw, p.sizes
    world, tp, pp, cp, ep, etp = s["world"], s["tp"], s["pp"], s["cp"], s["ep"], s["etp"]
    dp, vpp = s["dp"], s["vpp"] or 1
    seq = run.prompt_length + run.response_mean
    tokens = run.sequences * seq
    passes = (3 if p.trainable else 1) + (1 if p.trainable and p.recompute == "full" else 0)
    attn_passes = passes + (1 if p.trainable and p.recompute == "selective" else 0)
    directions = passes  # every forward and backward moves the layer's activations once
    per_rank = tokens / (dp * tp * cp)  # what one rank of a stage computes: its DP share, split over TP x CP
    local = tokens / (dp * cp)  # the [tokens, h] a TP group's collectives move
    width = _attention_width(m)
    stages, overlapped_by_stage = [], []
    base_passes = passes - (1 if p.trainable and p.frozen_base else 0)  # a frozen base: no weight-gradient GEMMs
    adapter_work = p.adapter_work or (0,) * len(p.stage_layers)
    for (dense, expert, layers, moe_layers), adapter in zip(_stage_work(m, p.stage_layers, p.value_head), adapter_work):
        compute = per_rank * (base_passes * 2 * dense / (hw.bf16_flops * DENSE_GEMM_EFFICIENCY)
                              + base_passes * 2 * expert / (hw.bf16_flops * GROUPED_GEMM_EFFICIENCY)
                              + passes * 2 * adapter / (hw.bf16_flops * DENSE_GEMM_EFFICIENCY)
                              + attn_passes * 2 * layers * width * seq / (hw.bf16_flops * ATTENTION_EFFICIENCY))
        comm = 0.0
        if tp > 1:  # per layer and direction: all-gather + reduce-scatter of [tokens, h] (= one all-reduce) twice
            bw, _ = _link(hw, tp)
            comm += layers * directions * 2 * 2 * (tp - 1) / tp * local * m.hidden_size * 2 / bw
        if m.is_moe and ep > 1:  # dispatch + combine of top-k copies of each token, per MoE layer and direction
            bw, _ = _link(hw, ep * etp)
            comm += moe_layers * directions * 2 * per_rank * m.moe_router_topk * m.hidden_size * 2 * (ep - 1) / ep / bw
        ring = 0.0
        if cp > 1:
            bw, _ = _link(hw, tp * cp)
            kv_heads = max((m.num_query_groups or m.num_attention_heads) // tp, 1)
            ring = layers * directions * (cp - 1) * 2 * local * kv_heads * m.head_dim * 2 / bw
        stages.append((compute, comm))
        overlapped_by_stage.append(ring)
    # the slowest stage decides: every micro-batch waits for it, and the bubble is (pp - 1) / (vpp x micro) of it
    slowest = max(range(pp), key=lambda i: sum(stages[i]) + max(overlapped_by_stage[i] - stages[i][0], 0))
    compute, exposed = stages[slowest]
    overlapped = overlapped_by_stage[slowest]
    steps = run.mini_batches if p.trainable else 1
    micro = max(tokens / dp / steps / p.micro_tokens, 1.0)
    compute *= 1 + (pp - 1) / (vpp * micro)
    if p.trainable:  # per optimizer step: gradient reduce-scatter (overlapped), parameter all-gather (exposed)
        dense_local, expert_local = p.adapter_local if p.frozen_base else count_params(
            m, tp=tp, pp=pp, ep=ep, etp=etp, value_head=p.value_head, stage_layers=p.stage_layers)  # most loaded stage
        bw, _ = _link(hw, world // pp)
        for params, group in ((dense_local, dp * cp), (expert_local, s["expert_dp"])):
            if group > 1 and params:
                overlapped += steps * params * 4 * (group - 1) / group / bw
                if p.distributed_optimizer:
                    exposed += steps * params * 2 * (group - 1) / group / bw
        shard = (dense_local / (dp * cp) + expert_local / s["expert_dp"]) if p.distributed_optimizer else \
            dense_local + expert_local
        exposed += steps * shard * 2 * 18 / (hw.hbm_bytes_per_s * HBM_COPY_EFFICIENCY)  # Adam reads + writes 18 B
    seconds = (max(compute, overlapped) + exposed) * p.repeats
    bound = "communication" if exposed + max(overlapped - compute, 0) > compute else "compute"
    where = f", slowest stage {slowest} of {pp} ({p.stage_layers[slowest]} layers)" if pp > 1 else ""
    frozen = f" (LoRA: the frozen base's GEMMs {base_passes})" if base_passes != passes else ""
    detail = (f"{tokens / 1e6:.2f} M tokens, {passes} pass{'es' if passes > 1 else ''}{frozen}, compute {compute:.1f} s, "
              f"exposed communication {exposed + max(overlapped - compute, 0):.1f} s{where}")
    return PhaseTime(seconds, bound, detail, stages=tuple(c + e for c, e in stages))


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


def _weight_sync(run: _Run) -> PhaseTime:
    hw = run.hw
    if run.lora_slot_rank:  # lora.merge: false: the compact adapter, through host memory, into vLLM's LoRA slot
        move = 2 * run.adapter_sync_bytes / (hw.host_bytes_per_s * HOST_LINK_EFFICIENCY)
        load = 2 * _lora_slot(run) / (hw.hbm_bytes_per_s * HBM_COPY_EFFICIENCY)
        load += run.adapter_sync_tensors * VLLM_LOAD_S_PER_TENSOR
        return PhaseTime(move + load, "communication" if move >= load else "engine load",
                         f"{run.adapter_sync_bytes / GIB:.2f} GiB of LoRA adapters only (lora.merge=false) over host "
                         f"memory, load {load:.2f} s")
    total = rollout_weight_bytes(run.model, run.rollout_dtype, run.quantization)
    shard = _engine_weights(run)[0]
    load = 2 * shard / (hw.hbm_bytes_per_s * HBM_COPY_EFFICIENCY)  # the engine copies each tensor into place
    load += _hf_tensor_count(run.model) * VLLM_LOAD_S_PER_TENSOR
    if run.backend in ("colocated", "cuda_ipc"):
        a = run.passes[-1].sizes  # the actor's layout: its model-parallel group holds one full copy
        bw, link = _link(hw, a["world"] if a["pp"] > 1 else max(a["tp"] * a["cp"], a["ep"] * a["etp"]))
        move = shard / bw
    elif run.backend == "nccl":
        bw, link = _link(hw, run.world if run.colocated else run.world + run.rollout_gpus)
        move = total / bw
    elif run.backend == "broadcast":
        link, move = "gloo over TCP", total / GLOO_BYTES_PER_S
    else:  # shm / bytes: through host memory, down and up again
        link, move = "host memory", 2 * total / (hw.host_bytes_per_s * HOST_LINK_EFFICIENCY)
    bound = "communication" if move >= load else "engine load"
    return PhaseTime(move + load, bound, f"{total / GIB:.1f} GiB over {link} ({run.backend}), load {load:.2f} s")


def _offload(run: _Run) -> PhaseTime:
    engine = 2 * _engine_weights(run)[0] if run.sleeps and run.sleep_level == 1 else 0  # level 1: weights to host and back
    moved = run.offload_bytes + engine
    seconds = moved / (run.hw.host_bytes_per_s * HOST_LINK_EFFICIENCY)
    return PhaseTime(seconds, "PCIe", f"{moved / GIB:.1f} GiB per GPU moved over the host link per step")


def _evaluate(run: _Run) -> StepTime:
    gen, kv, warnings = _generation(run)
    phases = {"gen": gen}
    for p in run.passes:
        phases[p.phase] = _megatron_pass(run, p)
    phases["weight_sync"] = _weight_sync(run)
    phases["offload"] = _offload(run)
    total = sum(p.seconds for p in phases.values())
    if run.mode == "separate_async" and run.overlap:
        train = total - gen.seconds - phases["weight_sync"].seconds
        step = max(gen.seconds, train) + phases["weight_sync"].seconds
    else:
        step = total
    gpus = run.world + (0 if run.colocated else run.rollout_gpus)
    return StepTime(hardware=run.hw.name, mode=run.mode, phases=phases, step_time_s=step,
                    tokens_per_step=run.sequences * (run.prompt_length + run.response_mean), gpus=gpus, kv=kv,
                    response_mean=run.response_mean, response_p99=run.response_p99, warnings=warnings)


# ----------------------------------------------------------------------------- from the config
_PART_BYTES = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes"}


def _check_length(option: str, value: Optional[float], maximum: int) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value <= 0 or value > maximum:
        raise ValueError(f"{option}={value} must be a number of tokens > 0 and at most data.max_response_length="
                         f"{maximum}")


def _offload_bytes(schedule: Any, roles: dict) -> int:
    """Bytes per GPU the schedule's onloads and offloads move in one steady-state step (the cycle's transitions)."""
    state = schedule.resident(schedule.phases[-1].name)
    moved = 0
    for phase in schedule.phases:
        for t in schedule.transitions(state, phase.name):
            if t.target in roles:
                moved += sum(getattr(roles[t.target], _PART_BYTES[part]) for part in t.parts)
        state = schedule.resident(phase.name)
    return moved


def _build(cfg: Any, plan: Any, hw: Hardware, mean: Optional[float], p99: Optional[float]) -> _Run:
    from megatron_rl.algos.needs import resolve_run
    from megatron_rl.planner.architectures import resolve_architecture
    from megatron_rl.trainer.placement import role_token_budgets
    from megatron_rl.trainer.schedule import step_schedule
    from parallel.config import pipeline_stage_layers, uneven_pipeline_fields

    arr, data, rollout, v1 = cfg.actor_rollout_ref, cfg.data, cfg.actor_rollout_ref.rollout, cfg.trainer.v1
    _check_length("--response-length-mean", mean, data.max_response_length)
    _check_length("--response-length-p99", p99, data.max_response_length)
    p99 = float(p99 if p99 is not None else data.max_response_length)
    mean = float(mean if mean is not None else p99)
    if mean > p99:
        raise ValueError(f"--response-length-mean={mean:g} is larger than the p99 ({p99:g}, "
                         f"{'--response-length-p99' if p99 != data.max_response_length else 'data.max_response_length'})")
    needs = resolve_run(cfg)
    lora = arr.model.lora_config()
    ref_in_actor = lora.enabled and needs.reference  # the trainer's rule: the reference is the actor, adapters off
    schedule = step_schedule(cfg, dataclasses.replace(needs, reference=False) if ref_in_actor else needs)
    world, seq_max = cfg.trainer.world_size, data.max_prompt_length + data.max_response_length
    budgets = role_token_budgets(cfg)

    def sizes(megatron: Any) -> dict:
        return megatron.parallel().sizes(world)

    def stages(megatron: Any, model: ModelConfig) -> tuple:
        size = sizes(megatron)
        return pipeline_stage_layers(model.num_layers, size["pp"], size["vpp"],
                                     **uneven_pipeline_fields(megatron.override_transformer_config))

    def recompute(megatron: Any) -> str:
        return str(megatron.override_transformer_config.get("recompute_granularity") or "")

    actor = arr.actor
    frozen = _lora_pass_fields(plan.model, lora, sizes(actor.megatron), stages(actor.megatron, plan.model))
    log_prob_micro = getattr(rollout, "log_prob_micro_batch_size_per_gpu", None) or actor.ppo_micro_batch_size_per_gpu
    correction = cfg.algorithm.rollout_correction
    bypass = v1.trainer_mode == "separate_async" or bool(correction is not None and correction.bypass_mode)
    passes = [_Pass("actor_log_prob", plan.model, sizes(actor.megatron), False, False, "", False,
                    budgets["actor"].forward or log_prob_micro * seq_max, stages(actor.megatron, plan.model),
                    skipped=bypass, adapter_work=frozen.get("adapter_work", ()))]
    if ref_in_actor:  # the actor's own forward with the adapters off, in the actor's layout
        passes.append(_Pass("ref_log_prob", plan.model, sizes(actor.megatron), False, False, "", False,
                            budgets["actor"].forward or (arr.ref.log_prob_micro_batch_size_per_gpu or 1) * seq_max,
                            stages(actor.megatron, plan.model)))
    elif needs.reference:
        passes.append(_Pass("ref_log_prob", plan.model, sizes(arr.ref.megatron), False, False, "", False,
                            budgets["ref"].forward or (arr.ref.log_prob_micro_batch_size_per_gpu or 1) * seq_max,
                            stages(arr.ref.megatron, plan.model)))
    if needs.teacher:
        t = cfg.distillation.teacher_model
        t_model, _ = resolve_architecture("distillation.teacher_model.model_path", path=t.model_path, config=t.config)
        passes.append(_Pass("teacher_log_prob", t_model, sizes(t.megatron), False, False, "", False,
                            budgets["teacher"].forward or (t.log_prob_micro_batch_size_per_gpu or 1) * seq_max,
                            stages(t.megatron, t_model)))
    if needs.critic:
        c = cfg.critic
        c_model, _ = resolve_architecture("critic.model.path", path=c.model.path, config=c.model.config,
                                          overrides=c.model.override_config)
        micro = c.ppo_micro_batch_size_per_gpu * seq_max
        passes.append(_Pass("critic_values", c_model, sizes(c.megatron), False, True, "", False,
                            budgets["critic"].forward or micro, stages(c.megatron, c_model)))
        passes.append(_Pass("critic_update", c_model, sizes(c.megatron), True, True, recompute(c.megatron),
                            c.megatron.use_distributed_optimizer, budgets["critic"].train or micro,
                            stages(c.megatron, c_model), getattr(c, "ppo_epochs", 1)))
    passes.append(_Pass("actor_update", plan.model, sizes(actor.megatron), True, False, recompute(actor.megatron),
                        actor.megatron.use_distributed_optimizer,
                        budgets["actor"].train or actor.ppo_micro_batch_size_per_gpu * seq_max,
                        stages(actor.megatron, plan.model), actor.ppo_epochs, **frozen))
    order = schedule.names + (["ref_log_prob"] if ref_in_actor else [])
    passes.sort(key=lambda p: order.index(p.phase) if p.phase != "ref_log_prob" or not ref_in_actor
                else order.index("actor_log_prob") + 0.5)
    engines = plan.engines
    kv_dtype = str(rollout.engine_kwargs.get("vllm", {}).get("kv_cache_dtype", "auto"))
    dtype = rollout.dtype if rollout.dtype != "auto" else "bfloat16"
    threshold = v1.sampler.max_off_policy_threshold
    overlap = v1.trainer_mode == "separate_async" and threshold != 0 and v1.separate_async.num_warmup_batches > 0
    return _Run(model=plan.model, hw=hw, gpus_per_node=cfg.trainer.n_gpus_per_node, world=world,
                sequences=data.train_batch_size * rollout.n, prompts=data.train_batch_size,
                extra_generations=data.train_batch_size if needs.baseline else 0,
                prompt_length=data.max_prompt_length, response_mean=mean, response_p99=p99,
                mini_batches=max(data.train_batch_size // actor.ppo_mini_batch_size, 1),
                rollout_tp=rollout.tensor_model_parallel_size, rollout_pp=rollout.pipeline_model_parallel_size,
                rollout_dp=rollout.data_parallel_size, rollout_ep=rollout.expert_parallel_size, rollout_gpus=engines.replicas * engines.engine_gpus,
                colocated=engines.colocated, nodes_per_engine=engines.nodes_per_engine,
                vllm_bytes=int(rollout.gpu_memory_utilization * plan.memory_budget_bytes), rollout_dtype=dtype,
                quantization=rollout.quantization, kv_dtype_bytes=1 if kv_dtype.startswith("fp8") else 2,
                max_num_seqs=rollout.max_num_seqs, prefix_caching=rollout.enable_prefix_caching,
                backend=rollout.checkpoint_engine.backend, passes=tuple(passes),
                offload_bytes=_offload_bytes(schedule, plan.roles), sleep_level=schedule.sleep_level,
                sleeps=schedule.rollout_sleeps, mode=v1.trainer_mode, overlap=overlap,
                partial_rollout=v1.partial_rollout, **_lora_sync_fields(cfg, plan, lora))


def _lora_pass_fields(m: ModelConfig, lora: Any, size: dict, stage_layers: tuple) -> dict:
    """The actor update's ``_Pass`` fields of a LoRA actor (``{}`` without LoRA): the base frozen, the adapters'
    work per stage (whole, routed experts at top-k of E) and one rank's adapters on the most loaded stage."""
    from megatron_rl.planner.lora import adapter_params

    if not lora.enabled:
        return {}
    pp = size["pp"]
    whole = adapter_params(m, lora, pp=pp, stage_layers=stage_layers)
    topk = m.moe_router_topk / m.num_moe_experts if m.is_moe else 0
    local = adapter_params(m, lora, tp=size["tp"], pp=pp, ep=size["ep"], etp=size["etp"], stage_layers=stage_layers)
    return {"frozen_base": True, "adapter_work": tuple(d + e * topk for d, e in whole),
            "adapter_local": max(local, key=sum)}


def _lora_sync_fields(cfg: Any, plan: Any, lora: Any) -> dict:
    """The ``_Run`` fields of an adapter-only sync (``lora.merge: false``; ``{}`` otherwise)."""
    from megatron_rl.config.lora import vllm_lora_rank
    from megatron_rl.planner.lora import adapter_sync_tensors

    if not lora.enabled or lora.merge:
        return {}
    from megatron_rl.planner.plan import _embedding_lora

    return {"lora_slot_rank": vllm_lora_rank(lora.rank), "adapter_sync_tensors": adapter_sync_tensors(plan.model, lora),
            "lora_slot_embeddings": _embedding_lora(cfg),
            "adapter_sync_bytes": plan.phases["weight sync"]["sync adapter"]}


def estimate_step_time(config: Any, plan: Any, *, hardware: str = "H100", response_length_mean: Optional[float] = None,
                       response_length_p99: Optional[float] = None) -> StepTime:
    """The step time of ``config`` (a ``TrainerRunConfig``) on ``hardware``, per phase of its ``StepSchedule``,
    from its ``plan`` (``plan_run``: the model, the engine map, each role's bytes). Response lengths default
    to ``data.max_response_length``; ``ValueError`` names the option for a bad one or an unknown GPU."""
    hw = get_hardware(hardware)
    if plan.device != "cuda":
        raise ValueError("the step-time model is for GPU runs (trainer.device=cuda); this run is on CPU")
    run = _build(config, plan, hw, response_length_mean, response_length_p99)
    result = _evaluate(run)
    result.lever = _largest_lever(run, result)
    return result


# ----------------------------------------------------------------------------- the largest lever
def _levers(run: _Run) -> list[tuple[str, _Run]]:
    """Single changes worth trying, each as the modified run (only the valid ones)."""
    out = []
    m, tp = run.model, run.rollout_tp
    heads = m.num_attention_heads
    for new in (tp * 2, tp // 2):
        gpus = new * run.rollout_pp * run.rollout_dp
        if new < 1 or new == tp or new > run.gpus_per_node or heads % new or run.rollout_gpus % gpus:
            continue
        out.append((f"a rollout TP of {new} instead of {tp} ({run.rollout_gpus // gpus} engines instead of "
                    f"{run.rollout_gpus // (tp * run.rollout_pp * run.rollout_dp)}; "
                    "actor_rollout_ref.rollout.tensor_model_parallel_size)",
                    dataclasses.replace(run, rollout_tp=new, rollout_ep=new * run.rollout_dp if run.rollout_ep > 1 else 1)))
    if run.quantization is None and run.hw.fp8_flops is not None:
        out.append(("fp8 rollout weights (actor_rollout_ref.rollout.quantization=fp8)",
                    dataclasses.replace(run, quantization="fp8")))
    if run.kv_dtype_bytes == 2:
        out.append(("an fp8 KV cache (actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8)",
                    dataclasses.replace(run, kv_dtype_bytes=1)))
    if not run.partial_rollout and run.response_p99 > 1.1 * run.response_mean:
        out.append((f"cutting the tail (partial rollouts or over-sampling: decode to the mean {run.response_mean:.0f} "
                    f"instead of the p99 {run.response_p99:.0f} tokens)", dataclasses.replace(run, partial_rollout=True)))
    if run.backend in ("broadcast", "shm", "bytes"):
        faster = "cuda_ipc" if run.colocated else "nccl"
        out.append((f"the {faster} weight-sync transport instead of {run.backend} "
                    f"(actor_rollout_ref.rollout.checkpoint_engine.backend={faster})",
                    dataclasses.replace(run, backend=faster)))
    if run.offload_bytes:
        out.append(("keeping the roles resident (the *.megatron.*_offload keys off, if memory allows)",
                    dataclasses.replace(run, offload_bytes=0)))
    return out


def _largest_lever(run: _Run, base: StepTime) -> str:
    name, phase = max(base.phases.items(), key=lambda kv: kv[1].seconds)
    share = phase.seconds / sum(p.seconds for p in base.phases.values())
    head = f"{name} is {share:.0%} of the step ({phase.bound})"
    best = None
    for what, other in _levers(run):
        try:
            step = _evaluate(other).step_time_s
        except ValueError:
            continue
        if step < base.step_time_s * 0.99 and (best is None or step < best[1]):
            best = (what, step)
    if best is None:
        return f"{head}; none of the single changes tried shortens it"
    what, step = best
    return (f"{head}: {what} takes the step from {base.step_time_s:.0f} s to {step:.0f} s "
            f"(-{1 - step / base.step_time_s:.0%})")


# ----------------------------------------------------------------------------- output
def format_step_time(st: StepTime) -> str:
    """The report's step-time block: KV cache, one line per phase, the step, tokens/s/GPU and the lever."""
    kv = st.kv
    lines = [f"step time on {st.hardware} ({st.mode}; responses: mean {st.response_mean:.0f}, p99 "
             f"{st.response_p99:.0f} tokens):",
             f"  kv cache: {kv.bytes_per_token:,} B/token per GPU, {kv.free_bytes_per_gpu / GIB:.1f} GiB free per GPU -> "
             f"{kv.capacity_tokens:,} tokens per engine, {kv.fits_at_once} sequences at once, "
             f"{kv.sequences_per_engine} per engine, {kv.waves} wave{'s' if kv.waves > 1 else ''}"]
    total = sum(p.seconds for p in st.phases.values())
    for name, p in st.phases.items():
        lines.append(f"  {name:<16} {p.seconds:8.1f} s  {p.seconds / total:4.0%}  {p.bound:<16} {p.detail}")
    lines.append(f"  step {st.step_time_s:.1f} s, {st.tokens_per_s_per_gpu:,.0f} tokens/s/GPU over {st.gpus} GPUs")
    lines.append(f"  largest lever: {st.lever}")
    lines += [f"warning: {w}" for w in st.warnings]
    return "\n".join(lines)


def step_time_json(st: StepTime) -> dict:
    """``plan --json``'s step-time members: ``step_time_s``, ``tokens_per_s_per_gpu``, ``phases``
    (``{name: {"seconds", "bound"}}``), ``kv_cache``, ``lever``, ``hardware``."""
    return {"step_time_s": round(st.step_time_s, 3), "tokens_per_s_per_gpu": round(st.tokens_per_s_per_gpu, 1),
            "phases": {n: {"seconds": round(p.seconds, 3), "bound": p.bound} for n, p in st.phases.items()},
            "kv_cache": dataclasses.asdict(st.kv), "lever": st.lever, "hardware": st.hardware, "mode": st.mode,
            "step_time_warnings": list(st.warnings)}
