"""Bytes transport: one safetensors blob per bucket, carried by the channel itself.

For receivers reached through a channel that copies its arguments (an RPC into engine
workers in other processes): the blob is built with one copy per tensor, and the receiver
reads its tensors as views into the blob it was handed.
"""

from __future__ import annotations

from parallel.transport.transport_base import Receiver, Sender
from parallel.transport.buckets import Bucket
from parallel.transport.safetensors_format import bytes_tensor, safetensors_views, serialize_safetensors

__all__ = ["BytesSender", "BytesReceiver"]


class BytesSender(Sender):
    """The message is the bucket as a safetensors ``bytearray``."""

    name = "bytes"

    def send_bucket(self, bucket: Bucket) -> bytearray:
        return serialize_safetensors(bucket)


class BytesReceiver(Receiver):
    """Views into the received blob (no copy)."""

    name = "bytes"

    def receive_bucket(self, message: bytes | bytearray) -> Bucket:
        return safetensors_views(bytes_tensor(message))
