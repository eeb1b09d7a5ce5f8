"""megatron_rl.data."""
