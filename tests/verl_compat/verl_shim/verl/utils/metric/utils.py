"""``verl.utils.metric.utils``: verl-only metric helpers (see verl/_verl_only.py)."""

from verl.utils.metric import AggregationType, Metric  # noqa: F401
