"""runtime/capture.collector_paused: the automatic collector off inside, restored after
(also when the block raises, and left off when it was off)."""
from __future__ import annotations

import gc

import pytest

from alphallama.runtime.capture import collector_paused


def test_pauses_and_restores_the_collector():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
