"""Rule rewards: a registry of ``compute_score`` functions and the batch scorer the trainer calls.

Every registry entry has verl's custom-reward signature, so any of them (or
``default_compute_score``) can be handed to verl as ``custom_reward_function`` and vice versa::

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)
        -> float | {"score": float, "acc": float, ...}

``solution_str`` is the decoded response only (special tokens skipped), as verl's reward
managers pass it. Entries:

- ``toy_copy`` / ``toy_reverse`` / ``toy_count``: the built-in toy tasks that
  ``megatron_rl.data.datasets.make_toy_dataset`` generates (small enough for a tiny model to
  learn by RL on CPU); copy/reverse give positional partial credit, count is exact.
- ``gsm8k``: verl's ``#### answer`` extraction (``method="strict"``) or last number
  (``"flexible"``), exact string match with the ground truth.
- ``math``: verl's math-verify scorer (``\\boxed{ground_truth}`` against the response).
- ``countdown``: TinyZero's rules: the last ``<answer>...</answer>`` must use the given numbers
  exactly once each and evaluate to the target (1.0); a parsable answer that fails gets
  ``format_score`` (0.1).

``RewardFunction`` scores a rollout batch: it decodes the valid response tokens, calls the
score function per sample, places each score on the sample's last valid response token
(``token_level_scores [b, R]``, verl's convention), optionally adds DAPO's overlong penalty, and
refuses to average over failures: a sample whose score function raises or returns a
non-finite/non-numeric value makes the whole call raise ``RewardError`` naming the samples.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_rl.data.shaping import apply_overlong_penalty
from megatron_rl.utils.registry import Registry, UnknownNameError

__all__ = [
    "REWARD_FNS",
    "DATA_SOURCE_TO_REWARD",
    "register_reward",
    "get_reward_fn",
    "default_compute_score",
    "load_custom_reward_fn",
    "check_custom_reward_file",
    "finite_means",
    "gsm8k_extract_solution",
    "countdown_extract_solution",
    "RewardError",
    "RewardOutput",
    "RewardFunction",
]

REWARD_FNS = Registry("reward function")
"""Reward name -> ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)``."""

DATA_SOURCE_TO_REWARD: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    # verl scores these with its string-normalising math_reward and recommends math-verify
    # instead; we use math-verify directly (see ``math_verify_score``).
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "countdown": "countdown",
    "Jiayi-Pan/Countdown-Tasks-3to4": "countdown",
}
"""``data_source`` values routed to a differently named registry entry by ``default_compute_score``
(a ``data_source`` equal to a registry name, e.g. ``toy_reverse``, needs no row here)."""


def register_reward(name: str) -> Callable:
    """Decorator registering a ``compute_score``-signature function under ``name``."""
    return REWARD_FNS.register(name)


def get_reward_fn(name_or_fn: str | Callable | None = None, **reward_kwargs: Any) -> Callable:
    """The score function for a registry name, a callable, or ``None`` (``default_compute_score``),
    with ``reward_kwargs`` bound (verl's ``custom_reward_function.reward_kwargs``)."""
    if name_or_fn is None:
        fn = default_compute_score
    elif isinstance(name_or_fn, str):
        fn = REWARD_FNS[name_or_fn]
    elif callable(name_or_fn):
        fn = name_or_fn
    else:
        raise TypeError(f"compute_score must be a registry name, a callable or None, got {type(name_or_fn).__name__}")
    return partial(fn, **reward_kwargs) if reward_kwargs else fn


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, **kwargs: Any
) -> float | dict:
    """verl's ``default_compute_score``: pick the rule reward from ``data_source``.

    ``data_source`` is looked up in ``DATA_SOURCE_TO_REWARD``, then as a registry name; an
    unknown source raises ``UnknownNameError`` (a ValueError) listing the known ones.
    """
    name = DATA_SOURCE_TO_REWARD.get(data_source, data_source)
    if name not in REWARD_FNS:
        known = sorted(set(DATA_SOURCE_TO_REWARD) | set(REWARD_FNS))
        raise UnknownNameError(f"no reward function for data_source={data_source!r}; known data sources: {known}")
    return REWARD_FNS[name](data_source, solution_str, ground_truth, extra_info, **kwargs)


def _reward_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        what = "it is a directory" if path.is_dir() else "it does not exist"
        raise ValueError(f"reward.custom_reward_function.path={str(path)!r} is not a file ({what})")
    return path


