"""Rollout: the vLLM engine wrapper and the vLLM side of weight sync."""
