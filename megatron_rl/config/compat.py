"""The one list of keys accepted for verl compatibility that have no effect here, and their warning.

Every other leaf of ``TrainerRunConfig`` is read by the code that acts on it
(``tests/megatron_rl/config/test_every_key_is_read.py`` proves it by recording the reads of real
runs). A key in ``INERT_KEYS`` is accepted so that a verl config loads unchanged, and set to a
value other than its default it warns by name (``InertKeyWarning``) when the config is built.
Patterns use ``fnmatch`` (``*`` spans dots).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from typing import Any, Iterator

__all__ = ["INERT_KEYS", "InertKeyWarning", "inert_reason", "warn_inert_keys"]

_OFFLOAD = ("no effect yet: the colocated phase schedule that moves it to host memory between phases is not "
            "built (the memory-choreography issue); the planner assumes it")
INERT_KEYS: dict[str, str] = {
    "*.megatron.param_offload": _OFFLOAD,
    "*.megatron.grad_offload": _OFFLOAD,
    "*.megatron.optimizer_offload": _OFFLOAD,
    "trainer.balance_batch": "samples are not reordered for an even token count per data-parallel rank",
    "algorithm.use_pf_ppo": "preference-feedback PPO reweighting is not implemented",
    "algorithm.pf_ppo": "the options of algorithm.use_pf_ppo, which is not implemented",
    "algorithm.filter_groups.max_inflight_gen_batches": "DAPO generation rounds run one at a time",
    "reward.reward_model.tokenizer_path": "the reward model scores the policy's token ids, so it must share the "
                                          "policy's tokenizer (re-tokenising for another vocabulary is not implemented)",
    "critic.model.tokenizer_path": "the critic scores the policy's token ids with the policy's tokenizer",
    "critic.model.custom_chat_template": "prompts are formatted once, with the policy's tokenizer",
    "critic.model.trust_remote_code": "models are built by Megatron from the HF config; no remote code runs",
    "distillation.distillation_loss.*chunked_topk*": "the vocab-parallel top-k path never materialises a full-vocabulary "
                                                      "log-softmax: there is no memory for chunking to bound",
    "actor_rollout_ref.actor.policy_loss.rollout_correction.bypass_mode": "bypass mode is switched on by "
        "algorithm.rollout_correction.bypass_mode (or policy_loss.loss_mode=bypass_mode); the trainer fills this copy",
    "*.strategy": "only 'megatron' is accepted (checked when the config is built): there is nothing to choose",
    "actor_rollout_ref.rollout.name": "only 'vllm' is accepted (checked when the config is built)",
}
"""Dotted-path pattern -> why the key has no effect (shown in the warning)."""


class InertKeyWarning(UserWarning):
    """A key accepted for verl compatibility was set, but it has no effect here."""


def inert_reason(path: str) -> str | None:
    """Why the leaf at dotted ``path`` has no effect, or None when it is acted on."""
    for pattern, reason in INERT_KEYS.items():
        if fnmatch.fnmatchcase(path, pattern):
            return reason
    return None


def _leaves(config: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(path, value, default)`` of every leaf under the built config section ``config``."""
    for f in dataclasses.fields(config):
        if f.metadata.get("internal"):
            continue
        value = getattr(config, f.name)
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _leaves(value, f"{path}.")
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING and f.default_factory is not \
            dataclasses.MISSING else f.default
        yield path, value, default


def warn_inert_keys(config: Any) -> list[str]:
    """Warn (``InertKeyWarning``) for every inert key of ``config`` set to a non-default value;
    return the warnings' texts."""
    messages = []
    for path, value, default in _leaves(config):
        reason = inert_reason(path)
        if reason is not None and value != default:
            messages.append(f"{path}={value!r} is accepted for verl compatibility but has no effect here: {reason}")
    for message in messages:
        warnings.warn(message, InertKeyWarning, stacklevel=3)
    return messages
