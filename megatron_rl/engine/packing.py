"""Sequence packing (verl's ``use_remove_padding``): a micro-batch's rows as one THD sequence.

The valid tokens of every row (``attention_mask`` ones: ``[left-padded prompt | right-padded
response]`` keeps them contiguous) are concatenated into one sequence ``[1, t]``; ``cu_seqlens``
marks the row boundaries (Megatron's ``PackedSeqParams``, ``qkv_format="thd"``), so RoPE restarts
at every row and attention never crosses one (``megatron_rl.models.attention`` on the local
spec, TransformerEngine's THD attention on the TE spec). No FLOP is spent on padding except the
alignment the layout needs, added once per packed sequence, not per row:

* sequence parallelism shards the sequence over TP: the packed length is a multiple of TP;
* context parallelism (TE only) splits every row into ``2 * CP`` zigzag chunks: each row is padded
  to a multiple of ``2 * CP`` and the total to ``2 * CP * TP``; this rank keeps chunks ``r`` and
  ``2 * CP - 1 - r`` of every row;
* the interleaved pipeline schedule exchanges one activation shape: every micro-batch is padded
  to the longest one (``pad_to``).

Padding is appended to the last row's segment (after its valid tokens, so causal attention keeps
it out of every valid position). ``PackedLayout`` maps the outputs back: the positions that
predict each valid response token, scattered into verl's ``[b, response_len]`` shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from parallel.context_parallel import zigzag_index

__all__ = ["PackedLayout", "pack_micro_batch", "packed_length", "row_lengths"]


def row_lengths(attention_mask: torch.Tensor, cp_size: int = 1) -> list[int]:
    """Tokens each row takes in a packed sequence: its valid tokens, rounded up to ``2 * cp_size``
    under context parallelism (what a token budget counts)."""
    lengths = attention_mask.sum(-1).long()
    if cp_size > 1:
        step = 2 * cp_size
        lengths = torch.where(lengths > 0, -(-lengths // step) * step, lengths)
    return [int(x) for x in lengths.tolist()]


def packed_length(attention_mask: torch.Tensor, *, tp_multiple: int = 1, cp_size: int = 1) -> int:
    """Length of the packed sequence of a micro-batch (all CP shares), alignment included."""
    total = sum(row_lengths(attention_mask, cp_size))
    step = tp_multiple * (2 * cp_size if cp_size > 1 else 1)
    return max(-(-total // step) * step, step)


class _GatherByIndex(torch.autograd.Function):
    """All-gather per-position values of every CP rank into their places in the whole sequence."""

    @staticmethod
    def forward(ctx, local, cp_group, indices, seq_len):
        parts = [torch.empty_like(local) for _ in indices]
        dist.all_gather(parts, local.contiguous(), group=cp_group)
        full = local.new_zeros(local.shape[0], seq_len, *local.shape[2:])
        for index, part in zip(indices, parts):
            full[:, index] = part
        ctx.own = indices[dist.get_rank(cp_group)]
        return full

    @staticmethod
    def backward(ctx, grad_full):
        # Every CP rank computes the same loss from the gathered values: each keeps its own share.
        return grad_full[:, ctx.own], None, None, None


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where one packed micro-batch's tokens sit, and how outputs map back to ``[b, r]``."""

    num_rows: int
    """Rows ``b`` of the micro-batch."""
    response_len: int
    """Response width ``r`` of the batch."""
    token_index: torch.Tensor
    """``[n]`` packed positions whose outputs predict the ``n`` valid response tokens."""
    rows: torch.Tensor
    """``[n]`` row of each of them."""
    cols: torch.Tensor
    """``[n]`` response column of each of them."""
    starts: torch.Tensor
    """``[b]`` where each row begins in the packed sequence."""
    lengths: torch.Tensor
    """``[b]`` valid tokens of each row."""
    seq_len: int
    """Packed length (all CP shares together, alignment included)."""
    cp_group: Any = None
    """The context-parallel group (None or size 1: the whole sequence is on this rank)."""
    cp_size: int = 1
    """Ranks sharing the sequence."""
    cp_indices: tuple = ()
    """CP only: per CP rank, the ``[t / cp]`` packed positions it holds."""
    local_labels: Optional[torch.Tensor] = None
    """CP only: ``[1, t / cp]`` the token each local position predicts."""

    def gather_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's per-position values ``[1, t/cp, ...]`` -> the whole packed sequence's ``[1, t, ...]``."""
        if self.cp_size == 1:
            return values
        return _GatherByIndex.apply(values, self.cp_group, self.cp_indices, self.seq_len)

    def _scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[n, ...]`` values of the valid response tokens -> ``[b, r, ...]`` (zeros elsewhere)."""
        out = values.new_zeros(self.num_rows, self.response_len, *values.shape[1:])
        return out.index_put((self.rows, self.cols), values)

    def scored(self, hidden: torch.Tensor, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states to score and the token each predicts: ``([1, n, h], [1, n])``; under CP
        every local position (``n = t / cp``)."""
        if self.cp_size > 1:
            return hidden, self.local_labels
        return self.response_hidden(hidden), responses[self.rows, self.cols][None]

    def response_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[1, n, h]`` final hidden states at the positions predicting the valid response tokens."""
        if self.cp_size > 1:
            raise ValueError("response_hidden of a packed sequence split over context parallelism is not available")
        return hidden[0, self.token_index][None]

    def to_responses(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores of ``scored`` (``[1, n, ...]``) -> ``[b, r, ...]``, zero at padding."""
        if self.cp_size > 1:
            scores = self.gather_sequence(scores)[:, self.token_index]
        return self._scatter(scores[0])

    def from_responses(self, values: torch.Tensor) -> torch.Tensor:
        """``[b, r, ...]`` per-response-token values -> ``[1, n, ...]`` in the scored order."""
        return values[self.rows, self.cols][None]

    def response_values(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position scalars ``[1, t/cp]`` -> ``[b, r]`` at the positions predicting the responses."""
        return self._scatter(self.gather_sequence(values)[0, self.token_index])

    def sequence_values(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position scalars ``[1, t/cp]`` -> ``[b, s]`` per left-aligned row (``s`` = the longest
        row; zero past each row's end)."""
        full = self.gather_sequence(values)[0]
        width = max(int(self.lengths.max()), 1)
        col = torch.arange(width, device=full.device)
        index = (self.starts[:, None] + col[None]).clamp(max=full.shape[0] - 1)
        return torch.where(
            col[None] < self.lengths[:, None], full[index], torch.zeros((), dtype=full.dtype, device=full.device)
        )


def pack_micro_batch(
    mb: Mapping[str, torch.Tensor], *, pad_to: int = 0, tp_multiple: int = 1, cp_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor, Any, PackedLayout]:
    """Model inputs of one packed micro-batch: ``(ids [1, t'], position ids [1, t'], PackedSeqParams,
    layout)``; ``t' = t / cp`` (this rank's zigzag share of every row under CP).

    ``pad_to`` is a floor for the packed length (the interleaved schedule), ``tp_multiple`` the
    sequence-parallel alignment.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    input_ids, mask = mb["input_ids"], mb["attention_mask"].bool()
    b, s = mask.shape
    r = mb["responses"].shape[1]
    device = input_ids.device
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    lengths = mask.sum(-1)  # [b]
    seg = torch.tensor(row_lengths(mask, cp_size), device=device)
    total = int(seg.sum())
    seq_len = max(packed_length(mask, tp_multiple=tp_multiple, cp_size=cp_size), pad_to)
    nonempty = torch.nonzero(seg > 0).flatten()
    last = int(nonempty[-1]) if len(nonempty) else 0
    seg[last] += seq_len - total  # alignment padding closes the last row's segment
    starts = torch.cumsum(seg, 0) - seg  # [b]

    # Row i's k-th valid token goes to starts[i] + k; its position id is k (RoPE restarts per row).
    ids = input_ids.new_zeros(seq_len)
    valid_rows = torch.arange(b, device=device).repeat_interleave(lengths)
    first_valid = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(int(lengths.sum()), device=device) - first_valid[valid_rows]
    ids[starts[valid_rows] + within] = input_ids[mask]
    seg_of_token = torch.arange(b, device=device).repeat_interleave(seg)
    pos = torch.arange(seq_len, device=device) - starts[seg_of_token]

    # Response token j of row i sits at column s - r + j, i.e. valid token s - r + j - shift_i, and is
    # predicted by the token before it (clamped into the row for an empty prompt, as the padded path does).
    shift = (mask.long().cumsum(-1) == 0).sum(-1)  # leading pads
    rows, cols = torch.nonzero(mask[:, s - r :], as_tuple=True)
    token_index = starts[rows] + (s - r + cols - shift[rows] - 1).clamp(min=0)

    bounds = torch.cat([starts[nonempty], starts.new_tensor([seq_len])]).to(torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        cu_seqlens_q_padded=bounds,
        cu_seqlens_kv_padded=bounds,
        max_seqlen_q=int(seg.max()),
        max_seqlen_kv=int(seg.max()),
    )
    common = dict(
        num_rows=b,
        response_len=r,
        token_index=token_index,
        rows=rows,
        cols=cols,
        starts=starts,
        lengths=lengths,
        seq_len=seq_len,
    )
    if cp_size == 1:
        return ids[None], pos[None], params, PackedLayout(**common)
    # Each CP rank holds chunks r and 2cp-1-r of every row (TE's THD zigzag).
    indices = tuple(
        torch.cat([starts[i] + zigzag_index(int(seg[i]), cp_size, rank, device) for i in nonempty.tolist()])
        for rank in range(cp_size)
    )
    local = indices[dist.get_rank(cp_group)]
    labels = torch.roll(ids, -1)[local][None]
    layout = PackedLayout(**common, cp_group=cp_group, cp_size=cp_size, cp_indices=indices, local_labels=labels)
    return ids[local][None], pos[local][None], params, layout
