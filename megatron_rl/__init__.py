"""megatron_rl: RL post-training (PPO, GRPO and family) with Megatron-Core, vLLM and Ray."""

__version__ = "0.1.0"

import parallel  # noqa: E402,F401  (installs parallel.lazy_jit: Megatron imports without inductor on CPU)
