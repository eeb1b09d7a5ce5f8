"""The configuration of a whole training run: one typed tree with verl's layout and key names.

    RunConfig
      data                     DataConfig            prompts, lengths, batch size
      actor_rollout_ref
        model                  ModelSourceConfig     an HF checkpoint dir, or an inline ModelConfig
        actor                  ActorConfig           loss, batch sizes, optimizer, ``megatron`` layout
        rollout                RolloutConfig         vLLM sampling and weight sync
        ref                    RefConfig             reference policy layout + offload
      critic                   CriticConfig          value loss, optimizer, model, ``megatron`` layout
      reward                   RewardConfig          rule reward / reward model, overlong shaping
      algorithm                AlgoConfig            estimator, KL-in-reward, DAPO filtering
      trainer                  TrainerConfig         steps, logging, checkpoints, cluster
      distillation             DistillationConfig    on-policy distillation teacher + loss

Each section validates its own fields in ``__post_init__``; ``RunConfig.__post_init__``
checks what spans sections (batch sizes against the cluster, lengths that must agree) and names
every field and number in its ``ValueError``. What depends on the algorithm -- which roles run,
so which layouts and batch sizes must fit -- is checked by ``check_roles``, called with the
needs that ``megatron_rl.algos.needs.resolve_run`` reads off the registries (this layer imports
nothing above it).
``RunConfig.from_dict`` (and ``megatron_rl.config.loader.load_config`` on top of it)
also fills verl's derived keys -- ``actor.rollout_n`` from ``rollout.n``,
``rollout.prompt_length`` from ``data.max_prompt_length``, the reference layout from the
actor's, ... -- wherever the input leaves them out, as verl's ``${oc.select:...}`` do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Mapping, Optional

from megatron_rl.config import read_tracking
from megatron_rl.config.actor_rollout_ref import ActorConfig, ActorRolloutRefConfig
from megatron_rl.config.algorithm import AlgoConfig
from megatron_rl.config.base_config import BaseConfig
from megatron_rl.config.critic import CriticConfig
from megatron_rl.config.data import DataConfig
from megatron_rl.config.distillation import DistillationConfig
from megatron_rl.config.layout import PARALLEL_KEYS, MegatronConfig, check_distributed_optimizer
from megatron_rl.config.model import ModelSourceConfig
from megatron_rl.config.reward import RewardConfig
from megatron_rl.config.schema import build_config, fill_derived
from megatron_rl.config.trainer import TrainerConfig
from megatron_rl.config.v1 import check_async_run
from megatron_rl.config.verl_keys import warn_inert_keys
from parallel.config import uneven_pipeline_fields

__all__ = ["RunConfig", "DERIVED_KEYS"]
# What the reference copies from the actor's ``megatron`` when left out (verl's ref interpolations).
_REF_FROM_ACTOR = PARALLEL_KEYS + ("sequence_parallel", "param_offload", "dtype", "seed", "override_transformer_config")

DERIVED_KEYS: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.rollout_n", "actor_rollout_ref.rollout.n"),
    ("critic.rollout_n", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length"),
    ("actor_rollout_ref.rollout.response_length", "data.max_response_length"),
    ("critic.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("critic.ppo_epochs", "actor_rollout_ref.actor.ppo_epochs"),
    ("critic.shuffle", "actor_rollout_ref.actor.shuffle"),
    ("critic.loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode"),
    ("critic.model", "actor_rollout_ref.model"),
    ("reward.reward_kwargs.max_resp_len", "data.max_response_length"),
    *((f"actor_rollout_ref.ref.megatron.{k}", f"actor_rollout_ref.actor.megatron.{k}") for k in _REF_FROM_ACTOR),
)
"""``(target, source)``: ``from_dict`` copies ``source`` to ``target`` when the input lacks ``target``
(verl's interpolations, e.g. ``rollout_n: ${oc.select:actor_rollout_ref.rollout.n,1}``)."""


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class RunConfig(BaseConfig):
    """Everything a training run needs, with verl's top-level layout."""

    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and batch."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """Policy model, actor, rollout, reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (used when ``needs_critic``)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    algorithm: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantage estimation, KL-in-reward, DAPO filtering, rollout correction."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run control and cluster."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, path: str = "", warn: bool = True) -> "RunConfig":
        """Build from a nested mapping (YAML, ``DictConfig``): derived keys are filled where
        missing, unknown keys are errors with the nearest valid keys, leaf types are checked.
        ``warn=False`` skips the scan for inert keys (``InertKeyWarning``), for callers that build many
        variants of one config and show no warnings (the layout hint's search)."""
        config = build_config(cls, fill_derived(data or {}, cls, DERIVED_KEYS), path=path)
        read_tracking.tag_paths(config)
        if warn:
            warn_inert_keys(config)
        return config

    # -- cross-section validation -------------------------------------------------------------
    def __post_init__(self) -> None:
        arr = self.actor_rollout_ref
        rollout = arr.rollout
        # The run's layout decides the optimizer's sharding; a section built on its own (the engine's
        # ActorConfig) is given it separately, so this is checked here, not in the section.
        check_distributed_optimizer("actor_rollout_ref.actor", arr.actor.megatron, arr.actor.optim)
        check_distributed_optimizer("critic", self.critic.megatron, self.critic.optim)
        if self.data.task is None and self.data.train_files is None:
            raise ValueError("data: set data.train_files (parquet/jsonl paths) or data.task (a built-in task name)")
        self._check_lengths(arr.actor.rollout_n, "actor_rollout_ref.actor.rollout_n")
        fg = self.algorithm.filter_groups
        if fg is not None and fg.enable:
            if not fg.metric:
                raise ValueError(
                    "algorithm.filter_groups.enable=True needs algorithm.filter_groups.metric (e.g. 'acc' or 'score')"
                )
            if rollout.n < 2:
                raise ValueError(
                    f"algorithm.filter_groups.enable=True needs actor_rollout_ref.rollout.n >= 2 "
                    f"(a group of one is never informative), got {rollout.n}"
                )
        _check_source("actor_rollout_ref.model", arr.model)
        context = self.data.max_prompt_length + self.data.max_response_length
        for where, model in (
            ("actor_rollout_ref.model", arr.model.config),
            ("distillation.teacher_model", self.distillation.teacher_model.config),
        ):
            if model is not None and context > model.max_position_embeddings:
                raise ValueError(
                    f"data.max_prompt_length + data.max_response_length = {context} exceeds "
                    f"{where}.config.max_position_embeddings={model.max_position_embeddings}"
                )
        world = self.trainer.world_size
        self._check_batch("actor_rollout_ref.actor", arr.actor, arr.model, world)
        rollout_tp = rollout.tensor_model_parallel_size
        if world % rollout_tp:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} does not divide "
                f"world_size={world} (trainer.nnodes * trainer.n_gpus_per_node = "
                f"{self.trainer.nnodes}*{self.trainer.n_gpus_per_node})"
            )
        check_async_run(self)  # trainer.v1 modes against placement, batch sizes and run length
        self.freeze()  # built: every section immutable from here (BaseConfig.with_values derives a copy)

    def check_roles(self, *, critic: bool, reference: bool, reward_model: bool, teacher: bool) -> None:
        """Check what the roles that run need of the configuration: their models, layouts and batch
        sizes (``ValueError`` naming the fields and numbers). The caller decides which roles run
        (``megatron_rl.algos.needs.resolve_run``)."""
        arr, world = self.actor_rollout_ref, self.trainer.world_size
        if critic:
            self._check_lengths(self.critic.rollout_n, "critic.rollout_n")
            _check_source("critic.model", self.critic.model)
            self._check_batch("critic", self.critic, self.critic.model, world)
        if teacher:
            source = self.distillation.teacher_model
            _check_source("distillation.teacher_model", source, path_key="model_path", family_required=False)
            student = arr.model.config
            if student is not None and source.config is not None and student.vocab_size != source.config.vocab_size:
                raise ValueError(
                    f"distillation.teacher_model.config.vocab_size={source.config.vocab_size} must equal "
                    f"actor_rollout_ref.model.config.vocab_size={student.vocab_size} "
                    "(teacher and student share the tokenizer)"
                )
        if reference:
            self._check_forward_only("actor_rollout_ref.ref", arr.ref.megatron, arr.model, world)
        if reward_model:
            self._check_forward_only("reward.reward_model", self.reward.reward_model.megatron, None, world)
        if teacher:
            source = self.distillation.teacher_model
            self._check_forward_only("distillation.teacher_model", source.megatron, source, world)

    def _check_lengths(self, rollout_n: int, rollout_n_key: str) -> None:
        arr, data = self.actor_rollout_ref, self.data
        pairs = (
            (rollout_n_key, rollout_n, "actor_rollout_ref.rollout.n", arr.rollout.n),
            (
                "actor_rollout_ref.rollout.prompt_length",
                arr.rollout.prompt_length,
                "data.max_prompt_length",
                data.max_prompt_length,
            ),
            (
                "actor_rollout_ref.rollout.response_length",
                arr.rollout.response_length,
                "data.max_response_length",
                data.max_response_length,
            ),
        )
        for name, value, source, expected in pairs:
            if value != expected:
                raise ValueError(
                    f"{name}={value} disagrees with {source}={expected}; leave {name} out (it is derived from {source})"
                )

    def _layout(self, where: str, megatron: MegatronConfig, source: Optional[ModelSourceConfig], world: int) -> dict:
        """Validate ``megatron``'s layout on ``world`` ranks (and against an inline model, its layers split
        as ``megatron.override_transformer_config``'s uneven-pipeline fields and ``account_for_*`` flags
        say); return sizes."""
        if self.trainer.device == "cpu" and megatron.context_parallel_size > 1:
            raise ValueError(
                f"{where}.megatron.context_parallel_size={megatron.context_parallel_size} needs "
                "TransformerEngine attention (trainer.device='cuda'); use 1 on CPU"
            )
        model = source.config if source is not None else None
        dims = {}
        if model is not None:
            dims = dict(
                num_layers=model.num_layers,
                num_attention_heads=model.num_attention_heads,
                num_query_groups=model.num_query_groups or model.num_attention_heads,
                num_experts=model.num_moe_experts,
            )
            dims.update(uneven_pipeline_fields(megatron.override_transformer_config))
        try:
            return megatron.parallel().validate(world, **dims)
        except ValueError as err:
            raise ValueError(
                f"{where}.megatron: {err} (world_size={world} = trainer.nnodes * "
                f"trainer.n_gpus_per_node = {self.trainer.nnodes}*{self.trainer.n_gpus_per_node})"
            ) from None

    def _check_batch(self, where: str, cfg: ActorConfig | CriticConfig, source: ModelSourceConfig, world: int) -> None:
        """verl's batch arithmetic for a trained role: prompts split into mini-batches, each
        mini-batch's responses split evenly over data-parallel ranks and into micro-batches. Under
        ``use_dynamic_bsz`` token budgets form the micro-batches, so (as verl) the micro-batch size
        need not divide a rank's share."""
        n, train = self.actor_rollout_ref.rollout.n, self.data.train_batch_size
        mini, micro = cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu
        if train < mini:
            raise ValueError(f"data.train_batch_size={train} must be >= {where}.ppo_mini_batch_size={mini}")
        if (train * n) % (mini * n):
            raise ValueError(
                f"data.train_batch_size * rollout.n = {train}*{n} = {train * n} is not divisible by "
                f"{where}.ppo_mini_batch_size * rollout.n = {mini}*{n} = {mini * n}"
            )
        dp = self._layout(where, cfg.megatron, source, world)["dp"]
        dynamic = (
            cfg.use_dynamic_bsz if cfg.use_dynamic_bsz is not None else self.actor_rollout_ref.actor.use_dynamic_bsz
        )
        if dynamic and (mini * n) % dp:
            raise ValueError(
                f"{where}.ppo_mini_batch_size * rollout.n = {mini}*{n} = {mini * n} is not divisible by "
                f"the data-parallel size {dp} of {where}"
            )
        if not dynamic and (mini * n) % (dp * micro):
            raise ValueError(
                f"{where}.ppo_mini_batch_size * rollout.n = {mini}*{n} = {mini * n} is not divisible by "
                f"data-parallel size * {where}.ppo_micro_batch_size_per_gpu = {dp}*{micro} = {dp * micro}"
            )

    def _check_forward_only(
        self, where: str, megatron: MegatronConfig, source: Optional[ModelSourceConfig], world: int
    ) -> None:
        n, train = self.actor_rollout_ref.rollout.n, self.data.train_batch_size
        dp = self._layout(where, megatron, source, world)["dp"]
        if (train * n) % dp:
            raise ValueError(
                f"data.train_batch_size * rollout.n = {train}*{n} = {train * n} is not divisible by "
                f"the data-parallel size {dp} of {where}"
            )


def _check_source(where: str, source: Any, *, path_key: str = "path", family_required: bool = True) -> None:
    path = getattr(source, path_key)
    if (path is None) == (source.config is None):
        got = "neither" if path is None else "both"
        raise ValueError(
            f"{where}: set exactly one of {where}.{path_key} (an HF checkpoint directory) and "
            f"{where}.config (an inline ModelConfig); got {got}"
        )
    if family_required and source.config is not None and source.family is None:
        raise ValueError(
            f"{where}.family must name the HF family an inline model is exported as for vLLM "
            f"(e.g. 'qwen3') when {where}.config is set"
        )
