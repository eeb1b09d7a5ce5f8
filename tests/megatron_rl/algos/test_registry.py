"""Registries: decorator registration, duplicate names, unknown-name errors."""

from enum import Enum

import pytest

from megatron_rl.algos import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
)


def test_register_and_lookup_by_string_and_enum():
    reg = Registry("thing")

    class Names(str, Enum):
        A = "a"

    @reg.register(Names.A)
    def fa():
        return 1

    assert reg["a"] is fa
    assert reg[Names.A] is fa
    assert list(reg) == ["a"] and len(reg) == 1


def test_duplicate_name_is_an_error():
    reg = Registry("thing")

    @reg.register("x")
    def f1():
        return 1

    with pytest.raises(ValueError, match=r"thing 'x' is already registered to .*f1; refusing to replace it with .*f2"):

        @reg.register("x")
        def f2():
            return 2


def test_reregistering_the_same_function_is_allowed():
    reg = Registry("thing")

    def f():
        return 1

    reg.register("x")(f)
    reg.register("x")(f)
    assert reg["x"] is f


def test_unknown_name_lists_every_valid_name():
    reg = Registry("thing")
    reg.register("b")(lambda: 0)
    reg.register("a")(lambda: 0)
    with pytest.raises(ValueError, match=r"^unknown thing 'zzz'; valid names: a, b$"):
        reg["zzz"]
    with pytest.raises(KeyError):  # also a KeyError, so Mapping semantics hold
        reg["zzz"]
    assert reg.get("zzz") is None


def test_global_registries_reject_unknown_names_with_all_valid_names():
    with pytest.raises(UnknownNameError) as info:
        get_adv_estimator_fn("not_an_estimator")
    for name in ADV_ESTIMATORS:
        assert name in str(info.value)
    with pytest.raises(ValueError) as info:
        get_policy_loss_fn("nope")
    for name in POLICY_LOSSES:
        assert name in str(info.value)


def test_global_registry_duplicate_via_verl_decorator():
    name = "test_only_estimator"

    @register_adv_est(name)
    def est(**kwargs):
        return None, None

    try:
        with pytest.raises(ValueError, match="already registered"):

            @register_adv_est(name)
            def other(**kwargs):
                return None, None

    finally:
        ADV_ESTIMATORS.unregister(name)
    assert name not in ADV_ESTIMATORS


def test_bad_name_type():
    with pytest.raises(TypeError, match="non-empty string"):
        Registry("thing").register("")
