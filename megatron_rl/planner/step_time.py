"""``estimate_step_time``: how long one training step takes, phase by phase, before anything runs.

One estimate per phase of the trainer's own ``StepSchedule`` (``megatron_rl.trainer.schedule``, the
phases the memory plan sums), each with the bound that decides it, from the published peaks of
``--hardware`` (``megatron_rl.planner.hardware``) and the named achievable fractions there:

* **gen** (memory bandwidth): prefill is compute (``2 x active params`` per prompt token, prompts
  shared by their ``rollout.n`` samples through prefix caching); every decode step of an engine reads
  its weight shard -- only the experts its running tokens touch, ``E (1 - (1 - k/E)^B)`` of ``E`` --
  and the KV cache of its running sequences, at ``DECODE_HBM_EFFICIENCY`` of HBM bandwidth, plus two
  tensor-parallel all-reduces per layer and the engine's fixed ``VLLM_DECODE_STEP_OVERHEAD_S`` (the host's
  work: under async scheduling, vLLM 0.32's default, it overlaps the GPU's step, ``max(gpu, overhead)``).
  The KV cache holds what ``gpu_memory_utilization`` leaves after the weights and ``VLLM_NON_KV_GIB``. A batch
  larger than the sequences of ``prompt + p99`` tokens it holds at once runs in waves (a warning says so);
  blocks are taken as sequences grow, so ``capacity / (prompt + mean)`` run at once on average and an
  engine's ``S`` sequences take ``S / running x mean`` decode steps plus ``p99 - mean`` for the last to
  finish its longest (``partial_rollout`` carries unfinished ones over and cuts that tail). A rollout PP > 1
  splits the layers as vLLM does (``vllm_stage_layers``), the embedding on the first stage and the head on the last; the
  stages decode different micro-batches at once, so the slowest stage's step sets the pace, and every
  stage gets as many KV blocks as the tightest worker holds.
* **log-prob and update passes** (compute): FLOPs per token ``2 x`` the active dense parameters
  (attention projections, shared experts, dense MLPs, the head; the embedding is a lookup) at
  ``DENSE_GEMM_EFFICIENCY``, ``2 x top-k`` routed experts at ``GROUPED_GEMM_EFFICIENCY``, causal
  attention ``2 x layers x heads x head_dim x sequence`` at ``ATTENTION_EFFICIENCY``; the head only on the
  response positions (the engine projects those alone). Plus the element-wise kernels between the GEMMs
  (norms, rotary embedding, attention's io, residual adds, SwiGLU, MoE permutes, the log-softmax;
  ``activation_traffic``: TE's fused kernels on a GPU, the local spec's torch operators on a CPU) at
  ``HBM_COPY_EFFICIENCY`` of the memory bandwidth, added, not overlapped. An update is 3
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
* **LoRA** (``lora.rank > 0``, ``megatron_rl.planner.lora_sizes``): the frozen base computes no weight gradients
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

Modules: ``step_run`` (the run's figures from the config, ``PhaseTime``, ``KVCache``), ``generation``
(``gen``, the KV cache), ``megatron_passes`` (log-prob and update passes), ``transfer_time`` (sync and offload);
this one composes them, names the largest lever and formats the report.

Calibration (``CALIBRATION``): NeMo-RL v0.6's published GRPO run on Qwen3-30B-A3B; only
``DECODE_HBM_EFFICIENCY`` is fitted to it (refit with ``VLLM_DECODE_STEP_OVERHEAD_S``, read from vLLM's
published measurements, and async scheduling in place; its docstring gives the fit). Figures read, not fitted:
the hardware table's peaks and every other fraction in ``hardware.py`` (each says where it came from).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

from megatron_rl.planner.generation import (
    VLLM_DECODE_STEP_OVERHEAD_S,
    VLLM_NON_KV_GIB,
    generation,
    kv_bytes_per_token,
    vllm_stage_layers,
)
from megatron_rl.planner.hardware import Hardware, get_hardware
from megatron_rl.planner.megatron_passes import megatron_pass
from megatron_rl.planner.memory import GIB
from megatron_rl.planner.step_run import KVCache, PhaseTime, Run, build_run
from megatron_rl.planner.transfer_time import VLLM_LOAD_S_PER_TENSOR, offload, weight_sync

__all__ = [
    "PhaseTime",
    "KVCache",
    "StepTime",
    "estimate_step_time",
    "format_step_time",
    "step_time_json",
    "kv_bytes_per_token",
    "vllm_stage_layers",
    "CALIBRATION",
    "VLLM_NON_KV_GIB",
    "VLLM_LOAD_S_PER_TENSOR",
    "VLLM_DECODE_STEP_OVERHEAD_S",
]

CALIBRATION = {
    "source": "NeMo-RL v0.6 performance summary (docs.nvidia.com/nemo/rl/0.6.0/about/performance-summary.html), "
    "recipe examples/configs/recipes/llm/performance/grpo-qwen3-30ba3b-4n8g.yaml",
    "published": {"step_time_s": 192.0, "tokens_per_s_per_gpu": 1102.0},
    "recipe": "gpu/qwen3_30b_a3b_grpo",
    # 4 x 8 H100, colocated, on-policy; 64 prompts x 32 = 2,048 generations, training batches of 512;
    # training TP=1 PP=1 EP=8 without recompute, generation TP=2 at gpu_memory_utilization 0.6;
    # sequences of at most 4,096 tokens (a ~128-token prompt), ~3,200 generated tokens on average.
    "overrides": [
        "trainer.nnodes=4",
        "trainer.n_gpus_per_node=8",
        "data.train_batch_size=64",
        "actor_rollout_ref.rollout.n=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "data.max_prompt_length=128",
        "data.max_response_length=3968",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8",
        "actor_rollout_ref.actor.megatron.sequence_parallel=false",
        "actor_rollout_ref.actor.megatron.override_transformer_config={}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cuda_ipc",
    ],
    "response_length_mean": 3200,
}
"""The one published run the constants are calibrated against (a test pins the model within 20 %)."""


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
    overlap: bool = False
    """``separate_async`` with a staleness bound: generation overlaps the trainer's passes (the step is the
    slower of the two plus the sync; the trainer waits ``max(gen - train, 0)`` for its batch)."""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Prompt + response tokens of the step per second and GPU (NeMo-RL's definition)."""
        return self.tokens_per_step / (self.step_time_s * self.gpus)


