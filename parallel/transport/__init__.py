"""Weight transports: moving buckets of HF-named tensors from an exporting rank to where they load.

Knows tensors, buckets, processes and groups; nothing about models, RL or inference engines.

    buckets              bucketing under a byte bound (one larger tensor travels alone), flat layouts
    safetensors_format   buckets as safetensors blobs/files, written and read without extra copies
    gloo                 the side band: a data and a control gloo group of their own, headers, acks
    transport_base       the protocol: Sender (send_bucket / release / abort), Receiver (receive_bucket),
                         the Transport registry entry, TransferStats
    colocated, bytes_blob, shm, broadcast    the four CPU transports
    nccl, cuda_ipc       the GPU transports (NCCL broadcast across GPUs; CUDA IPC handles on one GPU)
    cuda                 the CUDA check both GPU transports make, GPUs named by UUID
    transport_registry   name -> Transport (``get_transport``)
    execution            ``transfer(sender, buckets, channel)``: the one loop; ``CallChannel``
    stream               a whole sync as one stream over a SideBand (``RemoteWeightSender`` /
                         ``receive_stream``) for receivers in other processes

Modelled on Megatron-LM's ``megatron/core/resharding``: a plan (here the bridge's export,
built once), its execution (``transfer``) and pluggable copy services (the transports).
"""

from parallel.transport.transport_base import Receiver, Sender, TransferStats, Transport
from parallel.transport.buckets import bucket_meta, bucket_named_tensors, unpack_bucket
from parallel.transport.execution import CallChannel, Channel, transfer
from parallel.transport.gloo import DEFAULT_TIMEOUT_S, SideBand, new_gloo_group
from parallel.transport.transport_registry import (
    GPU_TRANSPORTS,
    RESERVED,
    STREAMABLE,
    TRANSPORTS,
    get_transport,
    link_group,
    new_receiver,
    new_sender,
)
from parallel.transport.safetensors_format import safetensors_views, serialize_safetensors, write_safetensors
from parallel.transport.stream import RemoteWeightSender, StreamChannel, receive_stream, stream_receivers

__all__ = [
    "Sender",
    "Receiver",
    "Transport",
    "TransferStats",
    "bucket_named_tensors",
    "bucket_meta",
    "unpack_bucket",
    "safetensors_views",
    "serialize_safetensors",
    "write_safetensors",
    "DEFAULT_TIMEOUT_S",
    "SideBand",
    "new_gloo_group",
    "TRANSPORTS",
    "RESERVED",
    "STREAMABLE",
    "GPU_TRANSPORTS",
    "get_transport",
    "new_sender",
    "new_receiver",
    "link_group",
    "Channel",
    "CallChannel",
    "transfer",
    "StreamChannel",
    "RemoteWeightSender",
    "receive_stream",
    "stream_receivers",
]
