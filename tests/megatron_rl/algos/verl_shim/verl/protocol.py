"""``verl.protocol`` -> ``megatron_rl.data.batch``."""

from megatron_rl.data.batch import DataProto  # noqa: F401
