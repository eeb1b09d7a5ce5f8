"""``trainer.callbacks``: a bad dotted path is refused naming the entry and why; a raising hook names
the callback and the hook. (A 2-step run with a callback: test_ppo_trainer.py's colocated run.)"""

from __future__ import annotations

import pytest

from megatron_rl.config.sections import TrainerConfig
from megatron_rl.trainer.callbacks import HOOKS, TrainerCallback, load_callbacks


class Exploding(TrainerCallback):
    def on_step_end(self, trainer, step, metrics):
        raise KeyError("no such metric")


@pytest.mark.parametrize(
    "path,message",
    [
        (
            "tests.megatron_rl.trainer.no_such_module.X",
            "trainer.callbacks[0]='tests.megatron_rl.trainer.no_such_module.X': "
            "cannot import module 'tests.megatron_rl.trainer.no_such_module'",
        ),
        (
            "megatron_rl.trainer.callbacks.Nope",
            "trainer.callbacks[0]='megatron_rl.trainer.callbacks.Nope': module "
            "'megatron_rl.trainer.callbacks' has no attribute 'Nope'",
        ),
        (
            "megatron_rl.trainer.callbacks.Validator",
            "trainer.callbacks[0]='megatron_rl.trainer.callbacks.Validator': "
            "Validator is not a subclass of megatron_rl.trainer.callbacks.TrainerCallback",
        ),
    ],
)
def test_a_bad_callback_path_is_refused_by_entry(path, message):
    with pytest.raises(ValueError) as err:
        load_callbacks([path])
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("value", [["x"], ["a..b"], [3], ["a.b-c"]])
def test_the_config_refuses_what_is_not_a_dotted_path(value):
    with pytest.raises(ValueError, match=r"trainer\.callbacks\[0\]=.*expected a dotted path 'package\.module\.Class'"):
        TrainerConfig(callbacks=value)


def test_hooks_run_in_list_order_and_an_error_names_the_callback_and_hook():
    seen = []

    callbacks = load_callbacks([f"{__name__}.Exploding"])
    assert len(callbacks) == 1 and HOOKS[0] == "on_fit_start" and HOOKS[-1] == "on_fit_end"
    callbacks.call("on_fit_start", None, 0)  # the base class's hooks do nothing
    with pytest.raises(
        RuntimeError,
        match=rf"trainer\.callbacks: {__name__}\.Exploding\.on_step_end raised "
        r"KeyError: 'no such metric'",
    ):
        callbacks.call("on_step_end", None, 1, {})

    class First(TrainerCallback):
        def on_step_end(self, trainer, step, metrics):
            seen.append(("first", step))

    class Second(TrainerCallback):
        def on_step_end(self, trainer, step, metrics):
            seen.append(("second", step))

    from megatron_rl.trainer.callbacks import Callbacks

    Callbacks([First(), Second()]).call("on_step_end", None, 3, {})
    assert seen == [("first", 3), ("second", 3)]
