"""``verl.trainer.ppo.core_algos`` -> ``megatron_rl.algos``.

verl's registries are module-level dicts that its tests replace wholesale
(``core_algos.ADV_ESTIMATOR_REGISTRY = {...}``) and then fill through ``register_adv_est``; here the
module assigns such a dict *into* the project's registry (clear + update), so the decorators and
getters, which use that registry, see it.
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
