"""``trainer.callbacks``: a bad dotted path is refused naming the entry and why; a raising hook names
the callback and the hook. (A 2-step run with a callback: test_ppo_trainer.py's colocated run.)"""

from __future__ import annotations

import pytest

from megatron_rl.config.trainer import TrainerConfig
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
            "megatron_rl.trainer.callbacks.GenerationDump",
            "trainer.callbacks[0]='megatron_rl.trainer.callbacks.GenerationDump': "
            "GenerationDump is not a subclass of megatron_rl.trainer.callbacks.TrainerCallback",
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


def test_the_side_concerns_are_hooks_run_by_order_and_their_errors_pass_unwrapped(tmp_path):
    """The trainer's own callbacks and a user's share one dispatch: validation (-30) and checkpoint (-20)
    before the user's hook (0), which sees their metrics; the metrics log (10) writes what the user's hook
    added; the skip guard (20) stops the run only after the step is logged, with its own error (a
    built-in's error is not wrapped; a user's is, once, also when raised inside a nested dispatch)."""
    import json
    from types import SimpleNamespace

    from megatron_rl.trainer.callbacks import Callbacks, CallbackError, MetricsLog, SkipGuard
    from megatron_rl.trainer.metrics import MetricsLogger

    seen = []

    class FakeValidation(TrainerCallback):
        order = -30

        def on_step_end(self, trainer, step, metrics):
            metrics["val-core/x/reward/mean@1"] = 0.5
            trainer.callbacks.call("on_validation_end", trainer, step, {"val-core/x/reward/mean@1": 0.5})

    class User(TrainerCallback):
        def on_validation_end(self, trainer, step, metrics):
            seen.append(("user.on_validation_end", step))

        def on_step_end(self, trainer, step, metrics):
            seen.append(("user.on_step_end", step, "val-core/x/reward/mean@1" in metrics))
            metrics["user/added"] = 1.0

    hooks = Callbacks([User()])
    trainer = SimpleNamespace(callbacks=hooks, batches=SimpleNamespace(last_error="reward timed out"))
    hooks.add(FakeValidation())
    logger = MetricsLogger(tmp_path, ["console"], total_steps=3)
    guard_cfg = TrainerConfig(max_consecutive_skipped_steps=2)
    with hooks.during(MetricsLog(logger), SkipGuard(guard_cfg)):
        assert [type(cb).__name__ for cb, _ in hooks.ordered()] == ["FakeValidation", "User", "MetricsLog", "SkipGuard"]
        hooks.call("on_step_end", trainer, 1, {"training/global_step": 1, "training/step_skipped": 1.0})
        with pytest.raises(RuntimeError, match=r"^2 steps in a row were skipped .* last error: reward timed out"):
            hooks.call("on_step_end", trainer, 2, {"training/global_step": 2, "training/step_skipped": 1.0})
    assert len(hooks) == 2  # the per-fit callbacks left with the fit; the logger was closed
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["user/added"], r["val-core/x/reward/mean@1"]) for r in rows] == [(1, 1.0, 0.5), (2, 1.0, 0.5)]
    assert seen == [
        ("user.on_validation_end", 1),
        ("user.on_step_end", 1, True),
        ("user.on_validation_end", 2),
        ("user.on_step_end", 2, True),
    ]

    class Broken(TrainerCallback):
        def on_validation_end(self, trainer, step, metrics):
            raise ValueError("bad")

    hooks = Callbacks([Broken()])
    hooks.add(FakeValidation())
    trainer.callbacks = hooks
    with pytest.raises(CallbackError) as err:  # raised inside the validation's nested dispatch: wrapped once
        hooks.call("on_step_end", trainer, 3, {})
    assert str(err.value).startswith("trainer.callbacks: ") and str(err.value).count("trainer.callbacks") == 1
    assert str(err.value).endswith(".Broken.on_validation_end raised ValueError: bad"), str(err.value)
