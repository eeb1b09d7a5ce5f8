"""``Registry``: a read-only name -> object mapping filled by a decorator.

The bottom of ``megatron_rl`` (no project imports): the algorithm registries
(``megatron_rl.algos``), the rule rewards and the toy tasks (``megatron_rl.data``) are all
instances. A duplicate name is an error; an unknown name lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Any, Callable, Optional, TypeVar

__all__ = ["Registry", "UnknownNameError"]

F = TypeVar("F", bound=Callable)


class UnknownNameError(ValueError, KeyError):
    """A registry lookup of a name that was never registered (a ValueError and a KeyError)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Registry(Mapping[str, Callable]):
    """A read-only mapping filled by a decorator; duplicates and unknown names are errors."""

    def __init__(self, kind: str, traits: Optional[Callable[..., Any]] = None):
        """``traits``: a class (e.g. a frozen dataclass) whose instance every entry declares with
        ``register(name, **fields)`` and that ``traits_of(name)`` returns; None = no traits."""
        self.kind = kind
        self._entries: dict[str, Callable] = {}
        self._traits_cls = traits
        self._traits: dict[str, Any] = {}

    def register(self, name: str | Enum, **traits: Any) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` (a string or a str-valued Enum), with the
        entry's declared ``traits`` (fields of the registry's traits class)."""
        key = name.value if isinstance(name, Enum) else name
        if traits and self._traits_cls is None:
            raise TypeError(f"{self.kind} registry declares no traits; got {sorted(traits)}")
        declared = self._traits_cls(**traits) if self._traits_cls is not None else None
        if not isinstance(key, str) or not key:
            raise TypeError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            existing = self._entries.get(key)
            if existing is not None and _qualname(existing) != _qualname(fn):
                raise ValueError(
                    f"{self.kind} {key!r} is already registered to {_qualname(existing)}; "
                    f"refusing to replace it with {_qualname(fn)}"
                )
            self._entries[key] = fn
            self._traits[key] = declared
            return fn

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests and plugins that replace themselves)."""
        self._entries.pop(name, None)
        self._traits.pop(name, None)

    def traits_of(self, name: str | Enum) -> Any:
        """What entry ``name`` declared at registration (an instance of the traits class)."""
        self[name]  # an unknown name raises UnknownNameError listing the valid ones
        return self._traits[name.value if isinstance(name, Enum) else name]

    def __getitem__(self, name: str | Enum) -> Callable:
        key = name.value if isinstance(name, Enum) else name
        try:
            return self._entries[key]
        except (KeyError, TypeError):
            raise UnknownNameError(
                f"unknown {self.kind} {key!r}; valid names: {', '.join(sorted(self._entries))}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
