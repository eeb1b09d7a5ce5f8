"""Bookkeeping of the asynchronous trainer (``megatron_rl.trainer.async_loop``) kept out of its loop.

* ``SampleLedger`` writes ``async_samples.jsonl`` (``SAMPLES_FILE``) in the run directory: per step
  the ids of the samples it trained on (``<uid>/<j>``: prompt group ``<epoch>-<row>``, sample ``j``
  of the group) and of the groups evicted as too stale or filtered by DAPO since the step before --
  what a killed and resumed run is compared by.
* ``GroupFilter``: DAPO dynamic sampling (``algorithm.filter_groups``) per finished generation, before
  the replay buffer, with verl's ``filter_groups/*`` metrics per step and the
  ``max_num_gen_batches`` bound.
* ``select_prompts``: some prompts of a dataloader batch (the rollouter submits part of a batch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_rl.data.batch import Batch
from megatron_rl.trainer.replay_buffer import Group
from megatron_rl.trainer.rollout_phase import REWARD_EXTRA_KEYS

__all__ = ["SAMPLES_FILE", "SampleLedger", "GroupFilter", "select_prompts"]

SAMPLES_FILE = "async_samples.jsonl"
"""Per step: ``{"step", "trained", "evicted", "filtered"}`` sample ids (see the module docstring)."""


class SampleLedger:
    """``async_samples.jsonl`` in a run directory; a resumed run first drops the lines of steps after
    its checkpoint (they are run again)."""

    def __init__(self, path: Path, resumed_step: int):
        from megatron_rl.trainer.metrics import drop_rows_after

        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        drop_rows_after(path, resumed_step)

    def write(self, step: int, groups: list[Group], *, evicted: list[str], filtered: list[str], n: int) -> None:
        """Append step ``step``'s line (written before the step's checkpoint can be)."""
        trained = [f"{g.uid}/{j}" for g in groups for j in range(len(g.payload))]
        row = {
            "step": step,
            "trained": trained,
            "evicted": [f"{u}/{j}" for u in evicted for j in range(n)],
            "filtered": [f"{u}/{j}" for u in filtered for j in range(n)],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


class GroupFilter:
    """DAPO dynamic sampling in the asynchronous loop: a finished group whose ``filter_groups.metric``
    is the same in all its samples is dropped before the buffer (its slot refilled).

    Args:
        config: the ``algorithm.filter_groups`` section (enabled).
        batch_groups: groups per training batch (``data.train_batch_size``).
        ahead_batches: prompt batches the rollouter may generate ahead of the trainer (the window's
            lookahead in prompt batches): ``max_num_gen_batches`` counts beyond them.
    """

    def __init__(self, config: Any, batch_groups: int, ahead_batches: int):
        self.cfg, self.batch_groups, self.ahead = config, batch_groups, ahead_batches
        self.groups = self.kept = self.batches = 0  # since the trainer's last take
        self.filtered_uids: list[str] = []  # filtered since the last ledger line

    def keep(self, batch: Batch) -> torch.Tensor:
        """Per sample of a scored generation, whether its group is kept (its metric varies)."""
        from megatron_rl.algos.dapo import compute_filter_metric, filter_groups

        extra = {k: list(batch[k]) for k in batch.meta_info.get(REWARD_EXTRA_KEYS, ())}
        values = compute_filter_metric(
            self.cfg.metric or "seq_reward", batch["token_level_scores"], batch["token_level_scores"], extra
        )
        self.batches += 1
        return filter_groups(values, [str(u) for u in batch["uid"]])[0]

    def count(self, uid: str, kept: bool) -> None:
        """One finished group, kept or filtered."""
        self.groups += 1
        self.kept += int(kept)
        if not kept:
            self.filtered_uids.append(uid)

    def check_rounds(self) -> None:
        """``RuntimeError`` when filtering keeps the trainer waiting past ``max_num_gen_batches``
        generation batches since its last take (beyond those the window generates ahead)."""
        limit = self.cfg.max_num_gen_batches
        if limit > 0 and self.batches > limit + self.ahead:
            raise RuntimeError(
                f"DAPO dynamic sampling: {self.batches} generation batches since the last step gave {self.kept} "
                f"informative prompt groups, fewer than data.train_batch_size={self.batch_groups} "
                f"(algorithm.filter_groups.max_num_gen_batches={limit}, plus {self.ahead} generated ahead); the data "
                "may be too hard or too easy for the model -- raise max_num_gen_batches (0 = unbounded) or "
                "data.gen_batch_size"
            )

    def take_metrics(self) -> dict[str, float]:
        """verl's ``filter_groups/*`` since the trainer's last take; resets the counts."""
        out = {
            "filter_groups/num_gen_batches": float(self.batches),
            "filter_groups/kept_group_ratio": self.kept / max(1, self.groups),
            "filter_groups/num_filtered_groups": float(self.groups - self.kept),
        }
        self.groups = self.kept = self.batches = 0
        return out


def select_prompts(prompts: dict[str, Any], idx: list[int]) -> dict[str, Any]:
    """The prompts at positions ``idx`` of a dataloader batch (tensors and per-prompt lists)."""
    out: dict[str, Any] = {}
    for key, value in prompts.items():
        if isinstance(value, torch.Tensor):
            out[key] = value[torch.as_tensor(idx, dtype=torch.long)]
        elif isinstance(value, (list, tuple)):
            out[key] = [value[i] for i in idx]
        else:
            out[key] = value
    return out
