"""The main job's report: the reward-curve PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["plot_reward_curve", "REWARD_KEY"]

REWARD_KEY = "critic/score/mean"
"""The per-step mean training reward (rule score of every sampled response)."""


def plot_reward_curve(history: Sequence[dict], path: str | Path, title: str = "", window: int = 10) -> Path:
    """Mean training reward per step, its ``window``-step moving average and (when logged) the
    exact-answer rate ``reward/acc/mean``, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    steps = [int(h["training/global_step"]) for h in history]
    mean = [float(h[REWARD_KEY]) for h in history]
    smooth = [sum(mean[max(0, i - window + 1):i + 1]) / len(mean[max(0, i - window + 1):i + 1]) for i in range(len(mean))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, mean, color="C0", alpha=0.35, linewidth=1, label="mean reward")
    ax.plot(steps, smooth, color="C0", linewidth=2, label=f"mean reward ({window}-step avg)")
    if all("reward/acc/mean" in h for h in history):
        ax.plot(steps, [float(h["reward/acc/mean"]) for h in history], color="C1", alpha=0.7, linewidth=1,
                label="exact answers")
    ax.set_xlabel("step")
    ax.set_ylabel("training reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
    return Path(path)
