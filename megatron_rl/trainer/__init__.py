"""The single-controller RL trainer (Ray): ``RayPPOTrainer`` and its metrics helpers.

Its names are imported when first asked for: ``from megatron_rl.trainer.step_checkpoints import ...``
(the CLI's config and plan paths) does not import the trainer, tensordict and torch.
"""

import importlib

__all__ = ["RayPPOTrainer", "MetricsLogger", "compute_data_metrics", "compute_timing_metrics", "timer"]
_HOMES = {"RayPPOTrainer": "ppo_trainer", **{name: "metrics" for name in __all__[1:]}}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
