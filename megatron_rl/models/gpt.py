"""Megatron-Core GPT models for the actor (LM head) and the critic (scalar value head).

A ``ModelConfig`` holds the architecture with Megatron's names (the HF families map onto it
in ``megatron_rl.models.<family>``); ``build_transformer_config`` combines it with a
``parallel.config.ParallelConfig``; ``build_model`` returns the model chunks this rank owns
(one per virtual pipeline stage). Layer specs are data: TransformerEngine's spec when TE
imports, otherwise the local spec with its core attention swapped for ``SDPAttention``
(``megatron_rl.models.attention``: padded rows and packed THD sequences with a document mask).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from megatron_rl.config.base_config import check_choice
from megatron_rl.config.model import ModelConfig
from megatron_rl.models.attention import SDPAttention

__all__ = [
    "SDPAttention",
    "SequenceParallelTorchNorm",
    "ValueHead",
    "get_layer_spec",
    "build_transformer_config",
    "build_model",
    "padded_vocab_size",
    "hidden_states_output",
    "te_available",
    "te_import_error",
    "require_te",
]


def te_import_error() -> Optional[str]:
    """Why TransformerEngine's PyTorch extension does not import here (``"ModuleNotFoundError: ..."``),
    or None when it does. A TE whose torch extension was built against another torch fails here with
    an undefined-symbol ``ImportError``: callers that need TE show this text instead of falling back."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"; its text is kept
        return f"{type(exc).__name__}: {exc}"
    return None


def te_available() -> bool:
    """True when TransformerEngine's PyTorch extension imports (GPU clusters)."""
    return te_import_error() is None


