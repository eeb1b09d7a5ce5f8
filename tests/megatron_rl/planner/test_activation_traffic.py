"""The planner's count of a layer's element-wise traffic (``megatron_rl.planner.activation_traffic``, unfused:
the local spec a CPU run uses) against the bytes a real Megatron forward dispatches.

A ``TorchDispatchMode`` sees every aten operator of an actor's ``compute_log_prob`` on the toy model (one rank,
packed rows) and adds up the bytes of each operator's tensor inputs and outputs, views and the GEMMs aside
(the GEMMs are the FLOP term's). Two models that differ by one decoder layer give the traffic of one layer;
the formula must land within 10 % of it. A dense layer (recipes/grpo.yaml's model) and a MoE layer
(recipes/grpo_moe.yaml's) are checked.
"""

from __future__ import annotations

import pytest

from parallel.testing import run_distributed

RECIPES = {"dense": "grpo", "moe": "grpo_moe"}
"""The toy recipes whose model's layers are counted."""
ROWS, PROMPT, RESPONSE = 16, 24, 16

# operators that move nothing of their own (views, allocations) and the GEMMs (the FLOP term's)
SKIP = {
    "view", "_unsafe_view", "as_strided", "transpose", "t", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "split", "split_with_sizes", "unflatten", "alias", "detach", "reshape", "_reshape_alias", "narrow",
    "unbind", "chunk", "view_as", "lift_fresh", "empty", "empty_strided", "empty_like", "set_", "resize_",
    "mm", "addmm", "addmm_", "bmm", "matmul", "baddbmm",
}  # fmt: skip


def toy_model(kind: str = "dense"):
    """The ``ModelConfig`` of the toy recipe ``RECIPES[kind]``."""
    from megatron_rl.config.loader import load_config

    return load_config(RECIPES[kind]).actor_rollout_ref.model.config


def _dispatched_bytes(rank: int, world: int, layer_counts: tuple, model) -> list[int]:
    import dataclasses

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.roles import build_role
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] not in SKIP:
                tensors = tree_flatten((args, kwargs, out))[0]
                self.total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            return out

    mesh = init_mesh(ParallelConfig(), seed=0)
    ids = torch.randint(0, model.vocab_size, (ROWS, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "responses": ids[:, PROMPT:],
        "response_mask": torch.ones(ROWS, RESPONSE, dtype=torch.long),
    }
    out = []
    for layers in layer_counts:
        actor = build_role(
            "actor",
            dataclasses.replace(model, num_layers=layers),
            mesh,
            ActorConfig(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=ROWS, optim=OptimConfig(lr=1e-6)),
            remove_padding=True,
        )
        actor.compute_log_prob(batch)  # warm: lazy state is built outside the count
        count = Count()
        with count:
            actor.compute_log_prob(batch)
        out.append(count.total)
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_unfused_layer_traffic_matches_the_dispatched_bytes(kind):
    from megatron_rl.planner.activation_traffic import layer_elements

    model = toy_model(kind)
    one, two = run_distributed(_dispatched_bytes, 1, (1, 2), model, timeout_s=300)[0]
    measured = (two - one) / (ROWS * (PROMPT + RESPONSE)) / 4  # float32 elements per token of one layer
    predicted = layer_elements(model, fused=False, moe=True)
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)
