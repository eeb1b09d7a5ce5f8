"""``verl.trainer.config.algorithm`` -> ``megatron_rl.config``."""

from megatron_rl.config import AlgoConfig, RolloutCorrectionConfig  # noqa: F401
