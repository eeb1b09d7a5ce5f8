"""Data-parallel dispatch: each DP shard of a field goes into Ray's object store once per step,
is shared by every call that reads the field, and reaches the ranks intact."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.data.batch import Batch
from megatron_rl.workers.dispatch import ShardCache, resolve_shard, split_for_dp

ray = pytest.importorskip("ray")


def test_split_for_dp_names_the_sizes():
    shards = split_for_dp({"a": torch.arange(6)}, 3)
    assert [s["a"].tolist() for s in shards] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="batch of 6 samples is not divisible by the data-parallel size 4"):
        split_for_dp({"a": torch.arange(6)}, 4)
    with pytest.raises(ValueError, match=r"batch fields disagree on the batch size: \{'a': 6, 'b': 2\}"):
        split_for_dp({"a": torch.arange(6), "b": torch.arange(2)}, 2)


def test_each_shard_is_put_once_per_step_and_fetched_intact(
    ray_cluster,
):  # the session's shared Ray (tests/conftest.py)
    batch = Batch.from_single_dict(
        {"input_ids": torch.arange(12).view(4, 3), "response_mask": torch.ones(4, 3), "uid": list("aabb")}
    )
    cache = ShardCache()
    first = cache.refs(batch, ("input_ids", "response_mask", "old_log_probs"), dp=2)  # old_log_probs: not yet there
    assert cache.num_puts == 4 and sorted(first[0]) == ["input_ids", "response_mask"]
    again = cache.refs(batch, ("input_ids", "response_mask"), dp=2)  # the next role of the step: nothing new
    assert cache.num_puts == 4 and again[1]["input_ids"] == first[1]["input_ids"]
    batch["old_log_probs"] = torch.randn(4, 3)  # added by the actor: only the new field travels
    update = cache.refs(batch, ("input_ids", "response_mask", "old_log_probs"), dp=2)
    assert cache.num_puts == 6 and update[0]["input_ids"] == first[0]["input_ids"]
    batch["response_mask"] = torch.zeros(4, 3)  # a field set anew is put anew
    cache.refs(batch, ("response_mask",), dp=2)
    assert cache.num_puts == 8
    cache.refs(batch, ("input_ids",), dp=4)  # another DP size has shards of its own
    assert cache.num_puts == 12
    shard = resolve_shard(update[1])
    assert torch.equal(shard["input_ids"], batch["input_ids"][2:]) and torch.equal(
        shard["old_log_probs"], batch["old_log_probs"][2:]
    )
    cache.clear()
    cache.refs(batch, ("input_ids",), dp=2)
    assert cache.num_puts == 14
