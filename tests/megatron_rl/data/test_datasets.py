"""Prompt datasets: loading parquet/jsonl in verl's layout, chat template, length limits, batching, resume."""

import json

import numpy as np
import pytest
import torch

from megatron_rl.data.datasets import (
    PromptDataLoader,
    PromptDataset,
    build_prompt_dataloader,
    collate_prompts,
    make_toy_dataset,
    toy_rows,
)
from megatron_rl.data.rewards import RewardFunction
from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    texts = [row["extra_info"]["question"] for row in toy_rows("toy_reverse", 200, seed=1)]
    return train_byte_bpe_tokenizer(texts + ["user assistant"], vocab_size=300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {
        "parquet": make_toy_dataset("toy_reverse", 10, seed=0, path=root / "reverse.parquet"),
        "jsonl": make_toy_dataset("toy_reverse", 10, seed=0, path=root / "reverse.jsonl"),
        "root": root,
    }


def cfg(files, **kw):
    return {"cache_dir": str(files["root"] / "hf_cache"), **kw}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chatml(question):
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- toy generator
def test_toy_rows_are_deterministic_and_correct():
    rows = toy_rows("toy_reverse", 30, seed=5, min_len=2, max_len=4)
    assert rows == toy_rows("toy_reverse", 30, seed=5, min_len=2, max_len=4)
    assert rows != toy_rows("toy_reverse", 30, seed=6, min_len=2, max_len=4)
    for i, row in enumerate(rows):
        digits = row["prompt"][0]["content"].removeprefix("Reverse: ").split()
        assert 2 <= len(digits) <= 4
        assert row["reward_model"]["ground_truth"] == " ".join(digits[::-1]) == row["extra_info"]["answer"]
        assert row["data_source"] == "toy_reverse" and row["extra_info"]["index"] == i
    for row in toy_rows("toy_count", 30, seed=5):
        head, seq = row["prompt"][0]["content"].split(" in: ")
        assert row["reward_model"]["ground_truth"] == str(seq.split().count(head.removeprefix("Count ")))
    for row in toy_rows("toy_copy", 5, seed=5):
        assert row["prompt"][0]["content"] == "Copy: " + row["reward_model"]["ground_truth"]
    with pytest.raises(
        ValueError, match="unknown toy task 'toy_sort'; valid names: toy_copy, toy_count, toy_multiply, toy_reverse"
    ):
        toy_rows("toy_sort", 3)
    with pytest.raises(ValueError, match="must end in .parquet, .jsonl or .json"):
        make_toy_dataset("toy_copy", 3, path="x.csv")


# ----------------------------------------------------------------------------- loading
def test_parquet_and_jsonl_load_the_same_tokenized_prompts(tokenizer, files):
    a = PromptDataset(files["parquet"], tokenizer, cfg(files, max_prompt_length=64))
    b = PromptDataset([str(files["jsonl"])], tokenizer, cfg(files, max_prompt_length=64))
    rows = toy_rows("toy_reverse", 10, seed=0)
    assert len(a) == len(b) == 10
    for i, row in enumerate(rows):
        question = row["extra_info"]["question"]
        assert a[i]["input_ids"] == b[i]["input_ids"] == tokenizer.encode(chatml(question), add_special_tokens=False)
        assert tokenizer.decode(a[i]["input_ids"]) == chatml(question)
        assert a[i]["ground_truth"] == b[i]["ground_truth"] == row["reward_model"]["ground_truth"]
        assert a[i]["data_source"] == "toy_reverse" and a[i]["index"] == i and a[i]["row"] == i
        assert a[i]["raw_prompt"] == row["prompt"] and a[i]["extra_info"] == row["extra_info"]


def test_string_prompts_and_multiple_files(tokenizer, files, tmp_path):
    path = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {"prompt": "Reverse: 1 2", "data_source": "toy_reverse", "reward_model": {"ground_truth": "2 1"}},
            {"prompt": "Copy: 3", "data_source": "toy_copy", "reward_model": {"ground_truth": "3"}},
        ],
    )
    ds = PromptDataset([path, files["jsonl"]], tokenizer, cfg(files))
    assert len(ds) == 12
    assert ds[0]["input_ids"] == tokenizer.encode(chatml("Reverse: 1 2"), add_special_tokens=False)
    assert ds[0]["raw_prompt"] == [{"role": "user", "content": "Reverse: 1 2"}]
    assert ds[1]["extra_info"] == {} and ds[1]["index"] == 1
    raw = PromptDataset(path, tokenizer, cfg(files, apply_chat_template=False))
    assert raw[0]["input_ids"] == tokenizer.encode("Reverse: 1 2", add_special_tokens=False)
    with pytest.raises(ValueError, match=r"row 0: column 'prompt' holds a message list but data.apply_chat_template"):
        PromptDataset(files["jsonl"], tokenizer, cfg(files, apply_chat_template=False))


