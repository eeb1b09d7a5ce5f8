"""What the trainer builds from the typed config before any worker starts: the tokenizer, the
training and validation prompt loaders and the reward function.

A built-in task (``data.task``) is materialised as parquet files in the run directory: the
training set with ``data.seed``, a held-out validation set (64 prompts unless
``data.val_max_samples``) with another seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from megatron_rl.config import RunConfig

__all__ = ["build_tokenizer", "build_train_dataloader", "build_val_dataloader", "build_reward_fn"]

_VAL_SEED_OFFSET = 7919  # the held-out set of a built-in task is drawn with another seed


def build_tokenizer(config: RunConfig, model_path: str):
    """``model.tokenizer_path`` (or the model's own directory) through ``AutoTokenizer``, with
    ``model.custom_chat_template`` in place of its own template when set (prompts are formatted
    with it once, on the driver; the rollout engine receives token ids)."""
    from transformers import AutoTokenizer

    model = config.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(
        model.tokenizer_path or model_path, trust_remote_code=model.trust_remote_code
    )
    if model.custom_chat_template is not None:
        tokenizer.chat_template = model.custom_chat_template
    return tokenizer


def _task_kwargs(config: RunConfig) -> tuple[int, dict]:
    kwargs = dict(config.data.task_kwargs)
    return int(kwargs.pop("num_samples", 1024)), kwargs


def build_train_dataloader(config: RunConfig, tokenizer: Any, run_dir: Path):
    """The training prompts: ``data.train_files``, or ``data.task`` written to ``run_dir/train.parquet``;
    batches of ``data.gen_batch_size`` (DAPO rounds) or ``data.train_batch_size`` prompts."""
    from megatron_rl.data.datasets import build_prompt_dataloader, make_toy_dataset

    data = config.data
    files = data.train_files
    if files is None:
        num, kwargs = _task_kwargs(config)
        files = str(
            make_toy_dataset(data.task, num, seed=int(data.seed or 0), path=run_dir / "train.parquet", **kwargs)
        )
    return build_prompt_dataloader(files, tokenizer, data, max_samples=data.train_max_samples)


def build_val_dataloader(config: RunConfig, tokenizer: Any, run_dir: Path):
    """``data.val_files``, or for a built-in task a held-out set drawn with another seed; None when
    neither exists. Batches of ``data.val_batch_size`` prompts (None = the whole set), in order
    unless ``data.validation_shuffle``."""
    from megatron_rl.data.datasets import PromptDataLoader, PromptDataset, make_toy_dataset

    data = config.data
    files, limit = data.val_files, data.val_max_samples
    if files is None:
        if data.task is None:
            return None
        _, kwargs = _task_kwargs(config)
        files = str(
            make_toy_dataset(
                data.task,
                limit if limit > 0 else 64,
                seed=int(data.seed or 0) + _VAL_SEED_OFFSET,
                path=run_dir / "val.parquet",
                **kwargs,
            )
        )
    dataset = PromptDataset(files, tokenizer, data, max_samples=limit)
    size = min(data.val_batch_size or len(dataset), len(dataset))
    return PromptDataLoader(dataset, size, shuffle=data.validation_shuffle, seed=data.seed, drop_last=False)


def build_reward_fn(config: RunConfig, tokenizer: Any, score: Optional[Any] = None):
    """The rule reward of ``reward.reward_fn`` / ``reward.custom_reward_function`` (or ``score``, a
    ``compute_score`` callable that replaces both), with DAPO's overlong shaping when enabled."""
    from megatron_rl.data.rewards import RewardFunction, load_custom_reward_fn

    reward = config.reward
    if score is None:
        score = reward.reward_fn
        if reward.custom_reward_function.path:
            score = load_custom_reward_fn(reward.custom_reward_function.path, reward.custom_reward_function.name)
    kwargs = reward.reward_kwargs
    return RewardFunction(
        tokenizer, score, overlong_buffer_cfg=kwargs.overlong_buffer_cfg, max_resp_len=kwargs.max_resp_len
    )
