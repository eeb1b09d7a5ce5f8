"""``verl.trainer.ppo.rollout_corr_helper`` -> ``megatron_rl.algos`` (rollout correction, its metrics)."""

from megatron_rl.algos import *  # noqa: F401,F403
