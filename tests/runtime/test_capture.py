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


def test_collects_first_when_asked():
    """A dead cycle is gone after entering with collect=True, though the collector is off."""
    import weakref

    class Node:
        pass

    gc.disable()
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        del a, b
        assert ref() is not None                       # a cycle: refcounts alone do not free it
        with collector_paused(collect=True):
            assert ref() is None and not gc.isenabled()
    finally:
        gc.enable()
