"""Megatron's fused kernels compile on their first call, not when Megatron is imported (CPU only).

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and every fusion module decorates its kernels
with it at import time. ``torch.compile(fn)`` compiles nothing then, but it imports dynamo's backends and
inductor (~0.8-1.3 s of Megatron's ~2-3 s import, in every process: each Ray worker, each rank). On CPU
those kernels are never called (``parallel.cpu_compat`` turns the fusions off), so every Megatron process
paid for an import it never used.

``install()`` (called by ``import parallel`` and ``import megatron_rl``, stdlib only) puts a finder on
``sys.meta_path`` that lets ``megatron.core.jit`` load as it is and then, on a machine without CUDA,
replaces its ``jit_fuser`` with ``compile_on_first_call(torch.compile)``: a kernel that is called gets
``torch.compile``'d on that first call, with the same arguments, so what runs is unchanged. With CUDA the
module is left as Megatron wrote it (its fused kernels run there, under Megatron's own compile).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

TARGET = "megatron.core.jit"


def compile_on_first_call(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``compile_fn`` (``torch.compile``) that calls it on the decorated function's first
    call instead of at decoration; both ``@fuser`` and ``@fuser(**options)`` forms."""

    def fuser(model: Callable[..., Any] | None = None, **options: Any) -> Any:
        if model is None:
            return functools.partial(fuser, **options)
        compiled = None

        @functools.wraps(model)
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return run

    return fuser


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        import torch  # megatron.core.jit imported it

        if not torch.cuda.is_available() and getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = compile_on_first_call(torch.compile)


class _DeferJitFuser(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> bool:
    """Put the finder on ``sys.meta_path`` once; False when Megatron's jit module is already loaded
    (too late: its kernels are decorated)."""
    if TARGET in sys.modules:
        return False
    if not any(isinstance(finder, _DeferJitFuser) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferJitFuser())
    return True
