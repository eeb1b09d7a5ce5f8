"""Per-rank memory of one Megatron role (actor, critic, reference, reward model, teacher).

Everything is counted for the most loaded pipeline stage of a layout, in bytes, following
what ``megatron_rl.engine.engine.MegatronEngine`` allocates:

* parameters: each weight's local shard (heads and MLP columns over TP -- KV heads are
  replicated when there are fewer than TP; routed experts over EP and their columns over ETP;
  the (padded) vocabulary over TP; norms and the router replicated), ``L / PP`` layers per
  stage (an uneven split, ``num_layers_in_first/last_pipeline_stage`` or the embedding/loss counted
  as a layer, ``account_for_embedding/loss_in_pipeline_split``: ``stage_layers``),
  embedding on the first stage, output layer on the last;
* gradients: Megatron DDP's buffer with ``grad_reduce_in_fp32=True`` -> 4 bytes/param;
* optimizer: Adam keeps m and v in fp32 (8 B/param) plus fp32 master weights for 16-bit
  params (12 B/param); SGD a momentum buffer (+ master); with a distributed optimizer the
  state is sharded over the data-parallel group (x CP) for dense and expert-DP for experts;
* Megatron's CPU optimizer (``optim.override_optimizer_config``: ``optimizer_cpu_offload`` with
  ``optimizer_offload_fraction`` f, megatron-core's ``HybridDeviceOptimizer``): the Adam state of a
  fraction f of the optimizer's parameters and their fp32 copies live in host memory. With
  ``use_precision_aware_optimizer`` the optimizer takes the 16-bit parameter shards themselves, so the
  GPU keeps ``(1 - f) * 12`` B/param; without it the distributed optimizer's fp32 masters stay on the
  GPU: ``4 + (1 - f) * 8``. Precision-aware without the CPU optimizer (TE's FusedAdam) keeps the
  masters in ``main_params_dtype`` and m / v in ``exp_avg_dtype`` / ``exp_avg_sq_dtype``;
* activations of the micro-batches in flight: 1 without PP, ``PP`` at stage 0 with 1F1B,
  ``(PP-1)*2 + (VPP-1)*PP + 1`` model chunks with the interleaved schedule. Per layer and
  token the saved tensors of the local spec with SDPA/flash attention (no ``s^2`` term) are
  counted -- 5 hidden-sized tensors (norm outputs, attention projection, MLP output,
  residual; divided by TP under sequence parallelism), ``3 * (heads + kv heads) / TP *
  head_dim`` for QKV, rotated q/k and the attention output, ``5 * ffn / TP`` for the SwiGLU
  MLP (fc1 output, activation, product); a MoE layer saves fp32 router logits/probs and, per
  routed token, ``3 * hidden + 5 * moe_ffn / ETP``. This is Korthikanti et al.'s accounting
  (Reducing Activation Recomputation, 2022) redone for SwiGLU/GQA/MoE layers; full
  recompute keeps only each layer's input plus one layer's activations; forward only (log-probs,
  values) keeps a layer's input and output, and one layer's intermediates or the head's logits
  chunk at a time (scratch);
* the output head: the actor's fused log-prob path forms ``chunk x vocab/TP`` fp32 logits
  twice (logits and their exp) and a weight-gradient of the output layer in backward,
  never the full ``[tokens, vocab]`` logits;
* LoRA (``lora.rank > 0``, ``megatron_rl.planner.lora_sizes``): the frozen base keeps only its parameters;
  the adapters (``r * (in_local + out_local)`` per targeted linear) have parameters in ``lora.dtype``
  (the base's by default), fp32 gradients and the optimizer state (sharded like the base's would be);
  the frozen output layer forms no weight gradient. Activations are counted as without LoRA (each
  adapted linear's input is saved for ``A``'s gradient as it was for the base weight's; the
  ``r``-wide ``A x`` is negligible).

A micro-batch holds ``micro_batch_size`` sequences of ``seq_length`` tokens, or with a token
budget (``use_dynamic_bsz``: ``max_token_len``) at most that many tokens -- one packed sequence
(``use_remove_padding``), all of whose tokens may be response tokens the head scores.

On CPU the activations are float32 (``ModelConfig.params_dtype``); on GPU the training dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

from megatron_rl.config.model import ModelConfig
from megatron_rl.models.gpt import padded_vocab_size

__all__ = [
    "RoleMemory",
    "count_params",
    "estimate_role",
    "DTYPE_BYTES",
    "rollout_weight_bytes",
    "fp8_linear_shapes",
    "optimizer_gpu_bytes_per_param",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class RoleMemory:
    """Bytes per rank of one role on its most loaded pipeline stage."""

    role: str
    params_dense: int
    """Parameters held on this rank outside routed experts."""
    params_expert: int
    """Routed-expert parameters held on this rank."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Saved activations of the micro-batches in flight."""
    transient_bytes: int
    """Peak scratch on top of the activations (output-head logits chunks, a layer's backward)."""
    params_adapter: int = 0
    """LoRA adapter parameters on this rank (beside ``params_dense`` + ``params_expert``, the base's)."""

    @property
    def state_bytes(self) -> int:
        """What stays allocated between steps: parameters + gradients + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        """While this role computes: state + activations + scratch."""
        return self.state_bytes + self.activation_bytes + self.transient_bytes


_OPTIMIZER_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
_OVERRIDES = "optim.override_optimizer_config"


def _dtype_bytes(overrides: Mapping[str, Any], name: str) -> int:
    value = overrides.get(name, "fp32")
    text = str(value).removeprefix("torch.")  # a torch.dtype set in code prints as torch.bfloat16
    if text not in _OPTIMIZER_DTYPE_BYTES:
        raise ValueError(
            f"{_OVERRIDES}.{name}={value!r} is not allowed; choose one of {sorted(_OPTIMIZER_DTYPE_BYTES)}"
        )
    return _OPTIMIZER_DTYPE_BYTES[text]


def optimizer_gpu_bytes_per_param(
    optimizer: str, param_bytes: int, overrides: Optional[Mapping[str, Any]] = None
) -> float:
    """GPU bytes the optimizer keeps per trained parameter (before any DP sharding): Adam's m and v (SGD's
    momentum) and the fp32 master of a 16-bit parameter, less what Megatron's CPU optimizer keeps in host
    memory (module docstring). ``ValueError`` naming the override key for a fraction outside [0, 1] or a
    state dtype other than fp32 / bf16 / fp16."""
    ov = dict(overrides or {})
    state = 8 if optimizer == "adam" else 4
    master = 4 if param_bytes != 4 else 0
    precision_aware = bool(ov.get("use_precision_aware_optimizer", False))
    if not ov.get("optimizer_cpu_offload", False):
        if precision_aware and optimizer == "adam":  # TE's FusedAdam: masters and m / v in their own dtypes
            master = _dtype_bytes(ov, "main_params_dtype") if param_bytes != 4 else 0
            state = _dtype_bytes(ov, "exp_avg_dtype") + _dtype_bytes(ov, "exp_avg_sq_dtype")
        return state + master
    fraction = ov.get("optimizer_offload_fraction", 0.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(
            f"{_OVERRIDES}.optimizer_offload_fraction={fraction!r} is not allowed; it is the fraction of the "
            "optimizer state kept on the CPU, a number in [0, 1]"
        )
    if precision_aware:  # the 16-bit shards are the optimizer's parameters: their fp32 copies move with them
        return (1.0 - fraction) * (state + master)
    return master + (1.0 - fraction) * state  # the distributed optimizer's fp32 masters stay on the GPU


def _layer_params(m: ModelConfig, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) parameters of one transformer layer on one rank."""
    h, hd = m.hidden_size, m.head_dim
    kv = m.num_query_groups or m.num_attention_heads
    q_local = m.num_attention_heads // tp
    kv_local = max(kv // tp, 1)  # fewer KV heads than TP ranks: each rank keeps one, replicated
    qkv = (q_local + 2 * kv_local) * hd * h + ((q_local + 2 * kv_local) * hd if m.add_qkv_bias else 0)
    dense = qkv + q_local * hd * h + 2 * h + (2 * hd if m.qk_layernorm else 0)
    gate = 2 if m.swiglu else 1
    expert = 0
    if m.is_moe:
        f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        dense += m.num_moe_experts * h  # router, replicated
        expert = (m.num_moe_experts // ep) * (gate + 1) * (f // etp) * h
        if m.moe_shared_expert_intermediate_size:
            dense += (gate + 1) * (m.moe_shared_expert_intermediate_size // tp) * h
    else:
        dense += (gate + 1) * (m.ffn_hidden_size // tp) * h
    return dense, expert


def _stage_layers(m: ModelConfig, pp: int, stage_layers: Optional[Sequence[int]]) -> list[int]:
    """Decoder layers per pipeline stage: ``stage_layers`` (an uneven split) or ``L / PP`` each."""
    if stage_layers is None:
        return [m.num_layers // pp] * pp
    if len(stage_layers) != pp or sum(stage_layers) != m.num_layers:
        raise ValueError(
            f"stage_layers={list(stage_layers)} must give each of the pipeline_model_parallel_size={pp} "
            f"stages its layers, num_layers={m.num_layers} in all"
        )
    return list(stage_layers)


def count_params(
    m: ModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    stage: Optional[int] = None,
    value_head: bool = False,
    stage_layers: Optional[Sequence[int]] = None,
) -> tuple[int, int]:
    """``(dense, expert)`` parameters held by one rank of pipeline ``stage`` (None = the most
    loaded stage). ``value_head``: a critic/reward model's ``[1, h]`` head replaces the LM head.
    ``stage_layers``: decoder layers per stage of an uneven split (``parallel.config.pipeline_stage_layers``)."""
    etp = etp or tp
    dense_layer, expert_layer = _layer_params(m, tp, ep, etp)
    layers_of = _stage_layers(m, pp, stage_layers)
    vocab_rows = padded_vocab_size(m.vocab_size, tp, m.make_vocab_size_divisible_by) // tp
    embed = vocab_rows * m.hidden_size
    if value_head:
        head = m.hidden_size
    elif m.tie_word_embeddings and pp == 1:
        head = 0  # the embedding is the head
    else:
        head = embed
    per_stage = []
    per_layer = getattr(m, "layer_params", None)  # ExtendedModelConfig: MLA and first-k-dense, layer by layer
    for s in range(pp):
        layers, first = layers_of[s], sum(layers_of[:s])
        if per_layer is None:
            d, e = layers * dense_layer, layers * expert_layer
        else:
            counts = [per_layer(first + i, tp=tp, ep=ep, etp=etp) for i in range(layers)]
            d, e = sum(c[0] for c in counts), sum(c[1] for c in counts)
        d += embed if s == 0 else 0
        d += (head + m.hidden_size) if s == pp - 1 else 0  # output layer + final norm
        per_stage.append((d, e))
    if stage is not None:
        return per_stage[stage]
    return max(per_stage, key=lambda x: x[0] + x[1])


def fp8_linear_shapes(m: ModelConfig) -> list[tuple[int, int, int]]:
    """``(rows, cols, count)`` of the HF weights an FP8 rollout engine holds block-quantised
    (``parallel.bridge.fp8.FP8_WEIGHTS``: every attention projection -- MLA's ``q_a/q_b/kv_a_proj_with_mqa/
    kv_b_proj/o_proj`` -- and every dense, shared and routed expert ``gate/up/down_proj``) of the
    whole model; router gates, norms, embeddings and the head are not among them."""
    h, heads = m.hidden_size, m.num_attention_heads
    gate = 2 if m.swiglu else 1
    shapes: list[tuple[int, int, int]] = []
    for layer in range(m.num_layers):
        if getattr(m, "multi_latent_attention", False):
            q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
            shapes += (
                [(heads * q_head, h, 1)]
                if m.q_lora_rank is None
                else [(m.q_lora_rank, h, 1), (heads * q_head, m.q_lora_rank, 1)]
            )
            shapes += [
                (m.kv_lora_rank + m.qk_pos_emb_head_dim, h, 1),
                (heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank, 1),
                (h, heads * m.v_head_dim, 1),
            ]
        else:
            d, groups = m.head_dim, m.num_query_groups or heads
            shapes += [(heads * d, h, 1), (groups * d, h, 2), (h, heads * d, 1)]
        moe = m.layer_is_moe(layer) if hasattr(m, "layer_is_moe") else m.is_moe
        if moe:
            f = m.moe_ffn_hidden_size or m.ffn_hidden_size
            shapes += [(f, h, gate * m.num_moe_experts), (h, f, m.num_moe_experts)]
            if m.moe_shared_expert_intermediate_size:
                s = m.moe_shared_expert_intermediate_size
                shapes += [(s, h, gate), (h, s, 1)]
        else:
            shapes += [(m.ffn_hidden_size, h, gate), (h, m.ffn_hidden_size, 1)]
    return shapes


def rollout_weight_bytes(
    m: ModelConfig, dtype: str, quantization: Optional[str] = None, block: tuple[int, int] = (128, 128)
) -> int:
    """Bytes of a vLLM engine's weights for the whole model (divide by the engine's TP for one GPU).

    ``quantization=None``: every parameter in ``dtype``. ``"fp8"`` (DeepSeek-V3's block format,
    ``rollout.quantization``): 1 byte per weight of ``fp8_linear_shapes`` + a 4-byte float32 scale per
    ``block`` (ceil-divided: edge blocks count whole), every other parameter (embedding, head, norms,
    router gates and biases) in ``dtype``.
    """
    total = sum(count_params(m))
    if quantization is None:
        return total * DTYPE_BYTES[dtype]
    if quantization != "fp8":
        raise ValueError(f"rollout.quantization={quantization!r} is not allowed; choose one of [None, 'fp8']")
    quantised = scales = 0
    for rows, cols, count in fp8_linear_shapes(m):
        quantised += rows * cols * count
        scales += math.ceil(rows / block[0]) * math.ceil(cols / block[1]) * count
    return quantised + 4 * scales + (total - quantised) * DTYPE_BYTES[dtype]


def layer_activation_elements(m: ModelConfig, *, tp: int, etp: int, sequence_parallel: bool, act_bytes: int) -> float:
    """Saved activation elements per token of one transformer layer (see module docstring)."""
    h, hd = m.hidden_size, m.head_dim
    sp = tp if sequence_parallel else 1
    kv = m.num_query_groups or m.num_attention_heads
    heads_local, kv_local = m.num_attention_heads / tp, max(kv / tp, 1)
    elems = 5 * h / sp + 3 * (heads_local + kv_local) * hd
    if m.is_moe:
        f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        router = 2 * m.num_moe_experts * 4 / act_bytes  # fp32 logits + probs
        elems += (router + m.moe_router_topk * (3 * h + 5 * f / etp)) / sp
        if m.moe_shared_expert_intermediate_size:
            elems += 5 * m.moe_shared_expert_intermediate_size / tp
    else:
        elems += 5 * m.ffn_hidden_size / tp
    return elems


def in_flight_chunks(stage: int, pp: int, vpp: Optional[int], num_microbatches: int) -> int:
    """Model chunks whose activations pipeline ``stage`` holds at once (Megatron's warm-up + 1)."""
    if pp == 1:
        return 1
    if not vpp:
        return min(pp - stage, num_microbatches)
    return min(num_microbatches * vpp, (pp - stage - 1) * 2 + (vpp - 1) * pp + 1)


def _stage_activations(
    m: ModelConfig,
    stage: int,
    pp: int,
    vpp: Optional[int],
    num_microbatches: int,
    per_layer: float,
    layer_input: float,
    trainable: bool,
    recompute: Optional[dict],
    stage_layers: Optional[Sequence[int]] = None,
) -> float:
    """Saved activations of one pipeline stage at its fullest."""
    if not trainable:  # forward only: a layer's input and output stay; its intermediates are scratch
        return 2 * layer_input
    chunks = in_flight_chunks(stage, pp, vpp, num_microbatches)
    layers_per_chunk = _stage_layers(m, pp, stage_layers)[stage] / (vpp or 1)
    recompute = dict(recompute or {})
    if recompute.get("recompute_granularity") == "full":
        n = int(recompute.get("recompute_num_layers") or 1)
        if recompute.get("recompute_method") == "block":  # first n layers of a chunk recomputed
            stored = max(layers_per_chunk - n, 0) * per_layer + min(n, layers_per_chunk) * layer_input
        else:  # "uniform": groups of n layers keep only their input
            stored = math.ceil(layers_per_chunk / n) * layer_input
        return chunks * stored + n * per_layer + layer_input  # + one group recomputed in backward
    return chunks * layers_per_chunk * per_layer + layer_input  # + embedding output / received input


def estimate_role(
    m: ModelConfig,
    *,
    role: str = "actor",
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    dp: int = 1,
    expert_dp: int = 1,
    dtype: str = "bfloat16",
    trainable: bool = True,
    optimizer: str = "adam",
    distributed_optimizer: bool = False,
    sequence_parallel: bool = True,
    micro_batch_size: int = 1,
    seq_length: int = 1024,
    response_length: int = 512,
    num_microbatches: int = 1,
    recompute: Optional[dict] = None,
    logprob_chunk_size: int = 1024,
    max_token_len: Optional[int] = None,
    stage_layers: Optional[Sequence[int]] = None,
    lora: Any = None,
    optimizer_overrides: Optional[Mapping[str, Any]] = None,
) -> RoleMemory:
    """Per-rank memory of ``role`` under one layout for micro-batches of ``micro_batch_size``
    sequences of ``seq_length`` tokens (``response_length`` of them scored), or of ``max_token_len``
    tokens (a token budget: every one may be scored). ``stage_layers``: decoder layers per pipeline
    stage of an uneven split (``parallel.config.pipeline_stage_layers``); None = ``L / PP`` each.
    ``lora``: a ``config.lora_config.LoRAConfig`` with ``rank > 0`` trains only the adapters (module docstring).
    ``optimizer_overrides``: ``optim.override_optimizer_config`` (Megatron ``OptimizerConfig`` fields); its
    CPU-offload and precision-aware fields set the optimizer's GPU bytes (``optimizer_gpu_bytes_per_param``)."""
    etp = etp or tp
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not allowed; choose one of {sorted(DTYPE_BYTES)}")
    value_head = role in ("critic", "reward")
    sp = sequence_parallel and tp > 1 or (m.is_moe and tp > 1)
    e = DTYPE_BYTES[dtype]
    frozen = lora is not None and lora.enabled  # LoRA: the base trains nothing, the adapters everything
    if frozen:
        dense, expert, a_dense, a_expert, a_e = _lora_stage(
            m, lora, e, tp=tp, pp=pp, ep=ep, etp=etp, value_head=value_head, stage_layers=stage_layers
        )
    else:
        dense, expert = count_params(m, tp=tp, pp=pp, ep=ep, etp=etp, value_head=value_head, stage_layers=stage_layers)
        a_dense = a_expert = 0
        a_e = e
    n_params = dense + expert
    param_bytes = n_params * e + (a_dense + a_expert) * a_e
    grad_bytes = opt_bytes = 0
    if trainable:
        t_dense, t_expert, t_e = (a_dense, a_expert, a_e) if frozen else (dense, expert, e)
        grad_bytes = (t_dense + t_expert) * 4
        per_param = optimizer_gpu_bytes_per_param(optimizer, t_e, optimizer_overrides)
        if distributed_optimizer:
            opt_bytes = math.ceil(t_dense * per_param / (dp * cp)) + math.ceil(t_expert * per_param / expert_dp)
        else:
            opt_bytes = (t_dense + t_expert) * per_param

    # -- activations and scratch, per pipeline stage; the plan keeps the worst stage ---------
    if max_token_len is not None and max_token_len < 1:
        raise ValueError(f"max_token_len={max_token_len!r} must be >= 1 (or None)")
    full_tokens = max_token_len if max_token_len is not None else micro_batch_size * seq_length
    tokens = full_tokens / cp
    per_layer = layer_activation_elements(m, tp=tp, etp=etp, sequence_parallel=sp, act_bytes=e) * tokens * e
    if trainable and (recompute or {}).get("recompute_granularity") == "selective":
        per_layer -= m.num_attention_heads / tp * m.head_dim * tokens * e  # core attention output recomputed
    layer_input = m.hidden_size * tokens / (tp if sp else 1) * e
    vocab_local = padded_vocab_size(m.vocab_size, tp, m.make_vocab_size_divisible_by) // tp
    if value_head:
        head = full_tokens * 4 * 2
    else:
        if max_token_len is not None:
            scored = max_token_len / cp
        else:
            scored = micro_batch_size * (response_length if cp == 1 else seq_length) / cp
        head = 2 * min(scored, logprob_chunk_size) * vocab_local * 4 + scored * m.hidden_size * e
        if trainable and not frozen:
            head += vocab_local * m.hidden_size * e  # output-layer weight gradient before it joins the buffer
    f = (m.moe_ffn_hidden_size or m.ffn_hidden_size) * (m.moe_router_topk if m.is_moe else 1)
    layer_backward = (2 * f / (etp if m.is_moe else tp) + m.hidden_size) * tokens * e if trainable else 0
    best = (0, 0)
    for stage in range(pp):
        acts = _stage_activations(
            m,
            stage,
            pp,
            vpp,
            num_microbatches if trainable else 1,
            per_layer,
            layer_input,
            trainable,
            recompute,
            stage_layers,
        )
        # forward only: one layer's intermediates live at a time, never together with the head's logits
        scratch = max(head if stage == pp - 1 else 0, layer_backward if trainable else per_layer)
        if acts + scratch > sum(best):
            best = (acts, scratch)
    activations, transient = best
    return RoleMemory(
        role=role,
        params_dense=dense,
        params_expert=expert,
        param_bytes=int(param_bytes),
        grad_bytes=int(grad_bytes),
        optimizer_bytes=int(opt_bytes),
        activation_bytes=int(activations),
        transient_bytes=int(transient),
        params_adapter=int(a_dense + a_expert),
    )


def _lora_stage(
    m: ModelConfig,
    lora: Any,
    e: int,
    *,
    tp: int,
    pp: int,
    ep: int,
    etp: int,
    value_head: bool,
    stage_layers: Optional[Sequence[int]],
) -> tuple[int, int, int, int, int]:
    """``(base dense, base expert, adapter dense, adapter expert, adapter bytes per parameter)`` of the pipeline
    stage whose base + adapters (+ the adapters' gradients and Adam state) weigh most on one rank."""
    from megatron_rl.planner.lora_sizes import adapter_params

    a_e = DTYPE_BYTES[_LORA_DTYPES.get(lora.dtype, lora.dtype)] if lora.dtype else e
    adapters = adapter_params(m, lora, tp=tp, pp=pp, ep=ep, etp=etp, stage_layers=stage_layers)
    best = None
    for s in range(pp):
        base = count_params(m, tp=tp, pp=pp, ep=ep, etp=etp, stage=s, value_head=value_head, stage_layers=stage_layers)
        weight = sum(base) * e + sum(adapters[s]) * (a_e + 16)
        if best is None or weight > best[0]:
            best = (weight, *base, *adapters[s])
    return (*best[1:], a_e)


_LORA_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``lora.dtype``'s short spellings (verl accepts both)."""
