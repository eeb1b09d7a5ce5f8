"""The outcome reward of agent sessions: the rule reward on each session's final answer.

A session's response holds its tool calls and the observations too -- which can contain the
answer (a calculator's result) -- so scoring the whole response would reward reading a tool's
output back, not answering. ``FinalAnswerReward`` wraps the run's ``RewardFunction`` and gives
it, as ``solution_str``, the decoded text of the last model turn of each sample (the last run of
``response_mask`` ones, special tokens skipped); the score sits on that turn's last token
(``token_level_scores``). A session with several samples (``output_index``) gives every sample
its final sample's score (verl's rule). Everything else -- the score registry, ``RewardError``
on a failure, DAPO's overlong shaping over all response tokens -- is the wrapped reward's.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from megatron_rl.data.rewards import RewardFunction, RewardOutput
from megatron_rl.data.shaping import apply_overlong_penalty

__all__ = ["FinalAnswerReward", "final_turn_spans"]


def final_turn_spans(response_mask: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each row's last run of mask ones (``(0, 0)`` for a row without one)."""
    spans = []
    for row in response_mask.bool().tolist():
        end = len(row) - row[::-1].index(True) if True in row else 0
        start = end
        while start > 0 and row[start - 1]:
            start -= 1
        spans.append((start, end))
    return spans


class FinalAnswerReward:
    """``RewardFunction``'s interface, scoring final answers (module docstring)."""

    def __init__(self, inner: RewardFunction):
        self.inner = inner
        self.tokenizer = inner.tokenizer

    def _texts(self, rows: list[list[int]]) -> list[str]:
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        eos = getattr(self.tokenizer, "eos_token", None)
        return [t[: -len(eos)] if eos and t.endswith(eos) else t for t in texts]

    def decode(self, responses: torch.Tensor, response_lengths: torch.Tensor) -> list[str]:
        """Whole sessions (model turns and observations, special tokens dropped) -- for sample dumps;
        ``response_lengths`` are ignored: with observations the mask does not give the length."""
        return self._texts([row.tolist() for row in responses])

    def score_texts(self, *args: Any, **kwargs: Any):
        """The wrapped reward's ``score_texts``."""
        return self.inner.score_texts(*args, **kwargs)

    def __call__(self, batch: Mapping[str, Any]) -> RewardOutput:
        """Score a batch of agent samples: ``responses``, ``response_mask``, ``attention_mask`` and the
        per-sample ``data_source`` / ``ground_truth`` (or ``reward_model``) / ``extra_info``."""
        responses, mask = batch["responses"], batch["response_mask"]
        spans = final_turn_spans(mask)
        texts = self._texts([row[s:e].tolist() for row, (s, e) in zip(responses, spans)])
        truths = (
            batch["ground_truth"] if "ground_truth" in batch else [rm["ground_truth"] for rm in batch["reward_model"]]
        )
        raw, extra = self.inner.score_texts(texts, batch["data_source"], truths, batch.get("extra_info"))
        scores = torch.tensor(raw, dtype=torch.float32)
        if "output_index" in batch:  # every sample of a session gets its final sample's score
            final: dict[tuple, int] = {}
            for i, key in enumerate(zip(batch["uid"], batch["session_id"], batch["output_index"])):
                if key[:2] not in final or key[2] > batch["output_index"][final[key[:2]]]:
                    final[key[:2]] = i
            source = [final[(u, s)] for u, s in zip(batch["uid"], batch["session_id"])]
            scores = scores[source]
            extra = {k: [v[j] for j in source] for k, v in extra.items()}
        lengths = batch["attention_mask"][:, -responses.shape[1] :].sum(-1)  # every response token, observations too
        scores, overlong = apply_overlong_penalty(
            scores, lengths, self.inner.max_resp_len, self.inner.overlong_buffer_cfg
        )
        for key, value in overlong.items():
            extra[key] = value.tolist()
        token_level_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = torch.tensor([max(e - 1, 0) for _, e in spans])
        token_level_scores[torch.arange(len(spans)), last] = scores
        return RewardOutput(token_level_scores, scores, extra, texts)
