"""``lora.adapter_path`` (verl's key): a saved PEFT adapter directory into the actor's adapters (issue 29).

A tiny Qwen3 checkpoint is loaded into a Megatron actor with rank-4 adapters drawn non-zero (B too); its
adapters are exported as the project exports them (``peft_adapter_tensors`` + ``peft_adapter_config`` +
``write_peft_adapter``: ``final_hf/lora_adapter``'s format). A second actor, its adapters at verl's default
start (B = 0: the base model), loads that directory with ``load_peft_adapter``:

- at TP=1 its logits equal the first actor's exactly, and exporting it again gives the file's tensors bit
  for bit; at TP=2 (sequence parallel, each rank reading its shards) they equal to ``TP_TOL`` = 1e-5;
- before loading it computed the base model (logits differ by > ``MOVED_MIN``);
- a directory whose config does not match (``r``, ``lora_alpha``), whose fused ``A`` differ between q/k/v,
  or whose targets differ from the model's is refused by key, naming what is wrong.
"""

from __future__ import annotations

import json

import pytest
import torch

from parallel.testing import run_distributed

TP_TOL = 1e-5
MOVED_MIN = 1e-2
KEY = "actor_rollout_ref.model.lora.adapter_path"
SGD = {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "clip_grad": 0.0}
LORA = dict(rank=4, alpha=8.0)


def _engine(hf_dir, mesh, **lora):
    from megatron_rl.config import OptimConfig
    from megatron_rl.config.lora_config import LoRAConfig
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.models.families import get_family
    from parallel.bridge import load_hf_checkpoint

    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir, make_vocab_size_divisible_by=64)
    weight_map = family.weight_map(model_cfg)
    config = LoRAConfig(merge=True, **lora)
    engine = MegatronEngine(
        model_cfg,
        mesh,
        trainable=True,
        optim=OptimConfig.from_dict(SGD),
        name="actor",
        sequence_parallel=mesh.size("tp") > 1,
        lora=config,
    )
    load_hf_checkpoint(engine.model, weight_map, hf_dir, mesh=mesh, ignore=engine.bridge_ignore)
    return engine, weight_map, config


def _export(rank, world_size, hf_dir: str, out_dir: str, input_ids, lora: dict):
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.engine.lora_peft import peft_adapter_config, peft_adapter_tensors, write_peft_adapter
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=7)
    engine, weight_map, config = _engine(hf_dir, mesh, lora_B_init_method="normal", **lora)
    logits = megatron_logits(engine.model, mesh, input_ids, weight_map.vocab_size)
    tensors = peft_adapter_tensors(engine.model, weight_map, mesh=mesh, bucket_bytes=8192)
    write_peft_adapter(tensors, peft_adapter_config(config, tensors, base_model_name_or_path=hf_dir), out_dir)
    return logits


def _load(rank, world_size, hf_dir: str, adapter_dir: str, input_ids, lora: dict):
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.engine.lora_peft import load_peft_adapter, peft_adapter_tensors
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(tensor_model_parallel_size=world_size), seed=11)
    engine, weight_map, config = _engine(hf_dir, mesh, **lora)
    before = megatron_logits(engine.model, mesh, input_ids, weight_map.vocab_size)
    try:
        load_peft_adapter(engine.model, weight_map, adapter_dir, config, mesh=mesh)
    except ValueError as exc:
        return {"error": str(exc)}
    after = megatron_logits(engine.model, mesh, input_ids, weight_map.vocab_size)
    again = peft_adapter_tensors(engine.model, weight_map, mesh=mesh, bucket_bytes=8192)
    return {"before": before, "after": after, "again": again}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("peft_load")
    hf_dir = root / "hf"
    build_tiny_hf_checkpoint(hf_dir, "qwen3", seed=3)
    input_ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    adapter = root / "lora_adapter"
    logits = run_distributed(_export, 1, str(hf_dir), str(adapter), input_ids, LORA, timeout_s=240)[0]
    return hf_dir, adapter, input_ids, logits


