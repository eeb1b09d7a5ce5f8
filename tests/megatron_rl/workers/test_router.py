"""The request router's pure parts: contiguous runs balanced by outstanding tokens, merged outputs."""

import torch

from megatron_rl.workers.router import merge_outputs, split_contiguous


def test_split_contiguous_balances_and_prefers_idle_replicas():
    assert split_contiguous([10] * 8, [0, 0]) == [(0, range(0, 4)), (1, range(4, 8))]
    assert split_contiguous([10] * 6, [0, 0, 0]) == [(0, range(0, 2)), (1, range(2, 4)), (2, range(4, 6))]
    assert split_contiguous([10] * 8, [100, 0]) == [(1, range(0, 8))]  # the busy replica gets nothing
    assert split_contiguous([10] * 8, [20, 0]) == [(1, range(0, 5)), (0, range(5, 8))]  # levels 50 / 50
    runs = split_contiguous([5, 50, 5, 5, 5, 5, 5, 5], [0, 0])
    assert [r for _, r in runs] == [range(0, 2), range(2, 8)]  # contiguous, every prompt once
    assert split_contiguous([7], [0, 0, 0]) == [(2, range(0, 1))]


def test_merge_outputs_in_prompt_order():
    merged = merge_outputs([{"a": torch.ones(2, 3), "uid": ["x", "y"]}, {"a": torch.zeros(1, 3), "uid": ["z"]}])
    assert merged["a"].tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3] and merged["uid"] == ["x", "y", "z"]


def test_a_replica_given_nothing_counts_zero_tokens_in_the_balance():
    """``rollout/replica_tokens_max_over_mean`` over every replica: one doing all the work reads 2.0 of 2."""
    from megatron_rl.workers.router import RolloutRouter

    router = RolloutRouter([object(), object()], response_length=8)
    router._record([1], [40.0], [0.5])
    assert router.last_tokens == [0.0, 40.0] and router.metrics()["rollout/replica_tokens_max_over_mean"] == 2.0
    router._record([0, 1], [30.0, 34.0], [0.4, 0.6])
    assert router.metrics() == {
        "rollout/replicas": 2.0,
        "rollout/replica_tokens_max_over_mean": 34.0 / 32.0,
        "rollout/replica_gen_seconds_max": 0.6,
        "rollout/replica_gen_seconds_min": 0.4,
    }
