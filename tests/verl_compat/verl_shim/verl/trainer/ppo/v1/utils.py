"""``verl.trainer.ppo.v1.utils`` -> the project's advantage registry and multi-output rule, on a ``DataProto``.

verl's ``compute_advantage`` / ``compute_advantage_for_multi_trajectories`` take and return a
``DataProto``; the project's take the batch's tensors (``megatron_rl.algos.get_adv_estimator_fn``,
``megatron_rl.algos.compute_advantage_for_multi_trajectories``). These adapters read the fields verl
reads, call the project's functions and write ``advantages`` / ``returns`` back, as verl does.
"""

from typing import Any

from megatron_rl.algos import compute_advantage_for_multi_trajectories as _multi_trajectories
from megatron_rl.algos import get_adv_estimator_fn


def _estimator_inputs(data) -> dict[str, Any]:
    inputs = {"token_level_rewards": data.batch["token_level_rewards"], "response_mask": data.batch["response_mask"]}
    for key in ("values", "reward_baselines"):
        if key in data.batch.keys():
            inputs[key] = data.batch[key]
    return inputs


def compute_advantage(
    data,
    adv_estimator,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
):
    """verl's ``compute_advantage``: the registered estimator on ``data``'s fields (groups by ``uid``)."""
    advantages, returns = get_adv_estimator_fn(adv_estimator)(
        **_estimator_inputs(data),
        index=data.non_tensor_batch.get("uid"),
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        config=config,
    )
    data.batch["advantages"], data.batch["returns"] = advantages, returns
    return data


def compute_advantage_for_multi_trajectories(
    data,
    batch_keys: list[str],
    adv_estimator,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
):
    """verl's multi-output rule (each session's final output sets the group statistics) on ``data``."""
    inputs = _estimator_inputs(data)
    advantages, returns = _multi_trajectories(
        inputs.pop("token_level_rewards"),
        inputs.pop("response_mask"),
        batch_keys,
        adv_estimator,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        config=config,
        **inputs,
    )
    data.batch["advantages"], data.batch["returns"] = advantages, returns
    return data
