"""``verl.utils.device``: verl-only device helpers (see verl/_verl_only.py)."""

from verl._verl_only import verl_only

get_device_name = verl_only("get_device_name")
get_nccl_backend = verl_only("get_nccl_backend")
get_torch_device = verl_only("get_torch_device")
