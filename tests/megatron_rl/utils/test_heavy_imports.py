"""collector_paused: automatic collection is off inside the block (an explicit collect still runs) and
the collector is as it was after it, also when the block raises; nothing is frozen."""

import gc

import pytest

from megatron_rl.utils.heavy_imports import collector_paused


def test_the_collector_is_paused_inside_and_restored_after():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        gc.collect()  # explicit collections still run
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("an import failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()
