"""What the GPU transports share: the CUDA availability check and the GPU identity of a device.

``nccl`` and ``cuda_ipc`` need CUDA on both ends; requesting either without it is a
``ValueError`` naming ``checkpoint_engine.backend`` (the key that picks a transport), raised
when a half is built -- before any buffer or group exists. A GPU is named by its UUID, not its
index: two processes with different ``CUDA_VISIBLE_DEVICES`` number the same GPU differently.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["CPU_TRANSPORTS", "require_cuda", "device_uuid", "visible_uuids", "local_index"]

CPU_TRANSPORTS = ("colocated", "bytes", "shm", "broadcast")


def require_cuda(transport: str, cuda_available: Optional[bool] = None) -> None:
    """``ValueError`` unless this process can use CUDA (``cuda_available`` overrides the probe)."""
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not available:
        raise ValueError(
            f"checkpoint_engine.backend={transport!r} needs CUDA, but torch.cuda.is_available() is False "
            f"in this process (torch {torch.__version__}); without a GPU choose one of "
            f"{list(CPU_TRANSPORTS)}"
        )


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by local index."""
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def local_index(uuid: str, visible: Sequence[str], transport: str = "cuda_ipc") -> int:
    """This process's index of the GPU ``uuid``; ``ValueError`` when it cannot see that GPU."""
    if uuid in visible:
        return list(visible).index(uuid)
    raise ValueError(
        f"{transport}: the sender's GPU {uuid} is not visible to this process (visible: {list(visible)}); "
        f"CUDA IPC needs the receiving engine on the sender's GPU (colocated), across GPUs use 'nccl'"
    )
