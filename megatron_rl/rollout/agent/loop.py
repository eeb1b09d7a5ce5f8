"""Agent loops: what a session does after each model turn (verl's ``AgentLoopBase`` family).

``AGENT_LOOPS`` maps ``rollout.agent.default_agent_loop`` to a class:

* ``single_turn_agent``: one model turn, no tools (verl's default; the plain rollout through the loop);
* ``tool_agent``: after a turn that calls tools (``multi_turn.format``), run the calls and append
  the observations; stop when a turn calls none, at a turn limit or at ``response_length``.

The ``AgentRunner`` (``megatron_rl.rollout.agent.runner``) advances all sessions together, one
engine call per round; a loop only decides, per session, what follows a model turn
(``after_model_turn``), executes the round's tool calls (``run_tools``) and which samples a
finished session yields (``outputs``: one per session here; a loop that yields several gives
them increasing indices, the last being the session's final result). ``agent.agent_loop_config_path``
registers more loops (``register_agent_loops``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

from megatron_rl.config.rollout import AgentLoopConfig, MultiTurnConfig, RolloutConfig
from megatron_rl.rollout.agent.calls import TimedOut, run_calls
from megatron_rl.rollout.agent.chat import ChatFormat
from megatron_rl.rollout.agent.parser import FunctionCall, get_parser
from megatron_rl.rollout.agent.session import AgentOutput, AgentSession
from megatron_rl.rollout.tools.tool_base import BaseTool, ToolResponse
from megatron_rl.rollout.tools.tool_registry import import_class
from megatron_rl.utils.registry import Registry

__all__ = [
    "AGENT_LOOPS",
    "AgentLoop",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "register_agent_loops",
    "truncate_tool_response",
]

logger = logging.getLogger(__name__)

AGENT_LOOPS = Registry("agent loop")
"""``rollout.agent.default_agent_loop`` name -> ``AgentLoop`` subclass."""


def truncate_tool_response(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters with verl's markers (``multi_turn.tool_response_truncate_side``)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half :]


class AgentLoop:
    """Base loop: one model turn, then the session ends (``single_turn_agent``).

    Args:
        chat: renders and encodes the session's messages.
        tools: ``{name: tool}`` (``multi_turn.tool_config_path``).
        multi_turn / agent / rollout: the rollout config's sections.
    """

    uses_tools = False

    def __init__(
        self,
        chat: ChatFormat,
        tools: Mapping[str, BaseTool],
        multi_turn: MultiTurnConfig,
        agent: AgentLoopConfig,
        rollout: RolloutConfig,
    ):
        self.chat, self.tools = chat, dict(tools)
        self.max_assistant_turns = multi_turn.max_assistant_turns
        self.max_user_turns = multi_turn.max_user_turns
        self.max_parallel_calls = multi_turn.max_parallel_calls
        self.max_tool_response_length = multi_turn.max_tool_response_length
        self.truncate_side = multi_turn.tool_response_truncate_side
        self.parser = get_parser(multi_turn.format)
        self.num_workers = agent.num_workers

    # -- after each model turn --------------------------------------------------------------
    def after_model_turn(self, session: AgentSession) -> None:
        """Decide what follows the turn just appended: end the session, or leave calls pending."""
        if self._limits_reached(session):
            return
        session.messages.append({"role": "assistant", "content": self._turn_text(session)})
        session.finish("answer")

    def _limits_reached(self, session: AgentSession) -> bool:
        """End the session at its token limit (truncated) or ``max_assistant_turns``."""
        if session.finish_reason == "length" or len(session.response_ids) >= session.limit:
            session.finish("response_length", truncated=True)
        elif self.max_assistant_turns and session.assistant_turns >= self.max_assistant_turns:
            session.finish("max_assistant_turns")
        return session.done

    def _turn_text(self, session: AgentSession) -> str:
        start, end = session.turn_spans[-1]
        ids = session.response_ids[start:end]
        if ids and ids[-1] == self.chat.eos_token_id:
            ids = ids[:-1]
        return self.chat.decode(ids)

    # -- tools ------------------------------------------------------------------------------
    def run_tools(self, sessions: Sequence[AgentSession]) -> None:
        """Execute the pending calls of ``sessions`` (all of them concurrently, ``agent.num_workers``
        at a time) and append each session's observation."""
        jobs, timeouts, owners = [], [], []
        for s in sessions:
            for call in s.pending:
                tool = self.tools.get(call.name) if call.error is None else None
                jobs.append(lambda call=call, tool=tool: self._call(call, tool))
                timeouts.append(tool.timeout if tool is not None else 1.0)
                owners.append((s, call))
        results = run_calls(jobs, timeouts, self.num_workers)
        replies: dict[int, list[dict]] = {}
        for (s, call), result in zip(owners, results):
            if isinstance(result, TimedOut):
                result = ToolResponse(
                    f"Error executing tool '{call.name}': timed out after {result.seconds:g} s", error=True
                )
            s.num_tool_calls += 1
            s.num_tool_errors += int(result.error)
            text = truncate_tool_response(result.text, self.max_tool_response_length, self.truncate_side)
            replies.setdefault(id(s), []).append({"role": "tool", "content": text})
        for s in sessions:
            messages = replies.get(id(s), [])
            ids = self.chat.observation_ids(messages)
            s.messages.extend(messages)
            s.pending = []
            if len(s.response_ids) + len(ids) >= s.limit:
                s.finish("response_length", truncated=True)  # no room left to answer (verl's rule)
            else:
                s.add_observation(ids)

    def _call(self, call: FunctionCall, tool: Optional[BaseTool]) -> ToolResponse:
        """One call as a ``ToolResponse``; every failure becomes an error observation (verl's wording)."""
        if call.error is not None:
            return ToolResponse(f"Error: {call.error}", error=True)
        if tool is None:
            return ToolResponse(f"Unknown function '{call.name}'. Available tools: {sorted(self.tools)}", error=True)
        problem = tool.tool_schema.argument_error(call.arguments)
        if problem is not None:
            return ToolResponse(f"Invalid arguments for '{call.name}': {problem}", error=True)
        instance = None
        try:
            instance = tool.create()
            out = tool.execute(instance, dict(call.arguments))
            return out if isinstance(out, ToolResponse) else ToolResponse(str(out))
        except Exception as err:  # noqa: BLE001 - a tool that raises is an observation, not a crash
            logger.debug("tool %r raised %s: %s", call.name, type(err).__name__, err)
            return ToolResponse(f"Error executing tool '{call.name}': {err}", error=True)
        finally:
            if instance is not None:
                try:
                    tool.release(instance)
                except Exception as err:  # noqa: BLE001
                    logger.warning("tool %r failed to release %s: %s", call.name, instance, err)

    # -- results ----------------------------------------------------------------------------
    def outputs(self, session: AgentSession, *, with_logprobs: bool = True) -> list[AgentOutput]:
        """The samples of a finished session: the whole session as one."""
        return [session.output(0, with_logprobs=with_logprobs)]