def require_te(why: str) -> None:
    """``RuntimeError`` with TE's import error when ``why`` (a key and value that asks for TE) cannot have it."""
    error = te_import_error()
    if error is not None:
        raise RuntimeError(
            f"{why} needs TransformerEngine, which does not import in this process ({error}); "
            "install the [gpu] extra's TransformerEngine (README: GPU install) or choose a "
            "setting that runs without it"
        )


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 1) -> int:
    """Embedding rows after padding to a multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


class SequenceParallelTorchNorm:
    """Torch ``RMSNorm``/``LayerNorm`` usable under sequence parallelism (no TE/Apex needed).

    Megatron's ``WrappedTorchNorm`` refuses sequence parallelism because it does not mark its
    weights; with ``sequence_parallel`` set on them, ``finalize_model_grads`` all-reduces their
    gradients over the TP group, exactly as it does for TE's norms. Parameter names are torch's
    (``weight``/``bias``), the same as ``WrappedTorchNorm``'s.
    """

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


def fixed_eps_norm(eps: float) -> type:
    """``SequenceParallelTorchNorm`` with epsilon ``eps`` whatever Megatron passes (MLA builds its latent
    norms with ``layernorm_epsilon``; HF's DeepSeek-V3 keeps them at 1e-6 when ``rms_norm_eps`` differs)."""

    def __new__(cls, config, hidden_size: int, **kwargs):
        return SequenceParallelTorchNorm.__new__(cls, config, hidden_size, **{**kwargs, "eps": eps})

    return type(f"SequenceParallelTorchNormEps{eps:g}", (SequenceParallelTorchNorm,), {"__new__": __new__})


def _set_latent_norm_eps(model: torch.nn.Module, eps: float) -> None:
    """TE spec: MLA's latent norms are fused into the up projections (TE's ``LayerNormLinear``,
    which reads ``self.eps`` at every forward); give them ``eps``."""
    for name, module in model.named_modules():
        if name.endswith(("linear_q_up_proj", "linear_kv_up_proj")) and hasattr(module, "eps"):
            module.eps = eps


def get_layer_spec(model_cfg: ModelConfig, *, moe: bool = True):
    """The transformer layer spec: TE's when available/asked, else local with SDPA attention.

    ``moe=False`` gives the dense-MLP layer of a model whose ``moe_layer_freq`` mixes dense and
    MoE layers; MLA (``ExtendedModelConfig.multi_latent_attention``) swaps the attention module.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    backend = model_cfg.attention_backend
    experts = model_cfg.num_moe_experts if moe else None
    mla = bool(getattr(model_cfg, "multi_latent_attention", False))
    if backend == "te":
        require_te("model.attention_backend='te'")  # never a silent fallback to the local spec
    if backend == "te" or (backend == "auto" and te_available()):
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts,
            moe_grouped_gemm=model_cfg.moe_grouped_gemm,
            qk_layernorm=model_cfg.qk_layernorm or mla,
            multi_latent_attention=mla,
        )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=experts,
        moe_grouped_gemm=model_cfg.moe_grouped_gemm,
        qk_layernorm=model_cfg.qk_layernorm,
        normalization=model_cfg.normalization,
        multi_latent_attention=mla,
    )
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    if mla:  # MLA always normalises its compressed query and key/value latents
        latent_eps = getattr(model_cfg, "mla_latent_norm_epsilon", None)
        latent = SequenceParallelTorchNorm if latent_eps is None else fixed_eps_norm(latent_eps)
        spec.submodules.self_attention.submodules.q_layernorm = latent
        spec.submodules.self_attention.submodules.kv_layernorm = latent
    elif model_cfg.qk_layernorm:  # Megatron all-reduces q/k-norm grads over TP by name
        spec.submodules.self_attention.submodules.q_layernorm = SequenceParallelTorchNorm
        spec.submodules.self_attention.submodules.k_layernorm = SequenceParallelTorchNorm
    if backend in ("auto", "sdpa"):
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def _decoder_spec(model_cfg: ModelConfig, transformer_config, vp_stage: Optional[int]):
    """Layer spec, or (local spec) a block spec whose final norm also supports sequence parallelism."""
    spec = get_layer_spec(model_cfg)
    layer_is_moe = getattr(model_cfg, "layer_is_moe", None)
    mixed = layer_is_moe is not None and getattr(model_cfg, "moe_layer_freq", None) is not None
    if spec.submodules.input_layernorm is not SequenceParallelTorchNorm and not mixed:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_local = get_num_layers_to_build(transformer_config, vp_stage=vp_stage)
    specs = [spec] * num_local
    if mixed:  # first-k-dense and other dense/MoE patterns: each local layer by its global index
        offset = get_transformer_layer_offset(transformer_config, vp_stage=vp_stage)
        dense = get_layer_spec(model_cfg, moe=False)
        specs = [spec if layer_is_moe(offset + i) else dense for i in range(num_local)]
    if spec.submodules.input_layernorm is not SequenceParallelTorchNorm:  # TE: Megatron's own pattern parser
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            transformer_config, use_transformer_engine=True, normalization=model_cfg.normalization, vp_stage=vp_stage
        )
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelTorchNorm)


def build_transformer_config(
    model_cfg: ModelConfig, parallel_cfg: Any, *, sequence_parallel: bool = False, **overrides: Any
):
    """A ``TransformerConfig`` for ``model_cfg`` under ``parallel_cfg`` (a ParallelConfig).

    ``sequence_parallel`` (``megatron.sequence_parallel``) shards norm/dropout activations over
    TP; it only acts with TP > 1, and is always on for MoE under TP (Megatron requires it).
    Dropout is off (RL needs the log-probs of the policy that sampled). On CPU the settings
    ``parallel.cpu_compat`` requires are applied.
    """
    from megatron.core.transformer import TransformerConfig

    dtype = model_cfg.dtype
    kwargs: dict[str, Any] = dict(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups or model_cfg.num_attention_heads,
        kv_channels=model_cfg.head_dim,
        normalization=model_cfg.normalization,
        layernorm_epsilon=model_cfg.layernorm_epsilon,
        qk_layernorm=model_cfg.qk_layernorm,
        add_qkv_bias=model_cfg.add_qkv_bias,
        add_bias_linear=model_cfg.add_bias_linear,
        gated_linear_unit=model_cfg.swiglu,
        activation_func=F.silu if model_cfg.swiglu else F.gelu,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel_cfg.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel_cfg.expert_tensor_parallel_size,
        context_parallel_size=parallel_cfg.context_parallel_size,
        # Megatron requires sequence parallelism for MoE under TP.
        sequence_parallel=parallel_cfg.tensor_model_parallel_size > 1 and (sequence_parallel or model_cfg.is_moe),
        # Micro-batches are trimmed to their longest row, so PP stages exchange shapes first.
        variable_seq_lengths=True,
        moe_token_dispatcher_type=model_cfg.moe_token_dispatcher_type,
    )
    if model_cfg.is_moe:
        kwargs.update(
            num_moe_experts=model_cfg.num_moe_experts,
            moe_ffn_hidden_size=model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
            moe_router_topk=model_cfg.moe_router_topk,
            moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
            moe_z_loss_coeff=model_cfg.moe_z_loss_coeff,
            moe_router_load_balancing_type=model_cfg.moe_router_load_balancing_type,
            moe_router_pre_softmax=model_cfg.moe_router_pre_softmax,
            moe_router_dtype=model_cfg.moe_router_dtype,
            moe_token_dispatcher_type=model_cfg.moe_token_dispatcher_type,
            moe_grouped_gemm=model_cfg.moe_grouped_gemm,
            moe_shared_expert_intermediate_size=model_cfg.moe_shared_expert_intermediate_size,
        )
    config_cls = TransformerConfig
    megatron_kwargs = getattr(model_cfg, "megatron_kwargs", None)
    if megatron_kwargs is not None:  # ExtendedModelConfig: MLA, YaRN, sigmoid/grouped routing, layer pattern
        kwargs.update(megatron_kwargs())
        if kwargs.get("multi_latent_attention"):
            from megatron.core.transformer import MLATransformerConfig

            config_cls = MLATransformerConfig
    if not torch.cuda.is_available():
        from parallel.cpu_compat import cpu_transformer_config_overrides

        kwargs.update(cpu_transformer_config_overrides())
    kwargs.update(overrides)
    return config_cls(**kwargs)


class ValueHead(torch.nn.Module):
    """The critic's head: hidden state -> one scalar per token, replicated over TP ranks.

    Mimics the output layer's call signature (``(output, bias)``) so it slots into
    ``GPTModel.output_layer``. With sequence parallelism the input is gathered first.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        # With sequence parallelism every TP rank gathers the full sequence first, so the weight's
        # gradient is already identical across TP ranks and needs no extra all-reduce.
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight), None


