"""A LoRA actor trains end to end on CPU (issue 29, layer 2): ``MegatronEngine(lora=...)`` + ``Actor``.

Two policy updates (Adam through Megatron's DDP and optimizer) of a 4-layer GPT with adapters on all
four Megatron linears, at TP=1 and TP=2 with sequence parallelism:

- the base weights are bit-identical after the updates and carry no gradient; DDP's gradient buffer
  and the optimizer hold exactly the adapters (their element count);
- the adapters changed, and the adapted policy's log-probs moved away from the base's;
- the reference log-probs (``compute_ref_log_prob``: the actor with adapters off) equal a plain
  frozen engine's that holds the same base weights, to float32 rounding (1e-6: the same kernels on
  the same weights; a missing switch-off would leave the adapted policy's ~1e-2 difference);
- ``merged_adapters`` (what weight sync exports with ``lora.merge: true``) gives the adapted log-probs
  from the merged base weights alone (<= 1e-5: float32 rounding of ``W + s B A`` vs ``W x + s B (A x)``
  over 4 layers of width <= 96), and leaves the base bit-identical afterwards;
- TP=2 (sequence parallel) after the same two updates gives TP=1's log-probs (<= 2e-5, the engine
  tests' LOGPROB_TOL), from adapters drawn non-zero (B too), so the shards must be the full draw's;
- a checkpoint saved at TP=2 loads into a TP=1 actor built from another seed and gives the saved
  actor's log-probs (adapters' TP axes and SwiGLU's [gate; up] split in the distributed checkpoint);
- PP=2 (dense) and EP=2 (MoE, the experts' linears adapted) equal one rank after two updates from
  the same start, and draw that start themselves (adapters seeded by global layer / expert index).
"""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import BATCH, DENSE, LOGPROB_TOL, RESPONSE, make_batch

ADAM = {"optimizer": "adam", "lr": 1e-2, "weight_decay": 0.0, "clip_grad": 1.0}
REF_TOL, MERGE_TOL = 1e-6, 1e-5


def _lora(**overrides):
    from megatron_rl.config.lora_config import LoRAConfig

    return LoRAConfig(**{"rank": 4, "alpha": 8.0, "merge": True, **overrides})


