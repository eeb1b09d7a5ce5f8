"""The Megatron engine on real Megatron-Core with gloo ranks: every parallel layout must give
the single-rank result (log-probs, entropy, values, losses, metrics and updated weights), run
through the roles (``megatron_rl.roles``) that drive it in training.

Weights travel between layouts through Megatron's distributed checkpoints, so the parallel
runs start from exactly the reference weights, and the updated weights are compared after
loading every layout's checkpoint back into one unsharded model.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel.testing import run_distributed

DENSE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             vocab_size=96, max_position_embeddings=64)
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.0)
BATCH, PROMPT, RESPONSE = 8, 6, 5
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 0.0}
LOGPROB_TOL = 2e-5
WEIGHT_TOL = 2e-5


def make_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses of varying lengths (one response is empty)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (BATCH, PROMPT), generator=g)
    responses = torch.randint(0, vocab, (BATCH, RESPONSE), generator=g)
    prompt_len = torch.tensor([6, 3, 4, 6, 1, 5, 2, 6])
    response_len = torch.tensor([5, 2, 5, 1, 4, 0, 3, 5])
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < response_len[:, None]).long()
    input_ids = torch.cat([prompts, responses], 1) * torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": torch.randn(BATCH, RESPONSE, generator=g),
        "returns": torch.randn(BATCH, RESPONSE, generator=g),
        # Shifts the old log-probs / values away from the current ones so clipping engages.
        "offset": 0.05 * torch.linspace(-1, 1, BATCH * RESPONSE).view(BATCH, RESPONSE),
    }


def make_role(name, model_kw, mesh, train_cfg=None, **kwargs):
    """``build_role(name, ...)`` with the role's typed config filled from the dict ``train_cfg``."""
    from megatron_rl.config import ActorConfig, CriticConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.roles import build_role

    config_cls = CriticConfig if name == "critic" else ActorConfig
    return build_role(name, ModelConfig(**model_kw), mesh, config_cls.from_dict(train_cfg), **kwargs)


def _run_layout(rank, world_size, par, model_kw, role, ckpt_in, ckpt_out, train_cfg, dp_split):
    """One layout: load ``ckpt_in`` (or save the fresh weights there), compute, update, save."""
    import os

    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    par = dict(par)
    sequence_parallel = par.pop("sequence_parallel", False)  # megatron.sequence_parallel, not a ParallelConfig field
    pc = ParallelConfig(**par)
    mesh = init_mesh(pc, seed=1234)
    worker = make_role(role, model_kw, mesh, train_cfg, sequence_parallel=sequence_parallel)
    if os.path.exists(ckpt_in):
        load_model(worker.engine.model, ckpt_in)
    else:
        save_model(worker.engine.model, ckpt_in)
    batch = make_batch(model_kw["vocab_size"])
    if dp_split:
        dp, dp_rank = mesh.size("dp"), mesh.dp_rank
        batch = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    if torch.cuda.is_available():
        batch = {k: v.cuda() for k, v in batch.items()}
    result = {}
    if role == "actor":
        out = worker.compute_log_prob(batch, calculate_entropy=True)
        result.update(out)
        batch["old_log_probs"] = out["log_probs"] + batch["offset"]
        result["metrics"] = worker.update_policy(batch)
    else:
        out = worker.compute_values(batch)
        result.update(out)
        batch["values"] = out["values"] + 2 * batch["offset"]
        result["metrics"] = worker.update_critic(batch)
    save_model(worker.engine.model, ckpt_out)
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in result.items()}


def _load_all(rank, world_size, model_kw, role, paths):
    """Load each checkpoint into one unsharded model; return its parameters."""
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.checkpoint import load_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    pc = ParallelConfig()
    init_mesh(pc, seed=1)
    mc = ModelConfig(**model_kw)
    chunks = build_model(mc, build_transformer_config(mc, pc), head="lm" if role == "actor" else "scalar")
    out = []
    for path in paths:
        load_model(chunks, path)
        out.append({k: v.detach().cpu().clone() for k, v in chunks[0].state_dict().items() if torch.is_tensor(v) and "_extra_state" not in k})
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("engine_ckpts")


# name -> (world size, parallel layout, training-config overrides)
LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2), {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "pp2": (2, dict(pipeline_model_parallel_size=2), {}),
    "pp2_vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), {}),
    "dp2": (2, dict(), {}),
    "mbs1": (1, dict(), {"ppo_micro_batch_size_per_gpu": 1}),
    "mbs8": (1, dict(), {"ppo_micro_batch_size_per_gpu": 8}),
}


