"""What a tool is: verl's interface (a class + an OpenAI function schema), called synchronously.

A tool-config entry names a ``BaseTool`` subclass, its ``config`` mapping and its
``tool_schema`` (``{"type": "function", "function": {"name", "description", "parameters"}}``,
OpenAI's function-calling format). The agent loop calls, per tool call, ``create()`` -> an
instance id, ``execute(instance_id, parameters)`` -> ``ToolResponse`` (or a plain string), then
``release(instance_id)``; tools keep per-call state under the instance id if they need any.
Calls run in worker threads, so ``execute`` must be thread-safe. ``parameters`` have already
been checked against the schema's JSON Schema (``ToolSchema.argument_error``).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Mapping, Optional

__all__ = ["BaseTool", "ToolResponse", "ToolSchema"]


@dataclasses.dataclass(frozen=True)
class ToolSchema:
    """An OpenAI function-tool schema whose ``parameters`` is a valid JSON Schema of an object."""

    name: str
    """The function name the model calls."""
    description: str
    """What the tool does (shown to the model by the chat template)."""
    parameters: dict
    """JSON Schema of the arguments object."""

    @classmethod
    def from_dict(cls, data: Any, where: str = "tool_schema") -> "ToolSchema":
        """Parse and check ``{"type": "function", "function": {...}}``; ValueError naming ``where`` and the field."""
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
        if data.get("type", "function") != "function":
            raise ValueError(f"{where}.type={data.get('type')!r} is not allowed; only 'function' tools exist")
        function = data.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(
                f"{where}.function must be a mapping with name, description and parameters, got {function!r}"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
            raise ValueError(f"{where}.function.name={name!r} must be a non-empty name without spaces")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise ValueError(f"{where}.function.parameters must be a JSON Schema object, got {parameters!r}")
        parameters = _plain(parameters)
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as err:
            path = "".join(f"[{p!r}]" for p in err.path)
            raise ValueError(
                f"{where}.function.parameters is not a valid JSON Schema: {err.message}"
                f"{f' (at parameters{path})' if path else ''}"
            ) from None
        if parameters.get("type") != "object":
            raise ValueError(
                f"{where}.function.parameters.type={parameters.get('type')!r}: the arguments of a "
                "function call are an object, so the schema's type must be 'object'"
            )
        return cls(name=name, description=str(function.get("description", "")), parameters=parameters)

    def to_openai(self) -> dict:
        """The schema as the chat template receives it (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def argument_error(self, arguments: Any) -> Optional[str]:
        """Why ``arguments`` do not fit ``parameters`` (the first violation), or None when they do."""
        from jsonschema import Draft202012Validator

        if not isinstance(arguments, Mapping):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        error = next(iter(Draft202012Validator(self.parameters).iter_errors(dict(arguments))), None)
        if error is None:
            return None
        where = "".join(f"[{p!r}]" for p in error.path)
        return f"{error.message}{f' (at arguments{where})' if where else ''}"


def _plain(value: Any) -> Any:
    """Mappings and sequences (OmegaConf's included) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclasses.dataclass
class ToolResponse:
    """What a call returns to the session: the observation text and how the call went."""

    text: str
    """The observation (truncated by ``multi_turn.max_tool_response_length`` before the model sees it)."""
    error: bool = False
    """The call failed (bad call, bad arguments, the tool raised or timed out, the sandbox refused)."""
    reward: float = 0.0
    """A per-call reward (verl's tool reward; recorded, not added to the outcome reward)."""


class BaseTool:
    """A tool (see the module docstring). Subclasses implement ``execute``.

    Args:
        config: the entry's ``config`` mapping (``type: native`` plus the tool's own settings;
            ``timeout`` = seconds the loop waits for one call, default 30).
        tool_schema: the entry's schema, or None for the class's ``default_schema()``.
    """

    def __init__(self, config: Optional[Mapping[str, Any]] = None, tool_schema: Optional[ToolSchema] = None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema if tool_schema is not None else self.default_schema()
        self.name = self.tool_schema.name
        timeout = self.config.get("timeout", 30.0)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"tool {self.name!r}: config.timeout={timeout!r} must be a number of seconds > 0")
        self.timeout = float(timeout)

    @classmethod
    def default_schema(cls) -> ToolSchema:
        """The schema used when the tool config gives none."""
        raise ValueError(
            f"{cls.__module__}.{cls.__qualname__} has no default schema; give tool_schema in the tool config"
        )

    def create(self, **kwargs: Any) -> str:
        """A fresh instance id for one call."""
        return uuid.uuid4().hex

    def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse | str:
        """Run the call; raising is fine (the loop turns it into an error observation)."""
        raise NotImplementedError

    def release(self, instance_id: str) -> None:
        """Free what ``create`` / ``execute`` kept for ``instance_id``."""
