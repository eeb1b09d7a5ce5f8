"""Name -> function registries that turn "change the algorithm" into "change a string".

verl's surface, by verl's names: ``ADV_ESTIMATOR_REGISTRY`` / ``POLICY_LOSS_REGISTRY`` (dicts in
verl; here the same registries, which also take ``REGISTRY[name] = fn``, ``copy()``, ``clear()``,
``update()`` and ``pop()`` as verl's tests use them to save and restore), the decorators
``register_adv_est`` / ``register_policy_loss``, the getters and the ``AdvantageEstimator`` enum.

Entries registered from user code (a function whose module is outside ``megatron_rl``) are
*plugins*: ``plugins()`` snapshots them into a picklable ``Plugins`` that registers them again
wherever it is unpickled. ``megatron_rl.algos.needs.resolve_run`` puts the snapshot into the
actor's policy-loss config, so a loss registered in the driver's script before ``train`` is
known inside the Ray workers that compute it.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, Callable, TypeVar

from megatron_rl.utils.registry import Registry, UnknownNameError

__all__ = [
    "Registry",
    "UnknownNameError",
    "EstimatorNeeds",
    "AlgoRegistry",
    "AdvantageEstimator",
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "Plugins",
    "plugins",
    "register_adv_est",
    "register_policy_loss",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "estimator_needs",
]

F = TypeVar("F", bound=Callable)


@dataclasses.dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator reads beyond rewards, mask and group ids; declared when it is
    registered, so the trainer asks the entry instead of testing names."""

    values: bool = False
    """Critic values (GAE): a critic is trained."""
    baseline: bool = False
    """``reward_baselines`` [batch]: the reward of one greedy response per prompt (ReMax)."""
    ref: bool = False
    """Reference-policy log-probs: a reference model runs."""
    reward_fields: bool = False
    """The reward's per-sample fields (``non_tensor_batch``), e.g. GDPO's separate reward components."""
    sum_pi_squared: bool = False
    """``sum_pi_squared`` [batch, response_length] (sum over the vocabulary of pi^2, from the actor's
    old-log-prob pass) with ``old_log_probs`` and, when present, ``rollout_is_weights`` (the
    optimal-token-baseline estimators)."""


