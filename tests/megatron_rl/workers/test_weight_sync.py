"""``megatron_rl.workers.weight_sync.WeightSync``: the path is picked once from the config, the
side band connects on the first sync only, and every call carries the config's values.

Ray is replaced by direct calls (``.remote(...)`` runs the method, ``ray.get`` returns its
value): the ranks and the rollout worker are recorders. The real thing runs end to end in
``tests/megatron_rl/trainer/test_ppo_trainer.py``.
"""

from __future__ import annotations

import pytest

from megatron_rl.config.rollout import WeightSyncConfig
from megatron_rl.workers import weight_sync as ws


class _Handle:
    """An actor handle whose ``method.remote(*args)`` calls ``method`` right away."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        method = getattr(self._target, name)
        return type("Method", (), {"remote": staticmethod(method)})


class _Rank:
    def __init__(self, rank, calls):
        self.rank, self.calls = rank, calls

    def weight_sync_listen(self, *args):
        self.calls.append((self.rank, "listen", args))
        return ("10.0.0.1", 4242) if self.rank == 0 else None

    def weight_sync_connect(self):
        self.calls.append((self.rank, "connect"))

    def weight_sync(self):
        self.calls.append((self.rank, "sync"))
        return {"transport": "shm", "seconds": 0.5, **({"bytes": 10} if self.rank == 0 else {})}

    def export_weights(self, bucket_bytes, dtype, quantization):
        self.calls.append((self.rank, "export", bucket_bytes, dtype, quantization))
        return [("w", None)] if self.rank == 0 else None


class _Rollout:
    def __init__(self, calls, name="rollout", tp=2):
        self.calls, self.name, self.tp = calls, name, tp

    def num_engine_workers(self):  # TP x PP of the engine
        return self.tp

    def weight_sync_connect(self, addr, port, world, rank_offset=1):
        self.calls.append((self.name, "connect", addr, port, world, rank_offset))

    def weight_sync_receive(self):
        self.calls.append((self.name, "receive"))
        return {"seconds": 0.25}

    def update_weights(self, weights, **kwargs):
        self.calls.append((self.name, "update", weights, kwargs))
        return {"transport": kwargs["transport"], "bytes": 10, "seconds": 0.1}


@pytest.fixture
def fake(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    calls: list = []
    group = type("Group", (), {"workers": [_Handle(_Rank(r, calls)) for r in range(2)]})()
    return group, _Handle(_Rollout(calls)), calls


def test_a_streamed_backend_connects_once_then_streams(fake):
    group, rollout, calls = fake
    sync = ws.WeightSync(
        group, rollout, WeightSyncConfig(backend="shm", update_weights_bucket_megabytes=3, shm_dir="/tmp")
    )
    assert sync.streamed and not sync.connected
    out = sync.sync()
    assert calls[:5] == [
        (0, "listen", (3, "shm", 3, "/tmp", None, None)),
        (1, "listen", (3, "shm", 3, "/tmp", None, None)),
        (0, "connect"),
        (1, "connect"),
        ("rollout", "connect", "10.0.0.1", 4242, 3, 1),
    ]
    assert calls[5:] == [(0, "sync"), (1, "sync"), ("rollout", "receive")]
    assert (out["bytes"], out["seconds"], out["receiver_seconds"]) == (10, 0.5, 0.25) and out["wall_seconds"] >= 0
    calls.clear()
    sync.sync()
    assert calls == [(0, "sync"), (1, "sync"), ("rollout", "receive")]  # connected once


@pytest.mark.parametrize("backend", ["colocated", "bytes"])
def test_a_gathered_backend_goes_through_the_object_store(fake, backend):
    group, rollout, calls = fake
    sync = ws.WeightSync(group, rollout, WeightSyncConfig(backend=backend, update_weights_bucket_megabytes=0.5))
    out = sync.sync()
    assert calls == [
        (0, "export", 2**19, None, None),
        (1, "export", 2**19, None, None),
        ("rollout", "update", [("w", None)], {"transport": backend, "bucket_megabytes": 0.5}),
    ]
    assert (out["transport"], out["bytes"]) == (backend, 10)
    with pytest.raises(ValueError, match=rf"checkpoint_engine.backend='{backend}' does not stream"):
        sync.connect()


def test_the_two_call_form_still_works(fake):
    group, rollout, calls = fake
    connected = ws.connect_weight_sync(group, rollout, transport="broadcast", bucket_megabytes=7)
    assert connected.connected and connected.config.shm_dir == WeightSyncConfig().shm_dir
    assert calls[0] == (0, "listen", (3, "broadcast", 7, WeightSyncConfig().shm_dir, None, None))
    calls.clear()
    assert ws.sync_weights(group, rollout)["receiver_seconds"] == 0.25
    assert calls == [(0, "sync"), (1, "sync"), ("rollout", "receive")]


def test_rollout_quantization_reaches_every_rank_of_both_paths(fake):
    """``quantization="fp8"`` (``rollout.quantization``): every actor rank exports (gathered path) or
    listens (streamed path) with it, so rank 0 quantises the stream it sends."""
    group, rollout, calls = fake
    ws.WeightSync(
        group, rollout, WeightSyncConfig(backend="bytes", update_weights_bucket_megabytes=0.5), quantization="fp8"
    ).sync()
    assert calls[:2] == [(0, "export", 2**19, None, "fp8"), (1, "export", 2**19, None, "fp8")]
    calls.clear()
    ws.WeightSync(
        group,
        rollout,
        WeightSyncConfig(backend="shm", update_weights_bucket_megabytes=3, shm_dir="/tmp"),
        quantization="fp8",
    ).sync()
    assert calls[:2] == [
        (0, "listen", (3, "shm", 3, "/tmp", None, "fp8")),
        (1, "listen", (3, "shm", 3, "/tmp", None, "fp8")),
    ]


def test_every_replica_joins_the_side_band_at_its_own_ranks(fake):
    """Two replicas (TP 2 and TP 3): the world is 1 + 2 + 3, replica 0's workers take ranks 1-2 and
    replica 1's ranks 3-5; both receive every sync."""
    group, _, calls = fake
    rollouts = [_Handle(_Rollout(calls, "r0", tp=2)), _Handle(_Rollout(calls, "r1", tp=3))]
    sync = ws.WeightSync(group, rollouts, WeightSyncConfig(backend="shm", shm_dir="/tmp"))
    out = sync.sync()
    assert [c for c in calls if c[1] == "connect" and isinstance(c[0], str)] == [
        ("r0", "connect", "10.0.0.1", 4242, 6, 1),
        ("r1", "connect", "10.0.0.1", 4242, 6, 3),
    ]
    assert calls[0][2][0] == 6  # every actor rank listens for a world of 6
    assert [c for c in calls if c[1] == "receive"] == [("r0", "receive"), ("r1", "receive")]
    assert out["replicas"] == 2