def test_missing_column_and_ground_truth_errors(tokenizer, files, tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "hi", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(
        ValueError,
        match=r"m.jsonl' has no column 'data_source'; available columns: "
        r"\['prompt', 'reward_model'\]",
    ):
        PromptDataset(path, tokenizer, cfg(files))
    with pytest.raises(ValueError, match=r"has no column 'question'; available columns: \['data_source', 'prompt', "):
        PromptDataset(files["parquet"], tokenizer, cfg(files, prompt_key="question"))
    path = write_jsonl(
        tmp_path / "g.jsonl",
        [
            {"prompt": "a", "data_source": "x", "reward_model": {"ground_truth": "1"}},
            {"prompt": "b", "data_source": "x", "reward_model": {"style": "rule"}},
        ],
    )
    with pytest.raises(ValueError, match=r"g.jsonl row 1: reward_model.ground_truth is missing"):
        PromptDataset(path, tokenizer, cfg(files))
    assert PromptDataset(path, tokenizer, cfg(files), require_ground_truth=False)[1]["ground_truth"] is None
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": [{"role": "user"}], "data_source": "x", "reward_model": {"ground_truth": "1"}}],
    )
    with pytest.raises(ValueError, match=r"p.jsonl row 0: column 'prompt' must be a string or a non-empty list"):
        PromptDataset(path, tokenizer, cfg(files))
    with pytest.raises(ValueError, match=r"data.truncation='drop'; allowed: \['error', 'left', 'right', 'middle'\]"):
        PromptDataset(files["parquet"], tokenizer, cfg(files, truncation="drop"))


