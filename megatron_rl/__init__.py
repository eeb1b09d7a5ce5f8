"""megatron_rl: RL post-training (PPO, GRPO and family) with Megatron-Core, vLLM and Ray."""

__version__ = "0.1.0"