AGENT_LOOPS.register("single_turn_agent")(AgentLoop)
SingleTurnAgentLoop = AgentLoop


@AGENT_LOOPS.register("tool_agent")
class ToolAgentLoop(AgentLoop):
    """Model turns and tool turns until the model answers without a call (module docstring)."""

    uses_tools = True

    def after_model_turn(self, session: AgentSession) -> None:
        if self._limits_reached(session):
            return
        content, calls = self.parser.parse(self._turn_text(session))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        valid = [c.to_message() for c in calls[: self.max_parallel_calls] if c.error is None]
        if valid:
            message["tool_calls"] = valid
        session.messages.append(message)
        if not calls:
            session.finish("answer")
        elif self.max_user_turns and session.user_turns >= self.max_user_turns:
            session.finish("max_user_turns")
        else:
            session.pending = calls[: self.max_parallel_calls]


def register_agent_loops(path: Optional[str]) -> list[str]:
    """Register the loops of verl's agent-loop config (a YAML list of ``{name, _target_}``); their names."""
    if path is None:
        return []
    from pathlib import Path

    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise ValueError(f"agent.agent_loop_config_path={path!r} is not a file")
    entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(entries, list):
        raise ValueError(f"agent loop config {path}: must be a YAML list of {{name, _target_}} entries")
    names = []
    for i, entry in enumerate(entries):
        where = f"agent loop config {path}: [{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or "_target_" not in entry:
            raise ValueError(f"{where} must be a mapping with a string name and a _target_ class, got {entry!r}")
        cls = import_class(entry["_target_"], f"{where}._target_")
        if not issubclass(cls, AgentLoop):
            raise ValueError(
                f"{where}._target_={entry['_target_']!r} is not a megatron_rl.rollout.agent.AgentLoop subclass"
            )
        AGENT_LOOPS.register(entry["name"])(cls)
        names.append(entry["name"])
    return names
