"""What the terminal shows per validation: one line with the step, mean reward and exact fraction."""

from pathlib import Path

from megatron_rl.job.report import validation_exact, validation_reward
from megatron_rl.trainer.callbacks import validation_line


def test_one_line_with_step_mean_reward_and_exact_fraction():
    per_source = {
        "toy_reverse": {"reward": [1.0, 0.5, 0.0, 0.5], "acc": [1.0, 0.0, 0.0, 0.0]},
        "other": {"reward": [1.0], "acc": [1.0]},
    }
    line = validation_line(10, per_source, Path("/run/validation/10.jsonl"))
    assert line == "[val] step 10: mean reward 0.600, exact 40.0% (5 samples); samples in /run/validation/10.jsonl"


def test_non_finite_values_are_left_out_and_no_acc_means_no_exact():
    assert (
        validation_line(0, {"s": {"reward": [0.25, float("nan"), 0.75]}})
        == "[val] step 0: mean reward 0.500 (2 samples)"
    )
    assert (
        validation_line(3, {"s": {"reward": [1.0, 1.0], "acc": [float("nan"), 1.0]}})
        == "[val] step 3: mean reward 1.000, exact 100.0% (2 samples)"
    )
    assert validation_line(4, {"s": {"reward": [float("nan")]}}) == "[val] step 4: no finite reward (0 samples)"


def test_summary_reads_the_validation_reward_and_exact_rate_of_a_metrics_row():
    row = {
        "step": 0,
        "val-core/a/reward/mean@1": 0.5,
        "val-core/b/reward/mean@1": 0.25,
        "val-aux/a/acc/mean@1": 0.125,
        "val-aux/a/len/mean@1": 9.0,
    }
    assert validation_reward(row) == 0.375 and validation_exact(row) == 0.125
    assert validation_exact({"val-core/a/reward/mean@1": 0.5}) is None
