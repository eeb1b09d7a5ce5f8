"""HF model families that map onto Megatron-Core's GPTModel, and the registry that finds them.

A family is data (``Family``): how an HF ``config.json`` becomes a ``ModelConfig`` and which
``parallel.bridge.WeightRule``s connect Megatron parameter names to HF tensor names. Each family
lives in its own module of ``megatron_rl.models`` that defines a module-level ``FAMILY``; the
registry discovers those modules on first use, so adding a family touches only its module (and
the test matrix). ``get_family`` finds the family of an HF config by its ``architectures``.

Typical use::

    hf_config = load_hf_config("/ckpt/Qwen3-8B")            # dict, path or PretrainedConfig
    family = get_family(hf_config)
    model_cfg = family.model_config(hf_config, params_dtype="bfloat16")
    weight_map = family.weight_map(model_cfg)                # for parallel.bridge
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_rl.config.model import ModelConfig
from parallel.bridge import WeightMap, WeightRule
from parallel.bridge.mtp import MTPLayers

__all__ = [
    "Family",
    "get_family",
    "supported_families",
    "load_hf_config",
    "decoder_rules",
    "DENSE_MLP_RULES",
    "moe_mlp_rules",
    "llama_like_kwargs",
    "reject",
    "hf_head",
    "MLA_ATTENTION_RULES",
    "shared_expert_rules",
    "expert_bias_rule",
]

_NOT_FAMILY_MODULES = {"gpt", "families", "extended"}

WEIGHT_SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "tie_word_embeddings",
    "add_qkv_bias",
    "qk_layernorm",
    "normalization",
    "swiglu",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
)
"""``ModelConfig`` fields that fix the weights' shapes: an HF-key override (``model.override_config``)
that would change one is refused (the checkpoint could not load)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF architecture family: config translation + weight rules."""

    name: str
    """Short name (``llama``, ``qwen3_moe`` ...)."""
    architectures: tuple[str, ...]
    """HF ``architectures`` values this family serves."""
    config_kwargs: Callable[[Any], dict[str, Any]]
    """HF config (a transformers ``PretrainedConfig``) -> ``ModelConfig`` keyword arguments;
    raises ``ValueError`` for settings Megatron's GPTModel cannot represent."""
    mlp_rules: tuple[WeightRule, ...]
    """Weight rules of the MLP block (dense or MoE); attention, norms and embeddings are shared."""
    attention_rules: Optional[tuple[WeightRule, ...]] = None
    """Weight rules of the attention block and the layer norms; None = Llama-style GQA
    (``MLA_ATTENTION_RULES`` for DeepSeek-V3's multi-latent attention)."""
    config_class: type = ModelConfig
    """The config dataclass ``model_config`` builds (``ExtendedModelConfig`` for MLA / sigmoid routing)."""
    mtp_layers: bool = False
    """Hub checkpoints carry multi-token-prediction layers after the decoder layers
    (``model.layers.{num_layers + i}``, ``i < num_nextn_predict_layers``), which the Megatron model
    does not build: loading checks them (``parallel.bridge.mtp``) and leaves them out, conversion
    carries them through; tensors of further layers are refused by name instead of being called
    tensors of another family."""

    def model_config(self, hf_config: Any, **overrides: Any) -> ModelConfig:
        """``ModelConfig`` for ``hf_config`` (dict, path or PretrainedConfig); ``overrides``
        set non-architecture fields (``params_dtype``, ``make_vocab_size_divisible_by`` ...) and, as verl's
        ``model.override_config`` does, HF config keys: those under a ``model_config`` key and those the
        HF config has (``max_position_embeddings``, ``attention_dropout``) are set on it before it is read."""
        original = load_hf_config(hf_config)
        hf, rest = apply_hf_overrides(original, overrides, self.config_class)
        kwargs = self.config_kwargs(hf)
        if hf is not original:  # HF keys may set the context length, dropout, RoPE ... never the weights' shapes
            base = self.config_kwargs(original)
            changed = [
                f"{k}: {base.get(k)!r} -> {kwargs.get(k)!r}"
                for k in WEIGHT_SHAPE_FIELDS
                if base.get(k) != kwargs.get(k)
            ]
            if changed:
                keys = sorted(set(overrides) - set(rest) - {"model_config"}) + sorted(
                    overrides.get("model_config") or {}
                )
                raise ValueError(
                    f"{self.name}: overrides {keys} would change the architecture read from the HF config "
                    f"({'; '.join(changed)}), which the checkpoint's weights have"
                )
        overrides = rest
        clash = sorted(set(overrides) & set(kwargs))
        if clash:
            raise ValueError(f"{self.name}: overrides {clash} would change the architecture read from the HF config")
        return self.config_class(**kwargs, **overrides)

    def weight_map(self, model_cfg: ModelConfig, *, head: str = "lm") -> WeightMap:
        """The HF <-> Megatron weight table bound to ``model_cfg``'s geometry.

        ``head="score"`` maps the scalar head of a reward model (``build_model(head="scalar")``)
        to HF's ``*ForSequenceClassification`` ``score.weight [1, hidden]`` (``num_labels=1``).
        """
        if head not in ("lm", "score"):
            raise ValueError(f"{self.name}: head={head!r} is not allowed; choose 'lm' or 'score'")
        rules = decoder_rules(
            self.mlp_rules,
            tie_word_embeddings=model_cfg.tie_word_embeddings and head == "lm",
            attention_rules=self.attention_rules,
        )
        if head == "score":
            rules = tuple(
                WeightRule("output_layer.weight", "score.weight") if r.megatron == "output_layer.weight" else r
                for r in rules
            )
        return WeightMap(
            rules=rules,
            vocab_size=model_cfg.vocab_size,
            num_attention_heads=model_cfg.num_attention_heads,
            num_query_groups=model_cfg.num_query_groups or model_cfg.num_attention_heads,
            head_dim=model_cfg.head_dim,
            # Tied checkpoints sometimes carry lm_head anyway; old ones carry RoPE buffers.
            optional_hf=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
            + ((r"lm_head\.weight",) if model_cfg.tie_word_embeddings and head == "lm" else ()),
            unsupported_hf=(
                (
                    mtp_layer_pattern(model_cfg.num_layers),
                    f"{self.name}: multi-token-prediction layers (model.layers.{model_cfg.num_layers}+) are "
                    "not built by the Megatron model; load a checkpoint without them",
                ),
            )
            if self.mtp_layers
            else (),
            mtp=(
                MTPLayers(model_cfg.num_layers, model_cfg.hidden_size, model_cfg.vocab_size)
                if self.mtp_layers
                else None
            ),
        )