def _case(rank, world_size):
    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.engine.lora_layers import lora_modules, merged_adapters
    from megatron_rl.roles import Actor
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(tensor_model_parallel_size=world_size), seed=5)
    sp = world_size > 1
    actor_cfg = ActorConfig.from_dict({"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 4, "optim": ADAM})
    # B drawn non-zero: TP=2 must split a drawn B like its base (SwiGLU's linear_fc1 holds [gate; up] per rank).
    engine = MegatronEngine(
        ModelConfig(**DENSE),
        mesh,
        trainable=True,
        optim=OptimConfig.from_dict(ADAM),
        sequence_parallel=sp,
        lora=_lora(lora_B_init_method="normal"),
        name="actor",
    )
    actor = Actor(engine, actor_cfg)
    # A plain frozen engine with the same base weights: the names are the base model's.
    plain = MegatronEngine(ModelConfig(**DENSE), mesh, sequence_parallel=sp, name="base")
    params = dict(engine.named_parameters())
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(params[name])
    base_actor = Actor(plain, actor_cfg)

    adapters = {n: p for n, p in params.items() if ".lora_" in n}
    base = {n: p.detach().clone() for n, p in params.items() if ".lora_" not in n}
    n_targets = 4 * DENSE["num_layers"]
    assert len(lora_modules(engine.model)) == n_targets and len(adapters) == 2 * n_targets
    assert all(p.requires_grad for p in adapters.values())
    assert not any(params[n].requires_grad for n in base)
    adapter_numel = sum(p.numel() for p in adapters.values())
    grad_buffer_numel = sum(b.numel_unpadded for chunk in engine.model for b in chunk.buffers)
    optim_numel = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    adapters_before = {n: p.detach().clone() for n, p in adapters.items()}

    batch = make_batch(DENSE["vocab_size"])
    mask = batch["response_mask"]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        old = actor.compute_log_prob(batch)["log_probs"]
        batch["old_log_probs"] = old
        batch["advantages"] = torch.randn(BATCH, RESPONSE, generator=g) * mask
        actor.update_policy(batch)

    base_equal = all(torch.equal(params[n], t) for n, t in base.items())
    base_grads = [n for n in base if params[n].grad is not None or getattr(params[n], "main_grad", None) is not None]
    adapter_change = min(
        float((p.detach() - adapters_before[n]).abs().max()) for n, p in adapters.items() if ".lora_B" in n
    )
    adapted = actor.compute_log_prob(batch)["log_probs"]
    ref = actor.compute_ref_log_prob(batch)["log_probs"]
    plain_lp = base_actor.compute_log_prob(batch)["log_probs"]
    with merged_adapters(engine.model):
        merged = actor.compute_log_prob(batch)["log_probs"]
    after_merge_equal = all(torch.equal(params[n], t) for n, t in base.items())
    again = actor.compute_log_prob(batch)["log_probs"]
    return {
        "adapter_numel": adapter_numel,
        "grad_buffer_numel": grad_buffer_numel,
        "optim_numel": optim_numel,
        "base_equal": base_equal,
        "base_grads": base_grads,
        "adapter_change": adapter_change,
        "ref_vs_plain": float(((ref - plain_lp) * mask).abs().max()),
        "adapted_vs_plain": float(((adapted - plain_lp) * mask).abs().max()),
        "merged_vs_adapted": float(((merged - adapted) * mask).abs().max()),
        "after_merge_equal": after_merge_equal,
        "again_equal": torch.equal(again, adapted),
        "adapted": adapted * mask,
    }


@pytest.fixture(scope="module")
def single_rank():
    return run_distributed(_case, world_size=1)[0]


@pytest.mark.parametrize("world_size", [1, 2])
def test_lora_actor_trains_adapters_only(world_size, single_rank):
    results = [single_rank] if world_size == 1 else run_distributed(_case, world_size=world_size)
    for r in results:
        assert r["grad_buffer_numel"] == r["adapter_numel"] and r["optim_numel"] == r["adapter_numel"]
        assert r["base_equal"] and r["after_merge_equal"] and not r["base_grads"]
        assert r["adapter_change"] > 1e-4  # every B moved
        assert r["adapted_vs_plain"] > 1e-3
        assert r["ref_vs_plain"] <= REF_TOL
        assert r["merged_vs_adapted"] <= MERGE_TOL
        assert r["again_equal"]  # the adapters are back on after the merged block
        assert float((r["adapted"] - single_rank["adapted"]).abs().max()) <= LOGPROB_TOL


def test_lora_engine_refusals():
    """A frozen engine refuses adapters; LoRAConfig names what is not built."""
    from megatron_rl.config.lora_config import resolve_lora

    run_distributed(_frozen_refuses, world_size=1)
    assert resolve_lora({"lora": {"rank": 4}}).merge is False  # verl's default: the adapter-only sync
    cases = [
        ({"lora": {"rank": 4, "merge": True, "type": "dora"}}, "lora.type='dora' is not allowed"),
        ({"lora": {"rank": 4, "merge": True, "target_modules": ["q_proj"]}}, "['q_proj'] not allowed"),
        ({"lora": {"rank": 4, "merge": True, "a2a_experimental": True}}, "lora.a2a_experimental=True is refused"),
        ({"lora": {"rank": -1}}, "lora.rank: -1 is not allowed"),
        ({"lora": {"rank": 4, "merge": True, "alpah": 2}}, "unknown key(s) ['alpah']"),
        ({"lora_rank": 4, "lora": {"rank": 8}}, "are both set"),
    ]
    for keys, message in cases:
        with pytest.raises(ValueError) as info:
            resolve_lora(keys)
        assert message in str(info.value), (keys, str(info.value))
    flat = resolve_lora({"lora_rank": 8, "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None})
    assert (flat.rank, flat.alpha, flat.merge, flat.target_modules) == (
        8,
        16,
        True,
        list(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")),
    )
    assert not resolve_lora({"lora": {"rank": 0}}).enabled  # verl's default: no LoRA, nothing refused
    # a PEFT adapter to start from (its directory is checked by the placement, tests/.../test_lora_peft_load.py)
    assert resolve_lora({"lora": {"rank": 4, "adapter_path": "/x"}}).adapter_path == "/x"
    assert resolve_lora({"lora_rank": 4, "lora_adapter_path": "/y"}).adapter_path == "/y"
    from megatron_rl.config.lora_config import check_lora_fits
    from megatron_rl.config.model import ModelConfig
    from tests.megatron_rl.engine.test_engine import MOE

    check_lora_fits(_lora(rank=48), ModelConfig(**MOE))  # the experts' fc2 is 64 x 48: rank 48 fits
    with pytest.raises(
        ValueError,
        match=r"lora.rank=49 is larger than linear_fc2's dimensions \(64 x 48\); "
        r"allowed: 1..48",
    ):
        check_lora_fits(_lora(rank=49), ModelConfig(**MOE))


def _frozen_refuses(rank, world_size):
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine import MegatronEngine
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=5)
    with pytest.raises(ValueError, match="frozen; LoRA adapters go on a trainable engine"):
        MegatronEngine(ModelConfig(**DENSE), mesh, lora=_lora(), name="ref")


def _train_save(rank, world_size, path):
    """Two updates at TP=``world_size``; save; the adapted log-probs."""
    engine, actor, batch = _lora_actor(world_size)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
        batch["advantages"] = torch.randn(BATCH, RESPONSE, generator=g) * batch["response_mask"]
        actor.update_policy(batch)
    engine.save_checkpoint(path)
    return actor.compute_log_prob(batch)["log_probs"] * batch["response_mask"]


def _load(rank, world_size, path):
    """A fresh LoRA actor at TP=``world_size`` (another seed: the load must overwrite its weights)
    restored from ``path`` (model, adapters' Adam state, schedule); its log-probs before and after."""
    engine, actor, batch = _lora_actor(world_size, seed=77)
    before = actor.compute_log_prob(batch)["log_probs"] * batch["response_mask"]
    engine.load_checkpoint(path)
    return before, actor.compute_log_prob(batch)["log_probs"] * batch["response_mask"]


def _lora_actor(world_size, seed=5):
    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.roles import Actor
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(tensor_model_parallel_size=world_size), seed=seed)
    engine = MegatronEngine(
        ModelConfig(**DENSE),
        mesh,
        trainable=True,
        optim=OptimConfig.from_dict(ADAM),
        sequence_parallel=world_size > 1,
        lora=_lora(),
        name="actor",
    )
    actor = Actor(
        engine, ActorConfig.from_dict({"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 4, "optim": ADAM})
    )
    return engine, actor, make_batch(DENSE["vocab_size"])


def test_lora_checkpoint_saved_at_tp2_loads_at_tp1(tmp_path):
    """Base weights and adapters (with their TP axes) go through Megatron's distributed checkpoint:
    saved at TP=2 (sequence parallel) after two updates, loaded into a TP=1 actor built from another
    seed, the log-probs are the saved actor's (<= LOGPROB_TOL)."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_train_save, 2, path)[0]
    before, loaded = run_distributed(_load, 1, path)[0]
    assert float((before - saved).abs().max()) > 1e-2  # the fresh actor differed
    assert float((loaded - saved).abs().max()) <= LOGPROB_TOL


def _layout_case(rank, world_size, layout, moe, ckpt, distributed_optimizer=False):
    """Two updates of a LoRA actor (adapters on every linear, experts' included) at ``layout``, from the
    base + adapters that the single rank saved to ``ckpt`` (the single rank writes it). Returns the
    adapted log-probs (every rank), whether the base stayed bit-identical, and whether the adapters
    this layout drew itself already equalled the saved ones (layout-free seeding)."""
    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.roles import Actor
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh
    from tests.megatron_rl.engine.test_engine import MOE

    mesh = init_mesh(ParallelConfig(**layout), seed=5)
    engine = MegatronEngine(
        ModelConfig(**(MOE if moe else DENSE)),
        mesh,
        trainable=True,
        optim=OptimConfig.from_dict(ADAM),
        lora=_lora(lora_B_init_method="normal"),
        name="actor",
        distributed_optimizer=distributed_optimizer,
    )
    actor = Actor(
        engine, ActorConfig.from_dict({"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": ADAM})
    )
    drawn = {n: p.detach().clone() for n, p in engine.named_parameters() if ".lora_" in n}
    if world_size == 1:
        engine.save_checkpoint(ckpt)
    else:
        engine.load_checkpoint(ckpt, load_optimizer=False)
    params = dict(engine.named_parameters())
    drawn_equal = all(torch.equal(params[n], t) for n, t in drawn.items())
    base = {n: p.detach().clone() for n, p in params.items() if ".lora_" not in n}
    batch = make_batch(DENSE["vocab_size"])
    g = torch.Generator().manual_seed(1)
    dp, dp_rank = mesh.size("dp"), mesh.dp_rank
    for _ in range(2):
        batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
        batch["advantages"] = torch.randn(BATCH, RESPONSE, generator=g) * batch["response_mask"]
        actor.update_policy({k: v.chunk(dp)[dp_rank] for k, v in batch.items()})
    return (
        actor.compute_log_prob(batch)["log_probs"] * batch["response_mask"],
        all(torch.equal(params[n], t) for n, t in base.items()),
        drawn_equal,
    )


@pytest.mark.parametrize(
    "layout,moe,distributed_optimizer",
    [
        ({"pipeline_model_parallel_size": 2}, False, False),
        ({"expert_model_parallel_size": 2}, True, False),
        ({}, False, True),
    ],
    ids=["pp2", "ep2_experts", "dp2_distributed_optimizer"],
)
def test_lora_layouts_equal_single_rank(layout, moe, distributed_optimizer, tmp_path):
    """PP=2 and EP=2 (each rank's adapters for its own experts, reduced over the expert-data-parallel
    group) and DP=2 with Megatron's DistributedOptimizer (the adapters' Adam state sharded over DP)
    equal one rank after two updates from the same base and adapters (<= LOGPROB_TOL); the
    base stays bit-identical; and the adapters each layout draws are the single rank's (seeded by
    global layer number and global expert index)."""
    ckpt = str(tmp_path / "init")
    single, single_base, _ = run_distributed(_layout_case, 1, {}, moe, ckpt)[0]
    assert single_base
    for lp, base_equal, drawn_equal in run_distributed(_layout_case, 2, layout, moe, ckpt, distributed_optimizer):
        assert base_equal and drawn_equal
        assert float((lp - single).abs().max()) <= LOGPROB_TOL
