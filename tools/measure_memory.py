"""Measure the per-rank tensor memory of one actor training step on CPU (gloo ranks).

Used by ``tests/megatron_rl/test_planner.py`` to check ``megatron_rl.planner``'s estimate.

What is measured: the bytes of *tensor storages* alive on this rank -- not RSS, which on CPU
mixes the allocator's caching, Python objects and shared libraries. A ``TorchDispatchMode``
sees every ATen op (forward, autograd backward and the optimizer step all dispatch through
it); each op's output storages are registered with a weak reference to the storage itself
(``StorageWeakRef``: it expires when the storage is freed, whatever views pointed at it).
After every op the expired ones are dropped and the live total is compared with the peak.
Storages that exist before the step (parameters, Megatron's gradient buffers, optimizer
state) are registered first by walking the model and the optimizer. The result is an exact
high-water mark of live tensor bytes at op granularity.

Run as a script for one layout: ``python tools/measure_memory.py --tp 2`` (spawns the ranks).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StorageTracker", "measure_train_step", "measure_offload_phases", "DEFAULT_MODEL", "DEFAULT_BATCH"]

DEFAULT_MODEL = dict(
    num_layers=4,
    hidden_size=256,
    ffn_hidden_size=768,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=4096,
    max_position_embeddings=512,
)
"""~5.3 M parameters: parameters, gradients, Adam state and activations are all tens of MB."""
DEFAULT_BATCH = dict(batch_size=4, prompt_length=64, response_length=192, micro_batch_size=2)
"""One mini-batch of 4 full-length responses (sequence 256), two micro-batches of 2."""


class StorageTracker(TorchDispatchMode):
    """Peak of live tensor-storage bytes over every op run inside the mode."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def register(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (once, however many views share it)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._live:
            nbytes = storage.nbytes()
            self._live[key] = (StorageWeakRef(storage), nbytes)
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def _prune(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self.current -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.register(tensor)
        self._prune()
        return out


def _static_tensors(engine) -> list[torch.Tensor]:
    """Parameters, gradient buffers and optimizer state that exist before the step."""
    out = [p for _, p in engine.named_parameters()]
    for chunk in engine.model:
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            out += [
                t for t in (getattr(buffer, "grad_data", None), getattr(buffer, "param_data", None)) if t is not None
            ]
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for group in opt.optimizer.param_groups:
            out += list(group["params"])
        for state in opt.optimizer.state.values():
            out += [v for v in state.values() if torch.is_tensor(v)]
    return out


def _batch(vocab: int, batch_size: int, prompt_length: int, response_length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch_size, prompt_length), generator=g)
    responses = torch.randint(0, vocab, (batch_size, response_length), generator=g)
    ones = torch.ones(batch_size, prompt_length + response_length, dtype=torch.long)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": ones,
        "responses": responses,
        "response_mask": torch.ones(batch_size, response_length, dtype=torch.long),
        "advantages": torch.randn(batch_size, response_length, generator=g),
        "old_log_probs": -torch.rand(batch_size, response_length, generator=g) - 8.0,
    }


def measure_train_step(
    rank: int, world_size: int, layouts: list[dict], model_kw: dict, batch_kw: dict, optim: str = "adam"
) -> list[dict[str, Any]]:
    """For each layout (``ParallelConfig`` kwargs): build the actor engine, run one
    ``update_policy`` step (forward + backward + optimizer step) as warm-up -- Adam creates its
    state lazily -- then a second one under a ``StorageTracker``; return per layout ``{"static": bytes before the step, "peak": peak live bytes}`` for this rank."""
    from megatron_rl.config import ActorConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.roles import build_role
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    torch.manual_seed(0)
    results = []
    for par in layouts:
        pc = ParallelConfig(**par)
        mesh = init_mesh(pc, seed=1234)
        dp, dp_rank = mesh.size("dp"), mesh.dp_rank
        cfg = {
            "ppo_mini_batch_size": batch_kw["batch_size"],
            "rollout_n": 1,
            "ppo_micro_batch_size_per_gpu": batch_kw["micro_batch_size"],
            "use_kl_loss": False,
            "optim": {"optimizer": optim, "lr": 1e-4, "clip_grad": 1.0},
        }
        actor = build_role("actor", ModelConfig(**model_kw), mesh, ActorConfig.from_dict(cfg))
        batch = _batch(
            model_kw["vocab_size"], batch_kw["batch_size"] * dp, batch_kw["prompt_length"], batch_kw["response_length"]
        )
        batch = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        actor.update_policy(batch)  # warm-up: creates the optimizer state (steady state from here)
        tracker = StorageTracker()
        for tensor in _static_tensors(actor.engine):
            tracker.register(tensor)
        static = tracker.current
        with tracker:
            actor.update_policy(batch)
        results.append({"layout": par, "static": static, "peak": tracker.peak, "after": tracker.current})
        del actor
        destroy_mesh(mesh)
    return results


def measure_offload_phases(rank: int, world_size: int, model_kw: dict, batch_kw: dict) -> dict[str, dict]:
    """The actor's colocated phases with every part offloaded outside them (``megatron.param_offload``,
    ``grad_offload``, ``optimizer_offload`` on): per phase the bytes it keeps resident (``resident``)
    and the peak of live tensor bytes while the phase computes (``peak``) -- ``gen`` (nothing of the
    actor), ``old_log_prob`` (parameters onloaded, forward) and ``update_actor`` (everything)."""
    from megatron_rl.config import ActorConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.roles import build_role
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    torch.manual_seed(0)
    mesh = init_mesh(ParallelConfig(), seed=1234)
    cfg = {
        "ppo_mini_batch_size": batch_kw["batch_size"],
        "rollout_n": 1,
        "ppo_micro_batch_size_per_gpu": batch_kw["micro_batch_size"],
        "use_kl_loss": False,
        "optim": {"optimizer": "adam", "lr": 1e-4, "clip_grad": 1.0},
    }
    actor = build_role("actor", ModelConfig(**model_kw), mesh, ActorConfig.from_dict(cfg))
    engine = actor.engine
    batch = _batch(
        model_kw["vocab_size"], batch_kw["batch_size"], batch_kw["prompt_length"], batch_kw["response_length"]
    )
    actor.update_policy(batch)  # warm-up: Adam's state exists from here

    def tracked(fn) -> dict:
        tracker = StorageTracker()
        for tensor in _static_tensors(engine):
            if tensor.untyped_storage().nbytes():  # offloaded storages are empty: not resident
                tracker.register(tensor)
        resident = tracker.current
        if fn is not None:
            with tracker:
                fn()
        return {"resident": resident, "peak": tracker.peak}

    out = {}
    engine.offload_to_cpu()
    out["gen"] = tracked(None)
    engine.load_to_device(params=True, grads=False, optimizer=False)
    out["old_log_prob"] = tracked(lambda: actor.compute_log_prob(batch, calculate_entropy=True))  # as the trainer
    engine.load_to_device()
    out["update_actor"] = tracked(lambda: actor.update_policy(batch))
    actor = engine = None  # the model and its buffers go before the mesh (the closures above hold the names)
    destroy_mesh(mesh)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=None, help="default: tp * pp")
    args = parser.parse_args(argv)
    from parallel.testing import run_distributed

    world = args.world_size or args.tp * args.pp
    layout = {"tensor_model_parallel_size": args.tp, "pipeline_model_parallel_size": args.pp}
    out = run_distributed(measure_train_step, world, [layout], DEFAULT_MODEL, DEFAULT_BATCH)
    print(json.dumps([r[0] for r in out], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