def _compare(role, model_kw, ckpt_root, layouts, train_cfg, backend="gloo"):
    init = str(ckpt_root / f"{role}_{model_kw.get('num_moe_experts', 0)}_init")
    ref_out = str(ckpt_root / f"{role}_{model_kw.get('num_moe_experts', 0)}_ref")
    (ref,) = run_distributed(_run_layout, 1, {}, model_kw, role, init, ref_out, train_cfg, False, backend=backend)
    results, paths = {}, [ref_out]
    for name, (world, par, overrides) in layouts.items():
        out = str(ckpt_root / f"{role}_{model_kw.get('num_moe_experts', 0)}_{name}")
        dp_split = name.startswith("dp") or name.startswith("ep")
        res = run_distributed(_run_layout, world, par, model_kw, role, init, out, {**train_cfg, **overrides}, dp_split,
                              backend=backend)
        if dp_split:  # each DP rank holds half the batch
            merged = {k: torch.cat([r[k] for r in res]) for k in res[0] if k != "metrics"}
            merged["metrics"] = res[0]["metrics"]
            assert res[0]["metrics"] == pytest.approx(res[1]["metrics"], rel=1e-6, abs=1e-9)
            res = [merged]
        results[name] = res[0]
        paths.append(out)
    weights = run_distributed(_load_all, 1, model_kw, role, paths, backend=backend)[0]
    return ref, results, weights


def _check(ref, results, weights, keys):
    mask = make_batch(DENSE["vocab_size"])["response_mask"].bool()  # padding positions carry no meaning
    for name, res in results.items():
        for key in keys:
            diff = _max_diff(res[key][mask], ref[key][mask])
            assert diff < LOGPROB_TOL, (name, key, diff)
        for metric, value in ref["metrics"].items():
            assert math.isclose(res["metrics"][metric], value, rel_tol=1e-4, abs_tol=1e-5), (name, metric, res["metrics"][metric], value)
    ref_w = weights[0]
    for (name, _), w in zip(results.items(), weights[1:]):
        assert w.keys() == ref_w.keys()
        worst = max(_max_diff(w[k], ref_w[k]) for k in ref_w)
        assert worst < WEIGHT_TOL, (name, worst)


def test_actor_layouts_equal_single_rank(ckpt_root):
    train_cfg = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": SGD,
                 "clip_ratio_low": 0.02, "clip_ratio_high": 0.03, "entropy_coeff": 0.01}
    ref, results, weights = _compare("actor", DENSE, ckpt_root, LAYOUTS, train_cfg)
    _check(ref, results, weights, ["log_probs", "entropys"])
    # The update moved the weights and clipping was active, so the comparison had teeth.
    assert ref["metrics"]["actor/pg_clipfrac"] > 0
    assert ref["metrics"]["actor/grad_norm"] > 0


def test_critic_layouts_equal_single_rank(ckpt_root):
    train_cfg = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": SGD, "cliprange_value": 0.05}
    layouts = {k: LAYOUTS[k] for k in ("tp2", "pp2")}
    ref, results, weights = _compare("critic", DENSE, ckpt_root, layouts, train_cfg)
    _check(ref, results, weights, ["values"])
    assert ref["metrics"]["critic/vf_clipfrac"] > 0


def test_moe_critic_expert_parallel_equals_single_rank(ckpt_root):
    train_cfg = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": SGD, "cliprange_value": 0.05}
    layouts = {"ep2": (2, dict(expert_model_parallel_size=2), {})}
    ref, results, weights = _compare("critic", MOE, ckpt_root, layouts, train_cfg)
    _check(ref, results, weights, ["values"])


def test_moe_actor_expert_parallel_equals_single_rank(ckpt_root):
    train_cfg = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": SGD}
    layouts = {"ep2": (2, dict(expert_model_parallel_size=2), {})}
    ref, results, weights = _compare("actor", MOE, ckpt_root, layouts, train_cfg)
    _check(ref, results, weights, ["log_probs", "entropys"])


