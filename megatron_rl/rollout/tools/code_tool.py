"""``CodeInterpreterTool``: runs the model's Python in the sandbox and returns what it printed.

Tool-config ``config`` keys (all optional): ``wall_seconds`` (10), ``cpu_seconds`` (5),
``memory_mb`` (512), ``max_output_bytes`` (8192), ``max_file_bytes`` (1 MiB), ``max_open_files`` (64),
``max_disk_bytes`` (64 MiB), ``max_files`` (1024), ``max_processes`` (32), ``max_cpus`` (1) -- the
``SandboxLimits`` of every call --, the loop's ``timeout`` (default: the wall limit + 5 s), and
``allow_unisolated`` (False): where this machine gives the sandbox no user namespace or no seccomp
filter, the tool refuses to be built unless it is set (then with a warning naming it).
A call whose code fails or exceeds a limit is an error observation with the reason.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional

from megatron_rl.rollout.tools.tool_base import BaseTool, ToolResponse, ToolSchema
from megatron_rl.rollout.tools.sandbox import SandboxLimits, isolation, run_python

__all__ = ["CodeInterpreterTool"]

_LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(SandboxLimits))


class CodeInterpreterTool(BaseTool):
    """Executes ``{"code": "print(48213 * 9174)"}`` in ``megatron_rl.rollout.tools.sandbox``."""

    def __init__(self, config: Optional[Mapping[str, Any]] = None, tool_schema: Optional[ToolSchema] = None):
        config = dict(config or {})
        unknown = set(config) - set(_LIMIT_KEYS) - {"type", "timeout", "allow_unisolated"}
        if unknown:
            raise ValueError(
                f"code tool config has unknown key(s) {sorted(unknown)}; allowed: "
                f"{['type', 'timeout', 'allow_unisolated', *_LIMIT_KEYS]}"
            )
        _check_isolation(bool(config.pop("allow_unisolated", False)))
        self.limits = SandboxLimits(**{k: config[k] for k in _LIMIT_KEYS if k in config})
        config.setdefault("timeout", self.limits.wall_seconds + 5.0)
        super().__init__(config, tool_schema)

    @classmethod
    def default_schema(cls) -> ToolSchema:
        return ToolSchema.from_dict(
            {
                "type": "function",
                "function": {
                    "name": "code_interpreter",
                    "description": "Run Python code and return what it prints.",
                    "parameters": {
                        "type": "object",
                        "properties": {"code": {"type": "string", "description": "a Python program; print the result"}},
                        "required": ["code"],
                    },
                },
            }
        )

    def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse:
        result = run_python(parameters["code"], self.limits)
        return ToolResponse(result.observation(self.limits), error=not result.ok)


def _check_isolation(allow_unisolated: bool) -> None:
    iso = isolation()
    missing = [
        name for name, ok in (("user namespace", iso.network_namespace), ("seccomp filter", iso.seccomp)) if not ok
    ]
    if not missing:
        return
    if not allow_unisolated:
        raise RuntimeError(
            f"code tool: this machine gives the sandbox no {' and no '.join(missing)}, so model code "
            "would run with only the audit hook between it and the host; set the code tool's "
            "allow_unisolated: true to run it anyway"
        )
    warnings.warn(
        f"code tool: allow_unisolated is set and the sandbox has no {' and no '.join(missing)}: model "
        "code runs weakly isolated",
        RuntimeWarning,
        stacklevel=3,
    )
