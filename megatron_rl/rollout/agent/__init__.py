"""Multi-turn agent rollouts (token in, token out): sessions that alternate model turns on one
vLLM engine with tool turns, trained on exactly the ids generated and observed.

``AgentRunner`` (``runner``) advances a step's sessions together, one engine call per round;
``AGENT_LOOPS`` (``loop``) decides what follows each model turn (``single_turn_agent``,
``tool_agent``); ``ChatFormat`` (``chat``) makes observation ids with the tokenizer's chat
template; ``HermesToolParser`` (``parser``) reads ``<tool_call>{json}</tool_call>``; tools live in
``megatron_rl.rollout.tools``. ``batch`` turns the worker's output into the step's ``Batch`` and
its metrics; ``reward`` scores a session's final answer.
"""

from megatron_rl.rollout.agent.chat import TOOL_CHATML_TEMPLATE, ChatFormat
from megatron_rl.rollout.agent.loop import AGENT_LOOPS, AgentLoop, ToolAgentLoop, register_agent_loops
from megatron_rl.rollout.agent.parser import FunctionCall, HermesToolParser
from megatron_rl.rollout.agent.runner import AgentRunner, pad_outputs
from megatron_rl.rollout.agent.session import AgentOutput, AgentSession

__all__ = [
    "AGENT_LOOPS",
    "AgentLoop",
    "AgentOutput",
    "AgentRunner",
    "AgentSession",
    "ChatFormat",
    "FunctionCall",
    "HermesToolParser",
    "TOOL_CHATML_TEMPLATE",
    "ToolAgentLoop",
    "pad_outputs",
    "register_agent_loops",
]
