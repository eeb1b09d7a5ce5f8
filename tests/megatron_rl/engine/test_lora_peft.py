"""PEFT export of a LoRA actor's adapters (issue 29): the real ``peft`` library gives the actor's logits.

A tiny Qwen3 checkpoint (2 layers, GQA 4 heads / 2 groups, SwiGLU) is loaded into a Megatron actor
with adapters drawn non-zero (B too, so every adapter moves the logits), the adapters are exported
with ``peft_adapter_tensors`` + ``peft_adapter_config`` and written by ``write_peft_adapter``, and
``peft.PeftModel.from_pretrained`` puts them on the HF base model (transformers, float32). Then:

- PEFT's logits equal the actor's (Megatron's forward with the adapters on) to ``PEFT_TOL`` = 1e-5,
  while the base model's differ from them by more than ``MOVED_MIN`` (the adapters matter), for
  all four targets (rank 4, alpha 8) and for a subset with one module excluded (rank 2, alpha 3:
  ``target_modules`` then lists full HF module names);
- PEFT's own state dict of the loaded adapters is exactly the exported one (no module left at
  PEFT's zero initialisation, none unknown);
- at TP=2 with sequence parallelism the export gathers the same tensors bit for bit (adapters are
  drawn whole and sharded, so both layouts hold one draw), and TP=2's logits match PEFT's too;
- writing is atomic: an existing directory is refused and no temporary directory is left.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from parallel.testing import run_distributed  # noqa: E402

PEFT_TOL = 1e-5
MOVED_MIN = 1e-2
SGD = {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "clip_grad": 0.0}
ALL = dict(rank=4, alpha=8.0, lora_B_init_method="normal")
PARTIAL = dict(
    rank=2,
    alpha=3.0,
    lora_B_init_method="normal",
    target_modules=["linear_qkv", "linear_fc2"],
    exclude_modules=["decoder.layers.0.self_attention.linear_qkv"],
)


def _case(rank, world_size, hf_dir: str, loras: list[dict], input_ids: torch.Tensor):
    from megatron_rl.config import OptimConfig
    from megatron_rl.config.lora_config import LoRAConfig
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.engine.lora_peft import peft_adapter_tensors
    from megatron_rl.models.families import get_family
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(tensor_model_parallel_size=world_size), seed=7)
    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir, make_vocab_size_divisible_by=64)
    weight_map = family.weight_map(model_cfg)
    out = []
    for kw in loras:
        engine = MegatronEngine(
            model_cfg,
            mesh,
            trainable=True,
            optim=OptimConfig.from_dict(SGD),
            name="actor",
            sequence_parallel=world_size > 1,
            lora=LoRAConfig(merge=True, **kw),
        )
        load_hf_checkpoint(engine.model, weight_map, hf_dir, mesh=mesh, ignore=engine.bridge_ignore)
        logits = megatron_logits(engine.model, mesh, input_ids, weight_map.vocab_size)
        tensors = peft_adapter_tensors(engine.model, weight_map, mesh=mesh, bucket_bytes=8192)
        out.append({"logits": logits, "tensors": tensors})
    return out if rank == 0 else None


def _peft_logits(hf_dir: str, adapter_dir, input_ids):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        adapted = model(input_ids=input_ids).logits
        with model.disable_adapter():
            plain = model(input_ids=input_ids).logits
    return adapted, plain, get_peft_model_state_dict(model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3

    dense = build_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), seed=0)
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, dense["config"].vocab_size, (2, 16), generator=gen)
    return dense["path"], input_ids


def test_peft_adapter_gives_the_actor_logits(tiny, tmp_path):
    from megatron_rl.config.lora_config import LoRAConfig
    from megatron_rl.engine.lora_peft import (
        ADAPTER_CONFIG_NAME,
        ADAPTER_WEIGHTS_NAME,
        peft_adapter_config,
        write_peft_adapter,
    )

    hf_dir, input_ids = tiny
    single = run_distributed(_case, 1, str(hf_dir), [ALL, PARTIAL], input_ids, timeout_s=600)[0]
    peft_logits = []
    for kw, res, name in zip((ALL, PARTIAL), single, ("all", "partial")):
        lora = LoRAConfig(merge=True, **kw)
        config = peft_adapter_config(lora, res["tensors"], base_model_name_or_path=str(hf_dir))
        adapter_dir = write_peft_adapter(res["tensors"], config, tmp_path / name)
        assert sorted(p.name for p in adapter_dir.iterdir()) == [ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME]
        adapted, plain, loaded = _peft_logits(str(hf_dir), adapter_dir, input_ids)
        assert float((adapted - res["logits"]).abs().max()) <= PEFT_TOL, name
        assert float((plain - res["logits"]).abs().max()) > MOVED_MIN, name
        assert sorted(loaded) == sorted(res["tensors"]), name
        assert all(torch.equal(loaded[k], res["tensors"][k]) for k in loaded), name
        peft_logits.append(adapted)
    written = json.loads((tmp_path / "all" / ADAPTER_CONFIG_NAME).read_text())
    assert (written["r"], written["lora_alpha"]) == (4, 8.0)
    assert written["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert len(single[0]["tensors"]) == 2 * 7 * 2  # 2 layers x 7 HF modules x (A, B)
    partial = json.loads((tmp_path / "partial" / ADAPTER_CONFIG_NAME).read_text())
    assert partial["target_modules"] == [
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    # q, k, v share A; their B rows are linear_qkv's B regrouped by query group.
    t = single[0]["tensors"]
    pre = "base_model.model.model.layers.0.self_attn."
    assert torch.equal(t[pre + "q_proj.lora_A.weight"], t[pre + "k_proj.lora_A.weight"])
    assert [t[pre + f"{m}_proj.lora_B.weight"].shape[0] for m in "qkv"] == [128, 64, 64]

    tp2 = run_distributed(_case, 2, str(hf_dir), [ALL], input_ids, timeout_s=600)[0][0]
    assert sorted(tp2["tensors"]) == sorted(t)
    assert all(torch.equal(tp2["tensors"][k], t[k]) for k in t)
    assert float((tp2["logits"] - peft_logits[0]).abs().max()) <= PEFT_TOL

    with pytest.raises(FileExistsError, match="exists"):
        write_peft_adapter(t, written, tmp_path / "all")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all", "partial"]
