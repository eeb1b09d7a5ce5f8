"""``verl.utils.torch_functional`` -> ``megatron_rl.algos`` (the single-process masked helpers).

verl's ``distributed_*`` reductions (NCCL across GPU ranks) are verl-only: the project's losses take the
global counts instead (``megatron_rl.algos.global_batch_info``).
"""

from megatron_rl.algos import expand_as_nested, masked_mean  # noqa: F401
from verl._verl_only import verl_only

distributed_masked_mean = verl_only("distributed_masked_mean")
distributed_mean_max_min_std = verl_only("distributed_mean_max_min_std")
