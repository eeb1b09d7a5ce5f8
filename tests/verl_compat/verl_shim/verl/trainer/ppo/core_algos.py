"""``verl.trainer.ppo.core_algos`` -> ``megatron_rl.algos`` (estimators, policy losses, KL, ``agg_loss``).

verl's tests replace a registry wholesale (``core_algos.ADV_ESTIMATOR_REGISTRY = {...}``) and then
register into it through ``register_adv_est``; the project's decorators and getters use the project's
registry object, so assigning a dict here empties that registry and fills it with the dict's entries
instead of rebinding the module attribute.
"""

import sys
import types

from megatron_rl.algos import *  # noqa: F401,F403
from megatron_rl.algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY  # noqa: F401

_REGISTRIES = ("ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY")


class _Module(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _REGISTRIES and name in self.__dict__:
            registry = self.__dict__[name]
            if value is not registry:
                registry.clear()
                registry.update(value)
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Module