# ------------------------------------------------------------------------------------------
# Shared weight rules (Megatron local-spec and TE-spec names, HF Llama-style names).
# ------------------------------------------------------------------------------------------
_L, _H = "decoder.layers.{layer}.", "model.layers.{layer}."

_ATTENTION_RULES = (
    WeightRule(_L + "input_layernorm.weight", _H + "input_layernorm.weight"),
    # TE spec: the input norm is fused into the QKV projection.
    WeightRule(_L + "self_attention.linear_qkv.layer_norm_weight", _H + "input_layernorm.weight"),
    WeightRule(_L + "self_attention.linear_qkv.weight", tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    WeightRule(_L + "self_attention.linear_qkv.bias", tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    WeightRule(_L + "self_attention.q_layernorm.weight", _H + "self_attn.q_norm.weight"),
    WeightRule(_L + "self_attention.k_layernorm.weight", _H + "self_attn.k_norm.weight"),
    WeightRule(_L + "self_attention.linear_proj.weight", _H + "self_attn.o_proj.weight"),
    WeightRule(_L + "pre_mlp_layernorm.weight", _H + "post_attention_layernorm.weight"),
    # TE spec, dense MLP: the pre-MLP norm is fused into fc1.
    WeightRule(_L + "mlp.linear_fc1.layer_norm_weight", _H + "post_attention_layernorm.weight"),
)

DENSE_MLP_RULES = (
    WeightRule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up"),
    WeightRule(_L + "mlp.linear_fc2.weight", _H + "mlp.down_proj.weight"),
)


# Multi-latent attention (Megatron's MLASelfAttention <-> HF DeepseekV3Attention). The local spec's
# down projections are column-parallel (rows split over TP), the TE spec's are replicated; both are
# plain copies. The TE spec fuses the latent norms into the up projections.
MLA_ATTENTION_RULES = (
    WeightRule(_L + "input_layernorm.weight", _H + "input_layernorm.weight"),
    WeightRule(_L + "self_attention.linear_q_proj.weight", _H + "self_attn.q_proj.weight"),
    WeightRule(_L + "self_attention.linear_q_down_proj.weight", _H + "self_attn.q_a_proj.weight"),
    WeightRule(_L + "self_attention.q_layernorm.weight", _H + "self_attn.q_a_layernorm.weight"),
    WeightRule(_L + "self_attention.linear_q_up_proj.layer_norm_weight", _H + "self_attn.q_a_layernorm.weight"),
    WeightRule(_L + "self_attention.linear_q_up_proj.weight", _H + "self_attn.q_b_proj.weight"),
    WeightRule(_L + "self_attention.linear_kv_down_proj.weight", _H + "self_attn.kv_a_proj_with_mqa.weight"),
    WeightRule(_L + "self_attention.kv_layernorm.weight", _H + "self_attn.kv_a_layernorm.weight"),
    WeightRule(_L + "self_attention.linear_kv_up_proj.layer_norm_weight", _H + "self_attn.kv_a_layernorm.weight"),
    WeightRule(_L + "self_attention.linear_kv_up_proj.weight", _H + "self_attn.kv_b_proj.weight"),
    WeightRule(_L + "self_attention.linear_proj.weight", _H + "self_attn.o_proj.weight"),
    WeightRule(_L + "pre_mlp_layernorm.weight", _H + "post_attention_layernorm.weight"),
    WeightRule(_L + "mlp.linear_fc1.layer_norm_weight", _H + "post_attention_layernorm.weight"),
)


def shared_expert_rules(prefix: str = "mlp.shared_experts.") -> tuple[WeightRule, ...]:
    """Rules of an always-on shared expert (SwiGLU); ``prefix`` is relative to ``model.layers.{layer}.``."""
    s = _L + "mlp.shared_experts."
    return (
        WeightRule(
            s + "linear_fc1.weight", (_H + prefix + "gate_proj.weight", _H + prefix + "up_proj.weight"), "gate_up"
        ),
        WeightRule(s + "linear_fc2.weight", _H + prefix + "down_proj.weight"),
    )


def expert_bias_rule(hf: str = "mlp.gate.e_score_correction_bias") -> WeightRule:
    """The router's expert bias (a Megatron buffer, float32) <-> HF's ``e_score_correction_bias``."""
    return WeightRule(_L + "mlp.router.expert_bias", _H + hf)


def moe_mlp_rules(router: str, expert: str, gate: str, up: str, down: str) -> tuple[WeightRule, ...]:
    """Rules of a routed-experts block; names are relative to ``model.layers.{layer}.``, and
    ``expert`` contains ``{expert}`` (e.g. ``mlp.experts.{expert}.``)."""
    e = _L + "mlp.experts.local_experts.{expert}."
    return (
        WeightRule(_L + "mlp.router.weight", _H + router),
        WeightRule(e + "linear_fc1.weight", (_H + expert + gate, _H + expert + up), "gate_up"),
        WeightRule(e + "linear_fc2.weight", _H + expert + down),
    )


def decoder_rules(
    mlp_rules: Sequence[WeightRule],
    *,
    tie_word_embeddings: bool,
    attention_rules: Optional[Sequence[WeightRule]] = None,
) -> tuple[WeightRule, ...]:
    """All rules of a Llama-style decoder with the given MLP (and attention) rules.

    Rules for parameters a model does not have (QKV bias, QK-norm, TE fused norms) match
    nothing and cost nothing; HF tensors they would read are then reported as unexpected.
    """
    if tie_word_embeddings:
        # The last pipeline stage keeps a copy of the embedding as its output layer.
        output = WeightRule("output_layer.weight", "model.embed_tokens.weight", "vocab", export=False)
    else:
        output = WeightRule("output_layer.weight", "lm_head.weight", "vocab")
    return (
        WeightRule("embedding.word_embeddings.weight", "model.embed_tokens.weight", "vocab"),
        *(_ATTENTION_RULES if attention_rules is None else attention_rules),
        *mlp_rules,
        WeightRule("decoder.final_layernorm.weight", "model.norm.weight"),
        output,
    )


def mtp_layer_pattern(num_layers: int) -> str:
    """Regex of HF tensors under ``model.layers.{k}`` for any ``k >= num_layers`` (MTP layers)."""
    below = "|".join(str(k) for k in range(num_layers))
    return rf"model\.layers\.(?!(?:{below})\.)\d+\..+" if below else r"model\.layers\.\d+\..+"


# ------------------------------------------------------------------------------------------
# HF config translation helpers.
# ------------------------------------------------------------------------------------------
def reject(family: str, field: str, value: Any, allowed: str) -> None:
    """Raise the ValueError for an HF config setting Megatron's GPTModel cannot represent."""
    raise ValueError(f"{family}: HF config {field}={value!r} is not supported; allowed: {allowed}")


def _rope_kwargs(family: str, cfg: Any, *, partial_rotary: bool = False) -> dict[str, Any]:
    """RoPE theta and scaling as GPTModel expresses them (plain, or Llama-3.1 scaling); with
    ``partial_rotary`` a ``partial_rotary_factor`` becomes ``rotary_percent`` (GLM-4.5: the first
    fraction of each head is rotated, rotate-half style, as Megatron does).

    Megatron's ``RotaryEmbedding._apply_scaling`` takes only ``factor``; it fixes
    low_freq_factor=1, high_freq_factor=4 and original_max_position_embeddings=8192 (the
    Llama 3.1 values), and GPTModel passes ``rotary_base`` as an int.
    """
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        reject(family, "rope_theta", theta, "a number")
    if float(theta) != int(theta):
        reject(family, "rope_theta", theta, "an integer value (GPTModel takes rotary_base as an int)")
    partial = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
    if partial != 1.0 and not (partial_rotary and 0.0 < partial < 1.0):
        reject(family, "rope_parameters.partial_rotary_factor", partial, "in (0, 1]" if partial_rotary else "1.0")
    rope_type = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": float(theta)}
    if partial != 1.0:
        out["rotary_percent"] = partial
    if rope_type == "default":
        return out
    if rope_type != "llama3":
        reject(family, "rope_parameters.rope_type", rope_type, "'default' or 'llama3'")
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for key, value in fixed.items():
        if key not in params or float(params[key]) != value:
            reject(
                family,
                f"rope_parameters.{key}",
                params.get(key),
                f"{value:g} (Megatron's llama3 RoPE scaling fixes it; only 'factor' is configurable)",
            )
    out.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]))
    return out


