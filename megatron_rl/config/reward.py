"""``reward``: how responses are scored -- a rule reward or a user's function, DAPO's overlong shaping, a
Megatron reward model (verl 0.9's ``reward`` section)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from megatron_rl.config.base_config import BaseConfig, check_range
from megatron_rl.config.layout import MegatronConfig

__all__ = [
    "OverlongBufferConfig",
    "RewardKwargsConfig",
    "CustomRewardFunctionConfig",
    "RewardModelConfig",
    "RewardConfig",
]


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
