"""The bookkeeping of ``parallel.cpu_compat``: every patch is recorded so that ``revert_cpu_compat()``
can undo it, and a Megatron module gets its own ``torch`` stand-in (``_TorchView``) instead of a
patched global ``torch``."""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any, Callable

import torch

_MC = "megatron.core."

_MISSING = object()
_UNDO: list[Callable[[], None]] = []
_APPLIED: list[str] = []


def _set_attr(obj: Any, name: str, value: Any) -> None:
    """``setattr`` that remembers the previous value (or its absence) for revert."""
    old = vars(obj).get(name, _MISSING)

    def undo() -> None:
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)

    setattr(obj, name, value)
    _UNDO.append(undo)


def _module(short_name: str) -> types.ModuleType:
    return importlib.import_module(_MC + short_name)


class _TorchView:
    """A stand-in for ``torch`` inside one Megatron module.

    Attribute reads fall through to the real object except for the few overridden names;
    dotted overrides (``"cuda.current_device"``) create nested views, so ``torch.cuda.is_available``
    and friends stay torch's own.
    """

    def __init__(self, real: Any):
        self._real = real
        self._overrides: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:  # only called for names not set on the view itself
        overrides = self.__dict__["_overrides"]
        if name in overrides:
            return overrides[name]
        return getattr(self.__dict__["_real"], name)

    def __repr__(self) -> str:
        return f"<cpu_compat view of {self._real!r}: overrides {sorted(self._overrides)}>"

    def override(self, dotted: str, value: Any) -> None:
        head, _, rest = dotted.partition(".")
        if not rest:
            self._overrides[head] = value
            return
        child = self._overrides.get(head)
        if not isinstance(child, _TorchView):
            child = _TorchView(getattr(self._real, head))
            self._overrides[head] = child
        child.override(rest, value)


def _torch_view(module: types.ModuleType) -> _TorchView:
    """The module's private ``torch`` view, installed on first use."""
    current = module.__dict__.get("torch")
    if isinstance(current, _TorchView):
        return current
    if current is not torch:
        raise RuntimeError(f"{module.__name__}.torch is {current!r}, expected the torch module")
    view = _TorchView(torch)
    _set_attr(module, "torch", view)
    return view


def _override_in(module_names: tuple[str, ...], dotted: str, value: Any) -> None:
    for short in module_names:
        _torch_view(_module(short)).override(dotted, value)


def _cpu_current_device() -> str:
    return "cpu"


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _tensor_type_reports_cuda():
    """``tensor.type()`` names a CPU tensor as its CUDA twin (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``)."""
    original = torch.Tensor.type

    def type_(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]