def llama_like_kwargs(family: str, cfg: Any, *, partial_rotary: bool = False, rope: bool = True) -> dict[str, Any]:
    """``ModelConfig`` kwargs shared by Llama-style decoders (RMSNorm, SwiGLU, RoPE, GQA);
    ``partial_rotary`` accepts a ``partial_rotary_factor`` (``rotary_percent``); ``rope=False``
    leaves the RoPE settings to the caller (DeepSeek-V3's MLA reads its own, YaRN included)."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        reject(family, "hidden_act", cfg.hidden_act, "'silu' (SwiGLU)")
    heads = cfg.num_attention_heads
    return dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
        kv_channels=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.rms_norm_eps),
        swiglu=True,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        **(_rope_kwargs(family, cfg, partial_rotary=partial_rotary) if rope else {}),
    )


def check_no_sliding_window(family: str, cfg: Any) -> None:
    """Megatron's local spec has no sliding-window attention."""
    if getattr(cfg, "use_sliding_window", False):
        reject(family, "use_sliding_window", cfg.use_sliding_window, "False")
    if not hasattr(cfg, "use_sliding_window") and getattr(cfg, "sliding_window", None) is not None:
        reject(family, "sliding_window", cfg.sliding_window, "None")


def moe_router_kwargs(cfg: Any, *, num_experts: int, norm_topk_prob: bool) -> dict[str, Any]:
    """Router settings: HF's softmax -> top-k (-> renormalise) as Megatron expresses it.

    Renormalised top-k of a softmax equals a softmax over the top-k logits, which is Megatron's
    ``moe_router_pre_softmax=False``; without renormalisation it is softmax-then-top-k
    (``moe_router_pre_softmax=True``). The auxiliary loss is on only where HF would add it.
    """
    aux = float(getattr(cfg, "router_aux_loss_coef", 0.0)) if getattr(cfg, "output_router_logits", False) else 0.0
    return dict(
        num_moe_experts=num_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_router_pre_softmax=not norm_topk_prob,
        moe_aux_loss_coeff=aux,
    )