def check_custom_reward_file(path: str | Path, name: str = "compute_score") -> None:
    """Check a ``custom_reward_function`` file without running it: it exists, compiles (a syntax error
    names the file and line) and defines ``name`` at its top level (a def, an import or an assignment).
    ``ValueError`` naming ``reward.custom_reward_function.path`` / ``.name``."""
    import ast

    path = _reward_file(path)
    try:
        source = path.read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"reward.custom_reward_function.path={str(path)!r} is not UTF-8 text ({exc})") from None
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise ValueError(
            f"reward.custom_reward_function.path={str(path)!r}: syntax error at {path}:{exc.lineno}: {exc.msg}"
        ) from None
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    if name not in defined and not any(
        isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in tree.body
    ):
        functions = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        raise ValueError(
            f"reward.custom_reward_function.name={name!r} is not a function in {path}; functions there: {functions}"
        )


def load_custom_reward_fn(path: str | Path, name: str = "compute_score") -> Callable:
    """Load function ``name`` from the Python file ``path`` (verl's ``custom_reward_function``).

    ``ValueError`` naming the file (and line) when it is missing, does not compile, raises while it is
    imported, or has no callable ``name``."""
    import traceback

    check_custom_reward_file(path, name)
    path = _reward_file(path)
    spec = importlib.util.spec_from_file_location(f"custom_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the user's file raises is reported with its line
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise ValueError(
            f"reward.custom_reward_function.path={str(path)!r}: importing it raised "
            f"{type(exc).__name__}: {exc} (at {where})"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"custom_reward_function.name={name!r} is not a function in {path}")
    return fn


# ----------------------------------------------------------------------------- toy tasks
def _digits(text: Any) -> list[str]:
    return str(text).split()


@register_reward("toy_copy")
@register_reward("toy_reverse")
def toy_sequence_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Optional[dict] = None,
    *,
    partial_credit: bool = True,
) -> dict:
    """Copy/reverse a digit sequence: the fraction of positions right, over the longer length.

    The response and ``ground_truth`` (e.g. ``"9 1 7 3"``) are split on whitespace;
    ``score = #{i: pred[i] == gt[i]} / max(len(gt), len(pred))``, so extra or missing tokens cost
    credit and only the exact answer scores 1.0. ``acc`` is 1.0 for the exact answer.
    ``partial_credit=False`` makes ``score == acc``.
    """
    target, pred = _digits(ground_truth), _digits(solution_str)
    acc = float(pred == target)
    if not partial_credit:
        return {"score": acc, "acc": acc}
    longest = max(len(target), len(pred))
    hits = sum(p == t for p, t in zip(pred, target))
    return {"score": hits / longest if longest else 0.0, "acc": acc}


@register_reward("toy_count")
def toy_count_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Optional[dict] = None,
    *,
    format_score: float = 0.0,
) -> dict:
    """Count task: 1.0 when the stripped response is exactly the count, ``format_score`` when
    it is some other integer, else 0.0."""
    pred = solution_str.strip()
    if pred == str(ground_truth).strip():
        return {"score": 1.0, "acc": 1.0}
    return {"score": float(format_score) if re.fullmatch(r"-?\d+", pred) else 0.0, "acc": 0.0}


# ----------------------------------------------------------------------------- gsm8k
_GSM8K_CLIP_CHARS = 300  # verl matches only the last 300 characters (regex speed on long outputs)