def _evaluate(run: Run) -> StepTime:
    gen_run = run
    if run.generation_prompts and run.generation_prompts != run.prompts:  # a round samples data.gen_batch_size
        per_prompt = run.sequences // run.prompts
        gen_run = dataclasses.replace(
            run,
            prompts=run.generation_prompts,
            sequences=run.generation_prompts * per_prompt,
            extra_generations=run.generation_prompts if run.extra_generations else 0,
        )
    gen, kv, warnings = generation(gen_run)
    call = run.hw.call_overhead_s or 0.0  # the trainer's fixed work of one call to the workers (CPU row)
    if call:  # one generation call per step, and one for ReMax's greedy baseline
        gen = dataclasses.replace(gen, seconds=gen.seconds + call * (2 if run.extra_generations else 1))
    if run.generation_rounds != 1:  # DAPO's dynamic sampling: each round generates the whole batch again
        gen = dataclasses.replace(
            gen,
            seconds=gen.seconds * run.generation_rounds,
            detail=f"{run.generation_rounds:g} rounds of: {gen.detail}",
        )
    phases = {"gen": gen}
    for p in run.passes:
        phases[p.phase] = megatron_pass(run, p)
    phases["update_weights"] = weight_sync(run)
    if call:
        phases["update_weights"] = dataclasses.replace(
            phases["update_weights"], seconds=phases["update_weights"].seconds + call
        )
    phases["offload"] = offload(run)
    total = sum(p.seconds for p in phases.values())
    if run.overlap:
        train = total - gen.seconds - phases["update_weights"].seconds
        step = max(gen.seconds, train) + phases["update_weights"].seconds
    else:
        step = total
    gpus = run.world + (0 if run.colocated else run.rollout_gpus)
    return StepTime(
        hardware=run.hw.name,
        mode=run.mode,
        phases=phases,
        step_time_s=step,
        tokens_per_step=run.sequences * (run.prompt_length + run.response_mean),
        gpus=gpus,
        kv=kv,
        response_mean=run.response_mean,
        response_p99=run.response_p99,
        warnings=warnings,
        overlap=run.overlap,
    )


def estimate_step_time(
    config: Any,
    plan: Any,
    *,
    hardware: Union[str, Hardware] = "H100",
    response_length_mean: Optional[float] = None,
    response_length_p99: Optional[float] = None,
    prompt_length_mean: Optional[float] = None,
    generation_rounds: float = 1.0,
) -> StepTime:
    """The step time of ``config`` (a ``RunConfig``) on ``hardware``, per phase of its ``StepSchedule``,
    from its ``plan`` (``plan_run``: the model, the engine map, each role's bytes). ``hardware`` is a
    ``--hardware`` name (a GPU run) or a ``Hardware`` row -- for a CPU run (``trainer.device=cpu``) the one
    ``cpu_row.cpu_hardware`` measures on the host, whose shares ``tools/bench_phase_share.py`` checks
    against a run's ``timing_s/*``. Response lengths default to ``data.max_response_length``, the prompt's to
    ``data.max_prompt_length``; ``ValueError`` names the option for a bad one, an unknown GPU or a row of
    the other device."""
    hw = hardware if isinstance(hardware, Hardware) else get_hardware(hardware)
    if plan.device != hw.device:
        if plan.device == "cpu":
            raise ValueError(
                f"--hardware={hw.name} is a GPU but this run is on CPU (trainer.device=cpu); a CPU run's step "
                "time needs the host's measured row (megatron_rl.planner.cpu_row.cpu_hardware)"
            )
        raise ValueError(f"the {hw.name} row is for trainer.device={hw.device} runs; this run is on {plan.device}")
    if not (math.isfinite(generation_rounds) and generation_rounds >= 1):
        raise ValueError(f"--generation-rounds={generation_rounds} must be a number of rounds >= 1")
    run = build_run(config, plan, hw, response_length_mean, response_length_p99, prompt_length_mean)
    run = dataclasses.replace(run, generation_rounds=float(generation_rounds))
    result = _evaluate(run)
    result.lever = _largest_lever(run, result)
    return result


