"""A tiny DeepSeek-V3 (MLA, YaRN, first layer dense, sigmoid routing with the expert bias, groups,
shared expert) trained through the Actor role (``megatron_rl.roles``) as GRPO trains it: its
log-probs equal HF's, and one ``update_policy`` step at EP=2 (DP=2, each rank half the batch)
equals the single-rank step -- log-probs, metrics, every updated weight and the router's expert
bias, which Megatron moves by its token counts (aux-loss-free balancing) after the step.
"""

from __future__ import annotations

import math

import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import BATCH, RESPONSE, make_batch
from tests.megatron_rl.models.test_families import read_hf_tensors
from tests.megatron_rl.models.test_frontier_moe import build_hf_model

ACTOR_CFG = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2,
             "optim": {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 0.0},
             "clip_ratio_low": 0.02, "clip_ratio_high": 0.03}


def _actor_step(rank, world_size, par, hf_dir, model_cfg):
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
    batch = make_batch(model_cfg.vocab_size, ragged=True)
    dp, dp_rank = mesh.size("dp"), mesh.dp_rank
    batch = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    log_probs = actor.compute_log_prob(batch)["log_probs"]
    batch["old_log_probs"] = log_probs + batch["offset"]
    metrics = actor.update_policy(batch)
    weights = {n: t.clone() for n, t in export_hf_weights(actor.engine.model, weight_map, mesh=mesh, all_ranks=True)}
    return {"log_probs": log_probs, "metrics": metrics, "weights": weights if rank == 0 else None}


def _hf_log_probs(model, batch) -> torch.Tensor:
    """HF log-probs of each row's response tokens, every row run alone without padding."""
    out = torch.zeros(BATCH, RESPONSE)
    with torch.no_grad():
        for i in range(BATCH):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
            n = int(batch["response_mask"][i].sum())
            if n:
                logp = model(ids).logits[0].float().log_softmax(-1)[-n - 1: -1]
                out[i, :n] = logp.gather(-1, ids[0, -n:, None]).squeeze(-1)
    return out


def test_deepseek_v3_actor_matches_hf_and_ep2_update_equals_single_rank(tmp_path):
    from megatron_rl.models.families import get_family

    model = build_hf_model("deepseek_v3")
    model.save_pretrained(tmp_path / "hf")
    model_cfg = get_family(tmp_path / "hf").model_config(tmp_path / "hf")
    batch = make_batch(model_cfg.vocab_size, ragged=True)
    mask = batch["response_mask"].bool()
    hf_lp = _hf_log_probs(model, batch)

    (one,) = run_distributed(_actor_step, 1, {}, str(tmp_path / "hf"), model_cfg, timeout_s=300)
    ep = run_distributed(_actor_step, 2, {"expert_model_parallel_size": 2}, str(tmp_path / "hf"), model_cfg,
                         timeout_s=300)
    assert float((one["log_probs"][mask] - hf_lp[mask]).abs().max()) < 1e-5
    ep_lp = torch.cat([r["log_probs"] for r in ep])
    assert float((ep_lp[mask] - one["log_probs"][mask]).abs().max()) < 1e-5
    for key, value in one["metrics"].items():
        assert math.isclose(ep[0]["metrics"][key], value, rel_tol=1e-4, abs_tol=1e-5), (key, ep[0]["metrics"][key], value)

    before = read_hf_tensors(tmp_path / "hf")  # the checkpoint's names (HF keeps experts fused in memory)
    after_one, after_ep = one["weights"], ep[0]["weights"]
    assert sorted(after_one) == sorted(after_ep) == sorted(before)
    assert max(float((after_ep[n] - after_one[n]).abs().max()) for n in after_one) < 2e-5
    moved = [n for n in after_one if not torch.equal(after_one[n], before[n])]
    assert any("experts.0." in n for n in moved) and any("self_attn.kv_b_proj" in n for n in moved)
    # The expert bias moved by +-rate per expert from the step's token counts, the same at both layouts.
    bias = [n for n in after_one if n.endswith("e_score_correction_bias")]
    assert len(bias) == 3
    for n in bias:
        step = after_one[n] - before[n]
        assert torch.equal(after_ep[n], after_one[n]) and float(step.abs().max()) > 0, n
        assert torch.allclose(step.abs()[step != 0], torch.full_like(step[step != 0], 1e-3), atol=1e-6), (n, step)