# ------------------------------------------------------------------------------------------
# Registry.
# ------------------------------------------------------------------------------------------
_REGISTRY: dict[str, Family] = {}


def _discover() -> dict[str, Family]:
    if not _REGISTRY:
        import megatron_rl.models as package

        found: dict[str, Family] = {}
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            if info.name in _NOT_FAMILY_MODULES or info.name.startswith("_"):
                continue
            family = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "FAMILY", None)
            if isinstance(family, Family):
                for other in found.values():
                    clash = set(other.architectures) & set(family.architectures)
                    if clash or other.name == family.name:
                        raise ValueError(
                            f"families {other.name!r} and {family.name!r} both claim {sorted(clash) or family.name}"
                        )
                found[family.name] = family
        _REGISTRY.update(found)
    return _REGISTRY


def supported_families() -> dict[str, tuple[str, ...]]:
    """Family name -> the HF architectures it serves."""
    return {name: f.architectures for name, f in sorted(_discover().items())}


def apply_hf_overrides(
    hf_config: Any, overrides: Mapping[str, Any], config_class: type = ModelConfig
) -> tuple[Any, dict[str, Any]]:
    """``(hf_config with verl's HF-key overrides set, the remaining ModelConfig overrides)``.

    An HF key is one under ``overrides["model_config"]`` (verl's wrapper) or a top-level key the HF
    config has; a key that is neither that nor a field of ``config_class`` is a ``ValueError`` (it would
    otherwise be ignored). ``hf_config`` itself is not changed."""
    import copy
    import dataclasses

    rest = dict(overrides)
    wrapped = rest.pop("model_config", None) or {}
    if not isinstance(wrapped, Mapping):
        raise ValueError(f"model.override_config.model_config={wrapped!r} must be a mapping of HF config keys")
    hf_keys = set(hf_config.to_dict())
    fields = {f.name for f in dataclasses.fields(config_class)}
    hf_overrides = dict(wrapped)
    for key in [k for k in rest if k in hf_keys]:
        hf_overrides[key] = rest.pop(key)
    missing = sorted(set(hf_overrides) - hf_keys)
    unknown = sorted(set(rest) - fields)
    if missing or unknown:
        raise ValueError(
            f"model.override_config: {missing + unknown} are neither keys of the {hf_config.model_type} "
            f"HF config nor {config_class.__name__} fields"
        )
    if hf_overrides:
        hf_config = copy.deepcopy(hf_config)
        for key, value in hf_overrides.items():
            setattr(hf_config, key, value)
    return hf_config, rest