# ----------------------------------------------------------------------------- the largest lever
def _levers(run: Run) -> list[tuple[str, Run]]:
    """Single changes worth trying, each as the modified run (only the valid ones)."""
    out = []
    m, tp = run.model, run.rollout_tp
    heads = m.num_attention_heads
    for new in (tp * 2, tp // 2):
        gpus = new * run.rollout_pp * run.rollout_dp
        if new < 1 or new == tp or new > run.gpus_per_node or heads % new or run.rollout_gpus % gpus:
            continue
        out.append(
            (
                f"a rollout TP of {new} instead of {tp} ({run.rollout_gpus // gpus} engines instead of "
                f"{run.rollout_gpus // (tp * run.rollout_pp * run.rollout_dp)}; "
                "actor_rollout_ref.rollout.tensor_model_parallel_size)",
                dataclasses.replace(run, rollout_tp=new, rollout_ep=new * run.rollout_dp if run.rollout_ep > 1 else 1),
            )
        )
    if run.quantization is None and run.hw.fp8_flops is not None:
        out.append(
            (
                "fp8 rollout weights (actor_rollout_ref.rollout.quantization=fp8)",
                dataclasses.replace(run, quantization="fp8"),
            )
        )
    if run.kv_dtype_bytes == 2:
        out.append(
            (
                "an fp8 KV cache (actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8)",
                dataclasses.replace(run, kv_dtype_bytes=1),
            )
        )
    if not run.partial_rollout and run.response_p99 > 1.1 * run.response_mean:
        out.append(
            (
                f"cutting the tail (partial rollouts or over-sampling: decode to the mean {run.response_mean:.0f} "
                f"instead of the p99 {run.response_p99:.0f} tokens)",
                dataclasses.replace(run, partial_rollout=True),
            )
        )
    if run.backend in ("broadcast", "shm", "bytes"):
        faster = "cuda_ipc" if run.colocated else "nccl"
        out.append(
            (
                f"the {faster} weight-sync transport instead of {run.backend} "
                f"(actor_rollout_ref.rollout.checkpoint_engine.backend={faster})",
                dataclasses.replace(run, backend=faster),
            )
        )
    if run.offload_bytes:
        out.append(
            (
                "keeping the roles resident (the *.megatron.*_offload keys off, if memory allows)",
                dataclasses.replace(run, offload_bytes=0),
            )
        )
    return out


def _largest_lever(run: Run, base: StepTime) -> str:
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
    return (
        f"{head}: {what} takes the step from {base.step_time_s:.0f} s to {step:.0f} s "
        f"(-{1 - step / base.step_time_s:.0%})"
    )


# ----------------------------------------------------------------------------- output
def format_step_time(st: StepTime) -> str:
    """The report's step-time block: KV cache, one line per phase, the step, tokens/s/GPU and the lever."""
    kv = st.kv
    lines = [
        f"step time on {st.hardware} ({st.mode}; responses: mean {st.response_mean:.0f}, p99 "
        f"{st.response_p99:.0f} tokens):",
        f"  kv cache: {kv.bytes_per_token:,} B/token per GPU, {kv.free_bytes_per_gpu / GIB:.1f} GiB free per GPU -> "
        f"{kv.capacity_tokens:,} tokens per engine, {kv.fits_at_once} sequences at once, "
        f"{kv.sequences_per_engine} per engine, {kv.waves} wave{'s' if kv.waves > 1 else ''}",
    ]
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
    return {
        "step_time_s": round(st.step_time_s, 3),
        "tokens_per_s_per_gpu": round(st.tokens_per_s_per_gpu, 1),
        "phases": {n: {"seconds": round(p.seconds, 3), "bound": p.bound} for n, p in st.phases.items()},
        "kv_cache": dataclasses.asdict(st.kv),
        "lever": st.lever,
        "hardware": st.hardware,
        "mode": st.mode,
        "step_time_warnings": list(st.warnings),
    }
