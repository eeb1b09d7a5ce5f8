"""How a Megatron model is spread over ranks: a typed, validated parallel layout.

``ParallelConfig`` holds the model-parallel sizes with Megatron's (and verl's) names; data
parallelism is whatever remains of the world. ``validate(world_size, num_layers=..., ...)``
checks a layout against a world size and a model *before* any process group exists and raises
a ``ValueError`` that names the numbers, so a bad recipe fails in a dry run rather than minutes
into start-up on a cluster.

Rank layout follows Megatron-Core's default order ``tp-cp-ep-dp-pp``:
    dense part:  world = TP * CP * DP * PP
    expert part: world = ETP * EP * EDP * PP     (ETP defaults to TP)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

__all__ = [
    "ACCOUNT_FOR_PIPELINE_FIELDS",
    "ParallelConfig",
    "UNEVEN_PIPELINE_FIELDS",
    "pipeline_stage_layers",
    "uneven_pipeline_fields",
]

UNEVEN_PIPELINE_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
"""Megatron ``TransformerConfig`` fields of an uneven pipeline split (verl sets them through
``megatron.override_transformer_config``, e.g. DeepSeek-V3's 61 layers as 13 + 4 x 12)."""

ACCOUNT_FOR_PIPELINE_FIELDS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
"""Megatron ``TransformerConfig`` flags that count the embedding (the loss) as one layer of the first
(last) pipeline stage, so ``num_layers + 1`` (``+ 2`` with both) is split evenly: verl's Qwen3-235B
script places its 94 layers at PP=8 as 11 + 6 x 12 + 11."""

_SIZE_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "context_parallel_size",
)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an int >= 1")