def test_max_prompt_length_filter_error_and_truncation(tokenizer, files):
    full = PromptDataset(files["parquet"], tokenizer, cfg(files, max_prompt_length=64))
    lengths = [len(full[i]["input_ids"]) for i in range(len(full))]
    limit = sorted(lengths)[4]  # rows longer than this are over the limit
    num_long = sum(n > limit for n in lengths)
    assert 0 < num_long < 10

    kept = PromptDataset(files["parquet"], tokenizer, cfg(files, max_prompt_length=limit, filter_overlong_prompts=True))
    assert kept.num_filtered == num_long and len(kept) == 10 - num_long
    assert [r["input_ids"] for r in kept] == [full[i]["input_ids"] for i in range(10) if lengths[i] <= limit]

    first_long = next(i for i, n in enumerate(lengths) if n > limit)
    with pytest.raises(
        ValueError,
        match=rf"reverse.parquet row {first_long}: prompt has {lengths[first_long]} tokens, "
        rf"more than data.max_prompt_length={limit}; set data.filter_overlong",
    ):
        PromptDataset(files["parquet"], tokenizer, cfg(files, max_prompt_length=limit))

    ids = full[first_long]["input_ids"]
    for mode, expected in [
        ("left", ids[-limit:]),
        ("right", ids[:limit]),
        ("middle", ids[: limit // 2] + ids[len(ids) - (limit - limit // 2) :]),
    ]:
        ds = PromptDataset(files["parquet"], tokenizer, cfg(files, max_prompt_length=limit, truncation=mode))
        assert ds[first_long]["input_ids"] == expected and len(expected) == limit
    with pytest.raises(ValueError, match="all 10 rows are longer than data.max_prompt_length=3"):
        PromptDataset(files["parquet"], tokenizer, cfg(files, max_prompt_length=3, filter_overlong_prompts=True))


def test_max_samples_like_verl(tokenizer, files):
    first = PromptDataset(files["parquet"], tokenizer, cfg(files), max_samples=4)
    assert [r["index"] for r in first] == [0, 1, 2, 3]
    picked = PromptDataset(files["parquet"], tokenizer, cfg(files, shuffle=True, seed=7), max_samples=4)
    assert [r["index"] for r in picked] == np.random.default_rng(7).choice(10, size=4, replace=False).tolist()


# ----------------------------------------------------------------------------- batching
def test_collate_left_pads():
    items = [
        {
            "input_ids": [5, 6, 7],
            "raw_prompt": "a",
            "data_source": "s",
            "ground_truth": "1",
            "extra_info": {},
            "index": 0,
            "row": 0,
        },
        {
            "input_ids": [8],
            "raw_prompt": "b",
            "data_source": "s",
            "ground_truth": "2",
            "extra_info": {},
            "index": 1,
            "row": 1,
        },
    ]
    batch = collate_prompts(items, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch["uid"] == ["0", "1"] and batch["ground_truth"] == ["1", "2"]
    assert collate_prompts(items, 9, pad_to=5)["input_ids"].tolist() == [[9, 9, 5, 6, 7], [9, 9, 9, 9, 8]]
    with pytest.raises(ValueError, match="a prompt has 3 tokens, more than pad_to=2"):
        collate_prompts(items, 0, pad_to=2)


def test_loader_batches_order_and_epochs(tokenizer, files):
    ds = PromptDataset(files["parquet"], tokenizer, cfg(files))
    loader = PromptDataLoader(ds, batch_size=4, seed=3)
    assert len(loader) == 2  # 10 rows, drop_last
    epoch0 = list(loader)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch_in_epoch"] == 0
    rows0 = [r for b in epoch0 for r in b["row"]]
    assert len(set(rows0)) == 8 and rows0 != sorted(rows0)
    assert epoch0[0]["uid"] == [f"0-{r}" for r in epoch0[0]["row"]]
    for b in epoch0:
        for j, r in enumerate(b["row"]):
            n = len(ds[r]["input_ids"])
            assert b["input_ids"][j, -n:].tolist() == ds[r]["input_ids"]
            assert b["attention_mask"][j].sum().item() == n and b["attention_mask"][j, -n:].all()
            assert (b["input_ids"][j, : b["input_ids"].shape[1] - n] == tokenizer.pad_token_id).all()
    epoch1 = list(loader)
    assert [r for b in epoch1 for r in b["row"]] != rows0  # a new permutation per epoch
    assert epoch1[0]["uid"][0].startswith("1-")
    again = PromptDataLoader(ds, batch_size=4, seed=3)
    assert [b["row"] for b in again] == [b["row"] for b in epoch0]
    assert [b["row"] for b in PromptDataLoader(ds, batch_size=4, seed=4)] != [b["row"] for b in epoch0]
    plain = PromptDataLoader(ds, batch_size=4, shuffle=False, drop_last=False)
    assert [b["row"] for b in plain] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match=r"batch_size=11 is larger than the dataset \(10 prompts\)"):
        PromptDataLoader(ds, batch_size=11)


def test_loader_resume_gives_the_same_next_batches(tokenizer, files):
    ds = PromptDataset(files["parquet"], tokenizer, cfg(files))
    reference = PromptDataLoader(ds, batch_size=3, seed=11)
    stream = [reference.next_batch() for _ in range(7)]  # 3 batches per epoch: crosses two epochs
    for stop in (1, 3, 4):
        run = PromptDataLoader(ds, batch_size=3, seed=11)
        for _ in range(stop):
            run.next_batch()
        state = run.state_dict()
        resumed = PromptDataLoader(ds, batch_size=3, seed=11)
        resumed.load_state_dict(state)
        for k in range(stop, 7):
            batch = resumed.next_batch()
            assert batch["uid"] == stream[k]["uid"]
            assert torch.equal(batch["input_ids"], stream[k]["input_ids"])
    assert run.state_dict() == {
        "epoch": 1,
        "batch_in_epoch": 1,
        "seed": 11,
        "shuffle": True,
        "batch_size": 3,
        "num_samples": 10,
        "drop_last": True,
    }
    with pytest.raises(ValueError, match="dataloader state has seed=11 but this loader has seed=12"):
        PromptDataLoader(ds, batch_size=3, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match=r"epoch=0, batch_in_epoch=3 is out of range \(0 <= batch_in_epoch < 3\)"):
        PromptDataLoader(ds, batch_size=3, seed=11).load_state_dict({"epoch": 0, "batch_in_epoch": 3})


def test_loader_batch_scores_with_reward_function(tokenizer, files):
    loader = build_prompt_dataloader(files["jsonl"], tokenizer, cfg(files, train_batch_size=5, seed=1))
    batch = loader.next_batch()
    answers = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in batch["ground_truth"]]
    width = max(map(len, answers))
    responses = torch.full((5, width), tokenizer.pad_token_id)
    mask = torch.zeros(5, width, dtype=torch.long)
    for i, ids in enumerate(answers):
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    out = RewardFunction(tokenizer)({"responses": responses, "response_mask": mask, **batch})
    assert out.scores.tolist() == [1.0] * 5
    assert out.token_level_scores.sum(-1).tolist() == [1.0] * 5
