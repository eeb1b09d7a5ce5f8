"""Rule rewards (verl / TinyZero semantics, hand-computed) and the batch scorer's placement and errors."""

import math

import pytest
import torch

from megatron_rl.algos.algo_registry import UnknownNameError
from megatron_rl.data.datasets import TOY_TASKS, toy_rows
from megatron_rl.data.rewards import (
    REWARD_FNS,
    RewardError,
    RewardFunction,
    default_compute_score,
    get_reward_fn,
    gsm8k_extract_solution,
    load_custom_reward_fn,
)
from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"{a} {b} {a + b} #### {a * b}" for a in range(12) for b in range(12)]
    return train_byte_bpe_tokenizer(texts, vocab_size=300)


def score(name, text, truth, **kw):
    return REWARD_FNS[name](name, text, truth, None, **kw)


# ----------------------------------------------------------------------------- gsm8k
@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("so 8 * 9 = 72\n#### 72", "strict", 1.0),
        ("#### 5 first, then #### 72", "strict", 1.0),  # the last '#### n' counts
        ("#### 7,2", "strict", 1.0),  # commas are removed
        ("#### 1,000", "strict", 0.1),  # '1000' != '72' -> format_score
        ("the answer is 72", "strict", 0.0),  # no '#### ' -> no answer
        ("####72", "strict", 0.0),  # the space after #### is required
        ("#### 71", "strict", 0.1),  # answered, wrong -> format_score
        ("#### 72" + "x" * 300, "strict", 0.0),  # only the last 300 characters are searched
        ("the answer is 72", "flexible", 1.0),
        ("I think 70, no: 72.", "flexible", 0.1),  # the last number-like run is '72.'
        ("72 .", "flexible", 1.0),  # a lone '.' is skipped
        ("72 ...", "flexible", 0.1),  # ... but '...' is a (wrong) answer
        ("no digits at all", "flexible", 0.0),
    ],
)
def test_gsm8k_scores(text, method, expected):
    out = score("gsm8k", text, "72", method=method, format_score=0.1)
    assert out["score"] == pytest.approx(expected, abs=0)
    assert out["acc"] == float(expected == 1.0)


def test_gsm8k_extraction_and_bad_ground_truth():
    assert gsm8k_extract_solution("#### -1,234.5") == "-1234.5"
    assert gsm8k_extract_solution("total 1,234", method="flexible") == "1,234"  # verl keeps commas here
    assert gsm8k_extract_solution(". .", method="flexible") == "."  # verl falls back to the first match
    with pytest.raises(ValueError, match="method='loose'"):
        gsm8k_extract_solution("1", method="loose")
    with pytest.raises(TypeError, match="gsm8k ground_truth must be a string like '72', got int 72"):
        score("gsm8k", "#### 72", 72)


# ----------------------------------------------------------------------------- countdown
GT = {"target": 51, "numbers": [93, 43, 1]}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>93-43=50</think> <answer>(93-43)+1</answer>", 1.0),
        ("<answer>1 + 93 - 43</answer>", 1.0),
        ("<answer>93-43-1</answer>", 0.1),  # right numbers, evaluates to 49
        ("<answer>93-42+1</answer>", 0.1),  # 42 is not one of the numbers
        ("<answer>93-43+1+1</answer>", 0.1),  # 1 used twice
        ("<answer>(93-43)+1</answer>\nDone.", 0.0),  # only the last line is searched
        ("(93-43)+1", 0.0),  # no <answer> tag
        ("<answer>abs(93-43)+1</answer>", 0.1),  # a name is not arithmetic
        ("<answer>1</answer> <answer>(93-43)+1</answer>", 1.0),  # the last tag counts
        ("Assistant: <answer>(93-43)+1</answer>", 1.0),  # TinyZero's prompt header is cut
    ],
)
def test_countdown_scores(text, expected):
    out = score("countdown", text, GT)
    assert out["score"] == expected
    assert out["acc"] == float(expected == 1.0)


def test_countdown_arithmetic_edge_cases():
    assert score("countdown", "<answer>12/(5-5)</answer>", {"target": 1, "numbers": [12, 5, 5]})["score"] == 0.1
    assert score("countdown", "<answer>12/4</answer>", {"target": 3, "numbers": [4, 12]})["score"] == 1.0
    # '**' is rejected (TinyZero would eval it): countdown allows + - * / only.
    assert score("countdown", "<answer>2**3</answer>", {"target": 8, "numbers": [2, 3]})["score"] == 0.1
    assert score("countdown", "<answer>7</answer>", {"target": 7, "numbers": [7]}, format_score=0.0, score=2.0) == {
        "score": 2.0,
        "acc": 1.0,
    }
    with pytest.raises(ValueError, match="countdown ground_truth must be a mapping with 'target' and 'numbers'"):
        score("countdown", "<answer>7</answer>", "7")


