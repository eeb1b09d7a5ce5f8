"""The config's transport names are the registry's, and the bucket bound has one default: the config's."""

from __future__ import annotations

import inspect

import pytest

from megatron_rl.config.rollout import TRANSPORTS, WeightSyncConfig
from megatron_rl.rollout.weight_stream import REMOTE_TRANSPORTS, ActorWeightSync
from parallel import transport


def test_config_names_every_transport_of_the_registry():
    assert TRANSPORTS == tuple(transport.TRANSPORTS)  # checkpoint_engine.backend accepts exactly these
    assert REMOTE_TRANSPORTS == transport.STREAMABLE == ("broadcast", "cuda_ipc", "nccl", "shm")
    assert WeightSyncConfig(backend="nccl").backend == "nccl"  # verl's name; CUDA is checked where a half is built
    with pytest.raises(ValueError, match=r"checkpoint_engine.backend='hccl' is not allowed"):
        WeightSyncConfig(backend="hccl")


def test_the_bucket_bound_defaults_only_in_the_config():
    assert WeightSyncConfig().update_weights_bucket_megabytes == 2048  # verl's default
    required = [
        (ActorWeightSync.__init__, "bucket_megabytes"),
        (transport.bucket_named_tensors, "bucket_bytes"),
        (transport.RemoteWeightSender.send, "bucket_bytes"),
    ]
    for fn, name in required:
        assert inspect.signature(fn).parameters[name].default is inspect.Parameter.empty, fn.__qualname__
