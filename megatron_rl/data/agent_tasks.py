"""The toy agentic task: multiply numbers too long for a tiny model's head, so the calculator pays.

``toy_multiply`` (registered in ``TOY_TASKS`` and ``REWARD_FNS``): the question is the bare
expression, e.g. ``482*917`` (two numbers of the same ``min_len..max_len`` digits), the answer the
exact product. Without spaces every digit is a token of its own wherever it
appears (question, tool call, tool result, answer), which keeps copying learnable for a tiny model. The reward scores the
session's final answer (the text of its last model turn, ``megatron_rl.rollout.agent.final_answer``):
the last integer in it against the product, digit by digit from the left over the longer of the
two (only the exact product scores 1.0; ``acc`` is 1.0 for it).

``AGENT_DEMOS`` maps an agentic task to its demonstrations for the supervised warm-up
(``megatron_rl.rollout.agent.warmup``): ``demo(row, use_tool)`` -> the messages that follow the
prompt, either a calculator call, its result and the answer, or a direct answer. The warm-up
mixes them (``DEMO_TOOL_FRACTION`` call the tool: enough of them that copying digits into the call
and out of its result is learnt), so RL starts from a model that calls the tool about half the
time and has to learn that calling it pays.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from megatron_rl.data.datasets import TOY_TASKS
from megatron_rl.data.rewards import register_reward
from megatron_rl.utils.registry import Registry

__all__ = ["AGENT_DEMOS", "DEMO_TOOL_FRACTION", "TOY_MULTIPLY", "multiply_demo", "toy_multiply_score"]

TOY_MULTIPLY = "toy_multiply"
DEMO_TOOL_FRACTION = 0.5
"""Share of warm-up demonstrations that call the tool (the rest answer directly)."""

AGENT_DEMOS = Registry("agent demonstration")
"""Agentic toy task name -> ``demo(row, use_tool) -> messages after the prompt``."""


def _number(rng: np.random.Generator, digits: int) -> int:
    return int(rng.integers(10 ** (digits - 1), 10**digits))


@TOY_TASKS.register(TOY_MULTIPLY)
def _toy_multiply(rng: np.random.Generator, length: int) -> tuple[str, str]:
    a, b = _number(rng, length), _number(rng, length)
    return f"{a}*{b}", str(a * b)


@register_reward(TOY_MULTIPLY)
def toy_multiply_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None
) -> dict:
    """Digit-by-digit credit of the last integer in ``solution_str`` against ``ground_truth`` (module docstring)."""
    found = re.findall(r"\d+", solution_str)
    target, pred = str(ground_truth).strip(), found[-1] if found else ""
    longest = max(len(target), len(pred))
    score = sum(p == t for p, t in zip(pred, target)) / longest if longest else 0.0
    return {"score": score, "acc": float(pred == target)}


@AGENT_DEMOS.register(TOY_MULTIPLY)
def multiply_demo(row: dict, use_tool: bool) -> list[dict]:
    """The calculator call for the row's question, its result and the answer (or the answer alone)."""
    answer = str(row["extra_info"]["answer"])
    if not use_tool:
        return [{"role": "assistant", "content": answer}]
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": row["extra_info"]["question"]}},
    }
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]
