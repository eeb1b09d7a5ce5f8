"""Workers: the Megatron engine (actor, critic, reference) and the vLLM rollout."""
