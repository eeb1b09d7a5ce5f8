"""How an RL batch meets the model: padded rows (left alignment, response positions, CP shares)
and the model output a head or loss closure sees.

RL batches are ``[left-padded prompt | right-padded response]`` (verl's layout: ``input_ids``,
``attention_mask`` ``[b, s]``, ``responses`` ``[b, r]``). Packed (``use_remove_padding``, the
default) the rows become one THD sequence (``megatron_rl.engine.packing``). Padded, every row is
rotated so its valid tokens start at column 0 (plain causal attention is then exact, positions
are ``arange``), trimmed to the micro-batch's longest row and, under context parallelism, cut
into this CP rank's zigzag share; ``Layout`` remembers where the response tokens went.
``ModelOutput`` is what a head or loss closure sees of one micro-batch's forward pass: the final
hidden states and the vocab-sharded output weight (an LM head) or the per-token scalars (a scalar
head), with helpers that map them back to verl's ``[b, response_len]`` shapes -- the same calls
for both layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.context_parallel import gather_from_context_parallel, pad_length_for_context_parallel, zigzag_index

__all__ = ["left_align", "response_positions", "Layout", "ModelOutput", "prepare_inputs"]


def left_align(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate each row so its valid tokens start at column 0.

    RL batches are ``[left-padded prompt | right-padded response]``: the valid tokens of a row
    are contiguous. Left-aligned, plain causal attention is exact for every valid token and
    position ids are ``arange``. Returns ``(aligned_ids [b, s], shift [b])`` where ``shift`` is
    the number of leading pads.
    """
    b, s = input_ids.shape
    shift = (attention_mask.long().cumsum(-1) == 0).sum(-1)  # [b]
    index = (torch.arange(s, device=input_ids.device)[None, :] + shift[:, None]) % s
    return input_ids.gather(1, index), shift


