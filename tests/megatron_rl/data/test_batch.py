"""``Batch``: DataProto's surface over a TensorDict, and the declared-fields decorator."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from megatron_rl.data.batch import Batch, BatchFields, batch_fields, fields_of


def _batch(n: int = 4) -> Batch:
    return Batch.from_single_dict(
        {
            "input_ids": torch.arange(n * 3).view(n, 3),
            "response_mask": torch.ones(n, 2),
            "uid": [f"u{i // 2}" for i in range(n)],
            "extra_info": [{"i": i} for i in range(n)],
        },
        meta_info={"step": 1},
    )


def test_fields_rows_and_dataproto_calls():
    b = _batch()
    assert len(b) == 4 and sorted(b.keys()) == ["extra_info", "input_ids", "response_mask", "uid"]
    assert b["input_ids"].shape == (4, 3) and list(b["uid"]) == ["u0", "u0", "u1", "u1"]
    assert b["extra_info"][3] == {"i": 3}  # dicts stay whole in the object array
    rows = b[1:3]
    assert list(rows["uid"]) == ["u0", "u1"] and torch.equal(rows["input_ids"], b["input_ids"][1:3])
    assert torch.equal(b.select_idxs(torch.tensor([True, False, False, True]))["input_ids"][:, 0], torch.tensor([0, 9]))
    assert list(b.repeat(2)["uid"]) == ["u0", "u0", "u0", "u0", "u1", "u1", "u1", "u1"]
    assert list(b.repeat(2, interleave=False)["uid"])[:4] == ["u0", "u0", "u1", "u1"]
    halves = b.chunk(2)
    assert [len(h) for h in halves] == [2, 2] and list(Batch.concat(halves)["uid"]) == list(b["uid"])
    with pytest.raises(ValueError, match="batch of 4 samples is not divisible into 3 chunks"):
        b.chunk(3)
    sel = b.select(["input_ids"], ["uid"])
    assert sorted(sel.keys()) == ["input_ids", "uid"] and sel.meta_info == {"step": 1}
    b["values"] = torch.zeros(4, 2)
    merged = sel.union(b.select(["values"], []))
    assert sorted(merged.keys()) == ["input_ids", "uid", "values"]
    popped = b.pop(["values"])
    assert "values" not in b and "values" in popped
    again = pickle.loads(pickle.dumps(b))
    assert torch.equal(again["input_ids"], b["input_ids"]) and list(again["uid"]) == list(b["uid"])


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match=r"batch fields disagree on the batch size: \{'a': 2, 'b': 3\}"):
        Batch({"a": torch.zeros(2), "b": torch.zeros(3)})
    b = _batch()
    with pytest.raises(ValueError, match="field 'uid' has 3 values for a batch of 4"):
        b["uid"] = ["a", "b", "c"]
    with pytest.raises(KeyError, match="batch has no field 'nope'"):
        b["nope"]
    with pytest.raises(ValueError, match="union: field 'uid' differs"):
        b.union(Batch.from_single_dict({"uid": list("abcd")}))


def test_a_field_set_anew_replaces_the_old_one():
    b = _batch()
    old = b["response_mask"]
    b["response_mask"] = torch.zeros(4, 2)  # the trainer owns the batch: rejection masks replace the mask
    assert b["response_mask"] is not old and float(b["response_mask"].sum()) == 0.0
    assert b["response_mask"] is b["response_mask"]  # the same tensor object on every read (the shard cache keys on it)


class _Role:
    @batch_fields("input_ids", "responses", optional=("ref_log_prob",))
    def compute(self, batch, scale=1):
        return scale * batch["input_ids"].sum()


def test_declared_fields_are_checked_and_readable():
    assert fields_of(_Role.compute) == BatchFields(("input_ids", "responses"), ("ref_log_prob",))
    assert fields_of(_Role.compute).all == ("input_ids", "responses", "ref_log_prob")
    assert _Role().compute({"input_ids": torch.ones(2), "responses": torch.ones(2)}, scale=3) == 6
    with pytest.raises(ValueError, match=r"batch is missing field\(s\) \['responses'\]; it has \['input_ids'\]"):
        _Role().compute({"input_ids": torch.ones(2)})
    with pytest.raises(TypeError, match="declares no batch fields"):
        fields_of(lambda batch: batch)
    assert np.asarray(_batch()["uid"]).dtype == object
