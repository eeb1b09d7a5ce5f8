"""The memory traffic of a Megatron pass outside its matrix products: what the step-time model adds to a
pass's GEMM time for the element-wise work of every layer (norms, rotary embedding, attention's inputs and
outputs, residual adds, the gated MLP's activation, MoE's permutes) and of the log-prob head.

The GEMMs of a layer are compute-bound and their operands move inside the kernels; every other operator of
a layer reads its inputs from memory and writes its output back, one after the other on the same stream (on
a GPU) or core (on a CPU), so it adds ``bytes / bandwidth`` to the pass instead of hiding under the GEMMs.
How many bytes depends on which kernels run, so there are two counts, per token of a layer's forward, in
elements of the activation dtype, each read or written once:

* ``fused=False`` -- Megatron's local spec as this project runs it on a CPU (``attention_backend: sdpa``):
  torch's RMSNorm is composite (``pow``, ``mean``, ``mul`` by the reciprocal, ``mul`` by the weight: 7 widths
  per norm), the rotary embedding is Megatron's unfused ``_apply_rotary_pos_emb_bshd`` (two ``mul``, the
  rotated half's ``neg`` and ``cat``, an ``add``, the pass-through ``cat``: 12 widths of each of ``q`` and
  ``k``, plus ``cos``/``sin`` of the frequencies), packed attention's per-row outputs are concatenated and
  transposed back (4 widths of ``q``), the QKV split copies keys and values (``clone``), bias-dropout-add is
  3 widths of ``h``, and the SwiGLU is ``silu``, an add and a ``mul`` (7 widths of its half). Counted from the
  operators a real forward dispatches (``tests/megatron_rl/planner/test_activation_traffic.py`` counts them
  with a ``TorchDispatchMode`` on the toy model and holds the formula to that count).
* ``fused=True`` -- TransformerEngine's spec on a GPU: the norms run once each (``LayerNormLinear`` /
  ``LayerNormMLP``: read and write), rotary embedding is one fused kernel over ``q`` and ``k``, flash attention
  reads ``q, k, v`` and writes its output, bias-dropout-add is fused, SwiGLU is one kernel (read ``2f``, write
  ``f``). Counted from which kernels TE launches, not measured (no GPU run of this project profiled them).

A backward moves about twice a forward's bytes (each operator reads its saved inputs and the output's
gradient and writes the input's gradient): a training pass counts 3x, as its FLOPs do; the toy's update moves
3.1x its forward's bytes in the dispatch count. MoE layers add the router's scores and the permute /
unpermute of ``topk`` copies of each token (TE's fused permute moves each copy once each way; the local
spec's permute is an ``index_select``, its unpermute a ``scatter_add_`` of the copies with their int64 index,
and each routed copy is scaled by its probability: 2 more widths).
"""

from __future__ import annotations

from megatron_rl.config.model import ModelConfig

__all__ = ["layer_elements", "head_elements", "norm_widths", "NORM_WIDTHS"]

NORM_WIDTHS = {False: {"RMSNorm": 7, "LayerNorm": 2}, True: {"RMSNorm": 2, "LayerNorm": 2}}
"""Widths of the normalised tensor a norm moves: torch's composite RMSNorm 7 (``pow`` 2, ``mean`` 1, two
``mul`` 2 each), ``native_layer_norm`` 2; a fused (TE) norm reads and writes once."""


def norm_widths(m: ModelConfig, *, fused: bool) -> int:
    """``NORM_WIDTHS`` of ``m``'s norm (another kind: read and write once)."""
    return NORM_WIDTHS[fused].get(m.normalization, 2)


def _head_widths(m: ModelConfig) -> tuple[int, int, int]:
    """``(q, k, head_dim)``: query and key widths of all heads (MLA: its query / key head width on every head)."""
    if getattr(m, "multi_latent_attention", False):
        d = m.qk_head_dim + m.qk_pos_emb_head_dim
        return m.num_attention_heads * d, m.num_attention_heads * d, d
    d = m.head_dim
    return m.num_attention_heads * d, (m.num_query_groups or m.num_attention_heads) * d, d


def layer_elements(m: ModelConfig, *, tp: int = 1, sequence_parallel: bool = False, fused: bool, moe: bool) -> float:
    """Elements one rank moves per token it computes (a ``tokens / (dp x tp x cp)`` share, the GEMMs'
    basis) in one decoder layer's forward, outside the GEMMs. Head-sized widths (``q``, ``k``, the MLP) are
    split over TP; hidden-sized ones (norms, residual adds) are too with sequence parallelism, else every TP
    rank repeats them for the whole group's tokens; every rank computes the rotary frequencies of them all."""
    h = m.hidden_size
    q, k, d = _head_widths(m)
    norm = norm_widths(m, fused=fused)
    hidden = (2 * norm + 2 * 3) * h  # the two pre-norms, the two residual adds (read 2, write 1)
    qk_norm = norm * (q + k) if m.qk_layernorm else 0
    if fused:
        heads = qk_norm + 2 * (q + k) + 2 * (q + k)  # qk-norm, fused rope, flash attention's io
        freqs = 0
    else:
        # clone of k / v out of the QKV split (4k); qk-norm; rope 12 widths of q and k; SDPA's io (2q + 2k);
        # the rows' cat and the transpose back (4q); rope's cos / sin / mul of the [t, d] frequencies (20d)
        heads = 4 * k + qk_norm + 12 * (q + k) + 2 * (q + k) + 4 * q
        freqs = 20 * d
    glu = (3 if fused else 7) if m.swiglu else 2  # SwiGLU: one kernel (2f in, f out) / silu, add, mul
    if moe and m.is_moe:
        topk, ffn = m.moe_router_topk, m.moe_ffn_hidden_size or m.ffn_hidden_size
        shared = m.moe_shared_expert_intermediate_size or 0
        if fused:  # TE's fused permute and unpermute: each copy written once and read once, each way
            hidden += (2 + 2 * topk) * h
            mlp = glu * (topk * ffn + shared)
        else:
            # permute (index_select: read h, write topk copies), the experts' outputs concatenated (2 topk h),
            # unpermute (zeros h, scatter_add_: read-modify-write h, read the copies and their int64 index)
            hidden += (1 + topk) * h + 2 * topk * h + h + (2 + 3 * topk) * h
            mlp = (glu + 2) * topk * ffn + glu * shared  # each routed copy is also scaled by its probability
        hidden += 4 * m.num_moe_experts  # the router's scores, softmax and top-k
    else:
        mlp = glu * m.ffn_hidden_size
    return hidden * (1 if sequence_parallel else tp) + freqs * tp + heads + mlp


def head_elements(m: ModelConfig, *, fused: bool) -> float:
    """Elements the log-prob head moves per scored token, on ``layer_elements``'s basis, outside its GEMM: the
    vocab-parallel log-softmax -- ``amax``, the target's ``gather``, ``sub``, ``exp``, ``sum`` (7 widths unfused;
    a fused kernel reads the logits twice: 2). Each TP rank scores every token of its group over ``V / tp``
    logits, so per token of the GEMMs' ``tokens / tp`` basis it is the whole ``V``. (The final norm, on every
    token, is ``megatron_passes``'.)"""
    return (2 if fused else 7) * m.vocab_size
