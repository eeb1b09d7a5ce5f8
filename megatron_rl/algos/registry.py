"""Name -> function registries that turn "change the algorithm" into "change a string"."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Callable, TypeVar

__all__ = [
    "Registry",
    "UnknownNameError",
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "register_adv_est",
    "register_policy_loss",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
]

F = TypeVar("F", bound=Callable)


class UnknownNameError(ValueError, KeyError):
    """A registry lookup of a name that was never registered (a ValueError and a KeyError)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Registry(Mapping[str, Callable]):
    """A read-only mapping filled by a decorator; duplicates and unknown names are errors."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Callable] = {}

    def register(self, name: str | Enum) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` (a string or a str-valued Enum)."""
        key = name.value if isinstance(name, Enum) else name
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
            return fn

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests and plugins that replace themselves)."""
        self._entries.pop(name, None)

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


ADV_ESTIMATORS = Registry("advantage estimator")
"""``algorithm.adv_estimator`` name -> ``fn(**kwargs) -> (advantages, returns)``."""

POLICY_LOSSES = Registry("policy loss")
"""``actor.policy_loss.loss_mode`` name -> ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``."""


def register_adv_est(name: str | Enum) -> Callable[[F], F]:
    """Register an advantage estimator (verl's decorator name)."""
    return ADV_ESTIMATORS.register(name)


def register_policy_loss(name: str | Enum) -> Callable[[F], F]:
    """Register a policy loss (verl's decorator name)."""
    return POLICY_LOSSES.register(name)


def get_adv_estimator_fn(name: str | Enum) -> Callable:
    """Look up an advantage estimator; an unknown name raises ValueError listing valid names."""
    return ADV_ESTIMATORS[name]


def get_policy_loss_fn(name: str | Enum) -> Callable:
    """Look up a policy loss; an unknown name raises ValueError listing valid names."""
    return POLICY_LOSSES[name]