def response_positions(shift: torch.Tensor, seq_len: int, response_len: int, max_pos: int) -> torch.Tensor:
    """Aligned positions whose outputs predict each response token: ``[b, response_len]``.

    Response token ``j`` sits at original column ``P + j`` (``P = seq_len - response_len``),
    i.e. aligned column ``P + j - shift``; it is predicted by the position before it.
    """
    prompt_len = seq_len - response_len
    j = torch.arange(response_len, device=shift.device)[None, :]
    return (prompt_len + j - shift[:, None] - 1).clamp(0, max_pos - 1)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one micro-batch's tokens sit in the model's input (left-aligned, trimmed, CP-split)."""

    positions: torch.Tensor
    """``[b, r]`` aligned positions whose outputs predict the response tokens."""
    seq_len: int
    """Length of the aligned, trimmed sequence (all CP shares together)."""
    cp_group: Any = None
    """The context-parallel group (None or size 1: the whole sequence is on this rank)."""
    cp_size: int = 1
    """Ranks sharing the sequence."""
    local_index: Optional[torch.Tensor] = None
    """CP only: ``[s/cp]`` aligned positions this rank holds (its zigzag share)."""
    local_labels: Optional[torch.Tensor] = None
    """CP only: ``[b, s/cp]`` the token each local position predicts."""

    def gather_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's per-position values ``[b, s/cp]`` -> the whole sequence's ``[b, s]``."""
        if self.cp_size == 1:
            return values
        return gather_from_context_parallel(values, self.cp_group, self.seq_len)

    def at_responses(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values ``[b, s/cp]`` -> ``[b, r]`` at the positions predicting the responses."""
        return self.gather_sequence(values).gather(1, self.positions)

    # -- what ``ModelOutput`` asks of a layout (``megatron_rl.engine.packing.PackedLayout`` too) --
    def response_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[b, r, h]`` hidden states at the positions that predict the response tokens."""
        b, r = self.positions.shape
        return hidden.gather(1, self.positions[..., None].expand(b, r, hidden.shape[-1]))

    def scored(self, hidden: torch.Tensor, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states to score and the token each predicts: ``([b, r, h], [b, r])``; under CP
        every local position (``[b, s/cp, h]``, ``[b, s/cp]``)."""
        if self.cp_size > 1:
            return hidden, self.local_labels
        return self.response_hidden(hidden), responses

    def to_responses(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores of ``scored`` -> ``[b, r, ...]``."""
        return scores if self.cp_size == 1 else self.at_responses(scores)

    def from_responses(self, values: torch.Tensor) -> torch.Tensor:
        """``[b, r, ...]`` per-response-token values in the scored order (here: unchanged)."""
        return values

    def response_values(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position scalars ``[b, s/cp]`` -> ``[b, r]``."""
        return self.at_responses(values)

    def sequence_values(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position scalars ``[b, s/cp]`` -> ``[b, s]`` (left-aligned rows, CP shares gathered)."""
        return self.gather_sequence(values)


@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """One micro-batch's forward pass, as a head or loss closure sees it (last pipeline stage).

    An LM-head engine fills ``hidden_states`` and ``output_weight`` (logits are never
    materialised for the whole sequence); a scalar-head engine fills ``values``.
    """

    layout: Any
    """Where the tokens sit: a padded ``Layout`` or a ``megatron_rl.engine.packing.PackedLayout``."""
    hidden_states: Optional[torch.Tensor] = None
    """LM head: ``[b, s/cp, h]`` final hidden states (after the final norm); packed ``[1, t/cp, h]``."""
    output_weight: Optional[torch.Tensor] = None
    """LM head: ``[vocab/tp, h]`` this TP rank's shard of the output (unembedding) weight."""
    values: Optional[torch.Tensor] = None
    """Scalar head: ``[b, s/cp]`` one float32 scalar per position; packed ``[1, t/cp]``."""
    vocab_size: int = 0
    """The real vocabulary (rows of ``output_weight`` past it are padding and stay out of softmaxes)."""
    tp_group: Any = None
    """The tensor-parallel group the vocabulary is sharded over."""
    tp_size: int = 1
    """Its size."""

    def response_hidden(self) -> torch.Tensor:
        """Final hidden states at the positions that predict the response tokens: ``[b, r, h]``
        (packed: ``[1, n, h]`` for the ``n`` valid response tokens)."""
        return self.layout.response_hidden(self.hidden_states)

    def scored_tokens(self, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states to score and the token each predicts: ``([., n, h], [., n])``.

        Padded rows: the ``r`` response positions of every row (``[b, r]``); packed rows: the ``n``
        valid response tokens (``[1, n]``); under CP every local position; ``to_responses`` maps the
        scores to ``[b, r]``.
        """
        return self.layout.scored(self.hidden_states, responses)

    def to_responses(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-token scores of ``scored_tokens`` / ``response_logits`` (``[., n, ...]``) -> ``[b, r, ...]``
        (packed: zero at padding)."""
        return self.layout.to_responses(scores)

    def from_responses(self, values: torch.Tensor) -> torch.Tensor:
        """Per-response-token batch values ``[b, r, ...]`` -> the order of ``response_logits``
        (``[., n, ...]``), e.g. a teacher's top-k ids."""
        return self.layout.from_responses(values)

    def response_logits(self) -> torch.Tensor:
        """``[., n, vocab/tp]`` logits (this rank's vocabulary shard) of the positions that predict the
        response tokens (``to_responses`` maps them to ``[b, r, ...]``) -- only those positions are
        projected. The hidden state's gradient is summed over TP, as ``ColumnParallelLinear``'s
        input gradient is."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        if self.layout.cp_size > 1:
            raise ValueError("response_logits does not support context parallelism")
        hidden = self.response_hidden()
        if self.tp_size > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        return hidden @ self.output_weight.t()

    def sequence_values(self) -> torch.Tensor:
        """Scalar head: ``[b, s]`` the scalar of every left-aligned position (CP shares gathered)."""
        return self.layout.sequence_values(self.values)

    def response_values(self) -> torch.Tensor:
        """Scalar head: ``[b, r]`` the scalars at the positions that predict the response tokens."""
        return self.layout.response_values(self.values)


def prepare_inputs(
    mb: Mapping[str, torch.Tensor], *, pad_to: int, multiple: int, cp_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor, Layout]:
    """Model inputs of one micro-batch: ``(token ids [b, s'], position ids [b, s'], layout)``.

    The rows are left-aligned and trimmed to the longest one (``pad_to`` sets a floor: the
    interleaved schedule exchanges activations of one shape for all micro-batches); the length is
    padded to a multiple of ``multiple`` (sequence parallelism) and of the CP split, and under CP
    cut to this rank's zigzag share (``s' = s / cp``).
    """
    ids, shift = left_align(mb["input_ids"], mb["attention_mask"])
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    seq_len = max(int(mb["attention_mask"].sum(-1).max().item()), pad_to)
    seq_len = pad_length_for_context_parallel(seq_len, cp_size, multiple)
    if seq_len > ids.shape[1]:
        ids = F.pad(ids, (0, seq_len - ids.shape[1]))
    ids = ids[:, :seq_len].contiguous()
    positions = response_positions(shift, mb["input_ids"].shape[1], mb["responses"].shape[1], seq_len)
    if cp_size > 1:  # this CP rank's zigzag share of the sequence
        local = zigzag_index(seq_len, cp_size, dist.get_rank(cp_group), ids.device)
        layout = Layout(
            positions, seq_len, cp_group, cp_size, local_index=local, local_labels=torch.roll(ids, -1, dims=1)[:, local]
        )
        ids = ids[:, local].contiguous()
        pos = local.unsqueeze(0).expand_as(ids)
    else:
        layout = Layout(positions, seq_len, cp_group, 1)
        pos = torch.arange(seq_len, device=ids.device).unsqueeze(0).expand_as(ids)
    return ids, pos, layout