class AdvantageEstimator(str, Enum):
    """verl's enum of the built-in estimator names (``algorithm.adv_estimator``); registering a
    string name needs no member here, as in verl."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


def _is_plugin(fn: Callable) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return not (module == "megatron_rl" or module.startswith("megatron_rl."))


class AlgoRegistry(Registry):
    """A ``Registry`` that also takes verl's dict assignment and remembers which entries came from
    user code (``plugin_entries``), so they can follow the work into other processes."""

    def __init__(self, kind: str, traits: Callable[..., Any] | None = None):
        super().__init__(kind, traits)
        self._plugins: set[str] = set()

    def register(self, name: str | Enum, **traits: Any) -> Callable[[F], F]:
        """As ``Registry.register``; an entry defined outside ``megatron_rl`` is a plugin."""
        inner = super().register(name, **traits)
        key = name.value if isinstance(name, Enum) else name

        def decorator(fn: F) -> F:
            inner(fn)
            if _is_plugin(fn):
                self._plugins.add(key)
            return fn

        return decorator

    def __setitem__(self, name: str | Enum, fn: Callable) -> None:
        """``REGISTRY[name] = fn`` (verl's registries are dicts): ``register(name)(fn)``, default traits."""
        self.register(name)(fn)

    def __delitem__(self, name: str) -> None:
        self[name]  # an unknown name raises UnknownNameError
        self.unregister(name)
        self._plugins.discard(name)

    # -- verl's tests treat the registries as dicts: save with copy(), empty, restore with update() --
    def copy(self) -> "RegistrySnapshot":
        """The entries as a dict (verl's ``REGISTRY.copy()``) that also remembers each entry's traits and
        plugin mark, so ``update(snapshot)`` after ``clear()`` restores the registry exactly."""
        snapshot = RegistrySnapshot(self._entries)
        snapshot.traits = dict(self._traits)
        snapshot.plugins = set(self._plugins)
        return snapshot

    def clear(self) -> None:
        """Remove every entry (verl's ``REGISTRY.clear()``; tests only: the built-ins go too)."""
        self._entries.clear()
        self._traits.clear()
        self._plugins.clear()

    def update(self, other: Any = (), **entries: Callable) -> None:
        """``REGISTRY[name] = fn`` for each item (verl's ``dict.update``); a ``copy()`` snapshot brings back
        its traits. Replacing an entry with a different function is refused, as registering it is."""
        items = dict(other.items() if hasattr(other, "items") else other, **entries)
        traits = getattr(other, "traits", {})
        for name, fn in items.items():
            declared = traits.get(name)
            self.register(name, **({} if declared is None else dataclasses.asdict(declared)))(fn)
            if name in getattr(other, "plugins", ()):
                self._plugins.add(name)
            elif hasattr(other, "plugins"):
                self._plugins.discard(name)

    def pop(self, name: str, *default: Any) -> Any:
        """Remove ``name`` and return its function (verl's ``dict.pop``)."""
        if name not in self._entries:
            if default:
                return default[0]
            self[name]  # UnknownNameError listing the valid names
        fn = self._entries[name]
        del self[name]
        return fn

    def plugin_entries(self) -> dict[str, tuple[Callable, Any]]:
        """``name -> (fn, traits)`` of the entries registered from user code."""
        return {name: (self[name], self._traits[name]) for name in sorted(self._plugins) if name in self}

    def install(self, entries: dict[str, tuple[Callable, Any]]) -> None:
        """Register ``plugin_entries()`` of another process's registry here (same function: no-op)."""
        for name, (fn, traits) in entries.items():
            fields = {} if traits is None else dataclasses.asdict(traits)
            self.register(name, **fields)(fn)


class RegistrySnapshot(dict):
    """``AlgoRegistry.copy()``: a plain dict of the entries plus their ``traits`` and ``plugins``."""

    traits: dict[str, Any]
    plugins: set[str]


ADV_ESTIMATORS = AlgoRegistry("advantage estimator", traits=EstimatorNeeds)
"""``algorithm.adv_estimator`` name -> ``fn(**kwargs) -> (advantages, returns)``; each entry
declares its ``EstimatorNeeds`` (``ADV_ESTIMATORS.traits_of(name)``)."""

POLICY_LOSSES = AlgoRegistry("policy loss")
"""``actor.policy_loss.loss_mode`` name -> ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``."""

ADV_ESTIMATOR_REGISTRY = ADV_ESTIMATORS
"""verl's name for ``ADV_ESTIMATORS``."""
POLICY_LOSS_REGISTRY = POLICY_LOSSES
"""verl's name for ``POLICY_LOSSES``."""


class Plugins:
    """A picklable snapshot of the user-registered estimators and policy losses; unpickling it
    (e.g. inside a Ray worker that receives a config holding it) registers them there."""

    def __init__(self, estimators: dict | None = None, losses: dict | None = None):
        self.estimators, self.losses = estimators or {}, losses or {}
        self.install()

    def install(self) -> None:
        """Register the snapshot's entries in this process's registries."""
        ADV_ESTIMATORS.install(self.estimators)
        POLICY_LOSSES.install(self.losses)

    def __bool__(self) -> bool:
        return bool(self.estimators or self.losses)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plugins) and (sorted(self.estimators), sorted(self.losses)) == (
            sorted(other.estimators),
            sorted(other.losses),
        )

    def __reduce__(self):
        return (Plugins, (self.estimators, self.losses))

    def __repr__(self) -> str:
        return f"Plugins(estimators={sorted(self.estimators)}, losses={sorted(self.losses)})"


def plugins() -> Plugins | None:
    """The user-registered entries of both registries, or None when there are none."""
    snapshot = Plugins(ADV_ESTIMATORS.plugin_entries(), POLICY_LOSSES.plugin_entries())
    return snapshot if snapshot else None


def register_adv_est(
    name: str | Enum,
    *,
    needs_values: bool = False,
    needs_baseline: bool = False,
    needs_ref: bool = False,
    needs_reward_fields: bool = False,
    needs_sum_pi_squared: bool = False,
) -> Callable[[F], F]:
    """Register an advantage estimator (verl's decorator name) with what it needs (``EstimatorNeeds``)."""
    return ADV_ESTIMATORS.register(
        name,
        values=needs_values,
        baseline=needs_baseline,
        ref=needs_ref,
        reward_fields=needs_reward_fields,
        sum_pi_squared=needs_sum_pi_squared,
    )


def register_policy_loss(name: str | Enum) -> Callable[[F], F]:
    """Register a policy loss (verl's decorator name)."""
    return POLICY_LOSSES.register(name)


def get_adv_estimator_fn(name: str | Enum) -> Callable:
    """Look up an advantage estimator; an unknown name raises ValueError listing valid names."""
    return ADV_ESTIMATORS[name]


def get_policy_loss_fn(name: str | Enum) -> Callable:
    """Look up a policy loss; an unknown name raises ValueError listing valid names."""
    return POLICY_LOSSES[name]


def estimator_needs(name: str | Enum) -> EstimatorNeeds:
    """What the advantage estimator ``name`` needs (unknown names list the valid ones)."""
    return ADV_ESTIMATORS.traits_of(name)
