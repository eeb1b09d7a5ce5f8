"""DeepSeek-V3 (and R1): multi-latent attention, first-k dense layers, then sigmoid-routed experts
with an expert bias, group-limited routing, a routed scaling factor and a shared expert.

HF ``DeepseekV3ForCausalLM`` maps onto Megatron-Core's MLA (``MLATransformerConfig``) and MoE:

==============================  ==============================================
HF config                       Megatron
==============================  ==============================================
q_lora_rank / kv_lora_rank      q_lora_rank / kv_lora_rank
qk_nope_head_dim                qk_head_dim
qk_rope_head_dim                qk_pos_emb_head_dim (RoPE on interleaved pairs)
v_head_dim                      v_head_dim
rope_parameters (yarn)          rope_type="yarn", rotary_scaling_factor, beta_*, mscale*
first_k_dense_replace           moe_layer_freq = [0] * k + [1] * (n - k)
n_routed_experts / top-k        num_moe_experts / moe_router_topk
sigmoid + e_score_correction    moe_router_score_function="sigmoid", expert bias
n_group / topk_group            moe_router_num_groups / moe_router_group_topk
routed_scaling_factor           moe_router_topk_scaling_factor
n_shared_experts                moe_shared_expert_intermediate_size
rms_norm_eps                    layernorm_epsilon (MLA's latent norms: 1e-6, as HF)
==============================  ==============================================

Multi-token prediction: neither HF's model nor the Megatron model here builds the MTP module (a
hub checkpoint's ``num_nextn_predict_layers`` MTP layers sit at ``model.layers.{num_hidden_layers + i}``).
``load_hf_checkpoint`` checks them (complete, shaped like the last decoder layer; each bad tensor
named) and warns that they are not trained; ``megatron-rl convert`` and the trainer's HF export
carry them through bit for bit (``parallel.bridge.mtp``). Tensors of further layers are refused by
name. MTP training (``actor_rollout_ref.model.mtp.*``) is not implemented (inert, with a warning).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.extended import ExtendedModelConfig
from megatron_rl.models.families import (
    DENSE_MLP_RULES,
    MLA_ATTENTION_RULES,
    Family,
    expert_bias_rule,
    llama_like_kwargs,
    moe_mlp_rules,
    reject,
    shared_expert_rules,
)

__all__ = ["FAMILY", "sigmoid_router_kwargs", "yarn_kwargs"]


def yarn_kwargs(family: str, cfg: Any) -> dict[str, Any]:
    """MLA RoPE settings (plain or YaRN) of an HF config, as ``ExtendedModelConfig`` fields."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None or float(theta) != int(theta):
        reject(family, "rope_theta", theta, "an integer value (GPTModel takes rotary_base as an int)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        reject(family, "rope_parameters.partial_rotary_factor", params["partial_rotary_factor"], "1.0")
    rope_type = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": float(theta)}
    if rope_type == "default":
        return dict(out, rope_type="rope")
    if rope_type != "yarn":
        reject(family, "rope_parameters.rope_type", rope_type, "'default' or 'yarn'")
    if params.get("truncate", True) is not True:
        reject(family, "rope_parameters.truncate", params["truncate"], "True (Megatron rounds YaRN's correction range)")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if factor is None or original is None:
        reject(
            family, "rope_parameters.factor/original_max_position_embeddings", (factor, original), "both set for YaRN"
        )
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # HF uses mscale/mscale_all_dim for the cos/sin scale only when both are non-zero; Megatron
    # whenever both are set. Both rules agree when mscale is 1 or both are given.
    if not (mscale and mscale_all_dim) and mscale not in (None, 1, 1.0):
        reject(family, "rope_parameters.mscale", mscale, "1.0 unless mscale_all_dim is set too")
    if params.get("attention_factor") is not None:
        reject(
            family,
            "rope_parameters.attention_factor",
            params["attention_factor"],
            "None (derived from factor, mscale and mscale_all_dim)",
        )
    return dict(
        out,
        rope_type="yarn",
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(mscale if mscale is not None else 1.0),
        mscale_all_dim=float(mscale_all_dim if mscale_all_dim is not None else 0.0),
    )


def sigmoid_router_kwargs(family: str, cfg: Any) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, expert bias, groups, scaling, shared expert,
    first-k-dense layer pattern."""
    experts, topk = cfg.n_routed_experts, cfg.num_experts_per_tok
    # Hub config.json files name the routing (transformers ignores the keys; vLLM reads them).
    if getattr(cfg, "topk_method", "noaux_tc") != "noaux_tc":
        reject(family, "topk_method", cfg.topk_method, "'noaux_tc' (sigmoid scores + expert bias, grouped top-k)")
    if getattr(cfg, "scoring_func", "sigmoid") != "sigmoid":
        reject(family, "scoring_func", cfg.scoring_func, "'sigmoid'")
    # Megatron renormalises sigmoid top-k weights whenever topk > 1.
    if not getattr(cfg, "norm_topk_prob", True) and topk > 1:
        reject(family, "norm_topk_prob", cfg.norm_topk_prob, "True (Megatron renormalises sigmoid top-k weights)")
    groups, group_topk = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
    if experts % groups:
        reject(family, "n_group", groups, f"a divisor of n_routed_experts={experts}")
    grouped = groups > 1
    if grouped and topk // group_topk != 2:
        # HF scores a group by its top-2 experts; Megatron by its top (topk // topk_group).
        reject(
            family,
            "topk_group",
            group_topk,
            f"num_experts_per_tok // 2 = {topk // 2} when n_group > 1 "
            "(Megatron scores a group by its top topk/topk_group experts, HF by its top 2)",
        )
    if not grouped and group_topk != 1:
        reject(family, "topk_group", group_topk, "1 when n_group is 1")
    shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
    first_dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    layers = cfg.num_hidden_layers
    if not 0 <= first_dense <= layers:
        reject(family, "first_k_dense_replace", first_dense, f"0..num_hidden_layers={layers}")
    aux = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    aux = aux if getattr(cfg, "output_router_logits", False) else 0.0  # HF adds it only then
    scaling = float(cfg.routed_scaling_factor)
    return dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * shared if shared else None,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=False,
        moe_router_num_groups=groups if grouped else None,
        moe_router_group_topk=group_topk if grouped else None,
        moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
        moe_aux_loss_coeff=aux,
        moe_layer_freq=tuple([0] * first_dense + [1] * (layers - first_dense)) if first_dense else None,
    )


def _config_kwargs(cfg: Any) -> dict[str, Any]:
    f = "deepseek_v3"
    if getattr(cfg, "attention_bias", False):
        reject(f, "attention_bias", cfg.attention_bias, "False (Megatron's MLA projections have no bias)")
    if not getattr(cfg, "rope_interleave", True):
        reject(f, "rope_interleave", cfg.rope_interleave, "True (Megatron's MLA rotates interleaved pairs)")
    heads = cfg.num_attention_heads
    if (getattr(cfg, "num_key_value_heads", None) or heads) != heads:
        reject(f, "num_key_value_heads", cfg.num_key_value_heads, f"num_attention_heads={heads} (MLA has no GQA)")
    v_dim = cfg.v_head_dim
    return dict(
        llama_like_kwargs(f, cfg, rope=False),  # RMSNorm, SwiGLU (hidden_act checked), sizes, vocab
        num_query_groups=heads,
        kv_channels=v_dim,
        multi_latent_attention=True,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=v_dim,
        # HF builds q_a_layernorm / kv_a_layernorm with their default eps 1e-6 whatever rms_norm_eps
        # says (Moonlight-16B-A3B: 1e-5); Megatron would use layernorm_epsilon for them too.
        mla_latent_norm_epsilon=1e-6 if float(cfg.rms_norm_eps) != 1e-6 else None,
        **yarn_kwargs(f, cfg),
        **sigmoid_router_kwargs(f, cfg),
    )


MOE_RULES = (
    *DENSE_MLP_RULES,  # the first-k dense layers
    *moe_mlp_rules(
        "mlp.gate.weight", "mlp.experts.{expert}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"
    ),
    expert_bias_rule(),
    *shared_expert_rules(),
)
"""MLP rules shared with GLM-4.5: dense layers, routed experts, the router bias, the shared expert."""

FAMILY = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    config_kwargs=_config_kwargs,
    mlp_rules=MOE_RULES,
    attention_rules=MLA_ATTENTION_RULES,
    config_class=ExtendedModelConfig,
    mtp_layers=True,
)
