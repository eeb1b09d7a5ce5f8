"""``verl.utils.torch_functional`` -> ``megatron_rl.algos.utils`` (the single-process helpers)."""

from megatron_rl.algos.utils import expand_as_nested, masked_mean  # noqa: F401
