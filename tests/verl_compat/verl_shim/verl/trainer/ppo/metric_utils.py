"""``verl.trainer.ppo.metric_utils`` -> ``megatron_rl.trainer.metrics`` (batch, timing, throughput metrics).

verl passes a ``DataProto``; the project's functions take the batch's tensors as a mapping. verl's
throughput function (``compute_throughout_metrics``, verl's spelling) reads the per-sequence token counts
from ``meta_info["global_token_num"]``; the project sums ``attention_mask``, whose per-row sums are those
counts, so the adapter hands it the counts as that mask's row sums. The validation metrics (best@n, maj@n)
are verl-only (see verl/_verl_only.py).
"""

import torch

from megatron_rl.trainer.metrics import compute_data_metrics as _data_metrics
from megatron_rl.trainer.metrics import compute_throughput_metrics as _throughput_metrics
from megatron_rl.trainer.metrics import compute_timing_metrics as _timing_metrics
from verl._verl_only import verl_only

bootstrap_metric = verl_only("bootstrap_metric")
calc_maj_val = verl_only("calc_maj_val")
process_validation_metrics = verl_only("process_validation_metrics")
_compute_response_info = verl_only("_compute_response_info")


def _tensors(data) -> dict:
    """``data.batch`` with verl's back-compatible ``response_mask`` (the response part of the attention mask)."""
    batch = dict(data.batch.items())
    if "response_mask" not in batch:
        batch["response_mask"] = batch["attention_mask"][:, -batch["responses"].shape[-1] :]
    return batch


def compute_data_metrics(batch, use_critic: bool = True) -> dict:
    """verl's ``compute_data_metrics`` of a ``DataProto``."""
    return _data_metrics(_tensors(batch), use_critic)


def compute_timing_metrics(batch, timing_raw: dict) -> dict:
    """verl's ``compute_timing_metrics`` of a ``DataProto``."""
    return _timing_metrics(_tensors(batch), timing_raw)


def compute_throughout_metrics(batch, timing_raw: dict, n_gpus: int) -> dict:
    """verl's ``compute_throughout_metrics``: tokens from ``meta_info["global_token_num"]``."""
    counts = torch.as_tensor(batch.meta_info["global_token_num"])  # [bs] tokens per sequence
    return _throughput_metrics({"attention_mask": counts}, timing_raw, n_gpus)
