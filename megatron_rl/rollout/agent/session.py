"""One agent session's state, and what it hands to the trainer (``AgentOutput``).

A session starts from its prompt ids; every model turn appends the generated ids with
``response_mask`` 1 and their rollout log-probs, every tool turn appends the observation ids
with mask 0 and log-prob 0. The ids are never re-tokenised: ``prompt_ids + response_ids`` is
exactly what the engine saw and produced. ``messages`` is the transcript in chat form (what the
tools and the sanity check read).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from megatron_rl.rollout.agent.parser import FunctionCall

__all__ = ["AgentSession", "AgentOutput", "TERMINATIONS"]

TERMINATIONS = ("answer", "max_assistant_turns", "max_user_turns", "response_length")
"""Why a session ended: the model answered without calling a tool; a turn limit; or its tokens
reached ``rollout.response_length`` (the session is then marked ``truncated``)."""


@dataclasses.dataclass
class AgentOutput:
    """One training sample of a session (verl's ``AgentLoopOutput``), keyed ``uid_session_index``."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: Optional[list[float]]
    uid: str
    session_id: int
    index: int
    """Position among the session's outputs (the largest is its final result)."""
    prompt_index: int
    num_turns: int
    num_tool_calls: int
    num_tool_errors: int
    termination: str
    truncated: bool
    finish_reason: str
    tokenization_match: Optional[bool]


class AgentSession:
    """The state of one session (see the module docstring)."""

    def __init__(
        self,
        *,
        uid: str,
        session_id: int,
        prompt_index: int,
        messages: Sequence[dict],
        prompt_ids: Sequence[int],
        limit: int,
    ):
        self.uid, self.session_id, self.prompt_index = uid, session_id, prompt_index
        self.limit = limit
        """Response tokens the session may hold (``rollout.response_length`` or a smaller override)."""
        self.messages = [dict(m) for m in messages]
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.assistant_turns = self.user_turns = self.num_tool_calls = self.num_tool_errors = 0
        self.pending: list[FunctionCall] = []
        self.turn_spans: list[tuple[int, int]] = []
        """``(start, end)`` of each model turn in ``response_ids``."""
        self.termination: Optional[str] = None
        self.truncated = False
        self.finish_reason = ""
        self.tokenization_match: Optional[bool] = None

    @property
    def done(self) -> bool:
        return self.termination is not None

    @property
    def context(self) -> list[int]:
        """What the engine continues next: the prompt and everything appended so far."""
        return self.prompt_ids + self.response_ids

    def add_model_turn(self, ids: Sequence[int], logprobs: Optional[Sequence[float]], finish_reason: str) -> None:
        """Append a generated turn (mask 1, its log-probs)."""
        self.turn_spans.append((len(self.response_ids), len(self.response_ids) + len(ids)))
        self.response_ids += list(ids)
        self.response_mask += [1] * len(ids)
        self.response_logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.assistant_turns += 1
        self.finish_reason = finish_reason

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append a tool turn's ids (mask 0, log-prob 0)."""
        self.response_ids += list(ids)
        self.response_mask += [0] * len(ids)
        self.response_logprobs += [0.0] * len(ids)
        self.user_turns += 1

    def finish(self, termination: str, *, truncated: bool = False) -> None:
        """End the session (``termination`` one of ``TERMINATIONS``)."""
        assert termination in TERMINATIONS, termination
        self.termination, self.truncated, self.pending = termination, truncated, []

    def output(
        self, index: int, *, start: int = 0, end: Optional[int] = None, with_logprobs: bool = True
    ) -> AgentOutput:
        """``response_ids[start:end]`` as one sample, whatever precedes it as its prompt (the whole
        session by default; one model turn for loops that emit a sample per turn)."""
        end = len(self.response_ids) if end is None else end
        return AgentOutput(
            prompt_ids=self.prompt_ids + self.response_ids[:start],
            response_ids=self.response_ids[start:end],
            response_mask=self.response_mask[start:end],
            response_logprobs=self.response_logprobs[start:end] if with_logprobs else None,
            uid=self.uid,
            session_id=self.session_id,
            index=index,
            prompt_index=self.prompt_index,
            num_turns=self.assistant_turns + self.user_turns + 1,
            num_tool_calls=self.num_tool_calls,
            num_tool_errors=self.num_tool_errors,
            termination=self.termination or "",
            truncated=self.truncated,
            finish_reason="length" if self.truncated else self.finish_reason,
            tokenization_match=self.tokenization_match,
        )
