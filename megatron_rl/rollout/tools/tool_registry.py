"""Tools from verl's tool-config YAML: ``load_tools(path)`` -> ``{name: BaseTool}``.

The file (verl's ``multi_turn.tool_config_path`` format)::

    tools:
      - class_name: megatron_rl.rollout.tools.calculator.CalculatorTool
        config: {type: native}              # the tool's own settings; type must be native
        tool_schema:                        # OpenAI function schema (optional if the class has one)
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, ...}}

``path`` may also name a built-in config (``BUILTIN_TOOL_CONFIGS``: the files in
``megatron_rl/rollout/tools/configs/``). Every problem is a ValueError naming the file, the
entry and the field, raised before any tool runs: a class that cannot be imported or is no
``BaseTool``, a schema that is not valid JSON Schema, duplicate names.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_rl.rollout.tools.tool_base import BaseTool, ToolSchema

__all__ = ["BUILTIN_DIR", "BUILTIN_TOOL_CONFIGS", "resolve_tool_config", "load_tools", "import_class"]

BUILTIN_DIR = Path(__file__).with_name("configs")
BUILTIN_TOOL_CONFIGS = tuple(sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml")))
"""Names ``multi_turn.tool_config_path`` may give instead of a path."""


def resolve_tool_config(path_or_name: str) -> Path:
    """The file of ``path_or_name``: an existing path, or a built-in tool config's name."""
    path = Path(path_or_name).expanduser()
    if path.is_file():
        return path
    if str(path_or_name) in BUILTIN_TOOL_CONFIGS:
        return BUILTIN_DIR / f"{path_or_name}.yaml"
    raise ValueError(
        f"multi_turn.tool_config_path={str(path_or_name)!r} is neither a file nor a built-in tool "
        f"config; built-in: {list(BUILTIN_TOOL_CONFIGS)}"
    )


def import_class(dotted: Any, where: str) -> type:
    """The class ``module.Class`` names; ValueError naming ``where`` when it cannot be imported."""
    if not isinstance(dotted, str) or "." not in dotted:
        raise ValueError(f"{where}={dotted!r} must be a dotted 'module.Class' name")
    module_name, _, class_name = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{where}={dotted!r} cannot be imported: {err}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{where}={dotted!r} cannot be imported: module {module_name!r} has no class {class_name!r}")
    return cls


def load_tools(path_or_name: Optional[str]) -> dict[str, BaseTool]:
    """The tools of a tool config (see the module docstring); ``{}`` for None."""
    if path_or_name is None:
        return {}
    from omegaconf import OmegaConf

    path = resolve_tool_config(path_or_name)
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as err:  # noqa: BLE001 - YAML and interpolation errors alike
        raise ValueError(f"tool config {path}: cannot be read as YAML: {err}") from None
    entries = data.get("tools") if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        raise ValueError(f"tool config {path}: needs a top-level 'tools' list, got {type(entries).__name__}")
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(entries):
        where = f"tool config {path}: tools[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a mapping with class_name, config and tool_schema")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {sorted(unknown)}; allowed: class_name, config, tool_schema")
        cls = import_class(entry.get("class_name"), f"{where}.class_name")
        if not issubclass(cls, BaseTool):
            raise ValueError(
                f"{where}.class_name={entry['class_name']!r} is not a megatron_rl.rollout.tools.BaseTool subclass"
            )
        config = dict(entry.get("config") or {})
        if config.get("type", "native") != "native":
            raise ValueError(
                f"{where}.config.type={config['type']!r} is not allowed; only 'native' tools are "
                "supported (as in verl 0.9.1)"
            )
        schema = entry.get("tool_schema")
        schema = None if schema is None else ToolSchema.from_dict(schema, f"{where}.tool_schema")
        try:
            tool = cls(config=config, tool_schema=schema)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if tool.name in tools:
            raise ValueError(f"{where}: tool name {tool.name!r} is declared twice")
        tools[tool.name] = tool
    return tools
