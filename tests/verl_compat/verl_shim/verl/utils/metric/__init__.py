"""``verl.utils.metric``: verl-only metric helpers (see verl/_verl_only.py)."""

from verl._verl_only import verl_only

Metric = verl_only("Metric")
AggregationType = verl_only("AggregationType")
reduce_metrics = verl_only("reduce_metrics")
