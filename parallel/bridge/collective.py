"""Small collectives the bridge needs; each degrades to a single rank without a process group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, over the default group."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def raise_together(errors: list[tuple[type, str]]) -> None:
    """Raise the same error on every rank if any rank has one (so none waits in a collective).

    ``errors`` holds ``(exception type, message)``; the first rank's first type is raised.
    """
    gathered = all_gather_object([(t.__name__, m) for t, m in errors])
    unique: list[tuple[str, str]] = []
    for rank_errors in gathered:
        for e in rank_errors:
            if e not in unique:
                unique.append(e)
    if unique:
        types = {t.__name__: t for t in (ValueError, FileNotFoundError, FileExistsError, OSError, RuntimeError)}
        more = f" (and {len(unique) - 8} more)" if len(unique) > 8 else ""
        raise types.get(unique[0][0], RuntimeError)("\n".join(m for _, m in unique[:8]) + more)


def broadcast_str(value: str) -> str:
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