def load_hf_config(source: Any) -> Any:
    """A transformers ``PretrainedConfig`` from a config object, a ``config.json`` dict, or a
    path to a checkpoint directory / config.json (no network access)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"HF config {path} does not exist")
        source = json.loads(path.read_text())
    if not isinstance(source, Mapping):
        raise TypeError(f"HF config must be a PretrainedConfig, a dict or a path, got {type(source).__name__}")
    data = dict(source)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"HF config has no 'model_type'; keys: {sorted(data)[:20]}")
    data.pop("transformers_version", None)
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"HF config model_type={model_type!r} is unknown to transformers: {exc}") from None


def get_family(hf_config_or_architecture: Any) -> Family:
    """The family serving an HF config (by its first ``architectures`` entry) or an
    architecture name; ``ValueError`` listing the supported families otherwise."""
    if isinstance(hf_config_or_architecture, str) and not os.path.exists(hf_config_or_architecture):
        architectures = [hf_config_or_architecture]
    else:
        cfg = load_hf_config(hf_config_or_architecture)
        architectures = list(getattr(cfg, "architectures", None) or [])
    # A reward model (``XForSequenceClassification``) shares the decoder of ``XForCausalLM``.
    candidates = architectures + [a.replace("ForSequenceClassification", "ForCausalLM") for a in architectures]
    for family in _discover().values():
        if any(a in family.architectures for a in candidates):
            return family
    listing = "; ".join(f"{name}: {', '.join(archs)}" for name, archs in supported_families().items())
    raise ValueError(f"HF architectures {architectures} are not supported; supported families: {listing}")


def hf_head(hf_config: Any) -> str:
    """``"score"`` for a scalar reward-model checkpoint (``*ForSequenceClassification``, one label),
    ``"lm"`` for a causal LM; ValueError for a classifier with more than one label."""
    cfg = load_hf_config(hf_config)
    architectures = list(getattr(cfg, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return "lm"
    if cfg.num_labels != 1:
        raise ValueError(
            f"HF config {architectures} has num_labels={cfg.num_labels}; a reward model needs "
            "num_labels=1 (one scalar score)"
        )
    return "score"
