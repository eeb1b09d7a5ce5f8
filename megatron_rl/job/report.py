"""The main job's report: the algorithm's display name, the reward-curve PNG and the summary numbers."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = [
    "network_report",
    "plot_reward_curve",
    "REWARD_KEY",
    "algorithm_label",
    "validation_reward",
    "validation_exact",
    "as_number",
    "fmt_ratio",
]

REWARD_KEY = "critic/score/mean"
"""The per-step mean training reward (rule score of every sampled response)."""
_VAL_CORE = re.compile(r"^val-core/.+/reward/mean@\d+$")
_VAL_ACC = re.compile(r"^val-aux/.+/acc/mean@\d+$")
_ESTIMATOR_LABELS = {
    "gae": "PPO",
    "grpo": "GRPO",
    "rloo": "RLOO",
    "remax": "ReMax",
    "reinforce_plus_plus": "REINFORCE++",
    "reinforce_plus_plus_baseline": "REINFORCE++-baseline",
    "gdpo": "GDPO",
    "opo": "OPO",
    "grpo_passk": "GRPO-pass@k",
}


def algorithm_label(config: Any) -> str:
    """The algorithm a recipe runs, as its users call it: OPD (distillation), DAPO (dynamic sampling),
    GSPO (sequence-level policy loss), Dr. GRPO (unnormalised GRPO), PPO (GAE), GRPO, RLOO, ..."""
    algo, actor = config.algorithm, config.actor_rollout_ref.actor
    if config.distillation.enabled:
        return "OPD"
    if algo.filter_groups is not None and algo.filter_groups.enable:
        return "DAPO"
    if actor.policy_loss.loss_mode == "gspo":
        return "GSPO"
    if (
        algo.adv_estimator == "grpo"
        and not algo.norm_adv_by_std_in_grpo
        and actor.loss_agg_mode == "seq-mean-token-sum-norm"
    ):
        return "Dr.GRPO"
    return _ESTIMATOR_LABELS.get(algo.adv_estimator, algo.adv_estimator.upper())


def as_number(value: Any) -> Optional[float]:
    """``value`` as a finite float (metrics.jsonl writes NaN as ``"nan"``), else None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fmt_ratio(value: Any) -> str:
    """``12.5%`` for a finite ratio, ``n/a`` otherwise."""
    number = as_number(value)
    return "n/a" if number is None else f"{number:.1%}"


def validation_reward(row: dict) -> Optional[float]:
    """The mean of a metrics row's ``val-core/<source>/reward/mean@<n>`` values, or None without any."""
    values = [v for k, v in row.items() if _VAL_CORE.match(k) and as_number(v) is not None]
    return sum(float(v) for v in values) / len(values) if values else None


def validation_exact(row: dict) -> Optional[float]:
    """The mean of a metrics row's ``val-aux/<source>/acc/mean@<n>`` values (the exact-answer rate of the
    validation), or None when the reward reports no ``acc``."""
    values = [v for k, v in row.items() if _VAL_ACC.match(k) and as_number(v) is not None]
    return sum(float(v) for v in values) / len(values) if values else None


def plot_reward_curve(
    history: Sequence[dict],
    path: str | Path,
    title: str = "",
    window: int = 10,
    validation: Sequence[tuple[int, float]] = (),
) -> Path:
    """Mean training reward per step, its ``window``-step moving average and the validation reward at the
    steps in ``validation`` (``(step, reward)``) on the left axis, and (when logged) the exact-answer rate
    ``reward/acc/mean`` in % on its own right axis, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    steps = [int(h["training/global_step"]) for h in history]
    mean = [as_number(h[REWARD_KEY]) or 0.0 for h in history]
    smooth = [
        sum(mean[max(0, i - window + 1) : i + 1]) / len(mean[max(0, i - window + 1) : i + 1]) for i in range(len(mean))
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, mean, color="C0", alpha=0.35, linewidth=1, label="mean reward")
    ax.plot(steps, smooth, color="C0", linewidth=2, label=f"mean reward ({window}-step avg)")
    acc = [(s, as_number(h.get("reward/acc/mean"))) for s, h in zip(steps, history)]
    handles = []
    if acc and all(v is not None for _, v in acc):  # a rate of its own, often far below the reward: its own axis
        exact_ax = ax.twinx()
        handles += exact_ax.plot(
            [s for s, _ in acc],
            [100 * v for _, v in acc],
            color="C1",
            alpha=0.7,
            linewidth=1,
            label="exact answers (%, right axis)",
        )
        exact_ax.set_ylabel("exact answers (%)", color="C1")
        exact_ax.set_ylim(0, max(5.0, 100 * max(v for _, v in acc) * 1.1))
        exact_ax.tick_params(axis="y", colors="C1")
    if validation:
        ax.plot(
            [s for s, _ in validation],
            [v for _, v in validation],
            color="C2",
            marker="o",
            markersize=4,
            linewidth=1.5,
            label="validation reward",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    lines, labels = ax.get_legend_handles_labels()
    ax.legend(lines + handles, labels + [h.get_label() for h in handles], loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    plt.close(fig)
    return Path(path)


NETWORK_FILE = "network.json"


def network_report(out_dir: Path, log, *, joined: bool) -> list[dict]:
    """Who listens where once the workers are up: every TCP listener of this process and its
    descendants (a local Ray cluster: its GCS, raylet and every worker) to ``out_dir/network.json``,
    one console line per process, and a warning naming each listener on every interface (``*``).

    ``joined``: the run did not start its Ray (``RAY_ADDRESS``, or one already running); that
    cluster's processes are not this process's children, and Ray's servers there listen where the
    cluster was started to (on ``*`` unless its node address is loopback: Ray's own rule, which this
    project cannot change), so the report covers the driver only and says so."""
    import psutil

    from megatron_rl.job.prepare import atomic_text
    from parallel.netbind import listeners

    me = psutil.Process()
    pids = [me.pid] + [p.pid for p in me.children(recursive=True)]
    rows = listeners(pids)
    atomic_text(out_dir / NETWORK_FILE, json.dumps({"joined_cluster": joined, "listeners": rows}, indent=1))
    by_proc: dict[tuple[int, str], dict[str, int]] = {}
    for r in rows:
        where = by_proc.setdefault((r["pid"], r["name"]), {})
        where[r["address"]] = where.get(r["address"], 0) + 1
    for (pid, name), where in by_proc.items():
        log(f"listening: {name} (pid {pid}) on " + ", ".join(f"{a} x{n}" for a, n in where.items()))
    wild = [r for r in rows if r["wildcard"]]
    for r in wild:
        logging.getLogger(__name__).warning(
            "%s (pid %d) listens on every interface (%s:%d): reachable from other hosts",
            r["name"],
            r["pid"],
            r["address"],
            r["port"],
        )
    scope = "this driver only (a Ray cluster it joined)" if joined else "this run's process tree"
    log(
        f"network: {len(rows)} listeners in {len(by_proc)} processes of {scope}, "
        f"{sum(r['loopback'] for r in rows)} on loopback, {len(wild)} on every interface "
        f"-> {out_dir / NETWORK_FILE}"
    )
    return rows
