"""Where Ray put a process: ``bundle_where``, the probe ``GpuBundles`` runs in each of its bundles, and the
probe actors of the placement tests, which stand in for ``MegatronWorker``, ``RolloutWorker`` and
``HeadlessEngineNode`` (same constructor and the calls the placement makes) and report where Ray put
them (node, ``CUDA_VISIBLE_DEVICES``, GPU ids). They live in the package so that a Ray worker started
with a ``runtime_env`` (the engines' ``CUDA_VISIBLE_DEVICES``) can import them, and in a module that
imports nothing but ``os``: each Ray worker that runs one imports this module (torch would cost a
placement of 8 GPUs ~40 s on a 2-core machine)."""

from __future__ import annotations

import os

__all__ = ["bundle_where", "RankProbe", "EngineProbe", "HeadlessProbe"]


def bundle_where() -> tuple:
    """``(node_id, node_ip, gpu_id)`` of the bundle this Ray task runs in (``GpuBundles``' probe)."""
    import ray

    return _node(), ray.util.get_node_ip_address(), int(ray.get_gpu_ids()[0])


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class RankProbe:
    """Stands in for ``MegatronWorker``: the group's calls, answered with where the rank runs."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1):
        self.rank, self.world_size = rank, world_size

    def address(self):
        return "127.0.0.1", 0

    def init_engine(self, master_addr, master_port, spec):
        return {
            "rank": self.rank,
            "dp_rank": self.rank,
            "dp_size": self.world_size,
            "tp_rank": 0,
            "cp_rank": 0,
            "is_last_pp_stage": True,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_ids": _gpu_ids(),
            "node": _node(),
        }

    def shutdown(self):
        return None


class EngineProbe:
    """Stands in for ``RolloutWorker``: records its devices and the multi-node arguments it got."""

    def __init__(self, model_path, config, tokenizer_path=None, num_threads=1, partial_rollout=False, multi_node=None):
        self.multi_node, self.slept = multi_node, []

    def pad_token_id(self):
        return 0

    def sleep(self, level=1):
        self.slept.append(level)

    def where(self):
        return {
            "node": _node(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "multi_node": self.multi_node,
            "slept": list(self.slept),
        }


class HeadlessProbe:
    """Stands in for ``HeadlessEngineNode``."""

    def __init__(self, model_path, config, multi_node):
        self.multi_node = multi_node

    def where(self):
        return {"node": _node(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "multi_node": self.multi_node}


def _gpu_ids() -> list:
    import ray

    return [int(g) for g in ray.get_gpu_ids()]
