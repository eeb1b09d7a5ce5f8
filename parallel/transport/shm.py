"""Shared-memory transport: one safetensors file per bucket under a tmpfs directory.

The sender writes each bucket once into a file under ``shm_dir`` (``/dev/shm``: memory, not
disk) and sends its path; each receiver maps the file (no read copy) and reads views into
the map. The file is unlinked on ``release`` -- once every receiver has mapped it (the maps
keep the pages alive) -- and on ``abort``, so nothing outlives a sync, failed or not.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
from typing import Optional

from parallel.transport.transport_base import Receiver, Sender
from parallel.transport.buckets import Bucket
from parallel.transport.safetensors_format import file_bytes, safetensors_views, write_safetensors

__all__ = ["ShmSender", "ShmReceiver", "SHM_PREFIX"]

SHM_PREFIX = "megatron_rl_sync_"  # bucket files are named <shm_dir>/<SHM_PREFIX>*.safetensors


class ShmSender(Sender):
    """Writes each bucket to ``<shm_dir>/megatron_rl_sync_*.safetensors``; the message is ``{"path"}``."""

    name = "shm"

    def __init__(self, shm_dir: str):
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir={shm_dir!r} is not a directory (the shm transport writes its buckets there)")
        self.shm_dir = shm_dir
        self._files: collections.deque[str] = collections.deque()  # written, not yet released (oldest first)

    @classmethod
    def create(cls, *, group=None, shm_dir: Optional[str] = None) -> "ShmSender":
        if shm_dir is None:
            raise ValueError("the shm transport needs shm_dir (a tmpfs directory, e.g. checkpoint_engine.shm_dir)")
        return cls(shm_dir)

    def send_bucket(self, bucket: Bucket) -> dict[str, str]:
        fd, path = tempfile.mkstemp(prefix=SHM_PREFIX, suffix=".safetensors", dir=self.shm_dir)
        os.close(fd)
        try:
            write_safetensors(path, bucket)
        except BaseException:
            os.unlink(path)
            raise
        self._files.append(path)
        return {"path": path}

    def release(self) -> None:
        os.unlink(self._files.popleft())

    def abort(self) -> None:
        while self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._files.popleft())


class ShmReceiver(Receiver):
    """Maps the named file privately and returns views into the map."""

    name = "shm"

    def receive_bucket(self, message: dict[str, str]) -> Bucket:
        return safetensors_views(file_bytes(message["path"]))
