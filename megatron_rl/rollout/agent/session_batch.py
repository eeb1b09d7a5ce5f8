"""The rollout phase's side of agent sessions: the worker's output as the step's ``Batch``, and
the sessions' metrics.

``agent_batch(out, prompts, prompt_fields)``: the padded sessions (``AgentRunner.run``) as a
``Batch`` whose per-prompt fields (``data_source``, ``ground_truth`` ...) follow each sample's
``prompt_index`` (a session may yield several samples, so samples are not ``n`` per prompt).

``agent_metrics(batch)`` (over each session's final sample): ``agent/num_turns/{mean,min,max}``,
``agent/num_tool_calls/mean``, ``agent/tool_call_rate`` (sessions that called a tool),
``agent/tool_error_rate`` (failed calls / calls), ``agent/response_length_with_obs/mean`` and
``agent/response_length_model/mean`` (response tokens with and without observations),
``agent/truncated_rate``, ``agent/outputs_per_session/mean`` and, with the sanity check on,
``agent/tokenization_mismatch_rate``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from megatron_rl.data.batch import Batch

__all__ = ["agent_batch", "agent_batch_keys", "agent_metrics", "final_rows"]


def agent_batch(out: Mapping[str, Any], prompts: Mapping[str, Any], prompt_fields: Sequence[str]) -> Batch:
    """The step's ``Batch`` of agent samples (module docstring)."""
    batch = Batch.from_single_dict(dict(out))
    index = [int(i) for i in out["prompt_index"]]
    for key in prompt_fields:
        if key in prompts:
            batch[key] = [prompts[key][i] for i in index]
    return batch


def final_rows(batch: Mapping[str, Any]) -> list[int]:
    """Each session's final sample (largest ``output_index``), in first-seen order."""
    final: dict[tuple, int] = {}
    indices = batch["output_index"]
    for row, key in enumerate(zip(batch["uid"], batch["session_id"])):
        if key not in final or indices[row] > indices[final[key]]:
            final[key] = row
    return list(final.values())


def agent_metrics(batch: Mapping[str, Any]) -> dict[str, float]:
    """The sessions' metrics (module docstring)."""
    rows = final_rows(batch)
    if not rows:
        return {}
    pick = lambda key: [batch[key][i] for i in rows]  # noqa: E731
    turns, calls, errors = pick("num_turns"), pick("num_tool_calls"), pick("num_tool_errors")
    width = batch["responses"].shape[1]
    with_obs = batch["attention_mask"][rows, -width:].sum(-1).float()
    model = batch["response_mask"][rows].sum(-1).float()
    metrics = {
        "agent/num_turns/mean": sum(turns) / len(rows),
        "agent/num_turns/min": float(min(turns)),
        "agent/num_turns/max": float(max(turns)),
        "agent/num_tool_calls/mean": sum(calls) / len(rows),
        "agent/tool_call_rate": sum(c > 0 for c in calls) / len(rows),
        "agent/tool_error_rate": sum(errors) / sum(calls) if sum(calls) else 0.0,
        "agent/response_length_with_obs/mean": float(with_obs.mean()),
        "agent/response_length_model/mean": float(model.mean()),
        "agent/truncated_rate": sum(bool(t) for t in pick("truncated")) / len(rows),
        "agent/outputs_per_session/mean": len(batch["uid"]) / len(rows),
    }
    matches = [m for m in pick("tokenization_match") if m is not None]
    if matches:
        metrics["agent/tokenization_mismatch_rate"] = sum(not m for m in matches) / len(matches)
    return metrics


def agent_batch_keys(batch: Mapping[str, Any]) -> list[str]:
    """verl's ``"{uid}_{session_id}_{index}"`` key of every sample (the multi-output advantage's input)."""
    from megatron_rl.algos.multi_trajectory import trajectory_keys

    return trajectory_keys(list(batch["uid"]), list(batch["session_id"]), list(batch["output_index"]))
