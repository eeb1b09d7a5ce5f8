"""``AgentRunner``: all of a step's agent sessions against one vLLM engine, round by round.

Each round is one engine call over every active session's next turn (the engine batches them
continuously), then the round's tool calls run concurrently, then the next round; a session
leaves the rotation when its loop ends it. ``run`` returns the sessions' samples in the
rollout's verl layout (``VLLMRollout.generate``'s fields, ``prompts`` left-padded to
``prompt_length``, ``responses`` right-padded to ``response_length``) where
``response_mask`` is 0 on observation tokens and ``rollout_log_probs`` is 0 there, plus per
sample ``uid``, ``session_id``, ``output_index``, ``prompt_index``, ``num_turns``,
``num_tool_calls``, ``num_tool_errors``, ``termination``, ``truncated``, ``finish_reasons`` and
``tokenization_match`` (None when the sanity check is off).

Seeds: with a ``seed``, session ``k`` (prompt-major, like ``generate``) draws its round-``r``
turn with ``seed + k + r * ROUND_SEED_STRIDE``. The stride is a constant, not the call's number of
sessions, so a call over prompts ``[i, j)`` seeded ``seed + i * n`` (``RolloutRouter``'s runs, one per
replica) draws every session's every turn exactly as one call over all prompts would: the samples
do not depend on how many replicas share the step.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from megatron_rl.rollout.agent.chat import ChatFormat
from megatron_rl.rollout.agent.loop import AGENT_LOOPS, register_agent_loops
from megatron_rl.rollout.agent.session import AgentOutput, AgentSession
from megatron_rl.rollout.tools.tool_registry import load_tools

__all__ = ["AgentRunner", "check_agent_config", "pad_outputs", "ROUND_SEED_STRIDE"]

logger = logging.getLogger(__name__)

ROUND_SEED_STRIDE = 2**32
"""Seed distance between two rounds of one session: above any step's session count, so no two
(session, round) pairs of a call share a seed, and well inside the 64-bit seeds vLLM accepts."""


def check_agent_config(rollout: Any) -> None:
    """Fail early (before workers start) on a bad ``rollout.agent`` / ``multi_turn`` setup: an
    unknown agent loop, an agent-loop or tool config that does not load."""
    register_agent_loops(rollout.agent.agent_loop_config_path)
    if AGENT_LOOPS[rollout.agent.default_agent_loop].uses_tools:
        load_tools(rollout.multi_turn.tool_config_path)


class AgentRunner:
    """Agent sessions of ``rollout.agent.default_agent_loop`` on ``engine`` (a ``VLLMRollout``).

    Args:
        engine: has ``config`` (``RolloutConfig``), ``pad_token_id`` and ``generate_turns``.
        tokenizer: the engine's HF tokenizer.
        chat_template: replaces the tokenizer's template (``model.custom_chat_template``).
    """

    def __init__(self, engine: Any, tokenizer: Any, *, chat_template: Optional[str] = None):
        cfg = engine.config
        self.engine, self.config = engine, cfg
        register_agent_loops(cfg.agent.agent_loop_config_path)
        loop_cls = AGENT_LOOPS[cfg.agent.default_agent_loop]
        tools = load_tools(cfg.multi_turn.tool_config_path) if loop_cls.uses_tools else {}
        self.chat = ChatFormat(tokenizer, [t.tool_schema.to_openai() for t in tools.values()] or None, chat_template)
        self.loop = loop_cls(self.chat, tools, cfg.multi_turn, cfg.agent, cfg)
        self.sanity_mode = cfg.multi_turn.tokenization_sanity_check_mode
        self.prompt_length, self.response_length = cfg.prompt_length, cfg.response_length
        self.prompt_too_long = cfg.prompt_too_long

    def run(
        self, messages: Sequence[Sequence[dict]], *, uids: Sequence[str], validate: bool = False, **overrides: Any
    ) -> dict[str, Any]:
        """Run ``n`` sessions per prompt (``messages[i]``: its chat messages); the batch (module docstring).

        ``overrides``: sampling keys as for ``VLLMRollout.generate`` (``n``, ``seed``, ``do_sample`` ...);
        ``response_length`` bounds each session's response tokens (at most the configured width).
        """
        if len(uids) != len(messages):
            raise ValueError(f"uids has {len(uids)} entries for {len(messages)} prompts")
        source = self.config.val_kwargs if validate else self.config
        n = int(overrides.pop("n", None) or source.n)
        seed = overrides.pop("seed", None)
        limit = int(overrides.pop("response_length", self.response_length))
        if not 1 <= limit <= self.response_length:
            raise ValueError(f"response_length={limit} must lie in [1, rollout.response_length={self.response_length}]")
        sessions = []
        for i, msgs in enumerate(messages):
            prompt = self._fit_prompt(i, self.chat.prompt_ids(self._check_messages(i, msgs)))
            sessions += [
                AgentSession(
                    uid=str(uids[i]), session_id=j, prompt_index=i, messages=msgs, prompt_ids=prompt, limit=limit
                )
                for j in range(n)
            ]
        order = {id(s): k for k, s in enumerate(sessions)}
        active, rnd = list(sessions), 0
        while active:
            seeds = None if seed is None else [seed + order[id(s)] + rnd * ROUND_SEED_STRIDE for s in active]
            turns = self.engine.generate_turns(
                [s.context for s in active],
                [s.limit - len(s.response_ids) for s in active],
                seeds=seeds,
                validate=validate,
                **overrides,
            )
            for s, turn in zip(active, turns):
                s.add_model_turn(turn["token_ids"], turn["log_probs"], turn["finish_reason"])
                self.loop.after_model_turn(s)
            calling = [s for s in active if not s.done and s.pending]
            if calling:
                self.loop.run_tools(calling)
            for s in active:
                if not s.done and not s.pending and s.user_turns < s.assistant_turns:
                    raise RuntimeError(
                        f"agent loop {type(self.loop).__name__} left session {s.uid}_{s.session_id} "
                        "neither finished nor waiting for tools"
                    )
            active, rnd = [s for s in active if not s.done], rnd + 1
        self._sanity_check(sessions)
        with_logprobs = self.config.calculate_log_probs
        outputs = [o for s in sessions for o in self.loop.outputs(s, with_logprobs=with_logprobs)]
        return pad_outputs(outputs, self.prompt_width(), self.response_length, self.engine.pad_token_id)

    def prompt_width(self) -> int:
        """Width of ``prompts``: ``prompt_length`` (a loop yielding one sample per turn needs more)."""
        return int(getattr(self.loop, "prompt_width", lambda cfg: cfg.prompt_length)(self.config))

    @staticmethod
    def _check_messages(i: int, msgs: Any) -> list[dict]:
        if (
            isinstance(msgs, str)
            or not isinstance(msgs, Sequence)
            or not msgs
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise ValueError(
                f"agent sessions start from chat messages; prompt {i} is {msgs!r} (a prompt dataset "
                "with data.apply_chat_template=True gives message lists)"
            )
        return list(msgs)

    def _fit_prompt(self, i: int, ids: list[int]) -> list[int]:
        if len(ids) <= self.prompt_length:
            return ids
        if self.prompt_too_long == "error":
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens with the tools' system block, more than "
                f"rollout.prompt_length={self.prompt_length}; raise it or set "
                "rollout.prompt_too_long='truncate_left'"
            )
        return ids[-self.prompt_length :]

    def _sanity_check(self, sessions: Sequence[AgentSession]) -> None:
        """``multi_turn.tokenization_sanity_check_mode``: compare each session with its re-tokenised
        transcript; mismatches are recorded (training always uses the generated ids)."""
        if self.sanity_mode == "disable":
            return
        bad = 0
        for s in sessions:
            ours = s.context
            transcript = self.chat.transcript_ids(s.messages)
            if self.sanity_mode == "strict":
                s.tokenization_match = transcript[: len(ours)] == ours
            else:  # ignore_strippable: equal text up to whitespace
                mine = "".join(self.chat.decode(ours).split())
                s.tokenization_match = "".join(self.chat.decode(transcript).split()).startswith(mine)
            bad += not s.tokenization_match
        if bad:
            logger.warning(
                "%d of %d agent sessions differ from a re-tokenisation of their transcript "
                "(multi_turn.tokenization_sanity_check_mode=%s); the trainer uses the generated ids",
                bad,
                len(sessions),
                self.sanity_mode,
            )


def pad_outputs(outputs: Sequence[AgentOutput], prompt_width: int, response_width: int, pad_id: int) -> dict[str, Any]:
    """The samples in the rollout's padded layout (module docstring)."""
    num = len(outputs)
    prompts = torch.full((num, prompt_width), pad_id, dtype=torch.long)
    responses = torch.full((num, response_width), pad_id, dtype=torch.long)
    response_mask = torch.zeros(num, response_width, dtype=torch.long)
    logps = torch.zeros(num, response_width, dtype=torch.float32)
    prompt_mask = torch.zeros(num, prompt_width, dtype=torch.long)
    attn_response = torch.zeros(num, response_width, dtype=torch.long)
    for j, o in enumerate(outputs):
        p, r = o.prompt_ids[-prompt_width:], o.response_ids[:response_width]
        if p:
            prompts[j, prompt_width - len(p) :] = torch.tensor(p)
            prompt_mask[j, prompt_width - len(p) :] = 1
        if r:
            responses[j, : len(r)] = torch.tensor(r)
            response_mask[j, : len(r)] = torch.tensor(o.response_mask[:response_width])
            attn_response[j, : len(r)] = 1
            if o.response_logprobs is not None:
                logps[j, : len(r)] = torch.tensor(o.response_logprobs[:response_width], dtype=torch.float32)
    attention_mask = torch.cat([prompt_mask, attn_response], dim=1)
    batch: dict[str, Any] = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
    }
    if num and all(o.response_logprobs is not None for o in outputs):
        batch["rollout_log_probs"] = logps
    for name, attr in (
        ("uid", "uid"),
        ("session_id", "session_id"),
        ("output_index", "index"),
        ("prompt_index", "prompt_index"),
        ("num_turns", "num_turns"),
        ("num_tool_calls", "num_tool_calls"),
        ("num_tool_errors", "num_tool_errors"),
        ("termination", "termination"),
        ("truncated", "truncated"),
        ("finish_reasons", "finish_reason"),
        ("tokenization_match", "tokenization_match"),
    ):
        batch[name] = [getattr(o, attr) for o in outputs]
    return batch