def uneven_pipeline_fields(overrides: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The pipeline-split fields set in ``overrides`` (TransformerConfig fields): the uneven counts
    that are not None and the ``account_for_*`` flags that are not None or False -- the keyword
    arguments of ``pipeline_stage_layers`` and ``ParallelConfig.validate``."""
    overrides = overrides or {}
    fields = {k: overrides[k] for k in UNEVEN_PIPELINE_FIELDS if overrides.get(k) is not None}
    fields.update({k: overrides[k] for k in ACCOUNT_FOR_PIPELINE_FIELDS if overrides.get(k) not in (None, False)})
    return fields


def _accounted_stage_layers(
    num_layers: int, pp: int, vpp: int, embedding: bool, loss: bool, key: str
) -> tuple[int, ...]:
    """``pipeline_stage_layers`` with the embedding (loss) counted as a layer of the first (last) stage,
    as Megatron-Core's ``get_num_layers_to_build``: ``num_layers + embedding + loss`` over PP (and each
    stage's share over VPP), then one fewer decoder layer in the first (last) model chunk."""
    on = " and ".join(
        f"{key}.{name}=True" for name, value in zip(ACCOUNT_FOR_PIPELINE_FIELDS, (embedding, loss)) if value
    )
    counted = num_layers + embedding + loss
    if counted % pp:
        what = " and ".join(n for n, v in (("the embedding", embedding), ("the loss", loss)) if v)
        raise ValueError(
            f"{on} count{'' if embedding + loss == 2 else 's'} {what} as "
            f"{'one layer each' if embedding + loss == 2 else 'a layer'}: num_layers + {embedding + loss} = "
            f"{counted} is not divisible by pipeline_model_parallel_size={pp}"
        )
    per_stage = counted // pp
    if per_stage % vpp:
        raise ValueError(
            f"{on}: (num_layers + {embedding + loss}) / pipeline_model_parallel_size = {counted}/{pp} = "
            f"{per_stage} layers per stage is not divisible by virtual_pipeline_model_parallel_size={vpp}"
        )
    chunks = [[per_stage // vpp] * vpp for _ in range(pp)]
    chunks[0][0] -= embedding
    chunks[-1][-1] -= loss
    if min(min(c) for c in chunks) < 1:
        raise ValueError(
            f"{on} leave{'s' if embedding + loss == 1 else ''} a pipeline stage"
            f"{' (model chunk)' if vpp > 1 else ''} of num_layers={num_layers} at "
            f"pipeline_model_parallel_size={pp}{f' x virtual_pipeline_model_parallel_size={vpp}' if vpp > 1 else ''} "
            "without a decoder layer; a stage without one is not built here (use a smaller PP or VPP)"
        )
    return tuple(sum(c) for c in chunks)


def pipeline_stage_layers(
    num_layers: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    *,
    num_layers_in_first_pipeline_stage: Optional[int] = None,
    num_layers_in_last_pipeline_stage: Optional[int] = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
    key: str = "megatron.override_transformer_config",
) -> tuple[int, ...]:
    """Decoder layers on each pipeline stage, first to last, as Megatron-Core builds them.

    Without the uneven fields every stage holds ``num_layers / PP``; with them the first (last)
    stage holds the given count and the stages between share the rest evenly (Megatron's
    ``get_num_layers_to_build``). Under VPP each stage's count must split into its model chunks.
    ``account_for_embedding/loss_in_pipeline_split`` count the embedding (loss) as one layer of the
    first (last) stage: ``num_layers + 1`` (``+ 2``) splits evenly over PP (x VPP) and that stage
    builds one decoder layer fewer; they cannot be combined with the uneven counts (Megatron refuses).
    ``ValueError`` naming the field (under ``key``), its value and what is allowed otherwise.
    """
    pp, vpp = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    ends = {"first": num_layers_in_first_pipeline_stage, "last": num_layers_in_last_pipeline_stage}
    accounted = dict(
        zip(ACCOUNT_FOR_PIPELINE_FIELDS, (account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split))
    )
    for name, value in accounted.items():
        if not isinstance(value, bool):
            raise ValueError(f"{key}.{name}={value!r} is not allowed; it must be true or false")
    if any(accounted.values()):
        if any(v is not None for v in ends.values()):
            set_ = ", ".join(
                f"{key}.num_layers_in_{end}_pipeline_stage={v}" for end, v in ends.items() if v is not None
            )
            on = ", ".join(f"{key}.{name}=True" for name, value in accounted.items() if value)
            raise ValueError(
                f"{set_} cannot be combined with {on} (Megatron-Core refuses both); set either the "
                "stage counts or the account_for_* flags"
            )
        return _accounted_stage_layers(
            num_layers, pp, vpp, account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split, key
        )
    if all(v is None for v in ends.values()):
        if num_layers % (pp * vpp):
            what = (
                f"pipeline_model_parallel_size * virtual_pipeline_model_parallel_size = {pp}*{vpp} = {pp * vpp}"
                if vpp > 1
                else f"pipeline_model_parallel_size={pp}"
            )
            raise ValueError(f"num_layers={num_layers} is not divisible by {what}")
        return (num_layers // pp,) * pp
    for end, value in ends.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"{key}.num_layers_in_{end}_pipeline_stage={value!r} is not allowed; it must be an int >= 1 or null"
            )
    set_ = ", ".join(f"{key}.num_layers_in_{end}_pipeline_stage={v}" for end, v in ends.items() if v is not None)
    if pp < 2:
        raise ValueError(f"{set_} needs pipeline_model_parallel_size > 1, got {pp}; unset it for one stage")
    middle_stages = pp - sum(v is not None for v in ends.values())
    middle_layers = num_layers - sum(v or 0 for v in ends.values())
    if middle_stages == 0 and middle_layers != 0:
        raise ValueError(
            f"{set_} place {num_layers - middle_layers} of num_layers={num_layers} layers on the "
            f"pipeline_model_parallel_size={pp} stages; the counts must add up to {num_layers}"
        )
    if middle_stages and (middle_layers < middle_stages or middle_layers % middle_stages):
        raise ValueError(
            f"{set_} leave {middle_layers} of num_layers={num_layers} layers for the {middle_stages} "
            f"middle stage(s) of pipeline_model_parallel_size={pp}: they must share them evenly, at "
            "least one layer each"
        )
    per_middle = middle_layers // middle_stages if middle_stages else 0
    stages = tuple(
        [ends["first"] if ends["first"] is not None else per_middle]
        + [per_middle] * (pp - 2)
        + [ends["last"] if ends["last"] is not None else per_middle]
    )
    if vpp > 1 and any(n % vpp for n in stages):
        raise ValueError(
            f"{set_} give pipeline stages of {list(stages)} layers; with "
            f"virtual_pipeline_model_parallel_size={vpp} each must be divisible by {vpp}"
        )
    return stages


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes of one Megatron model; data parallel = what remains of the world."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that split each weight matrix (attention heads, MLP columns, vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """PP: ranks that each hold a contiguous slice of the layers (pipeline stages)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """VPP: model chunks per pipeline rank for the interleaved 1F1B schedule; ``None`` = no
    interleaving. Needs PP > 1 and num_layers divisible by PP * VPP. On gloo (CPU) PP=2 with VPP
    needs ``batch_p2p_comm=False`` (see ``parallel.cpu_compat``) and equal-length micro-batches:
    Megatron's shape exchange is always batched and pairs up crosswise when prev == next."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split the set of MoE experts (each holds num_experts / EP experts)."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP: tensor parallelism inside each expert; ``None`` = same as TP."""
    context_parallel_size: int = 1
    """CP: ranks that split the sequence (ring attention; needs TransformerEngine attention)."""

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            _check_positive_int(name, getattr(self, name))
        if self.expert_tensor_parallel_size is not None:
            _check_positive_int("expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 2:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size={vpp!r} is not allowed; it must be None "
                    f"(no interleaving) or an int >= 2"
                )
            if self.pipeline_model_parallel_size < 2:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1, "
                    f"got pipeline_model_parallel_size={self.pipeline_model_parallel_size}"
                )

    # ---- mapping interface (reads like verl's DictConfig: cfg.get("key")) ----
    def get(self, key: str, default: Any = None) -> Any:
        """``getattr`` with a default, as on an OmegaConf ``DictConfig``."""
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> list[str]:
        """Field names."""
        return [f.name for f in dataclasses.fields(self)]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | Any | None) -> "ParallelConfig":
        """Build from a mapping/``DictConfig`` with Megatron's keys; unknown keys are errors."""
        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping) and hasattr(data, "items"):
            data = dict(data.items())
        if not isinstance(data, Mapping):
            raise TypeError(f"ParallelConfig.from_dict: expected a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown parallel config keys {unknown}; allowed keys: {sorted(names)}")
        return cls(**dict(data))

    # ---- derived sizes ----
    @property
    def effective_expert_tensor_parallel_size(self) -> int:
        """ETP with the ``None`` default resolved to TP."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """TP * PP * CP: ranks that together hold one copy of the dense model."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def sizes(self, world_size: int) -> dict[str, Optional[int]]:
        """All group sizes for ``world_size`` ranks (validates the world-size arithmetic only)."""
        self._check_world(world_size)
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        ep, etp = self.expert_model_parallel_size, self.effective_expert_tensor_parallel_size
        return {
            "world": world_size,
            "tp": tp,
            "pp": pp,
            "vpp": self.virtual_pipeline_model_parallel_size,
            "cp": cp,
            "dp": world_size // (tp * pp * cp),
            "ep": ep,
            "etp": etp,
            "expert_dp": world_size // (etp * ep * pp),
        }

    def _check_world(self, world_size: int) -> None:
        _check_positive_int("world_size", world_size)
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        if world_size % (tp * pp * cp):
            raise ValueError(
                f"world_size={world_size} is not divisible by tensor_model_parallel_size * "
                f"pipeline_model_parallel_size * context_parallel_size = {tp}*{pp}*{cp} = {tp * pp * cp}"
            )
        ep, etp = self.expert_model_parallel_size, self.effective_expert_tensor_parallel_size
        ranks_per_stage = world_size // pp
        if ranks_per_stage % (ep * etp):
            raise ValueError(
                f"expert_model_parallel_size * expert_tensor_parallel_size = {ep}*{etp} = {ep * etp} "
                f"does not divide the {ranks_per_stage} ranks of a pipeline stage "
                f"(world_size={world_size} / pipeline_model_parallel_size={pp})"
            )

    def validate(
        self,
        world_size: int,
        *,
        num_layers: Optional[int] = None,
        num_attention_heads: Optional[int] = None,
        num_query_groups: Optional[int] = None,
        num_experts: Optional[int] = None,
        seq_length: Optional[int] = None,
        num_microbatches: Optional[int] = None,
        sequence_parallel: bool = False,
        num_layers_in_first_pipeline_stage: Optional[int] = None,
        num_layers_in_last_pipeline_stage: Optional[int] = None,
        account_for_embedding_in_pipeline_split: bool = False,
        account_for_loss_in_pipeline_split: bool = False,
    ) -> dict[str, Optional[int]]:
        """Check this layout against ``world_size`` and (optionally) the model; return ``sizes()``.

        Raises ``ValueError`` naming the numbers for: a world size not divisible by TP*PP*CP or
        whose pipeline stage is not divisible by EP*ETP; heads or query groups that TP does not
        split (query groups may also divide TP, as Megatron allows); layers not divisible by PP
        (x VPP), or an uneven split (``num_layers_in_first/last_pipeline_stage``, see
        ``pipeline_stage_layers``) that does not add up, or ``num_layers`` + the embedding/loss counted
        by ``account_for_embedding/loss_in_pipeline_split`` not divisible by PP (x VPP); experts not divisible by EP; a sequence not divisible
        by 2*CP (Megatron's load-balanced CP split) or by TP*CP under sequence parallelism; and,
        for the interleaved schedule, a micro-batch count not divisible by PP. Touches no process
        group, so it can run in a dry run before ``init_mesh``.
        """
        sizes = self.sizes(world_size)
        tp, pp, cp = sizes["tp"], sizes["pp"], sizes["cp"]
        vpp, ep = sizes["vpp"], sizes["ep"]

        if num_attention_heads is not None:
            _check_positive_int("num_attention_heads", num_attention_heads)
            if num_attention_heads % tp:
                raise ValueError(
                    f"num_attention_heads={num_attention_heads} is not divisible by tensor_model_parallel_size={tp}"
                )
        if num_query_groups is not None:
            _check_positive_int("num_query_groups", num_query_groups)
            if num_query_groups % tp and tp % num_query_groups:
                raise ValueError(
                    f"num_query_groups={num_query_groups} must be a multiple or a divisor of "
                    f"tensor_model_parallel_size={tp}"
                )
            if num_attention_heads is not None and num_attention_heads % num_query_groups:
                raise ValueError(
                    f"num_attention_heads={num_attention_heads} is not divisible by num_query_groups={num_query_groups}"
                )
        if num_layers is not None:
            _check_positive_int("num_layers", num_layers)
            pipeline_stage_layers(
                num_layers,
                pp,
                vpp,
                num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
                num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
                account_for_embedding_in_pipeline_split=account_for_embedding_in_pipeline_split,
                account_for_loss_in_pipeline_split=account_for_loss_in_pipeline_split,
            )
        if num_experts is not None:
            _check_positive_int("num_experts", num_experts)
            if num_experts % ep:
                raise ValueError(f"num_experts={num_experts} is not divisible by expert_model_parallel_size={ep}")
        if seq_length is not None:
            _check_positive_int("seq_length", seq_length)
            if cp > 1 and seq_length % (2 * cp):
                raise ValueError(f"seq_length={seq_length} is not divisible by 2 * context_parallel_size = {2 * cp}")
            if sequence_parallel and seq_length % (tp * cp):
                raise ValueError(
                    f"seq_length={seq_length} is not divisible by tensor_model_parallel_size * "
                    f"context_parallel_size = {tp * cp} (sequence_parallel=True)"
                )
        if num_microbatches is not None:
            _check_positive_int("num_microbatches", num_microbatches)
            if vpp and num_microbatches % pp:
                raise ValueError(
                    f"num_microbatches={num_microbatches} is not divisible by "
                    f"pipeline_model_parallel_size={pp} (interleaved schedule, "
                    f"virtual_pipeline_model_parallel_size={vpp})"
                )
        return sizes
