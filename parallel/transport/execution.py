"""One transfer: buckets through a transport's sender, their messages over a channel.

``transfer(sender, buckets, channel)`` is the only loop that moves weights; callers differ
only in the ``Channel`` that carries each bucket's message to the receivers:

* ``CallChannel(call)``: ``call(message)`` returns once every receiver has taken the bucket
  (an RPC into an engine's workers, which load it before returning);
* ``stream.StreamChannel``: headers over a side band's control group to receivers looping in
  other processes, which acknowledge each bucket once they hold it. That channel is
  *pipelined*: the sender prepares bucket k+1 (exports it, writes its file) before it waits
  for bucket k's acknowledgement, so at most two buckets are outstanding.

After a failure the receivers still owed an acknowledgement are met, the sender drops what
is outstanding (no file outlives a failed sync) and the channel tells the receivers
(``abort``), so they raise instead of waiting for a timeout.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterable, Protocol

from parallel.transport.transport_base import Sender, TransferStats
from parallel.transport.buckets import Bucket

__all__ = ["Channel", "CallChannel", "transfer"]


class Channel(Protocol):
    """Carries a transport's per-bucket messages from the sender to every receiver."""

    pipelined: bool
    """``wait_taken`` may lag one bucket behind ``deliver`` (receivers run concurrently)."""

    def deliver(self, message: Any) -> None:
        """Hand one bucket's message to every receiver."""

    def wait_taken(self) -> None:
        """Block until every receiver has taken the oldest delivered, unconfirmed bucket."""

    def end(self) -> None:
        """The transfer is complete."""

    def abort(self, error: str) -> None:
        """The transfer failed on the sender's side with ``error``."""


class CallChannel:
    """A synchronous channel: ``call(message)`` returns after every receiver has taken the bucket."""

    pipelined = False

    def __init__(self, call: Callable[[Any], Any]):
        self.call = call

    def deliver(self, message: Any) -> None:
        self.call(message)

    def wait_taken(self) -> None:
        pass  # the call's return was the receipt

    def end(self) -> None:
        pass

    def abort(self, error: str) -> None:
        pass  # receivers only act when called


def transfer(sender: Sender, buckets: Iterable[Bucket], channel: Channel) -> TransferStats:
    """Send every bucket of ``buckets`` (consumed lazily) through ``sender`` over ``channel``.

    Returns what was moved (``TransferStats``). On any failure -- of the bucket source (e.g. the
    export), the sender or the channel -- the receivers are told to abort and the error is
    re-raised here.
    """
    stats = TransferStats(sender.name)
    start = time.perf_counter()
    unconfirmed = 0  # delivered buckets whose receipt the channel has not confirmed yet

    def confirm_oldest() -> None:
        nonlocal unconfirmed
        channel.wait_taken()
        unconfirmed -= 1
        sender.release()

    try:
        buckets = iter(buckets)
        while True:
            bucket = next(buckets, None)
            if bucket is None:
                break
            message = sender.send_bucket(bucket)
            stats.add(bucket)
            del bucket  # before the source builds the next one: the sender holds what it still needs
            if channel.pipelined and unconfirmed:
                confirm_oldest()  # the previous bucket, now that this one is ready
            channel.deliver(message)
            del message
            unconfirmed += 1
            if not channel.pipelined:
                confirm_oldest()
        while unconfirmed:
            confirm_oldest()
        channel.end()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            while unconfirmed:  # receivers still owe these acknowledgements: meet them
                channel.wait_taken()
                unconfirmed -= 1
        sender.abort()
        with contextlib.suppress(Exception):
            channel.abort(f"{type(exc).__name__}: {exc}")
        raise
    stats.seconds = time.perf_counter() - start
    return stats
