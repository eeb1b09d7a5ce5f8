"""The role-agnostic Megatron engine: one model's chunks, optimizer and schedule on this rank.

``MegatronEngine`` (``engine.py``) runs caller-supplied closures over Megatron's schedule:
``forward(batch, fn)`` and ``train_step(mini_batch, loss_fn)``. ``layout.py`` maps RL batches onto
the model (left alignment, response positions, CP shares) and defines the ``ModelOutput`` the
closures see; ``metrics.py`` the ``StepInfo`` / ``LossMetrics`` protocol of a training step;
``optim.py`` DDP + optimizer + LR schedule; ``state.py`` host offload. Roles live above, in
``megatron_rl.roles``.
"""

from megatron_rl.engine.engine import HEADS, ForwardFn, LossFn, MegatronEngine
from megatron_rl.engine.layout import Layout, ModelOutput, left_align, response_positions
from megatron_rl.engine.metrics import LossMetrics, StepInfo

__all__ = ["MegatronEngine", "HEADS", "ForwardFn", "LossFn", "ModelOutput", "Layout", "StepInfo", "LossMetrics",
           "left_align", "response_positions"]
