"""Where an engine's state lives: host-memory offload and the device round trip.

``move_state`` moves parameters, Megatron's DDP gradient/parameter buffers (the parameters are
views into them, so they are re-pointed at the moved storage) and the optimizer state between
the GPU and host memory. Without CUDA it does nothing: on CPU everything already is in host
memory. Checkpoints are ``parallel.checkpoint``'s distributed checkpoints (see
``MegatronEngine.save_checkpoint``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["move_state"]


def move_state(model: list[torch.nn.Module], optimizer: Optional[Any], device: str) -> None:
    """Move ``model``'s chunks (and ``optimizer``'s state) to ``"cpu"`` or ``"cuda"`` (no-op without CUDA)."""
    if not torch.cuda.is_available():
        return
    target = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    for chunk in model:
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            for attr in ("param_data", "grad_data"):
                tensor = getattr(buffer, attr, None)
                if tensor is not None:
                    tensor.data = tensor.data.to(target, non_blocking=True)
            # Params are views into param_data: re-point them at the moved storage.
            for param, (start, end, _) in buffer.param_index_map.items():
                param.data = buffer.param_data[start:end].view(param.data.shape)
                param.main_grad = buffer.grad_data[start:end].view(param.data.shape)
        for param in chunk.parameters():
            if param.device != target:
                param.data = param.data.to(target, non_blocking=True)
    if optimizer is not None:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            for state in opt.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        state[key] = value.to(target, non_blocking=True)
    torch.cuda.synchronize()
    if device == "cpu":
        torch.cuda.empty_cache()
