"""The sections of a run's configuration (``data``, ``actor_rollout_ref``, ``critic``, ``reward``,
``trainer``, ``distillation``), with verl's key names and defaults.

Each is a ``BaseConfig`` dataclass with a docstring per field that validates its own fields in
``__post_init__``; what spans sections is checked by ``megatron_rl.config.trainer.TrainerRunConfig``.
The actor and critic extend the algorithm layer's ``ActorConfig``/``CriticConfig`` (so the engine
takes them as they are) with a ``megatron`` layout, as verl's ``McoreActorConfig`` does.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import field
from collections.abc import Mapping
from typing import Any, Optional

from megatron_rl.config.algorithm import ActorConfig, CriticConfig
from megatron_rl.config.base_config import TRAINING_ENGINES, BaseConfig, check_built, check_choice, check_range
from megatron_rl.config.lora_config import LoRAConfig, resolve_lora
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.distillation import DistillationLossConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.v1 import V1Config
from parallel.config import ParallelConfig

__all__ = [
    "RouterReplayConfig",
    "MegatronConfig",
    "ModelSourceConfig",
    "DataConfig",
    "ActorRunConfig",
    "RefConfig",
    "ActorRolloutRefConfig",
    "CriticRunConfig",
    "OverlongBufferConfig",
    "RewardKwargsConfig",
    "CustomRewardFunctionConfig",
    "RewardModelConfig",
    "RewardConfig",
    "TrainerConfig",
    "TeacherModelConfig",
    "DistillationConfig",
    "LOGGERS",
    "PARALLEL_KEYS",
]

LOGGERS = ("console", "tensorboard", "wandb")
PARALLEL_KEYS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
"""The layout keys of ``MegatronConfig`` (the fields of ``parallel.config.ParallelConfig``)."""
_DTYPES = (None, "float32", "bfloat16", "float16")


def suggest(value: str, allowed) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the entries of ``allowed`` closest to ``value`` (difflib), else ``""``."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _check_rollout_n(value: int) -> None:
    """``rollout_n`` is copied from ``actor_rollout_ref.rollout.n``: report it under the key users set."""
    if isinstance(value, int) and value < 1:
        raise ValueError(f"actor_rollout_ref.rollout.n={value} is out of range (samples per prompt); allowed: [1, inf)")


def _check_distributed_optimizer(where: str, megatron: "MegatronConfig", optim: Any) -> None:
    """Megatron's ``DistributedOptimizer`` shards Adam's state and refuses any other optimizer (an
    assertion inside the workers, after allocation): name the keys here instead."""
    if megatron.use_distributed_optimizer and optim.optimizer != "adam":
        raise ValueError(
            f"{where}.megatron.use_distributed_optimizer=True is not allowed with {where}.optim.optimizer="
            f"{optim.optimizer!r}: Megatron's DistributedOptimizer shards only Adam's state; set "
            f"{where}.megatron.use_distributed_optimizer=False or {where}.optim.optimizer=adam"
        )


def _check_freq(field_name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"{field_name}={value!r} is not allowed; use a positive int, or -1/0 to disable")


# ----------------------------------------------------------------------------- shared pieces
@dataclasses.dataclass
class RouterReplayConfig(BaseConfig):
    """``*.megatron.router_replay``: pin an MoE model's routing (verl's ``EngineRouterReplayConfig``;
    ``megatron_rl.engine.router_replay``)."""

    mode: str = "disabled"
    """``disabled``; ``R2``: the update (and a reference set to R2) replays the experts the actor's
    old-log-prob pass chose; ``R3``: every actor / reference pass replays the rollout engine's
    experts (needs vLLM's routed-experts output)."""
    record_file: Optional[str] = None
    """Actor only: save each step's replayed routing (``routed_experts`` with ``input_ids`` and
    ``attention_mask``) with ``torch.save`` to this path (``{step}`` is replaced by the step; without
    it the file is overwritten every step)."""
    replay_file: Optional[str] = None
    """verl's key, read nowhere (see ``INERT_KEYS``): replay always uses the step's own routing."""

    def __post_init__(self) -> None:
        check_choice("megatron.router_replay.mode", self.mode, ("disabled", "R2", "R3"))

    @property
    def enabled(self) -> bool:
        """Replay is on (R2 or R3): the engine builds Megatron's router replay."""
        return self.mode != "disabled"


@dataclasses.dataclass
class MegatronConfig(BaseConfig):
    """``*.megatron``: how one Megatron model is laid out and kept (verl's ``McoreEngineConfig`` keys)."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that split each weight matrix."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """VPP: model chunks per pipeline rank (interleaved 1F1B); None = no interleaving."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split the routed experts."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP: tensor parallelism inside each expert; None = TP."""
    context_parallel_size: int = 1
    """CP: ranks that split the sequence (needs TransformerEngine attention, i.e. a GPU)."""
    sequence_parallel: bool = True
    """Shard norms/dropout activations over TP (only acts with TP > 1; always on for MoE under TP)."""
    param_offload: bool = False
    """Keep parameters in host memory while this role is idle."""
    grad_offload: bool = False
    """Keep gradient buffers in host memory while this role is idle."""
    optimizer_offload: bool = False
    """Keep optimizer state in host memory while this role is idle."""
    use_distributed_optimizer: bool = True
    """Shard a trainable role's optimizer state (Adam moments, fp32 masters) over data parallelism
    (Megatron's ZeRO-1 ``DistributedOptimizer``; on CPU through ``parallel.cpu_compat``), as verl's
    default. At DP=1 it steps like the plain optimizer up to float32 rounding (it sums the gradient
    norm in another order); Adam only (``optim.optimizer=sgd`` needs False). Megatron pads each bucket
    to a multiple of lcm(DP, 128), so every DP size shards evenly."""
    dtype: Optional[str] = None
    """Training dtype (the workers' ``params_dtype``): ``float32``, ``bfloat16`` or ``float16``; None =
    the model's: an inline model's ``params_dtype``, ``float32`` for an HF checkpoint (its stored
    dtype is not used; set ``bfloat16`` for GPU runs, as the GPU recipes do)."""
    seed: int = 42
    """Seed of Megatron's model-parallel RNG (weight init of from-scratch models, dropout)."""
    override_transformer_config: dict = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields (e.g. ``recompute_granularity: full``)."""
    use_remove_padding: bool = True
    """Pack each micro-batch's rows into one THD sequence (no FLOPs on padding; RoPE restarts and
    attention stops at every row); False pads rows to the micro-batch's longest."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE router replay (R2 / R3) of the actor and the reference."""

    def __post_init__(self) -> None:
        self.parallel()  # ParallelConfig's ValueError names the field and its allowed values
        check_choice("megatron.dtype", self.dtype, _DTYPES)

    def parallel(self) -> ParallelConfig:
        """The model-parallel layout as a ``parallel.config.ParallelConfig``."""
        return ParallelConfig(**{k: getattr(self, k) for k in PARALLEL_KEYS})


@dataclasses.dataclass
class ModelSourceConfig(BaseConfig):
    """``*.model``: where a model's architecture and weights come from (set exactly one of
    ``path`` and ``config``)."""

    path: Optional[str] = None
    """HF checkpoint directory (config.json + safetensors); ``~`` is expanded by the trainer."""
    config: Optional[ModelConfig] = None
    """Inline architecture for a from-scratch model (toy runs); weights are initialised with
    ``megatron.seed``."""
    family: Optional[str] = None
    """HF family an inline model is exported as for vLLM (``qwen3``, ``llama`` ...); required with ``config``."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory; None = ``path``, or, with an inline model, a byte-level BPE tokenizer
    trained on the task's texts with ``config.vocab_size`` entries."""
    override_config: dict = field(default_factory=dict)
    """``ModelConfig`` fields set on top of the checkpoint's (``freeze_router``, ``moe_router_dtype``,
    ``make_vocab_size_divisible_by`` ...) and, as in verl, HF config keys set on the checkpoint's config
    before it is read (under ``model_config`` or at the top: ``max_position_embeddings``, ``attention_dropout``;
    a key the HF config lacks is refused when it is read, ``megatron_rl.models.families.apply_hf_overrides``)."""
    trust_remote_code: bool = False
    """Allow custom modelling code when reading an HF checkpoint or tokenizer."""
    custom_chat_template: Optional[str] = None
    """Jinja chat template replacing the tokenizer's."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """verl 0.9.1's Megatron LoRA (``megatron_rl.config.lora_config.LoRAConfig``); ``lora.rank: 0`` (the default)
    trains every parameter. The actor's only: a critic that runs with ``rank > 0`` is refused (not built)
    before any worker starts (``megatron_rl.trainer.placement.check_lora_roles``)."""
    lora_rank: int = 0
    """verl's older flat form of ``lora.rank`` (0 = off); with it ``lora_alpha``, ``target_modules``,
    ``exclude_modules`` and ``lora_adapter_path`` map onto ``lora.*`` (``lora_config()``). Set one form only."""
    lora_alpha: float = 16
    """Flat form of ``lora.alpha`` (with ``lora_rank > 0``; a flat key set beside ``lora.rank > 0`` is refused)."""
    target_modules: Any = "all-linear"
    """Flat form of ``lora.target_modules``: Megatron linear names, or ``all-linear`` (every one)."""
    exclude_modules: Optional[list] = None
    """Flat form of ``lora.exclude_modules``."""
    lora_adapter_path: Optional[str] = None
    """Flat form of ``lora.adapter_path`` (a PEFT adapter directory the actor's adapters start from)."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, Mapping):  # built by keyword: the section as a mapping
            self.lora = resolve_lora({"lora": self.lora}, "model")
        resolve_lora(self, "model")  # both forms set, or a bad flat value: ValueError naming the key
        names = [f.name for f in dataclasses.fields(ModelConfig)]
        wrapped = self.override_config.get("model_config", {})
        if not isinstance(wrapped, Mapping):
            raise ValueError(f"model.override_config.model_config={wrapped!r} must be a mapping of HF config keys")
        if self.config is not None or self.path is None:  # no HF config to set keys on: only ModelConfig fields
            for key in self.override_config:
                if key not in names:
                    raise ValueError(
                        f"model.override_config: unknown ModelConfig field {key!r}{suggest(key, names)} "
                        "(HF config keys apply to a checkpoint given by model.path)"
                    )

    @property
    def is_inline(self) -> bool:
        """True for a from-scratch model described by ``config``."""
        return self.config is not None

    def lora_config(self) -> LoRAConfig:
        """This model's one LoRA setting: ``lora`` itself, or (``lora_rank > 0``) verl's flat keys mapped
        onto a ``LoRAConfig`` (``merge: true``: the flat form has no merge key). Every flat key is looked
        at: one set beside ``lora.rank > 0`` would be ignored, so it is refused (``resolve_lora``)."""
        flat = {
            "lora": self.lora,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "target_modules": self.target_modules,
            "exclude_modules": self.exclude_modules,
            "lora_adapter_path": self.lora_adapter_path,
        }
        resolved = resolve_lora(flat, "model")
        return resolved if self.lora_rank else self.lora  # the section itself: its readers are its keys


# ----------------------------------------------------------------------------- data
@dataclasses.dataclass
class DataConfig(BaseConfig):
    """``data.*``: the prompt dataset, lengths and the training batch (verl's keys and defaults)."""

    train_files: Any = None
    """Training parquet/jsonl file(s) (a path or a list); or None with ``task``."""
    val_files: Any = None
    """Validation file(s); None = no validation set (or the task's own)."""
    task: Optional[str] = None
    """Built-in task that generates prompts (and answers) instead of reading files."""
    task_kwargs: dict = field(default_factory=dict)
    """Options of ``task`` (sizes, difficulty, seed ...)."""
    train_max_samples: int = -1
    """Use at most this many training samples; -1 = all."""
    val_max_samples: int = -1
    """Use at most this many validation samples; -1 = all."""
    prompt_key: str = "prompt"
    """Column holding the prompt (chat messages or a string)."""
    reward_fn_key: str = "data_source"
    """Column that selects the rule reward per sample when ``reward.reward_fn`` is None."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (after the chat template)."""
    max_response_length: int = 512
    """Longest response in tokens."""
    train_batch_size: int = 1024
    """Prompts per training step (each sampled ``rollout.n`` times)."""
    gen_batch_size: Optional[int] = None
    """Prompts per generation round under DAPO dynamic sampling; None = ``train_batch_size``."""
    val_batch_size: Optional[int] = None
    """Prompts per validation generation call; None = the whole validation set."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch."""
    validation_shuffle: bool = False
    """Shuffle the validation prompts."""
    seed: Optional[int] = None
    """Sampler seed; None = 1 (verl's fallback)."""
    truncation: str = "error"
    """A prompt over ``max_prompt_length``: ``error``, or truncate from the ``left``/``right``/``middle``."""
    filter_overlong_prompts: bool = False
    """Drop prompts over ``max_prompt_length`` when loading instead of applying ``truncation``."""
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    """Extra arguments of ``tokenizer.apply_chat_template`` (e.g. ``enable_thinking: false``)."""

    def __post_init__(self) -> None:
        for name in ("max_prompt_length", "max_response_length", "train_batch_size"):
            check_range(f"data.{name}", getattr(self, name), low=1)
        for name in ("gen_batch_size", "val_batch_size"):
            if getattr(self, name) is not None:
                check_range(f"data.{name}", getattr(self, name), low=1)
        check_choice("data.truncation", self.truncation, ("error", "left", "right", "middle"))
        if self.task is not None and self.train_files is not None:
            raise ValueError(
                f"data: data.task={self.task!r} and data.train_files={self.train_files!r} are exclusive; set one"
            )


# ----------------------------------------------------------------------------- actor / rollout / ref
@dataclasses.dataclass
class ActorRunConfig(ActorConfig):
    """``actor_rollout_ref.actor``: ``ActorConfig`` (loss, batch sizes, optimizer) + the Megatron layout."""

    strategy: str = "megatron"
    """Training backend; only ``megatron``."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout, offload and dtype of the policy."""

    def __post_init__(self) -> None:
        check_built("actor.strategy", self.strategy, TRAINING_ENGINES, "training engines")  # before the loss checks
        _check_rollout_n(self.rollout_n)
        super().__post_init__()
        _check_distributed_optimizer("actor_rollout_ref.actor", self.megatron, self.optim)


@dataclasses.dataclass
class RefConfig(BaseConfig):
    """``actor_rollout_ref.ref``: the frozen reference policy (same model as the actor)."""

    strategy: str = "megatron"
    """Backend; only ``megatron``."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Layout, dtype and offload of the reference; each key left out is copied from the actor's."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per forward micro-batch; None = ``actor.ppo_micro_batch_size_per_gpu``."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Token-budget forward micro-batches; None = ``actor.log_prob_use_dynamic_bsz`` (itself
    ``actor.use_dynamic_bsz`` by default)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one forward micro-batch; None = the actor's forward budget."""

    def __post_init__(self) -> None:
        check_built("ref.strategy", self.strategy, TRAINING_ENGINES, "training engines")
        if self.log_prob_micro_batch_size_per_gpu is not None:
            check_range("ref.log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu, low=1)
        if self.log_prob_max_token_len_per_gpu is not None:
            check_range("ref.log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu, low=1)


@dataclasses.dataclass
class ActorRolloutRefConfig(BaseConfig):
    """``actor_rollout_ref``: the policy model and its three roles."""

    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    """The policy model (shared by actor, rollout and reference)."""
    actor: ActorRunConfig = field(default_factory=ActorRunConfig)
    """Policy training."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation with vLLM."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy for KL terms."""


# ----------------------------------------------------------------------------- critic
@dataclasses.dataclass
class CriticRunConfig(CriticConfig):
    """``critic``: ``CriticConfig`` (value loss, batch sizes, optimizer) + model + Megatron layout."""

    strategy: str = "megatron"
    """Backend; only ``megatron``."""
    enable: Optional[bool] = None
    """Train a critic; None = only when ``algorithm.adv_estimator`` uses values (``gae``)."""
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    """Value model (a scalar head on this model); defaults to the policy model."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout, offload and dtype of the critic."""

    def __post_init__(self) -> None:
        check_built("critic.strategy", self.strategy, TRAINING_ENGINES, "training engines")  # before the loss checks
        _check_rollout_n(self.rollout_n)
        super().__post_init__()
        _check_distributed_optimizer("critic", self.megatron, self.optim)


# ----------------------------------------------------------------------------- reward
@dataclasses.dataclass
class OverlongBufferConfig(BaseConfig):
    """DAPO overlong reward shaping (``reward.reward_kwargs.overlong_buffer_cfg``)."""

    enable: bool = False
    """Penalise responses that reach into the last ``len`` tokens of ``max_resp_len``."""
    len: int = 0
    """Buffer length in tokens; the penalty grows linearly across it."""
    penalty_factor: float = 0.0
    """Penalty at ``max_resp_len``."""
    log: bool = False
    """Report the penalty per sample as a metric."""


@dataclasses.dataclass
class RewardKwargsConfig(BaseConfig):
    """``reward.reward_kwargs``: options of the reward manager (verl's ``dapo`` manager keys)."""

    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong shaping."""
    max_resp_len: Optional[int] = None
    """Length the buffer is measured from; derived from ``data.max_response_length``."""


@dataclasses.dataclass
class CustomRewardFunctionConfig(BaseConfig):
    """``reward.custom_reward_function``: a user Python file with a scoring function."""

    path: Optional[str] = None
    """Python file; None = use the built-in rewards."""
    name: str = "compute_score"
    """Function in that file: ``(data_source, solution_str, ground_truth, extra_info) -> float | dict``."""


@dataclasses.dataclass
class RewardModelConfig(BaseConfig):
    """``reward.reward_model``: a Megatron scalar-head reward model."""

    enable: bool = False
    """Score responses with the model (added to any rule reward)."""
    model_path: Optional[str] = None
    """HF checkpoint of the reward model."""
    tokenizer_path: Optional[str] = None
    """Its tokenizer; None = ``model_path``."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Layout and offload of the reward model."""
    micro_batch_size_per_gpu: int = 1
    """Responses per forward micro-batch."""
    use_dynamic_bsz: Optional[bool] = None
    """Token-budget forward micro-batches (verl's reward-model key); None = ``critic.use_dynamic_bsz``
    (itself the actor's by default)."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one forward micro-batch; None = ``critic.forward_max_token_len_per_gpu``."""

    def __post_init__(self) -> None:
        check_range("reward_model.micro_batch_size_per_gpu", self.micro_batch_size_per_gpu, low=1)
        if self.forward_max_token_len_per_gpu is not None:
            check_range("reward_model.forward_max_token_len_per_gpu", self.forward_max_token_len_per_gpu, low=1)

    def forward_token_budget(self) -> Optional[int]:
        """Tokens per forward micro-batch with ``use_dynamic_bsz`` (both keys resolved), else None."""
        return self.forward_max_token_len_per_gpu if self.use_dynamic_bsz else None


@dataclasses.dataclass
class RewardConfig(BaseConfig):
    """``reward``: how responses are scored (verl 0.9's ``reward`` section)."""

    reward_fn: Optional[str] = None
    """Rule reward for every sample; None = chosen per sample by the ``data.reward_fn_key`` column."""
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """User scoring function (replaces the built-in rule rewards)."""
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)
    """Reward-manager options (overlong shaping)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Model-based reward."""

    def __post_init__(self) -> None:
        if self.reward_fn is not None and self.custom_reward_function.path is not None:
            raise ValueError(
                f"reward: reward.reward_fn={self.reward_fn!r} and reward.custom_reward_function.path="
                f"{self.custom_reward_function.path!r} both choose the reward; set one"
            )
        if self.reward_model.enable and not self.reward_model.model_path:
            raise ValueError("reward.reward_model.enable=True needs reward.reward_model.model_path")
        buf = self.reward_kwargs.overlong_buffer_cfg
        if buf.enable:
            where = "reward.reward_kwargs.overlong_buffer_cfg"
            if buf.len <= 0:
                raise ValueError(f"{where}.len={buf.len!r} must be > 0 when {where}.enable=True")
            check_range(f"{where}.penalty_factor", buf.penalty_factor, low=0.0)
            max_len = self.reward_kwargs.max_resp_len
            if max_len is None or buf.len > max_len:
                raise ValueError(
                    f"{where}.len={buf.len} must be <= reward.reward_kwargs.max_resp_len={max_len} "
                    "(= data.max_response_length unless set)"
                )


# ----------------------------------------------------------------------------- trainer
@dataclasses.dataclass
class TrainerConfig(BaseConfig):
    """``trainer.*``: run length, logging, checkpoints and the cluster (verl's keys and defaults)."""

    total_epochs: int = 30
    """Passes over the training prompts."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps; None = ``total_epochs`` worth."""
    project_name: str = "verl_examples"
    """Project name for loggers and the checkpoint directory."""
    experiment_name: str = "gsm8k"
    """Run name for loggers and the checkpoint directory."""
    logger: list = field(default_factory=lambda: ["console"])
    """Metric sinks among ``console``, ``tensorboard``, ``wandb`` (metrics.jsonl is always written)."""
    log_val_generations: int = 0
    """Validation samples printed/logged per validation."""
    rollout_data_dir: Optional[str] = None
    """Dump every step's generations as jsonl here; None = off."""
    validation_data_dir: Optional[str] = None
    """Dump validation generations as jsonl here; None = off."""
    nnodes: int = 1
    """Nodes in the cluster."""
    n_gpus_per_node: int = 8
    """Devices per node (worker processes per node on CPU)."""
    device: str = "cuda"
    """``cuda`` or ``cpu``."""
    save_freq: int = -1
    """Checkpoint every N steps (and at the end); -1/0 = only the final model."""
    test_freq: int = -1
    """Validate every N steps; -1/0 = never during training."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_only: bool = False
    """Validate and exit."""
    critic_warmup: int = 0
    """Steps that update only the critic before the actor starts training."""
    sft_warmup_steps: int = 0
    """Supervised steps on the built-in task's (prompt, answer) pairs before RL (needs ``data.task``);
    RL starts from the warmed model, as from an SFT checkpoint. 0 = off."""
    sft_warmup_lr: float = 3e-3
    """Peak learning rate of the supervised warm-up (AdamW, cosine decay)."""
    balance_batch: bool = True
    """Reorder each step's samples so every data-parallel rank of the actor gets a near-equal token
    count (Karmarkar-Karp over verl's attention workload); logs verl's ``global_seqlen/*`` metrics."""
    resume_mode: str = "auto"
    """``auto`` (latest checkpoint in ``default_local_dir`` if any), ``disable``, or ``resume_path``."""
    resume_from_path: Optional[str] = None
    """Checkpoint to resume from with ``resume_mode=resume_path``."""
    default_local_dir: Optional[str] = None
    """Checkpoint directory; None = ``checkpoints/{project_name}/{experiment_name}``."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N actor checkpoints; None = all."""
    max_critic_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N critic checkpoints; None = all."""
    max_consecutive_skipped_steps: int = 3
    """A step whose rewards fail (the reward function raised or returned a non-finite value) is
    reported and skipped; this many skipped in a row stop the run with the error."""
    phase_timeout_s: Optional[float] = None
    """Hang watchdog: a step phase (generation, a role's forward or update, weight sync, a checkpoint
    save, validation) running longer than this many seconds dumps the Python stacks of the driver and
    every worker to ``<default_local_dir>/stacks/`` and stops the run (exit 1), naming the phase and the
    last good checkpoint. None = off."""
    save_on_preemption: bool = False
    """On SIGTERM (SLURM's preemption and time limit): finish the current step, save a checkpoint, then
    stop (exit 143). False: abandon the step at once (the last saved checkpoint stays the latest). A
    second signal stops at once either way."""
    resume_fallback: bool = True
    """``resume_mode=auto`` with a damaged latest checkpoint (its manifest's sizes or checksums do not
    match): resume from the newest complete one and say which file is bad; False: refuse (exit 2)."""
    v1: V1Config = field(default_factory=V1Config)
    """verl's V1 trainer modes: ``sync`` (default), ``colocate_async`` (one-step off-policy),
    ``separate_async`` (fully async, bounded staleness): ``megatron_rl.config.v1``."""
    callbacks: list = field(default_factory=list)
    """Your own callbacks, as dotted paths ``package.module.Class`` of ``TrainerCallback`` subclasses
    (``megatron_rl.trainer.callbacks``): constructed with no arguments in the driver, called in this order at
    ``on_fit_start``, ``on_validation_end``, ``on_checkpoint``, ``on_step_end``, ``on_fit_end``. One that
    cannot be imported stops the run before any worker starts."""

    def __post_init__(self) -> None:
        if isinstance(self.v1, Mapping):
            self.v1 = V1Config.from_dict(self.v1, path="v1")
        if isinstance(self.logger, str):
            self.logger = [self.logger]
        if isinstance(self.callbacks, str):
            self.callbacks = [self.callbacks]
        for i, path in enumerate(self.callbacks):
            if (
                not isinstance(path, str)
                or "." not in path.strip(".")
                or any(not part.isidentifier() for part in path.split("."))
            ):
                raise ValueError(f"trainer.callbacks[{i}]={path!r}: expected a dotted path 'package.module.Class'")
        for name in self.logger:
            check_choice("trainer.logger entry", name, LOGGERS)
        check_choice("trainer.device", self.device, ("cpu", "cuda"))
        check_choice("trainer.resume_mode", self.resume_mode, ("auto", "disable", "resume_path"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode='resume_path' needs trainer.resume_from_path")
        for name in ("total_epochs", "nnodes", "n_gpus_per_node"):
            check_range(f"trainer.{name}", getattr(self, name), low=1)
        for name in ("total_training_steps", "max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
            if getattr(self, name) is not None:
                check_range(f"trainer.{name}", getattr(self, name), low=1)
        for name in ("critic_warmup", "log_val_generations", "sft_warmup_steps", "max_consecutive_skipped_steps"):
            check_range(f"trainer.{name}", getattr(self, name), low=0)
        _check_freq("trainer.save_freq", self.save_freq)
        _check_freq("trainer.test_freq", self.test_freq)
        if self.phase_timeout_s is not None:
            check_range("trainer.phase_timeout_s", self.phase_timeout_s, low=0, low_inclusive=False)
        if self.default_local_dir is None:
            self.default_local_dir = f"checkpoints/{self.project_name}/{self.experiment_name}"

    @property
    def world_size(self) -> int:
        """Devices (or CPU worker processes) in the cluster: ``nnodes * n_gpus_per_node``."""
        return self.nnodes * self.n_gpus_per_node


# ----------------------------------------------------------------------------- distillation
@dataclasses.dataclass
class TeacherModelConfig(BaseConfig):
    """``distillation.teacher_model``: the teacher (set exactly one of ``model_path`` and ``config``);
    it must share the student's tokenizer."""

    model_path: Optional[str] = None
    """HF checkpoint of the teacher."""
    config: Optional[ModelConfig] = None
    """Inline architecture of a from-scratch teacher (toy runs)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Layout, dtype and offload of the teacher (forward only)."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per forward micro-batch; None = ``actor.ppo_micro_batch_size_per_gpu``."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Token-budget forward micro-batches; None = the actor's (``actor.log_prob_use_dynamic_bsz``)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one forward micro-batch; None = the actor's forward budget."""
    sft_warmup_steps: int = 0
    """Inline teacher only: supervised steps on the built-in task before the run (a teacher must
    know the task better than the student); 0 = a randomly initialised teacher."""

    def __post_init__(self) -> None:
        check_range("distillation.teacher_model.sft_warmup_steps", self.sft_warmup_steps, low=0)
        if self.log_prob_micro_batch_size_per_gpu is not None:
            check_range(
                "distillation.teacher_model.log_prob_micro_batch_size_per_gpu",
                self.log_prob_micro_batch_size_per_gpu,
                low=1,
            )
        if self.log_prob_max_token_len_per_gpu is not None:
            check_range(
                "distillation.teacher_model.log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu, low=1
            )


@dataclasses.dataclass
class DistillationConfig(BaseConfig):
    """``distillation``: on-policy distillation from a teacher (verl's keys)."""

    enabled: bool = False
    """Add the distillation loss (or reward) from ``teacher_model``."""
    teacher_model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    """The teacher."""
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    """Loss mode, top-k, coefficient, clamps, policy-gradient mode."""