def _naive_reference(rank, world_size, model_kw, temperature):
    """Engine log-probs vs. running each unpadded sequence alone through the model + log_softmax."""
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    actor = make_role("actor", model_kw, init_mesh(ParallelConfig(), seed=7), {"ppo_mini_batch_size": BATCH})
    batch = make_batch(model_kw["vocab_size"])
    out = {mbs: actor.compute_log_prob(batch, temperature=temperature, calculate_entropy=True, micro_batch_size=mbs)
           for mbs in (1, 3, BATCH)}
    model = actor.engine.model[0].module
    expected_lp = torch.zeros(BATCH, RESPONSE)
    expected_h = torch.zeros(BATCH, RESPONSE)
    with torch.no_grad():
        for i in range(BATCH):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
            n_resp = int(batch["response_mask"][i].sum())
            if n_resp == 0:
                continue
            logits = model(ids, torch.arange(ids.shape[1])[None], attention_mask=None)[0].float() / temperature
            logp = logits.log_softmax(-1)[-n_resp - 1 : -1]
            expected_lp[i, :n_resp] = logp.gather(-1, ids[0, -n_resp:, None]).squeeze(-1)
            expected_h[i, :n_resp] = -(logp.exp() * logp).sum(-1)
    mask = batch["response_mask"].bool()
    return {mbs: (_max_diff(o["log_probs"][mask], expected_lp[mask]), _max_diff(o["entropys"][mask], expected_h[mask]))
            for mbs, o in out.items()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_unpadded_forward_for_any_micro_batch_size(temperature):
    diffs = run_distributed(_naive_reference, 1, DENSE, temperature)[0]
    for mbs, (lp_diff, h_diff) in diffs.items():
        assert lp_diff < 1e-5 and h_diff < 1e-5, (mbs, lp_diff, h_diff)


def _reference_engine_case(rank, world_size, ckpt):
    """A frozen reference model built from the actor's weights gives the actor's log-probs."""
    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=11)
    actor = make_role("actor", DENSE, mesh, {"ppo_mini_batch_size": BATCH})
    ref = make_role("ref", DENSE, mesh)
    save_model(actor.engine.model, ckpt)
    load_model(ref.engine.model, ckpt)
    batch = make_batch(DENSE["vocab_size"])
    mask = batch["response_mask"].bool()
    diff = _max_diff(actor.compute_log_prob(batch)["log_probs"][mask], ref.compute_log_prob(batch)["log_probs"][mask])
    frozen = all(not p.requires_grad for _, p in ref.engine.named_parameters())
    try:
        ref.update_policy({**batch, "old_log_probs": torch.zeros(BATCH, RESPONSE), "advantages": batch["advantages"]})
        error = ""
    except ValueError as exc:
        error = str(exc)
    ref.engine.offload_to_cpu()  # a no-op without CUDA; must not disturb the weights
    after = _max_diff(ref.compute_log_prob(batch)["log_probs"][mask], actor.compute_log_prob(batch)["log_probs"][mask])
    return diff, frozen, error, after


def test_reference_model_is_a_frozen_copy_of_the_actor(tmp_path):
    diff, frozen, error, after = run_distributed(_reference_engine_case, 1, str(tmp_path / "ckpt"))[0]
    assert diff == 0.0 and after == 0.0 and frozen
    assert error == "the 'ref' engine is not trainable"


def _offload_case(rank, world_size):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    actor = make_role("actor", DENSE, init_mesh(ParallelConfig(), seed=5),
                      {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2})
    engine = actor.engine
    batch = {k: v.cuda() for k, v in make_batch(DENSE["vocab_size"]).items()}
    before = actor.compute_log_prob(batch)["log_probs"]
    engine.offload_to_cpu()
    on_cpu = all(p.device.type == "cpu" for _, p in engine.named_parameters())
    free_after_offload = torch.cuda.memory_allocated()
    engine.load_to_device()
    after = actor.compute_log_prob(batch)["log_probs"]
    batch["old_log_probs"], batch["advantages"] = after, batch["advantages"]
    metrics = actor.update_policy(batch)  # optimizer state survived the round trip
    return on_cpu, free_after_offload, float((before - after).abs().max()), metrics["actor/grad_norm"]


@pytest.mark.gpu
def test_offload_round_trip_keeps_weights_and_frees_gpu_memory():
    on_cpu, _, diff, grad_norm = run_distributed(_offload_case, 1, backend="nccl")[0]
    assert on_cpu and diff == 0.0 and math.isfinite(grad_norm)


@pytest.mark.gpu
def test_context_parallel_actor_equals_single_rank(ckpt_root):
    """CP needs TransformerEngine's attention: runs on 2 GPUs only."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    train_cfg = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": SGD}
    model_kw = dict(DENSE, attention_backend="te")
    layouts = {"cp2": (2, dict(context_parallel_size=2), {})}
    ref, results, weights = _compare("actor", model_kw, ckpt_root, layouts, train_cfg, backend="nccl")
    _check(ref, results, weights, ["log_probs", "entropys"])
