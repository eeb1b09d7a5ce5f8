"""The single-controller RL trainer (Ray): ``RayPPOTrainer`` and its metrics helpers."""

from megatron_rl.trainer.metrics import MetricsLogger, compute_data_metrics, compute_timing_metrics, timer
from megatron_rl.trainer.ppo_trainer import RayPPOTrainer

__all__ = ["RayPPOTrainer", "MetricsLogger", "compute_data_metrics", "compute_timing_metrics", "timer"]
