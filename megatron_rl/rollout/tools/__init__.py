"""Tools for agent sessions: verl's tool interface and tool-config YAML, a calculator, and a
sandboxed Python interpreter (``sandbox``: limits, private working directory, no network)."""

from megatron_rl.rollout.tools.tool_base import BaseTool, ToolResponse, ToolSchema
from megatron_rl.rollout.tools.tool_registry import BUILTIN_TOOL_CONFIGS, load_tools, resolve_tool_config

__all__ = ["BaseTool", "ToolResponse", "ToolSchema", "BUILTIN_TOOL_CONFIGS", "load_tools", "resolve_tool_config"]
