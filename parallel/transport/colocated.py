"""Colocated transport: the bucket's tensors themselves, by reference, inside one process.

For an engine whose workers run in the sender's process (vLLM's in-process engine at TP=1),
where delivering a message is a plain function call: nothing is copied or serialised.
"""

from __future__ import annotations

from parallel.transport.transport_base import Receiver, Sender
from parallel.transport.buckets import Bucket, check_pair

__all__ = ["ColocatedSender", "ColocatedReceiver"]


class ColocatedSender(Sender):
    """The message is the bucket (a list of pairs that alias the sender's tensors)."""

    name = "colocated"

    def send_bucket(self, bucket: Bucket) -> Bucket:
        return bucket


class ColocatedReceiver(Receiver):
    """Takes the sender's pairs as they are (checked, not copied)."""

    name = "colocated"

    def receive_bucket(self, message: Bucket) -> Bucket:
        return [check_pair(pair, i) for i, pair in enumerate(message)]