HEADS = ("lm", "scalar")


def _mla_without_te() -> None:
    """Megatron-Core 0.16.1's MLA module believes TE is present when it is not.

    ``megatron.core.extensions.transformer_engine`` imports without TransformerEngine and leaves
    ``TELinear`` a ``MagicMock``, so ``multi_latent_attention.HAVE_TE`` is True and its
    ``isinstance(self.linear_proj, TELinear)`` raises TypeError. Without TE, say so.
    """
    if te_available():
        return
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False


def build_model(model_cfg: ModelConfig, transformer_config, *, head: str = "lm") -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage) with ``head`` on the last stage.

    ``head`` is ``lm`` (the LM head over the padded vocabulary, vocab-parallel output: actor,
    reference, teacher) or ``scalar`` (one value per token: critic, reward model). Requires an
    initialised mesh.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    check_choice("head", head, HEADS)
    value_head = head == "scalar"
    vocab = padded_vocab_size(
        model_cfg.vocab_size, transformer_config.tensor_model_parallel_size, model_cfg.make_vocab_size_divisible_by
    )
    vpp = transformer_config.virtual_pipeline_model_parallel_size or 1
    if getattr(transformer_config, "multi_latent_attention", False) and not torch.cuda.is_available():
        from parallel.cpu_compat import redirect_yarn_current_device

        redirect_yarn_current_device()  # MLA's YaRN RoPE allocates on torch.cuda.current_device()
    if getattr(transformer_config, "multi_latent_attention", False):
        _mla_without_te()
    if transformer_config.num_moe_experts and not torch.cuda.is_available():
        from parallel.cpu_compat import redirect_uneven_tp_collectives

        redirect_uneven_tp_collectives()  # ETP>1 with EP>1: the dispatcher's uneven expert-TP gathers
    chunks = []
    for vp_stage in range(vpp):
        vp = vp_stage if vpp > 1 else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = GPTModel(
            config=transformer_config,
            transformer_layer_spec=_decoder_spec(model_cfg, transformer_config, vp),
            vocab_size=vocab,
            max_sequence_length=model_cfg.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=model_cfg.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_percent=model_cfg.rotary_percent,
            rotary_base=int(model_cfg.rotary_base),
            rope_scaling=model_cfg.rope_scaling,
            rope_scaling_factor=model_cfg.rope_scaling_factor,
            vp_stage=vp,
        )
        latent_eps = getattr(model_cfg, "mla_latent_norm_epsilon", None)
        if latent_eps is not None:
            _set_latent_norm_eps(model, latent_eps)
        if value_head and post:
            model.output_layer = ValueHead(model_cfg.hidden_size, model_cfg.dtype, transformer_config.sequence_parallel)
        if model_cfg.freeze_router:
            for name, param in model.named_parameters():
                if ".router." in name:
                    param.requires_grad_(False)
        chunks.append(model)
    return chunks


class _HiddenOut(torch.nn.Module):
    """Stands in for the output layer: returns the hidden states, records the LM weight used."""

    def __init__(self, real: torch.nn.Module):
        super().__init__()
        self.real = [real]  # a list keeps it out of this module's parameters
        self.weight_used: Optional[torch.Tensor] = None

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        self.weight_used = weight if weight is not None else self.real[0].weight
        if getattr(self.real[0], "sequence_parallel", False):
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # The log-prob function all-reduces the hidden-state gradient over TP itself, so the
            # gather's backward must only split it (not reduce-scatter it a second time).
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return hidden_states, None


@contextlib.contextmanager
def hidden_states_output(model: torch.nn.Module) -> Iterator[_HiddenOut]:
    """Within the block, ``model(...)`` returns the final hidden states ``[b, s, h]`` instead of
    logits; ``handle.weight_used`` is the (vocab-sharded) output weight, for computing log-probs
    straight from hidden states without materialising full logits."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    if not getattr(inner, "post_process", False):  # not the last pipeline stage: nothing to swap
        yield None
        return
    real = inner.output_layer
    handle = _HiddenOut(real)
    inner.output_layer = handle
    try:
        yield handle
    finally:
        inner.output_layer = real
