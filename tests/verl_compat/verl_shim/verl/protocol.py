"""``verl.protocol`` -> ``megatron_rl.data.batch`` (the batch container with ``DataProto``'s surface)."""

from megatron_rl.data.batch import DataProto  # noqa: F401
