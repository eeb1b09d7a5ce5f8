"""The Megatron engine on real Megatron-Core with gloo ranks: every parallel layout must give
the single-rank result (log-probs, entropy, values, losses, metrics and updated weights), run
through the roles (``megatron_rl.roles``) that drive it in training.

The reference is one rank with padded micro-batches of 2 rows. The layouts mix the engine's two
input paths: padded rows (``megatron.use_remove_padding=False``) and packed THD sequences, with
fixed-size micro-batches or token budgets of 12, 16 and 32 tokens (``use_dynamic_bsz``); on a
ragged batch (rows of 1 token, rows at the length limit, empty responses), packed / dynamic at
TP=2 (sequence parallel), PP=2, PP=2 x VPP=2, DP=2 and EP=2 (MoE) equals padded single-rank to
1e-5 -- the loss does not depend on the budget (normalisation by the global token count).
Actor and critic run in the same spawned processes, on the same mesh.

Weights travel between layouts through Megatron's distributed checkpoints, so the parallel
runs start from exactly the reference weights, and the updated weights are compared after
loading every layout's checkpoint back into one unsharded model.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel.testing import run_distributed
from tests.numerics import assert_within, gpt_forward_terms, rounding_bound

DENSE = dict(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    max_position_embeddings=64,
)
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.0)
BATCH, PROMPT, RESPONSE = 8, 6, 5
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 0.0}
LOGPROB_TOL = 2e-5
PACKED_TOL = 1e-5  # packed / token-budget layouts against the padded reference
WEIGHT_TOL = 2e-5
BF16_SCALE = 2000.0  # bfloat16 runs: 4e-2 on log-probs and weights (8 bits of mantissa vs float32's 24)
RAGGED_PROMPTS, RAGGED_RESPONSES = [6, 1, 4, 6, 1, 1, 2, 6], [5, 0, 5, 1, 4, 0, 3, 5]
"""Rows of 11 tokens (the limit), 1 token (a lone prompt token), empty responses."""


def make_batch(vocab: int, seed: int = 0, ragged: bool = False) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses of varying lengths (one response is empty;
    ``ragged``: two rows of a single token, two at the full length)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (BATCH, PROMPT), generator=g)
    responses = torch.randint(0, vocab, (BATCH, RESPONSE), generator=g)
    prompt_len = torch.tensor(RAGGED_PROMPTS if ragged else [6, 3, 4, 6, 1, 5, 2, 6])
    response_len = torch.tensor(RAGGED_RESPONSES if ragged else [5, 2, 5, 1, 4, 0, 3, 5])
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


def _run_layout(rank, world_size, par, model_kw, train_cfgs, ckpts, dp_split):
    """One layout, both roles on one mesh: per role load ``ckpts[role][0]`` (or save the fresh
    weights there), compute, update, save to ``ckpts[role][1]``."""
    import os

    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    par = dict(par)
    options = {
        "sequence_parallel": par.pop("sequence_parallel", False),  # megatron.* keys, not ParallelConfig fields
        "remove_padding": par.pop("remove_padding", True),
    }
    mesh = init_mesh(ParallelConfig(**par), seed=1234)
    results = {}
    for role, train_cfg in train_cfgs.items():
        worker = make_role(role, model_kw, mesh, train_cfg, **options)
        ckpt_in, ckpt_out = ckpts[role]
        if os.path.exists(ckpt_in):
            load_model(worker.engine.model, ckpt_in)
        else:
            save_model(worker.engine.model, ckpt_in)
        batch = make_batch(model_kw["vocab_size"], ragged=True)
        if dp_split:
            dp, dp_rank = mesh.size("dp"), mesh.dp_rank
            batch = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
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
        results[role] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in result.items()}
    return results


def _load_roles(rank, world_size, model_kw, paths_by_role):
    """Per role, load each checkpoint into one unsharded model; return its parameters."""
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.checkpoint import load_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    pc = ParallelConfig()
    init_mesh(pc, seed=1)
    mc = ModelConfig(**model_kw)
    out = {}
    for role, paths in paths_by_role.items():
        chunks = build_model(mc, build_transformer_config(mc, pc), head="lm" if role == "actor" else "scalar")
        out[role] = []
        for path in paths:
            load_model(chunks, path)
            out[role].append(
                {
                    k: v.detach().cpu().clone()
                    for k, v in chunks[0].state_dict().items()
                    if torch.is_tensor(v) and "_extra_state" not in k
                }
            )
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("engine_ckpts")


def _budget(tokens: int) -> dict:
    """Training-config overrides for token-budget micro-batches of ``tokens`` (both roles' keys)."""
    return {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": tokens}


PADDED = {"remove_padding": False}
# name -> (world size, parallel layout + megatron options, training-config overrides)
LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2, **PADDED), {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), _budget(16)),
    "pp2": (2, dict(pipeline_model_parallel_size=2), _budget(12)),
    "pp2_vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), _budget(16)),
    "dp2": (2, dict(), _budget(12)),
    "mbs1": (1, dict(PADDED), {"ppo_micro_batch_size_per_gpu": 1}),
    "mbs8": (1, dict(), {"ppo_micro_batch_size_per_gpu": 8}),
    "budget32": (1, dict(), _budget(32)),
}
ACTOR_CFG = {
    "ppo_mini_batch_size": BATCH,
    "ppo_micro_batch_size_per_gpu": 2,
    "optim": SGD,
    "clip_ratio_low": 0.02,
    "clip_ratio_high": 0.03,
    "entropy_coeff": 0.01,
}
CRITIC_CFG = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": SGD, "cliprange_value": 0.05}


