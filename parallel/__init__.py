"""The distributed compute layer: meshes, vocab-parallel math, CPU compatibility, test helpers.

Names are exported lazily so that ``import parallel`` stays cheap (no Megatron import).
"""

from __future__ import annotations

import importlib
from typing import Any

from parallel.lazy_jit import install as _defer_megatron_jit

_defer_megatron_jit()  # Megatron's fused kernels compile when first called, not at import (CPU)

_EXPORTS = {
    "ParallelConfig": "parallel.config",
    "Mesh": "parallel.mesh",
    "init_mesh": "parallel.mesh",
    "destroy_mesh": "parallel.mesh",
    "apply_cpu_compat": "parallel.cpu_compat",
    "cpu_transformer_config_overrides": "parallel.cpu_compat",
    "run_distributed": "parallel.testing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'parallel' has no attribute {name!r}")
