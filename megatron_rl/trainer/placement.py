"""Placement: which roles a run creates, what each one's ranks build, and where they run.

``role_specs(config, needs, ...)`` turns the typed run config and the run's needs
(``megatron_rl.algos.needs.RunNeeds``) into one ``WorkerSpec`` per Megatron role -- the only
place that maps config sections onto roles. ``Placement`` starts the worker groups and the
rollout worker with the resources of ``trainer.device``: on GPUs the roles and the rollout share
each device (verl's colocated workers); on CPU fractional CPUs let every rank of every role start
on a small machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_rl.algos.needs import RunNeeds
from megatron_rl.algos.rollout_correction import bypass_policy_loss_config
from megatron_rl.config import ActorConfig, RunConfig
from megatron_rl.config.lora_config import LoRAConfig, check_lora_fits
from megatron_rl.models.tiny import megatron_overrides
from megatron_rl.utils.engine_map import rollout_layout
from megatron_rl.workers.dispatch import ShardCache
from megatron_rl.workers.spec import WorkerSpec

__all__ = [
    "role_specs",
    "role_token_budgets",
    "RoleBudget",
    "actor_config",
    "check_token_budget",
    "Placement",
    "gpu_rollout_placement_error",
    "actor_lora",
    "check_lora_roles",
    "reference_in_actor",
    "lora_rollout_config",
]


def _with_horizon(role_config, total_steps: int):
    """``role_config`` whose LR schedule spans the run: ``optim.total_training_steps`` set to
    ``total_steps`` unless the config gives its own (verl's trainer does the same)."""
    if role_config.optim.total_training_steps > 0:
        return role_config
    return role_config.replace(optim=role_config.optim.replace(total_training_steps=total_steps))


def actor_config(config: RunConfig, total_steps: int):
    """The actor's config: the run's LR horizon; in rollout-correction bypass mode its policy loss
    becomes ``bypass_mode`` with the correction settings (verl's ``apply_bypass_mode``)."""
    actor, rc = _with_horizon(config.actor_rollout_ref.actor, total_steps), config.algorithm.rollout_correction
    if rc is None or not rc.bypass_mode:
        return actor
    return actor.replace(policy_loss=bypass_policy_loss_config(actor.policy_loss, rc))


def _model_overrides(megatron, source=None, inline=None) -> dict:
    """What a role's workers set on top of the checkpoint's architecture: an inline model's
    Megatron-side options, then the source's ``model.override_config``, then the role's
    ``megatron.dtype`` as ``params_dtype``."""
    if inline is None and source is not None:
        inline = source.config
    out = {}
    if inline is not None:
        out.update(megatron_overrides(inline))
    if source is not None:
        out.update(source.override_config)
    if megatron.dtype is not None:
        out["params_dtype"] = megatron.dtype
    return out


def _pick(value, default):
    """A role's own setting, or (None) the one it defaults to (verl's ``${oc.select:...}``)."""
    return default if value is None else value


def check_token_budget(key: str, budget: Optional[int], megatron, data) -> None:
    """ValueError, before any worker starts, for a token budget (``key``) that cannot hold the
    longest sample (``data.max_prompt_length + data.max_response_length``) or, packed, is not a
    multiple of the THD alignment (TP under sequence parallelism x ``2 * CP``). None: fixed-size
    micro-batches, nothing to check."""
    if budget is None:
        return
    longest = data.max_prompt_length + data.max_response_length
    if budget < longest:
        raise ValueError(
            f"{key}={budget} is smaller than the longest sample: data.max_prompt_length + "
            f"data.max_response_length = {data.max_prompt_length}+{data.max_response_length} = {longest}"
        )
    tp, cp = megatron.tensor_model_parallel_size, megatron.context_parallel_size
    align = (tp if megatron.sequence_parallel and tp > 1 else 1) * (2 * cp if cp > 1 else 1)
    if megatron.use_remove_padding and budget % align:
        raise ValueError(
            f"{key}={budget} is not a multiple of {align}, the packed-sequence alignment of its layout "
            f"(tensor_model_parallel_size={tp} with sequence_parallel x 2 * context_parallel_size={cp})"
        )


@dataclasses.dataclass(frozen=True)
class RoleBudget:
    """One role's micro-batch token budgets (None = fixed-size micro-batches) and where they are set."""

    train: Optional[int]
    """Tokens per training micro-batch (trainable roles)."""
    forward: Optional[int]
    """Tokens per forward micro-batch."""
    section: str
    """The role's config section (``actor_rollout_ref.actor`` ...)."""
    train_key: Optional[str]
    """The key of ``train`` in that section (None for frozen roles)."""
    forward_key: str
    """The key of ``forward`` in that section."""
    megatron: Any
    """The role's ``MegatronConfig`` (the layout the budgets must align with)."""

    def check(self, data: Any) -> None:
        """``check_token_budget`` for both budgets."""
        if self.train_key:
            check_token_budget(f"{self.section}.{self.train_key}", self.train, self.megatron, data)
        check_token_budget(f"{self.section}.{self.forward_key}", self.forward, self.megatron, data)


def role_token_budgets(config: RunConfig) -> dict[str, RoleBudget]:
    """Every role's ``RoleBudget``, with what a role leaves at None taken from what it defaults to
    (verl's interpolations): the reference's and teacher's forward budget from the actor's, the
    critic's ``use_dynamic_bsz`` from the actor's, the reward model's from the critic's. The one
    place these defaults are resolved (placement and the planner read it)."""
    arr, critic, rm = config.actor_rollout_ref, config.critic, config.reward.reward_model
    teacher, actor = config.distillation.teacher_model, arr.actor
    forward_dynamic = actor.forward_token_budget() is not None
    forward_budget = _pick(actor.log_prob_max_token_len_per_gpu, actor.ppo_max_token_len_per_gpu)
    critic_dynamic = _pick(critic.use_dynamic_bsz, actor.use_dynamic_bsz)
    critic_forward = _pick(critic.forward_max_token_len_per_gpu, critic.ppo_max_token_len_per_gpu)

    def when(dynamic, budget):
        return budget if dynamic else None

    lp = "log_prob_max_token_len_per_gpu"
    return {
        "actor": RoleBudget(
            actor.train_token_budget(),
            actor.forward_token_budget(),
            "actor_rollout_ref.actor",
            "ppo_max_token_len_per_gpu",
            lp,
            actor.megatron,
        ),
        "ref": RoleBudget(
            None,
            when(
                _pick(arr.ref.log_prob_use_dynamic_bsz, forward_dynamic),
                _pick(arr.ref.log_prob_max_token_len_per_gpu, forward_budget),
            ),
            "actor_rollout_ref.ref",
            None,
            lp,
            arr.ref.megatron,
        ),
        "critic": RoleBudget(
            when(critic_dynamic, critic.ppo_max_token_len_per_gpu),
            when(critic_dynamic, critic_forward),
            "critic",
            "ppo_max_token_len_per_gpu",
            "forward_max_token_len_per_gpu",
            critic.megatron,
        ),
        "reward": RoleBudget(
            None,
            when(_pick(rm.use_dynamic_bsz, critic_dynamic), _pick(rm.forward_max_token_len_per_gpu, critic_forward)),
            "reward.reward_model",
            None,
            "forward_max_token_len_per_gpu",
            rm.megatron,
        ),
        "teacher": RoleBudget(
            None,
            when(
                _pick(teacher.log_prob_use_dynamic_bsz, forward_dynamic),
                _pick(teacher.log_prob_max_token_len_per_gpu, forward_budget),
            ),
            "distillation.teacher_model",
            None,
            lp,
            teacher.megatron,
        ),
    }


def actor_lora(config: RunConfig) -> LoRAConfig:
    """The actor's LoRA: ``actor_rollout_ref.model.lora`` or verl's flat ``lora_rank`` keys (``rank: 0`` = off)."""
    return config.actor_rollout_ref.model.lora_config()


def reference_in_actor(config: RunConfig, needs: RunNeeds) -> bool:
    """True when the run's reference log-probs come from the actor with its adapters off (a LoRA actor:
    the reference is the base model, so no reference worker is built)."""
    return bool(needs.reference and actor_lora(config).enabled)


def lora_rollout_config(config: RunConfig):
    """``actor_rollout_ref.rollout``, with vLLM's LoRA switched on in ``engine_kwargs.vllm`` when the actor
    syncs only its adapters (``lora.merge: false``: ``vllm_lora_engine_kwargs``); otherwise unchanged."""
    from megatron_rl.config.lora_config import vllm_lora_engine_kwargs

    rollout_cfg = config.actor_rollout_ref.rollout
    lora_kwargs = vllm_lora_engine_kwargs(actor_lora(config))
    if not lora_kwargs:
        return rollout_cfg
    engine_kwargs = dict(rollout_cfg.engine_kwargs)
    engine_kwargs["vllm"] = {**lora_kwargs, **dict(engine_kwargs.get("vllm") or {})}  # the user's own win
    return dataclasses.replace(rollout_cfg, engine_kwargs=engine_kwargs)


def _warn_sync_keys_unused(sync) -> None:
    """With ``lora.merge: false`` the adapters travel once through Ray's object store, not through the
    weight-sync transport: its backend and bucket size set away from their defaults warn by name
    (``InertKeyWarning``). ``shm_dir`` still acts: the engine writes the adapter's PEFT directory there
    (``VLLMRollout.load_lora_tensors``)."""
    from megatron_rl.config.compat import warn_once
    from megatron_rl.config.rollout import WeightSyncConfig

    default = WeightSyncConfig()
    for name in ("backend", "update_weights_bucket_megabytes"):
        value = getattr(sync, name)
        if value != getattr(default, name):
            warn_once(
                f"actor_rollout_ref.rollout.checkpoint_engine.{name}={value!r} has no effect with "
                "actor_rollout_ref.model.lora.merge=false: the adapters reach vLLM's LoRA through Ray's "
                "object store, not through the weight-sync transport"
            )


def check_lora_roles(config: RunConfig, needs: RunNeeds, model_path: str) -> LoRAConfig:
    """The actor's ``LoRAConfig``, checked before any worker starts: a rank larger than a targeted linear's
    dimensions (``check_lora_fits`` on the actor's architecture at ``model_path``) and a critic that would
    run with LoRA (``critic.model`` left out copies the actor's model, LoRA settings included) are
    ``ValueError`` naming the key; so are a ``lora.adapter_path`` whose ``adapter_config.json`` does not match
    the LoRA settings and, with ``lora.merge: false`` (adapter-only sync), a rank vLLM cannot hold, FP8
    rollout quantization, partial rollouts and adapters inside MoE experts."""
    lora = actor_lora(config)
    if needs.critic:
        critic_lora = config.critic.model.lora_config()
        if critic_lora.enabled:
            key = "critic.model.lora_rank" if config.critic.model.lora_rank else "critic.model.lora.rank"
            raise ValueError(
                f"{key}={critic_lora.rank} is refused: LoRA on the critic is not built (its value head "
                "would stay frozen at its initialisation); a critic without its own model section "
                "copies actor_rollout_ref.model's LoRA settings. Allowed: 0 (set critic.model.lora.rank=0: "
                "the critic trains every parameter)"
            )
    if lora.enabled:
        from megatron_rl.models.families import get_family

        model_cfg = get_family(model_path).model_config(
            model_path, **_model_overrides(config.actor_rollout_ref.actor.megatron, config.actor_rollout_ref.model)
        )
        check_lora_fits(lora, model_cfg, "actor_rollout_ref.model.lora")
        if lora.adapter_path:  # a PEFT adapter to start from: its config must be these settings
            from megatron_rl.models.peft import read_peft_adapter_config

            key = (
                "actor_rollout_ref.model.lora_adapter_path"
                if config.actor_rollout_ref.model.lora_rank
                else "actor_rollout_ref.model.lora.adapter_path"
            )
            read_peft_adapter_config(lora.adapter_path, lora, key)
        if not lora.merge:  # adapter-only sync into vLLM's LoRA: what it cannot do yet is refused here
            from megatron_rl.config.lora_config import vllm_lora_engine_kwargs

            vllm_lora_engine_kwargs(lora)  # a rank vLLM cannot hold
            rollout_cfg = config.actor_rollout_ref.rollout
            refused = {
                "actor_rollout_ref.rollout.quantization": (rollout_cfg.quantization, None),
                "trainer.v1.partial_rollout": (config.trainer.v1.partial_rollout, False),
            }
            for key, (value, allowed) in refused.items():
                if value != allowed:
                    raise ValueError(
                        f"{key}={value!r} with actor_rollout_ref.model.lora.merge=false is not built "
                        f"(adapter-only sync into vLLM's LoRA); allowed: {allowed!r}, or set "
                        "actor_rollout_ref.model.lora.merge=true"
                    )
            _warn_sync_keys_unused(rollout_cfg.checkpoint_engine)
            experts = (
                model_cfg.is_moe
                and "experts" not in lora.exclude_modules
                and any(t in lora.target_modules for t in ("linear_fc1", "linear_fc2"))
            )
            if experts:
                raise ValueError(
                    f"actor_rollout_ref.model.lora.target_modules={lora.target_modules!r} adapts MoE "
                    "experts, whose adapter-only sync (lora.merge=false) is not built; allowed: "
                    "exclude_modules=[experts], or set actor_rollout_ref.model.lora.merge=true"
                )
    return lora


def role_specs(
    config: RunConfig, needs: RunNeeds, *, model_path: str, total_steps: int, teacher_path: Optional[str] = None
) -> dict[str, WorkerSpec]:
    """``{role: WorkerSpec}`` for the roles ``needs`` asks for (``actor`` always). ``model_path`` is the
    policy's HF directory (for an inline model, the materialised one); ``total_steps`` the LR horizon.
    Each role's config carries its token budgets (``role_token_budgets``, checked here, before any
    worker starts). A LoRA actor (``check_lora_roles``) gets its ``LoRAConfig`` and no reference worker
    is built: its reference is itself with the adapters off (``reference_in_actor``)."""
    arr = config.actor_rollout_ref
    lora = check_lora_roles(config, needs, model_path)
    if lora.enabled:
        needs = dataclasses.replace(needs, reference=False)
    budgets = role_token_budgets(config)
    for role, runs in (
        ("actor", True),
        ("ref", needs.reference),
        ("critic", needs.critic),
        ("reward", needs.reward_model),
        ("teacher", needs.teacher),
    ):
        if runs:
            budgets[role].check(config.data)

    def lm_forward(role_config, role):
        fwd = budgets[role].forward
        return role_config.replace(
            log_prob_use_dynamic_bsz=fwd is not None,
            log_prob_max_token_len_per_gpu=fwd or role_config.ppo_max_token_len_per_gpu,
        )

    specs = {
        "actor": WorkerSpec(
            "actor",
            arr.actor.megatron,
            actor_config(config, total_steps),
            hf_dir=model_path,
            model_overrides=_model_overrides(arr.actor.megatron, arr.model),
            lora=lora if lora.enabled else None,
        )
    }
    if needs.reference:
        specs["ref"] = WorkerSpec(
            "ref",
            arr.ref.megatron,
            lm_forward(arr.actor, "ref"),
            hf_dir=model_path,
            model_overrides=_model_overrides(arr.ref.megatron, arr.model),
        )
    if needs.critic:
        critic = config.critic
        if critic.model.path is None and (
            critic.model.config != arr.model.config or critic.model.family != arr.model.family
        ):
            raise ValueError(
                "critic.model: an inline critic is the policy's architecture (its value head on the "
                "materialised policy); set critic.model.path for another critic model"
            )
        critic_config = _with_horizon(critic, total_steps).replace(use_dynamic_bsz=budgets["critic"].train is not None)
        specs["critic"] = WorkerSpec(
            "critic",
            critic.megatron,
            critic_config,
            hf_dir=critic.model.path or model_path,
            model_overrides=_model_overrides(critic.megatron, critic.model),
        )
    if needs.reward_model:
        rm = config.reward.reward_model
        fwd = budgets["reward"].forward
        rm_config = rm.replace(use_dynamic_bsz=fwd is not None, forward_max_token_len_per_gpu=fwd)
        specs["reward"] = WorkerSpec(
            "reward", rm.megatron, rm_config, hf_dir=rm.model_path, model_overrides=_model_overrides(rm.megatron)
        )
    if needs.teacher:
        teacher = config.distillation.teacher_model
        micro = teacher.log_prob_micro_batch_size_per_gpu or arr.actor.ppo_micro_batch_size_per_gpu
        teacher_config = lm_forward(
            ActorConfig(ppo_micro_batch_size_per_gpu=micro, logprob_chunk_size=arr.actor.logprob_chunk_size), "teacher"
        )
        specs["teacher"] = WorkerSpec(
            "teacher",
            teacher.megatron,
            teacher_config,
            hf_dir=teacher_path,
            model_overrides=_model_overrides(teacher.megatron, inline=teacher.config),
        )
    return specs


def gpu_rollout_placement_error(config: RunConfig) -> Optional[str]:
    """Why the rollout's engines cannot be placed (``megatron_rl.utils.engine_map.rollout_layout``: an
    engine size that does not divide the rollout's GPUs, or stays neither inside a node nor on whole
    nodes; EP not TP x DP; a ``num_replicas`` the GPUs do not give), or None."""
    try:
        rollout_layout(config)
    except ValueError as err:
        return str(err)
    return None


class Placement:
    """The worker groups of a run (``groups[role]``) and its rollout engines, started together.

    ``router`` (``megatron_rl.workers.router.RolloutRouter``) routes generation over every engine;
    ``replicas`` are the engines as started (``RolloutReplica``: actor, nodes, GPUs); ``rollout`` is
    replica 0's actor (callers that talk to one engine). ``engines`` is the engine map
    (``megatron_rl.utils.engine_map.rollout_layout``), the one ``megatron-rl plan`` prints.

    On GPUs every colocated role shares one bundle per GPU (``GpuBundles``): rank ``g`` of each role
    holds a ``1 / (roles + 1)`` share of GPU ``g`` and engine ``r``'s vLLM sees exactly its GPUs (the
    engine map's ``[r*E, (r+1)*E)``). With a sleeping schedule (``free_cache_engine`` on GPUs) the
    engines start *before* the roles load their models and are put to sleep at once (verl's order:
    vLLM refuses to start when less than its ``gpu_memory_utilization`` share is free), and
    ``started_asleep`` tells the phase runner so. A separate rollout gets a pool of its own bundles.
    On CPU fractional CPUs let every rank of every role and every engine start on a small machine.

    ``role_worker_cls`` / ``rollout_worker_cls`` / ``headless_cls`` replace the actors (the placement
    tests start probes that report their node and devices).
    """

    def __init__(
        self,
        config: RunConfig,
        specs: dict[str, WorkerSpec],
        *,
        model_path: str,
        role_worker_cls: Optional[type] = None,
        rollout_worker_cls: Optional[type] = None,
        headless_cls: Optional[type] = None,
    ):
        import ray

        from megatron_rl.workers.group import GpuBundles, MegatronWorkerGroup
        from megatron_rl.workers.rollout_worker import create_rollout_replicas, wait_started
        from megatron_rl.workers.router import RolloutRouter

        world, rollout_cfg, trainer = config.trainer.world_size, lora_rollout_config(config), config.trainer
        self.engines = rollout_layout(config)  # ValueError by key before any worker starts
        separate = not self.engines.colocated
        cuda = trainer.device == "cuda"
        self.shards = ShardCache()
        self.groups: dict[str, MegatronWorkerGroup] = {}
        self.replicas: list = []
        self.bundles = self.rollout_bundles = None
        self.rollout = self.router = None
        self.started_asleep = False
        partial = config.trainer.v1.partial_rollout
        try:
            if cuda:
                share = 1.0 / (len(specs) + (0 if separate else 1))
                self.bundles = GpuBundles(
                    trainer.nnodes, trainer.n_gpus_per_node, num_cpus_per_bundle=len(specs) + 1, name="trainer_gpus_pg"
                )
                engine_bundles = self.bundles
                if separate:
                    self.rollout_bundles = GpuBundles(
                        rollout_cfg.nnodes, rollout_cfg.n_gpus_per_node, num_cpus_per_bundle=1, name="rollout_gpus_pg"
                    )
                    engine_bundles = self.rollout_bundles
                self.replicas = create_rollout_replicas(
                    model_path,
                    rollout_cfg,
                    self.engines,
                    bundles=engine_bundles,
                    partial_rollout=partial,
                    worker_cls=rollout_worker_cls,
                    headless_cls=headless_cls,
                )
                if not separate and rollout_cfg.free_cache_engine:
                    ray.get([r.actor.sleep.remote(1) for r in self.replicas])  # the roles load into the freed memory
                    self.started_asleep = True
                for role, spec in specs.items():
                    self.groups[role] = MegatronWorkerGroup(
                        spec,
                        world,
                        num_cpus_per_worker=1.0,
                        num_gpus_per_worker=share,
                        shards=self.shards,
                        bundles=self.bundles,
                        worker_cls=role_worker_cls,
                    )
            else:
                cpus, rollout_cpus = self._cpu_shares(
                    ray.available_resources().get("CPU", 1), len(specs), world, rollout_cfg
                )
                # The engines start while the roles do (vLLM's start-up is the longest; nothing orders
                # them on CPU): created first, waited for last.
                self.replicas = create_rollout_replicas(
                    model_path,
                    rollout_cfg,
                    self.engines,
                    num_cpus=rollout_cpus,
                    partial_rollout=partial,
                    worker_cls=rollout_worker_cls,
                    wait=False,
                )
                for role, spec in specs.items():
                    self.groups[role] = MegatronWorkerGroup(
                        spec, world, num_cpus_per_worker=cpus, shards=self.shards, worker_cls=role_worker_cls
                    )
                wait_started(self.replicas)
            self.rollout = self.replicas[0].actor
            self.router = RolloutRouter(self.replicas, response_length=rollout_cfg.response_length)
        except BaseException:
            self.shutdown()
            raise

    def _cpu_shares(self, available: float, num_roles: int, world: int, rollout_cfg) -> tuple[float, float]:
        """``(CPUs per rank, CPUs per engine)`` on CPU: fractions so that every rank of every role and every
        engine start; a separate rollout keeps ``n_gpus_per_node`` CPUs for its engines."""
        num_engines = self.engines.replicas
        if rollout_cfg.nnodes == 0:
            share = max(0.01, int(100 * available / (num_roles * world + num_engines)) / 100)
            return share, share
        own = float(rollout_cfg.nnodes * rollout_cfg.n_gpus_per_node)
        left = available - own
        if left <= 0:
            raise ValueError(
                f"actor_rollout_ref.rollout.n_gpus_per_node={rollout_cfg.n_gpus_per_node} CPUs for "
                f"the separate rollout leave none of Ray's {available} for the trainer's roles"
            )
        return max(0.01, int(100 * left / (num_roles * world)) / 100), own / num_engines

    def get(self, role: str):
        """The group of ``role``, or None when the run has none."""
        return self.groups.get(role)

    def shutdown(self) -> None:
        """Stop every worker and free the placement groups."""
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
        for replica in getattr(self, "replicas", []):
            replica.stop()
        self.replicas, self.rollout, self.router = [], None, None
        for bundles in (getattr(self, "bundles", None), getattr(self, "rollout_bundles", None)):
            if bundles is not None:
                bundles.shutdown()
        self.bundles = self.rollout_bundles = None
