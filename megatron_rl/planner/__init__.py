"""Dry-run layout planner: ``megatron-rl plan`` and the checks ``megatron-rl train`` runs first.

``plan_run(config, nodes, gpus_per_node, gpu_memory_gb)`` validates the parallel layout against
the model and the cluster, places ranks on nodes and estimates per-device memory per phase;
``check_plan(config)`` raises ``ValueError`` when the layout is invalid or does not fit.
"""

from megatron_rl.planner.architectures import KNOWN_ARCHITECTURES, resolve_architecture
from megatron_rl.planner.memory import RoleMemory, count_params, estimate_role
from megatron_rl.planner.plan import Plan, check_plan, format_plan, misfit_message, plan_json, plan_run

__all__ = [
    "KNOWN_ARCHITECTURES",
    "resolve_architecture",
    "RoleMemory",
    "count_params",
    "estimate_role",
    "Plan",
    "plan_run",
    "check_plan",
    "format_plan",
    "misfit_message",
    "plan_json",
]
