"""Heavy imports with Python's cyclic garbage collector paused.

An import of vLLM or Megatron allocates millions of objects that live as long as the
process; on the way each allocation burst triggers collections that walk the whole growing heap and
free nothing. Paused for the block (collection resumes after it: the first one walks the new
objects once), the same imports take less: measured in-process on the 2-core CI machine, three
runs each, ``from vllm import LLM`` and its engine module 7.1-8.0 s -> 5.8-6.8 s, a Megatron worker's
imports (``megatron_rl.roles``, ``parallel.bridge``, ``parallel.mesh``) 2.1-2.25 s -> 1.76-2.05 s; the
trainer driver's showed no gain (it is not paused). Every engine and worker process pays those
imports once, at its start.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with automatic collection off (an explicit ``gc.collect()`` still runs), then
    restore the collector as it was. Nothing is frozen: a frozen object is never freed, not even at
    exit, where extension modules' leak checks (nanobind's) would report it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
