"""The bottom of ``megatron_rl``: helpers with no project imports (the ``Registry`` class, ``cfg_get``)."""

from megatron_rl.utils.config_access import cfg_get
from megatron_rl.utils.registry import Registry, UnknownNameError

__all__ = ["Registry", "UnknownNameError", "cfg_get"]