def _compare(train_cfgs, model_kw, ckpt_root, layouts, backend="gloo", reference=PADDED):
    """Reference run + every layout, for every role of ``train_cfgs``: ``{role: (ref, results, weights)}``."""
    tag = f"{model_kw.get('num_moe_experts', 0)}_{model_kw.get('attention_backend', 'auto')}"

    def ckpts(name):
        return {
            role: (str(ckpt_root / f"{role}_{tag}_init"), str(ckpt_root / f"{role}_{tag}_{name}"))
            for role in train_cfgs
        }

    (ref,) = run_distributed(_run_layout, 1, reference, model_kw, train_cfgs, ckpts("ref"), False, backend=backend)
    results = {role: {} for role in train_cfgs}
    paths = {role: [ckpts("ref")[role][1]] for role in train_cfgs}
    for name, (world, par, overrides) in layouts.items():
        dp_split = name.startswith("dp") or name.startswith("ep")
        cfgs = {role: {**cfg, **overrides} for role, cfg in train_cfgs.items()}
        res = run_distributed(_run_layout, world, par, model_kw, cfgs, ckpts(name), dp_split, backend=backend)
        for role in train_cfgs:
            role_res = [r[role] for r in res]
            if dp_split:  # each DP rank holds half the batch
                merged = {k: torch.cat([r[k] for r in role_res]) for k in role_res[0] if k != "metrics"}
                merged["metrics"] = role_res[0]["metrics"]
                # exact: every rank takes its metrics from the same all-reduced float64 sums and all-reduced
                # gradients (a + b == b + a), so the ranks' values are bitwise equal
                assert role_res[0]["metrics"] == role_res[1]["metrics"]
                role_res = [merged]
            results[role][name] = role_res[0]
            paths[role].append(ckpts(name)[role][1])
    weights = run_distributed(_load_roles, 1, model_kw, paths, backend=backend)[0]
    return {role: (ref[role], results[role], weights[role]) for role in train_cfgs}


def _check(ref, results, weights, keys, layouts=LAYOUTS, scale=1.0):
    """Every layout's results and updated weights against the reference; ``scale`` widens the float32
    tolerances (bfloat16 runs)."""
    mask = make_batch(DENSE["vocab_size"], ragged=True)["response_mask"].bool()  # padding positions carry no meaning
    for name, res in results.items():
        packed = layouts[name][1].get("remove_padding", True)
        for key in keys:
            diff = _max_diff(res[key][mask], ref[key][mask])
            assert diff < LOGPROB_TOL * scale, (name, key, diff)
            assert not packed or diff < PACKED_TOL * scale, (name, key, diff)
        for metric, value in ref["metrics"].items():
            assert math.isclose(res["metrics"][metric], value, rel_tol=1e-4 * scale, abs_tol=1e-5 * scale), (
                name,
                metric,
                res["metrics"][metric],
                value,
            )
    ref_w = weights[0]
    for (name, _), w in zip(results.items(), weights[1:]):
        assert w.keys() == ref_w.keys()
        worst = max(_max_diff(w[k], ref_w[k]) for k in ref_w)
        assert worst < WEIGHT_TOL * scale, (name, worst)


@pytest.fixture(scope="module")
def dense_runs(ckpt_root):
    """Both roles through the reference and every layout of ``LAYOUTS``, once for the module."""
    return _compare({"actor": ACTOR_CFG, "critic": CRITIC_CFG}, DENSE, ckpt_root, LAYOUTS)


EP_LAYOUTS = {"ep2": (2, dict(expert_model_parallel_size=2), _budget(16))}


@pytest.fixture(scope="module")
def moe_runs(ckpt_root):
    """Both MoE roles: padded single rank vs packed token-budget EP=2."""
    actor = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": SGD}
    return _compare({"actor": actor, "critic": CRITIC_CFG}, MOE, ckpt_root, EP_LAYOUTS)