# ----------------------------------------------------------------------------- math
def test_math_verify_scores():
    pytest.importorskip("math_verify")
    assert score("math", "The answer is $\\boxed{\\frac{1}{2}}$.", "0.5") == {"score": 1.0, "acc": 1.0}
    assert score("math", "so x = 0.5", "\\frac{1}{2}")["score"] == 1.0
    assert score("math", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}")["score"] == 1.0
    assert score("math", "\\boxed{3}", "4")["score"] == 0.0
    assert score("math", "no answer here", "1")["score"] == 0.0


# ----------------------------------------------------------------------------- toy tasks
@pytest.mark.parametrize(
    "text, expected_score, expected_acc",
    [
        ("9 1 7 3", 1.0, 1.0),
        ("  9 1 7 3 \n", 1.0, 1.0),
        ("9 7 1 3", 0.5, 0.0),  # positions 0 and 3 right
        ("9 1 7 3 3", 0.8, 0.0),  # 4 right over the longer length 5
        ("9 1", 0.5, 0.0),  # 2 right over 4
        ("", 0.0, 0.0),
    ],
)
def test_toy_sequence_scores(text, expected_score, expected_acc):
    for name in ("toy_copy", "toy_reverse"):
        assert score(name, text, "9 1 7 3") == {"score": expected_score, "acc": expected_acc}
    assert score("toy_reverse", text, "9 1 7 3", partial_credit=False)["score"] == expected_acc


def test_toy_count_scores():
    assert score("toy_count", " 3\n", "3") == {"score": 1.0, "acc": 1.0}
    assert score("toy_count", "4", "3") == {"score": 0.0, "acc": 0.0}
    assert score("toy_count", "4", "3", format_score=0.1) == {"score": 0.1, "acc": 0.0}
    assert score("toy_count", "three", "3", format_score=0.1) == {"score": 0.0, "acc": 0.0}


def test_every_toy_task_scores_its_own_answers_one():
    assert set(TOY_TASKS) <= set(REWARD_FNS)
    for name in TOY_TASKS:
        for row in toy_rows(name, 50, seed=3):
            truth = row["reward_model"]["ground_truth"]
            assert default_compute_score(name, truth, truth)["score"] == 1.0
            assert default_compute_score(name, "0", truth)["score"] < 1.0 or truth == "0"


# ----------------------------------------------------------------------------- dispatch
def test_default_compute_score_dispatch_and_kwargs():
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == {"score": 1.0, "acc": 1.0}
    assert default_compute_score("countdown", "<answer>3+4</answer>", {"target": 7, "numbers": [3, 4]})["score"] == 1.0
    with pytest.raises(UnknownNameError, match="no reward function for data_source='my/data'; known data sources: "):
        default_compute_score("my/data", "x", "y")
    flexible = get_reward_fn("gsm8k", method="flexible")
    assert flexible(data_source="openai/gsm8k", solution_str="it is 72", ground_truth="72")["score"] == 1.0
    with pytest.raises(UnknownNameError, match="unknown reward function 'gsm9k'; valid names: countdown, gsm8k"):
        get_reward_fn("gsm9k")


def test_load_custom_reward_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) == int(ground_truth))\n"
    )
    fn = load_custom_reward_fn(path)
    assert fn("x", "abc", "3") == 1.0
    with pytest.raises(ValueError, match="custom_reward_function.name='nope' is not a function in"):
        load_custom_reward_fn(path, "nope")
    with pytest.raises(ValueError, match="is not a file"):
        load_custom_reward_fn(tmp_path / "missing.py")


