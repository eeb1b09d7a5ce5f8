"""Tool calls in the text a model turn decodes to: the Hermes / Qwen format.

A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/3's chat
templates render ``tool_calls`` this way and their tokenizers stop the turn with eos after it).
``HermesToolParser.parse(text)`` returns the text without the call blocks and one
``FunctionCall`` per block, in order; a block that is not a JSON object with a string ``name``
and object ``arguments`` (a JSON-encoded object string is accepted, as OpenAI sends them), or an
unclosed ``<tool_call>``, is a ``FunctionCall`` with ``error`` set -- the loop answers it with an
error observation instead of failing.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

__all__ = ["FunctionCall", "HermesToolParser", "PARSERS", "get_parser"]


@dataclasses.dataclass(frozen=True)
class FunctionCall:
    """One parsed call; ``error`` says why it is malformed (then name/arguments may be None)."""

    name: Optional[str]
    arguments: Optional[dict]
    error: Optional[str] = None
    raw: str = ""

    def to_message(self) -> dict:
        """The OpenAI ``tool_calls`` entry the chat template renders."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring)."""

    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        """``(content without the call blocks, calls)``."""
        calls = [self._call(m.group(1)) for m in self._block.finditer(text)]
        content = self._block.sub("", text)
        if self.start in content:  # an opened call the turn never closed
            head, _, tail = content.partition(self.start)
            calls.append(FunctionCall(None, None, f"unclosed {self.start} (no {self.end} follows it)", tail))
            content = head
        return content.strip(), calls

    @staticmethod
    def _call(body: str) -> FunctionCall:
        raw = body.strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            return FunctionCall(None, None, f"the tool call is not valid JSON ({err.msg} at character {err.pos})", raw)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return FunctionCall(
                None,
                None,
                'a tool call must be a JSON object {"name": ..., "arguments": {...}} with a string name',
                raw,
            )
        args: Any = obj.get("arguments", {})
        if isinstance(args, str):  # OpenAI's wire format sends the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            return FunctionCall(
                obj["name"],
                None,
                f"the arguments of {obj['name']!r} must be a JSON object, got {type(args).__name__}",
                raw,
            )
        return FunctionCall(obj["name"], args, None, raw)

    def format(self, name: str, arguments: dict) -> str:
        """The text of a call (Qwen's template: the JSON on its own line)."""
        return f"{self.start}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{self.end}"


PARSERS = {"hermes": HermesToolParser}
"""``multi_turn.format`` -> parser class (``megatron_rl.config.rollout.TOOL_CALL_FORMATS`` lists the same names)."""


def get_parser(name: str) -> HermesToolParser:
    """The parser of ``multi_turn.format`` ``name``."""
    if name not in PARSERS:
        raise ValueError(f"multi_turn.format={name!r} is not allowed; choose one of {sorted(PARSERS)}")
    return PARSERS[name]()
