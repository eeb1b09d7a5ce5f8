"""``cfg_get``: read a dotted key from a verl ``DictConfig``, a dict or a typed config.

For the public functions that verl users call with their own ``DictConfig`` (the algorithm
layer, the reward shaping); the trainer, workers and engine read typed configs by attribute.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cfg_get"]

_MISSING = object()


def cfg_get(config: Any, key: str, default: Any = None) -> Any:
    """Read a dotted ``key`` from a DictConfig, a dict or a typed config; ``default`` if absent/None."""
    node = config
    for part in key.split("."):
        if node is None:
            return default
        if isinstance(node, dict) or hasattr(node, "get"):
            node = node.get(part, _MISSING)
        else:
            node = getattr(node, part, _MISSING)
        if node is _MISSING:
            return default
    return default if node is None else node
