"""What every CUDA graph capture here shares: Python's cyclic garbage collector paused.

CUDA refuses to reset a graph while a stream captures, and the refusal invalidates that
capture. A collection that frees an unreachable CUDAGraph (say an earlier model's, held in
a reference cycle) runs exactly that reset, and collections are triggered by allocations,
which a capture makes plenty of (Triton launch arguments, tensors). torch.cuda.graph()
collects once on entry; pausing the automatic collector for the capture closes the rest of
the window (explicit gc.collect() calls, torch.cuda.graph's included, still run).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The automatic cyclic collector off inside the block, restored as it was after."""
    on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if on:
            gc.enable()