def test_exported_adapter_loads_back_into_tp1_and_tp2(tiny):
    from safetensors.torch import load_file

    hf_dir, adapter, input_ids, logits = tiny
    file_tensors = load_file(str(adapter / "adapter_model.safetensors"))
    for tp in (1, 2):
        res = run_distributed(_load, tp, str(hf_dir), str(adapter), input_ids, LORA, timeout_s=240)[0]
        assert "error" not in res, res.get("error")
        assert (res["before"] - logits).abs().max() > MOVED_MIN  # verl's start (B = 0) is the base model
        diff = float((res["after"] - logits).abs().max())
        if tp == 1:
            assert diff == 0.0
            assert sorted(res["again"]) == sorted(file_tensors)
            assert all(torch.equal(res["again"][n], file_tensors[n]) for n in file_tensors)
        else:
            assert diff <= TP_TOL, diff


def _with(adapter, tmp_path, name, *, config=None, tensors=None):
    """A copy of ``adapter`` with its config fields / tensors changed."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / name
    out.mkdir()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    data = load_file(str(adapter / "adapter_model.safetensors"))
    data = tensors(data) if tensors else data
    save_file({k: v.contiguous().clone() for k, v in data.items()}, str(out / "adapter_model.safetensors"))
    return out


def test_a_mismatching_adapter_is_refused_by_key(tiny, tmp_path):
    from megatron_rl.config.lora_config import LoRAConfig
    from megatron_rl.models.peft import read_peft_adapter_config

    hf_dir, adapter, input_ids, _ = tiny
    with pytest.raises(ValueError, match=r"r=8 but actor_rollout_ref.model.lora.rank=4; lora_alpha=3"):
        read_peft_adapter_config(_with(adapter, tmp_path, "r8", config={"r": 8, "lora_alpha": 3}), LoRAConfig(**LORA))
    with pytest.raises(ValueError, match="use_dora=True"):
        read_peft_adapter_config(_with(adapter, tmp_path, "dora", config={"use_dora": True}), LoRAConfig(**LORA))
    with pytest.raises(FileNotFoundError, match=f"{KEY}=.*adapter_config.json does not exist"):
        read_peft_adapter_config(tmp_path, LoRAConfig(**LORA))

    def k_differs(data):
        name = next(n for n in data if "layers.0.self_attn.k_proj.lora_A" in n)
        return {**data, name: data[name] + 1.0}

    res = run_distributed(
        _load, 1, str(hf_dir), str(_with(adapter, tmp_path, "k", tensors=k_differs)), input_ids, LORA, timeout_s=240
    )[0]
    assert "k_proj.lora_A.weight differs from" in res["error"] and "one A for all its HF modules" in res["error"]
    only_attention = dict(LORA, target_modules=["linear_qkv", "linear_proj"])  # the file also adapts the MLP
    res = run_distributed(_load, 1, str(hf_dir), str(adapter), input_ids, only_attention, timeout_s=240)[0]
    assert res["error"].startswith(f"{KEY}=") and "no weight rule of this model accounts for" in res["error"]
    assert "mlp.gate_proj.lora_A.weight" in res["error"] or "mlp.down_proj.lora_A.weight" in res["error"]


def test_the_trainer_refuses_a_mismatching_adapter_before_any_worker_starts(tiny, tmp_path):
    """``megatron-rl train grpo_lora`` (rank 16) pointed at the rank-4 adapter: ``role_specs`` (the placement,
    before any worker) names the key and both ranks; the same directory at rank 4 / alpha 8 passes the check."""
    from megatron_rl.algos.needs import resolve_run
    from megatron_rl.config import load_config
    from megatron_rl.trainer.placement import role_specs

    hf_dir, adapter, _, _ = tiny
    cfg = load_config("grpo_lora", [f"{KEY}={adapter}"])
    with pytest.raises(ValueError, match=f"{KEY}='{adapter}': .* r=4 but actor_rollout_ref.model.lora.rank=16"):
        role_specs(cfg, resolve_run(cfg), model_path=str(hf_dir), total_steps=1)
    cfg = load_config(
        "grpo_lora", [f"{KEY}={adapter}", "actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8"]
    )
    specs = role_specs(cfg, resolve_run(cfg), model_path=str(hf_dir), total_steps=1)
    assert specs["actor"].lora.adapter_path == str(adapter)