# ----------------------------------------------------------------------------- batch scoring
def make_batch(tokenizer, texts, width, eos=True):
    """Right-padded responses [b, width] holding ``texts`` (+ eos), and their mask."""
    responses = torch.full((len(texts), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = (tokenizer.encode(text) + ([tokenizer.eos_token_id] if eos else []))[:width]
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1
    return responses, mask


def test_token_level_scores_on_last_valid_token(tokenizer):
    texts = ["#### 72", "#### 5", "so 72", ""]
    responses, mask = make_batch(tokenizer, texts, width=12)
    mask[3] = 0  # an empty response: verl's index valid_len - 1 = -1 is the last column
    batch = {
        "responses": responses,
        "response_mask": mask,
        "data_source": ["openai/gsm8k"] * 4,
        "reward_model": [{"ground_truth": "72"}] * 4,
    }
    out = RewardFunction(tokenizer, reward_kwargs={"format_score": 0.25})(batch)
    lengths = mask.sum(-1)
    expected = torch.zeros(4, 12)
    for i, value in enumerate([1.0, 0.25, 0.0, 0.0]):
        expected[i, (int(lengths[i]) - 1) % 12] = value
    assert torch.equal(out.token_level_scores, expected)
    assert out.scores.tolist() == [1.0, 0.25, 0.0, 0.0]
    assert out.response_texts == ["#### 72", "#### 5", "so 72", ""]  # eos skipped
    assert out.reward_extra_info == {"score": [1.0, 0.25, 0.0, 0.0], "acc": [1.0, 0.0, 0.0, 0.0]}
    assert out.metrics() == {"reward/score/mean": 0.3125, "reward/acc/mean": 0.25}


def test_attention_mask_fallback_and_overlong_penalty(tokenizer):
    texts = ["1 2", "1 2 3 4 5 6 7 8 9 10 11"]
    responses, mask = make_batch(tokenizer, texts, width=10, eos=False)
    prompt_mask = torch.ones(2, 3, dtype=torch.long)
    lengths = mask.sum(-1).tolist()
    assert lengths[0] < 6 and lengths[1] == 10  # the second response fills the width
    cfg = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
    fn = RewardFunction(tokenizer, "toy_copy", overlong_buffer_cfg=cfg, max_resp_len=10)
    out = fn(
        {
            "responses": responses,
            "attention_mask": torch.cat([prompt_mask, mask], 1),
            "data_source": ["toy_copy"] * 2,
            "ground_truth": ["1 2", "1 2"],
        }
    )
    # Sample 1 is cut to 10 tokens; its words: 2 of 10 right -> 0.2; 10 tokens exceed
    # max_resp_len - len = 6 by 4 -> penalty -4/4 * 1.0.
    assert out.response_texts[1] == "1 2 3 4 5 6 7 8 9 10"
    assert out.scores.tolist() == pytest.approx([1.0, 0.2 - 1.0], abs=1e-7)
    assert out.token_level_scores[1, 9].item() == pytest.approx(0.2 - 1.0, abs=1e-7)
    assert out.token_level_scores.sum().item() == pytest.approx(0.2, abs=1e-6)
    assert out.reward_extra_info["overlong_reward"] == [0.0, -1.0]
    assert out.reward_extra_info["overlong"] == [False, True]
    assert out.reward_extra_info["score"] == [1.0, 0.2]  # raw scores, before shaping


def test_float_results_record_acc_like_verl_dapo(tokenizer):
    responses, mask = make_batch(tokenizer, ["1", "22"], width=4)
    fn = RewardFunction(tokenizer, lambda data_source, solution_str, ground_truth, extra_info: len(solution_str) / 2)
    out = fn({"responses": responses, "response_mask": mask, "data_source": ["a", "b"], "ground_truth": [None, None]})
    assert out.scores.tolist() == [0.5, 1.0]
    assert out.reward_extra_info == {"score": [0.5, 1.0], "acc": [0.5, 1.0]}


def test_failing_reward_raises_reward_error_with_indices(tokenizer):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        results = {
            "raise": lambda: 1 / 0,
            "nan": lambda: math.nan,
            "inf": lambda: {"score": math.inf},
            "none": lambda: None,
            "str": lambda: "1.0",
            "nokey": lambda: {"acc": 1.0},
        }
        return results.get(ground_truth, lambda: 1.0)()

    truths = ["ok", "raise", "ok", "nan", "inf", "none", "str", "nokey"]
    responses, mask = make_batch(tokenizer, ["1"] * len(truths), width=3)
    fn = RewardFunction(tokenizer, flaky)
    with pytest.raises(RewardError) as info:
        fn({"responses": responses, "response_mask": mask, "data_source": ["src"] * 8, "ground_truth": truths})
    err = info.value
    assert err.indices == [1, 3, 4, 5, 6, 7]
    assert [why for _, _, why in err.failures] == [
        "ZeroDivisionError: division by zero",
        "returned non-finite score nan",
        "returned non-finite score inf",
        "returned None (NoneType); expected a float or a dict with 'score'",
        "returned '1.0' (str); expected a float or a dict with 'score'",
        "returned a dict without 'score' (keys: ['acc'])",
    ]
    assert str(err).startswith(
        "reward function failed on 6 of 8 samples (indices [1, 3, 4, 5, 6, 7]): "
        "sample 1 (data_source='src'): ZeroDivisionError: division by zero; "
    )
    assert str(err).endswith("... and 1 more")


def test_bad_batch_inputs(tokenizer):
    responses, mask = make_batch(tokenizer, ["1", "2"], width=3)
    fn = RewardFunction(tokenizer, "toy_copy")
    with pytest.raises(ValueError, match="ground_truth has 1 entries for a batch of 2 responses"):
        fn({"responses": responses, "response_mask": mask, "data_source": ["toy_copy"] * 2, "ground_truth": ["1"]})
    with pytest.raises(ValueError, match=r"response mask shape \(2, 2\) != responses shape \(2, 3\)"):
        fn({"responses": responses, "response_mask": mask[:, :2], "data_source": ["a"] * 2, "ground_truth": ["1"] * 2})
    with pytest.raises(ValueError, match="batch has neither 'ground_truth' nor 'reward_model'"):
        fn({"responses": responses, "response_mask": mask, "data_source": ["a"] * 2})