def gsm8k_extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """verl's GSM8K answer extraction.

    ``strict``: the last ``#### <number>`` (commas and ``$`` removed). ``flexible``: the last
    number-like run that is not ``""``/``"."`` (commas kept, as in verl). Only the last 300
    characters are searched. Returns None when nothing matches.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method={method!r}; allowed: 'strict', 'flexible'")
    text = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = re.findall(r"(\-?[0-9\.\,]+)", text)
    for candidate in reversed(found):
        if candidate not in ("", "."):
            return candidate
    # verl's loop leaves the last visited candidate (the first match) when all are invalid.
    return found[0] if found else None


@register_reward("gsm8k")
def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Optional[dict] = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict:
    """verl's GSM8K score: ``score`` if the extracted answer equals ``ground_truth`` (string
    equality), ``format_score`` if an answer was extracted but differs, 0.0 if none was found."""
    if not isinstance(ground_truth, str):
        # verl compares strings; a numeric ground truth would silently never match.
        raise TypeError(
            f"gsm8k ground_truth must be a string like '72', got {type(ground_truth).__name__} {ground_truth!r}"
        )
    answer = gsm8k_extract_solution(solution_str, method=method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    correct = answer == ground_truth
    return {"score": float(score if correct else format_score), "acc": float(correct)}


# ----------------------------------------------------------------------------- math (math-verify)
@register_reward("math")
def math_verify_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None
) -> dict:
    """verl's math-verify score: 1.0 if any answer parsed from the response (plain expression
    or LaTeX) is equivalent to ``\\boxed{ground_truth}``, else 0.0.

    Runs in this process with math-verify's own signal-based timeouts (a timed-out parse or
    comparison counts as wrong), so it must be called from the main thread; verl instead runs
    it in a process pool with a 30 s outer timeout, which also scores a timeout as 0.
    """
    try:
        from math_verify.grader import verify
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig, parse
    except ImportError as e:
        raise ImportError("the 'math' reward needs the math-verify package: pip install math-verify") from e
    gold = parse("\\boxed{" + str(ground_truth) + "}", (LatexExtractionConfig(),))
    pred = parse(solution_str, (ExprExtractionConfig(), LatexExtractionConfig()))
    correct = bool(gold and pred) and any(verify(g, p) for p in pred for g in gold)
    return {"score": float(correct), "acc": float(correct)}


# ----------------------------------------------------------------------------- countdown
def countdown_extract_solution(solution_str: str) -> Optional[str]:
    """TinyZero's countdown extraction: the last ``<answer>...</answer>`` on the last line.

    TinyZero scored prompt + response and first cut everything before ``Assistant:`` /
    ``<|im_start|>assistant``; a verl response has no such header, so the cut applies only
    when one is present.
    """
    for header in ("Assistant:", "<|im_start|>assistant"):
        if header in solution_str:
            solution_str = solution_str.split(header, 1)[1]
            break
    matches = re.findall(r"<answer>(.*?)</answer>", solution_str.split("\n")[-1])
    return matches[-1].strip() if matches else None


_ARITH_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval_arith(node: ast.AST) -> float:
    # A tree walk instead of eval(): no names or calls, and no '**' whose huge powers could hang.
    if isinstance(node, ast.Expression):
        return _eval_arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
        return _ARITH_OPS[type(node.op)](_eval_arith(node.left), _eval_arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_eval_arith(node.operand))
    raise ValueError(f"disallowed expression node {type(node).__name__}")


def _countdown_value(equation: str) -> Optional[float]:
    if not re.fullmatch(r"[\d+\-*/().\s]+", equation):
        return None
    try:
        return _eval_arith(ast.parse(equation, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


@register_reward("countdown")
def countdown_score(
    data_source: str,
    solution_str: str,
    ground_truth: Mapping,
    extra_info: Optional[dict] = None,
    *,
    format_score: float = 0.1,
    score: float = 1.0,
) -> dict:
    """TinyZero's countdown score.

    ``ground_truth = {"target": int, "numbers": [int, ...]}``. No ``<answer>`` -> 0.0; an
    equation whose integers are not exactly ``numbers`` (as a multiset), that does not parse
    as ``+ - * /`` arithmetic, or that misses the target by >= 1e-5 -> ``format_score``;
    otherwise ``score``. (TinyZero ``eval``s the string, so it would also accept ``**`` and
    ``//``; we reject them: countdown allows the four operations, and ``**`` can hang.)
    """
    if not isinstance(ground_truth, Mapping) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(f"countdown ground_truth must be a mapping with 'target' and 'numbers', got {ground_truth!r}")
    target, numbers = ground_truth["target"], [int(n) for n in ground_truth["numbers"]]
    equation = countdown_extract_solution(solution_str)
    if equation is None:
        return {"score": 0.0, "acc": 0.0}
    if sorted(int(n) for n in re.findall(r"\d+", equation)) != sorted(numbers):
        return {"score": float(format_score), "acc": 0.0}
    value = _countdown_value(equation)
    correct = value is not None and abs(value - target) < 1e-5
    return {"score": float(score if correct else format_score), "acc": float(correct)}


# ----------------------------------------------------------------------------- batch scoring
class RewardError(RuntimeError):
    """The score function raised or returned a non-finite / non-numeric value for some samples.

    ``failures`` is a list of ``(index, data_source, reason)``; ``indices`` their batch indices.
    The trainer reports and skips the step instead of averaging over the rest.
    """

    def __init__(self, failures: list[tuple[int, Any, str]], batch_size: int):
        self.failures = failures
        self.indices = [i for i, _, _ in failures]
        shown = "; ".join(f"sample {i} (data_source={src!r}): {why}" for i, src, why in failures[:5])
        more = f"; ... and {len(failures) - 5} more" if len(failures) > 5 else ""
        super().__init__(
            f"reward function failed on {len(failures)} of {batch_size} samples (indices {self.indices}): {shown}{more}"
        )


@dataclass
class RewardOutput:
    """Scores of one batch.

    Attributes:
        token_level_scores: ``[b, R]`` float32, each score on its sample's last valid response
            token, zeros elsewhere (verl's ``token_level_scores``).
        scores: ``[b]`` float32 per-sample score (after overlong shaping when enabled).
        reward_extra_info: per-sample lists, one per key a score dict returned (always
            ``score`` = the raw score, ``acc`` for float-returning functions, ``overlong_reward``
            / ``overlong`` with overlong logging); a key some samples lack holds None there.
        response_texts: the decoded responses that were scored.
    """

    token_level_scores: torch.Tensor
    scores: torch.Tensor
    reward_extra_info: dict[str, list] = field(default_factory=dict)
    response_texts: list[str] = field(default_factory=list)

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Means of ``scores`` and of every numeric ``reward_extra_info`` key (Nones skipped; non-finite
        values counted as ``<key>/num_nonfinite`` and left out of the mean, ``finite_means``)."""
        out = {f"{prefix}score/mean": float(self.scores.mean()) if self.scores.numel() else 0.0}
        out.update(finite_means({k: v for k, v in self.reward_extra_info.items() if k != "score"}, prefix))
        return out


def finite_means(fields: Mapping[str, Sequence], prefix: str = "reward/", suffix: str = "/mean") -> dict[str, float]:
    """``<prefix><key><suffix>``: the mean of the finite numbers of each per-sample field (Nones,
    strings and bools skipped); a field holding NaN/inf also gets ``<prefix><key>/num_nonfinite``
    (their count). A secondary reward key that misbehaves is reported, never averaged into NaN."""
    out: dict[str, float] = {}
    for key, values in fields.items():
        nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        finite = [v for v in nums if math.isfinite(v)]
        if finite:
            out[f"{prefix}{key}{suffix}"] = sum(finite) / len(finite)
        if len(finite) < len(nums):
            out[f"{prefix}{key}/num_nonfinite"] = float(len(nums) - len(finite))
    return out


def _as_list(value: Any, name: str, size: int) -> list:
    values = list(value.tolist() if hasattr(value, "tolist") and not isinstance(value, list) else value)
    if len(values) != size:
        raise ValueError(f"{name} has {len(values)} entries for a batch of {size} responses")
    return values


class RewardFunction:
    """Score rollout batches with a rule reward (verl's naive / DAPO reward manager).

    Args:
        tokenizer: decodes the responses (``skip_special_tokens=True``; a trailing eos string
            is also cut, as verl's DAPO manager does).
        compute_score: registry name, callable with the ``compute_score`` signature, or None
            for ``default_compute_score`` (dispatch on ``data_source``).
        reward_kwargs: keyword arguments bound to ``compute_score`` (e.g. ``method="flexible"``).
        overlong_buffer_cfg: DAPO overlong shaping (``enable``, ``len``, ``penalty_factor``,
            ``log``); None/disabled for none.
        max_resp_len: response-length limit the overlong buffer is measured from.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        compute_score: str | Callable | None = None,
        *,
        reward_kwargs: Optional[Mapping[str, Any]] = None,
        overlong_buffer_cfg: Any = None,
        max_resp_len: Optional[int] = None,
    ):
        self.tokenizer = tokenizer
        self.compute_score = get_reward_fn(compute_score, **dict(reward_kwargs or {}))
        self.overlong_buffer_cfg = overlong_buffer_cfg
        self.max_resp_len = max_resp_len

    def decode(self, responses: torch.Tensor, response_lengths: torch.Tensor) -> list[str]:
        """Decode the first ``response_lengths[i]`` tokens of each row of ``responses [b, R]``."""
        if self.tokenizer is None:
            raise ValueError("RewardFunction needs a tokenizer to decode token ids; pass tokenizer=...")
        rows = [row[:n].tolist() for row, n in zip(responses, response_lengths.tolist())]
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        eos = getattr(self.tokenizer, "eos_token", None)
        return [t[: -len(eos)] if eos and t.endswith(eos) else t for t in texts]

    def score_texts(
        self,
        texts: Sequence[str],
        data_sources: Sequence[Any],
        ground_truths: Sequence[Any],
        extra_infos: Optional[Sequence[Any]] = None,
    ) -> tuple[list[float], dict[str, list]]:
        """Score decoded responses: ``(scores, reward_extra_info)``; raises ``RewardError``."""
        size = len(texts)
        data_sources = _as_list(data_sources, "data_source", size)
        ground_truths = _as_list(ground_truths, "ground_truth", size)
        extra_infos = [None] * size if extra_infos is None else _as_list(extra_infos, "extra_info", size)
        scores: list[float] = []
        results: list[dict] = []
        failures: list[tuple[int, Any, str]] = []
        for i, (text, source, truth, info) in enumerate(zip(texts, data_sources, ground_truths, extra_infos)):
            try:
                result = self.compute_score(
                    data_source=source, solution_str=text, ground_truth=truth, extra_info=dict(info) if info else {}
                )
            except Exception as e:  # noqa: BLE001 - every failure is collected and re-raised below
                failures.append((i, source, f"{type(e).__name__}: {e}"))
                continue
            value, extra, why = _unpack_score(result)
            if why is not None:
                failures.append((i, source, why))
                continue
            scores.append(value)
            results.append(extra)
        if failures:
            raise RewardError(failures, size)
        keys = list(dict.fromkeys(k for r in results for k in r))
        return scores, {k: [r.get(k) for r in results] for k in keys}

    def __call__(self, batch: Mapping[str, Any]) -> RewardOutput:
        """Score a rollout batch.

        ``batch`` holds ``responses [b, R]``, ``response_mask [b, R]`` (or ``attention_mask
        [b, P+R]``), and per-sample lists ``data_source``, ``ground_truth`` (or verl's
        ``reward_model`` dicts) and optionally ``extra_info``.
        """
        responses = batch["responses"]
        if responses.dim() != 2:
            raise ValueError(f"responses must be [batch, response_length], got shape {tuple(responses.shape)}")
        size, width = responses.shape
        mask = batch["response_mask"] if "response_mask" in batch else batch["attention_mask"][:, -width:]
        if mask.shape != responses.shape:
            raise ValueError(f"response mask shape {tuple(mask.shape)} != responses shape {tuple(responses.shape)}")
        lengths = mask.long().sum(-1)  # [b]; responses are right-padded
        if "ground_truth" in batch:
            truths = batch["ground_truth"]
        elif "reward_model" in batch:
            truths = [rm["ground_truth"] for rm in batch["reward_model"]]
        else:
            raise ValueError(f"batch has neither 'ground_truth' nor 'reward_model'; keys: {sorted(batch.keys())}")
        texts = self.decode(responses, lengths)
        raw, extra = self.score_texts(texts, batch["data_source"], truths, batch.get("extra_info"))

        scores = torch.tensor(raw, dtype=torch.float32, device=responses.device)
        scores, overlong_extra = apply_overlong_penalty(scores, lengths, self.max_resp_len, self.overlong_buffer_cfg)
        for key, value in overlong_extra.items():
            extra[key] = value.tolist()
        # verl writes reward_tensor[i, valid_len - 1]; an empty response (len 0) lands on column -1.
        last = ((lengths - 1) % width).unsqueeze(-1)  # [b, 1]
        token_level_scores = torch.zeros(size, width, dtype=torch.float32, device=responses.device)
        token_level_scores.scatter_(1, last, scores.unsqueeze(-1))
        return RewardOutput(token_level_scores, scores, extra, texts)


def _unpack_score(result: Any) -> tuple[float, dict, Optional[str]]:
    """``(score, extra_info_entry, failure_reason_or_None)`` for one compute_score result."""
    extra: dict = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            return 0.0, extra, f"returned a dict without 'score' (keys: {sorted(result)})"
        extra = dict(result)
        value = result["score"]
    else:
        value = result
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError  # float("1") would accept a string
        number = float(value)
    except (TypeError, ValueError):
        return 0.0, extra, f"returned {value!r} ({type(value).__name__}); expected a float or a dict with 'score'"
    if not math.isfinite(number):
        return 0.0, extra, f"returned non-finite score {number}"
    if not isinstance(result, Mapping):
        extra = {"score": number, "acc": number}  # verl's DAPO manager records acc = score
    return number, extra, None
