"""``data``: the prompt dataset, lengths and the training batch (verl's keys and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_rl.config.base_config import BaseConfig, check_choice, check_range

__all__ = ["DataConfig"]


@dataclass
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
