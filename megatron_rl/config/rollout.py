"""Rollout configs with verl's ``actor_rollout_ref.rollout`` keys: sampling, validation sampling
(``val_kwargs``), the weight-sync transport (``checkpoint_engine``) and multi-turn agent sessions
(``multi_turn``, ``agent``; ``megatron_rl.rollout.agent``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megatron_rl.config.base_config import ROLLOUT_ENGINES, BaseConfig, check_built, check_choice, check_range

__all__ = [
    "RolloutConfig",
    "SamplingConfig",
    "WeightSyncConfig",
    "MultiTurnConfig",
    "AgentLoopConfig",
    "TRANSPORTS",
    "PROMPT_TOO_LONG",
    "QUANTIZATIONS",
    "TOOL_CALL_FORMATS",
    "TRUNCATE_SIDES",
    "SANITY_CHECK_MODES",
    "check_sampling",
]

TRANSPORTS = ("colocated", "bytes", "shm", "broadcast", "nccl", "cuda_ipc")
PROMPT_TOO_LONG = ("error", "truncate_left")
TOOL_CALL_FORMATS = ("hermes",)
"""``multi_turn.format`` values (the tool-call parsers of ``megatron_rl.rollout.agent.parser``)."""
TRUNCATE_SIDES = ("left", "right", "middle")
SANITY_CHECK_MODES = ("strict", "ignore_strippable", "disable")
QUANTIZATIONS = ("fp8",)
"""``rollout.quantization`` values besides None: ``fp8`` is DeepSeek-V3's block FP8 (verl's
``quantization: fp8``; ``megatron_rl.rollout.fp8_engine.fp8_engine_kwargs``)."""


@dataclass
class SamplingConfig(BaseConfig):
    """Sampling for validation (verl's ``rollout.val_kwargs``); greedy by default as in verl's yaml."""

    temperature: float = 0.0
    """Softmax temperature; 0 is greedy."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    top_p: float = 1.0
    """Nucleus mass to keep; 1 keeps all."""
    do_sample: bool = False
    """False forces greedy decoding whatever temperature/top_k/top_p say."""
    n: int = 1
    """Samples per prompt."""

    def __post_init__(self):
        check_sampling(self, "val_kwargs.")


@dataclass
class WeightSyncConfig(BaseConfig):
    """How trained weights reach the engine (verl's ``rollout.checkpoint_engine``)."""

    backend: str = "colocated"
    """Transport: ``colocated`` (tensors by reference, in-process engine), ``bytes``
    (safetensors blob through the RPC), ``shm`` (safetensors file under ``shm_dir``),
    ``broadcast`` (side-band gloo group), ``nccl`` (GPU to GPU over an NCCL group: engines on
    other GPUs) or ``cuda_ipc`` (CUDA IPC handles: engines on the actor's GPU); the last two need CUDA."""
    update_weights_bucket_megabytes: float = 2048
    """Upper bound of one bucket in MiB, and of any single piece: a larger tensor travels as row
    pieces; an expert's tensors are never split, so the bound must hold one expert shard."""
    shm_dir: str = "/dev/shm"
    """Directory of the ``shm`` transport's bucket files (a tmpfs)."""

    def __post_init__(self):
        check_choice("checkpoint_engine.backend", self.backend, TRANSPORTS)
        check_range(
            "checkpoint_engine.update_weights_bucket_megabytes",
            self.update_weights_bucket_megabytes,
            low=0,
            low_inclusive=False,
        )


@dataclass
class MultiTurnConfig(BaseConfig):
    """Multi-turn agent sessions with tool calls (verl's ``rollout.multi_turn``)."""

    enable: bool = False
    """Roll out agent sessions (``megatron_rl.rollout.agent``) instead of one completion per prompt."""
    max_assistant_turns: Optional[int] = None
    """Model turns per session; None = bounded only by ``response_length``."""
    max_user_turns: Optional[int] = None
    """Tool (observation) turns per session; None = unbounded."""
    tool_config_path: Optional[str] = None
    """verl's tool-config YAML (``tools: [{class_name, config, tool_schema}]``), or the name of a
    built-in one (``calculator``, ``code_interpreter``, ``calculator_and_code``); None = no tools."""
    max_parallel_calls: int = 1
    """Tool calls executed per model turn (further calls in the same turn are dropped)."""
    max_tool_response_length: int = 256
    """Characters of a tool's response kept in the observation."""
    tool_response_truncate_side: str = "middle"
    """Which part of a longer tool response is kept: ``left`` (its end), ``right`` (its start) or
    ``middle`` (start and end), with verl's ``(truncated)`` markers."""
    tokenization_sanity_check_mode: str = "strict"
    """Compare each finished session's tokens with a re-tokenisation of its transcript (the trainer
    always trains on the generated ids): ``strict`` (token ids), ``ignore_strippable`` (text up to
    whitespace) or ``disable``; mismatches are counted (``agent/tokenization_mismatch_rate``) and warned."""
    format: str = "hermes"
    """Tool-call format the model emits: ``hermes`` (Qwen's ``<tool_call>{json}</tool_call>``)."""

    def __post_init__(self):
        for key in ("max_assistant_turns", "max_user_turns"):
            if getattr(self, key) is not None:
                check_range(f"multi_turn.{key}", getattr(self, key), low=1)
        check_range("multi_turn.max_parallel_calls", self.max_parallel_calls, low=1)
        check_range("multi_turn.max_tool_response_length", self.max_tool_response_length, low=1)
        check_choice("multi_turn.tool_response_truncate_side", self.tool_response_truncate_side, TRUNCATE_SIDES)
        check_choice(
            "multi_turn.tokenization_sanity_check_mode", self.tokenization_sanity_check_mode, SANITY_CHECK_MODES
        )
        check_choice("multi_turn.format", self.format, TOOL_CALL_FORMATS)


@dataclass
class AgentLoopConfig(BaseConfig):
    """The agent loop that runs the sessions (verl's ``rollout.agent``)."""

    num_workers: int = 8
    """Threads that execute the sessions' tool calls concurrently (verl: agent-loop worker actors;
    here the sessions of a step advance together against one engine, and tools run in threads)."""
    default_agent_loop: str = "single_turn_agent"
    """Agent loop of every session: ``single_turn_agent``, ``tool_agent`` or one registered by
    ``agent_loop_config_path``."""
    agent_loop_config_path: Optional[str] = None
    """YAML list of ``{name, _target_}`` (``module.Class``, an ``AgentLoop`` subclass) registering
    custom agent loops (verl's format)."""

    def __post_init__(self):
        check_range("agent.num_workers", self.num_workers, low=1)
        if not self.default_agent_loop:
            raise ValueError("agent.default_agent_loop must name an agent loop, got an empty string")


@dataclass
class RolloutConfig(BaseConfig):
    """vLLM rollout settings, with verl's ``actor_rollout_ref.rollout`` key names."""

    name: str = "vllm"
    """Rollout engine; only ``vllm`` here."""
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature; the actor must use the same one for its log-probs."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    top_p: float = 1.0
    """Nucleus mass to keep; 1 keeps all."""
    do_sample: bool = True
    """False makes training rollouts greedy."""
    repetition_penalty: float = 1.0
    """vLLM repetition penalty (1 = off)."""
    prompt_length: int = 512
    """Width of the left-padded ``prompts``; longer prompts follow ``prompt_too_long``."""
    response_length: int = 512
    """Maximum new tokens, and the width of ``responses``."""
    prompt_too_long: str = "error"
    """``error``: ValueError naming the prompt; ``truncate_left``: keep its last tokens."""
    stop: Optional[list[str]] = None
    """Stop strings (the tokens that complete one stay in the response)."""
    stop_token_ids: Optional[list[int]] = None
    """Extra stop tokens besides eos (kept in the response, like eos)."""
    ignore_eos: bool = False
    """Keep generating past eos (benchmarks)."""
    calculate_log_probs: bool = True
    """Return ``rollout_log_probs`` (verl's yaml default)."""
    logprobs_mode: str = "processed_logprobs"
    """vLLM's log-prob source: ``processed_logprobs`` matches the actor's
    ``log_softmax(logits / temperature)``; ``raw_logprobs`` ignores temperature."""
    dtype: str = "auto"
    """Engine dtype; ``auto`` = float32 on CPU (bf16 drifts from HF after ~10 tokens), bfloat16 on GPU."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor parallel size (independent of training's layout)."""
    data_parallel_size: int = 1
    """vLLM data-parallel ranks inside one engine; an engine is TP x DP x PP GPUs
    (``megatron_rl.utils.engine_map``: replicas = the rollout's GPUs / engine size)."""
    pipeline_model_parallel_size: int = 1
    """vLLM pipeline stages inside one engine (GPU only)."""
    expert_parallel_size: int = 1
    """vLLM expert parallelism over the engine's TP x DP ranks: 1 (off) or TP x DP, as verl requires."""
    num_replicas: Optional[int] = None
    """Engines on CPU (this project's key; there are no GPUs to divide): None = 1. On GPUs the count is
    the arithmetic's (GPUs / engine size) and a different value here is refused."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (GPU only)."""
    kv_cache_space_gib: int = 1
    """KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``); vLLM's own default takes half the RAM."""
    enforce_eager: Optional[bool] = None
    """Disable torch.compile/CUDA graphs; None = eager on CPU, graphs on GPU."""
    free_cache_engine: bool = True
    """On GPU, let ``sleep()`` release weights and KV cache while training runs."""
    max_model_len: Optional[int] = None
    """Engine context length; None = prompt_length + response_length."""
    max_num_seqs: int = 1024
    """Sequences decoded concurrently."""
    max_num_batched_tokens: int = 8192
    """Tokens per engine step (raised to max_model_len if smaller)."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (the cache is reset after every weight sync)."""
    enable_chunked_prefill: bool = True
    """Split long prefills across steps."""
    load_format: str = "auto"
    """``auto`` loads the checkpoint; ``dummy`` starts from random weights (first sync fills them)."""
    seed: int = 42
    """Engine seed."""
    quantization: Optional[str] = None
    """Rollout weights in the engine: None = ``dtype``; ``fp8`` = DeepSeek-V3's block FP8 (verl's key):
    every attention / MLP / expert projection float8_e4m3fn with a float32 scale per 128x128 block,
    router gates, embeddings, norms and the head in ``dtype``; the weight sync quantises on the actor
    side (``megatron_rl.rollout.weight_stream.quantize_fp8_stream``). GPU only (vLLM's CPU FP8 kernels need AMX)."""
    nnodes: int = 0
    """Nodes of the rollout's own resources; 0 = colocated with the trainer (verl's default). With
    ``trainer.v1.trainer_mode=separate_async``: >= 1 (on CPU: 1, the rollout's own process)."""
    n_gpus_per_node: int = 1
    """Devices per rollout node when ``nnodes`` >= 1 (on CPU: the CPUs given to the rollout's process)."""
    in_process_engine: bool = True
    """Run the engine core in this process (fast start; required by ``colocated`` sync)."""
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling used by ``generate(..., validate=True)``."""
    checkpoint_engine: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weight-sync transport and bucket size."""
    engine_kwargs: dict = field(default_factory=dict)
    """Extra ``vllm.LLM`` arguments under ``engine_kwargs.vllm`` (verl's layout)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn agent sessions with tool calls."""
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    """The agent loop running the sessions."""

    def __post_init__(self):
        if isinstance(self.val_kwargs, Mapping):
            self.val_kwargs = SamplingConfig.from_dict(self.val_kwargs, path="val_kwargs")
        if isinstance(self.checkpoint_engine, Mapping):
            self.checkpoint_engine = WeightSyncConfig.from_dict(self.checkpoint_engine, path="checkpoint_engine")
        if isinstance(self.multi_turn, Mapping):
            self.multi_turn = MultiTurnConfig.from_dict(self.multi_turn, path="multi_turn")
        if isinstance(self.agent, Mapping):
            self.agent = AgentLoopConfig.from_dict(self.agent, path="agent")
        check_built("rollout.name", self.name, ROLLOUT_ENGINES, "rollout engines")
        check_sampling(self, "rollout.")
        for key in (
            "prompt_length",
            "response_length",
            "tensor_model_parallel_size",
            "max_num_seqs",
            "kv_cache_space_gib",
            "data_parallel_size",
            "pipeline_model_parallel_size",
            "expert_parallel_size",
        ):
            check_range(f"rollout.{key}", getattr(self, key), low=1)
        if self.num_replicas is not None:
            check_range("rollout.num_replicas", self.num_replicas, low=1)
        tp_dp = self.tensor_model_parallel_size * self.data_parallel_size
        if self.expert_parallel_size > 1 and self.expert_parallel_size != tp_dp:
            raise ValueError(
                f"rollout.expert_parallel_size={self.expert_parallel_size} must equal "
                f"tensor_model_parallel_size x data_parallel_size = {tp_dp} (vLLM's expert parallelism "
                "spans the engine's TP x DP ranks, as verl requires), or be 1"
            )
        check_choice("rollout.prompt_too_long", self.prompt_too_long, PROMPT_TOO_LONG)
        check_choice("rollout.logprobs_mode", self.logprobs_mode, ("processed_logprobs", "raw_logprobs"))
        check_choice("rollout.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        check_choice("rollout.quantization", self.quantization, (None, *QUANTIZATIONS))
        check_range("rollout.gpu_memory_utilization", self.gpu_memory_utilization, low=0, high=1, low_inclusive=False)
        if self.max_model_len is not None and self.max_model_len < self.prompt_length + self.response_length:
            raise ValueError(
                f"rollout.max_model_len={self.max_model_len} is smaller than prompt_length + response_length = "
                f"{self.prompt_length + self.response_length}"
            )
        unknown = set(self.engine_kwargs) - {"vllm", "sglang"}
        if unknown:
            raise ValueError(
                f"rollout.engine_kwargs has unknown engine(s) {sorted(unknown)}; allowed: ['vllm', 'sglang']"
            )


def check_sampling(cfg: Any, prefix: str) -> None:
    check_range(f"{prefix}n", cfg.n, low=1)
    check_range(f"{prefix}temperature", cfg.temperature, low=0)
    check_range(f"{prefix}top_p", cfg.top_p, low=0, high=1, low_inclusive=False)
    check_range(f"{prefix}top_k", cfg.top_k, low=-1)  # -1 and 0 both keep all tokens