def test_actor_layouts_equal_single_rank(dense_runs):
    ref, results, weights = dense_runs["actor"]
    _check(ref, results, weights, ["log_probs", "entropys"])
    # The update moved the weights and clipping was active, so the comparison had teeth.
    assert ref["metrics"]["actor/pg_clipfrac"] > 0
    assert ref["metrics"]["actor/grad_norm"] > 0


def test_critic_layouts_equal_single_rank(dense_runs):
    ref, results, weights = dense_runs["critic"]
    _check(ref, results, weights, ["values"])
    assert ref["metrics"]["critic/vf_clipfrac"] > 0


def test_moe_critic_expert_parallel_equals_single_rank(moe_runs):
    ref, results, weights = moe_runs["critic"]
    _check(ref, results, weights, ["values"], EP_LAYOUTS)


def test_moe_actor_expert_parallel_equals_single_rank(moe_runs):
    ref, results, weights = moe_runs["actor"]
    _check(ref, results, weights, ["log_probs", "entropys"], EP_LAYOUTS)


def _naive_reference(rank, world_size, model_kw, temperature):
    """Engine log-probs vs. running each unpadded sequence alone through the model + log_softmax."""
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    actor = make_role("actor", model_kw, init_mesh(ParallelConfig(), seed=7), {"ppo_mini_batch_size": BATCH})
    batch = make_batch(model_kw["vocab_size"])
    out = {
        mbs: actor.compute_log_prob(batch, temperature=temperature, calculate_entropy=True, micro_batch_size=mbs)
        for mbs in (1, 3, BATCH)
    }
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
    scales = (float(expected_lp[mask].abs().max()), float(expected_h[mask].abs().max()))
    return {
        mbs: (
            _max_diff(o["log_probs"][mask], expected_lp[mask]),
            _max_diff(o["entropys"][mask], expected_h[mask]),
            *scales,
        )
        for mbs, o in out.items()
    }


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_unpadded_forward_for_any_micro_batch_size(temperature):
    diffs = run_distributed(_naive_reference, 1, DENSE, temperature)[0]
    # Two float32 forwards (micro-batched and padded vs one sequence alone), each within eps * n * scale
    # of the exact log-probs / entropies: twice it apart. A one-position shift or a pad token in the
    # attention moves them by ~1e-1.
    terms = gpt_forward_terms(DENSE, PROMPT + RESPONSE)
    for mbs, (lp_diff, h_diff, lp_scale, h_scale) in diffs.items():
        assert_within(lp_diff, 2 * rounding_bound(terms, max(1.0, lp_scale)), f"naive T={temperature} mbs={mbs} lp")
        assert_within(h_diff, 2 * rounding_bound(terms, max(1.0, h_scale)), f"naive T={temperature} mbs={mbs} entropy")


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
    ref.engine.offload_to_cpu()  # the round trip must not disturb the weights
    ref.engine.load_to_device()
    after = _max_diff(ref.compute_log_prob(batch)["log_probs"][mask], actor.compute_log_prob(batch)["log_probs"][mask])
    return diff, frozen, error, after


def test_reference_model_is_a_frozen_copy_of_the_actor(tmp_path):
    diff, frozen, error, after = run_distributed(_reference_engine_case, 1, str(tmp_path / "ckpt"))[0]
    assert diff == 0.0 and after == 0.0 and frozen
    assert error == "the 'ref' engine is not trainable"


def _offload_case(rank, world_size):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    actor = make_role(
        "actor",
        DENSE,
        init_mesh(ParallelConfig(), seed=5),
        {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2},
    )
    engine = actor.engine
    batch = make_batch(DENSE["vocab_size"])  # host tensors, as the driver sends them: the engine moves them
    before = actor.compute_log_prob(batch)["log_probs"]
    engine.offload_to_cpu()
    on_cpu = not any(engine.resident_bytes(device="cuda").values())  # nothing of the state left on the GPU
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
    """CP needs TransformerEngine's attention: runs on 2 GPUs only, in bfloat16 (TE's flash and fused
    attention need fp16 / bf16, and its unfused attention is off under CP; the engine refuses CP at
    float32), so the tolerances are bfloat16's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    train_cfg = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": SGD}
    model_kw = dict(DENSE, attention_backend="te", params_dtype="bfloat16")
    # Padded CP (zigzag of the padded rows) and packed THD CP (zigzag per row, TE's THD attention),
    # both against padded single-rank TE.
    layouts = {
        "cp2_padded": (2, dict(context_parallel_size=2, **PADDED), {}),
        "cp2_thd": (2, dict(context_parallel_size=2), _budget(16)),
    }
    ref, results, weights = _compare({"actor": train_cfg}, model_kw, ckpt_root, layouts, backend="nccl")["actor"]
    _check(ref, results, weights, ["log_probs", "entropys"], layouts, scale=BF16_SCALE)
