"""What every CUDA graph capture here shares: Python's cyclic garbage collector paused.

CUDA refuses to reset a graph while a stream captures, and the refusal invalidates that
capture. A collection that frees an unreachable CUDAGraph (an earlier model's graphs, held
in a reference cycle) runs exactly that reset, and automatic collections are triggered by
allocations, which a capture makes plenty of (Triton launch arguments, tensors).
torch.cuda.graph() no longer collects on entry (torch >= 2.x: only under
torch.compiler.config.force_cudagraph_gc), so nothing else closes that window. Seen on the
H200 (88040c1): a model's bucket captures after earlier tests' models had become garbage
printed a "not permitted when stream is capturing (function reset)" warning per dead graph,
then failed with a sticky "previous error during capture".
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused(collect: bool = False) -> Iterator[None]:
    """The automatic cyclic collector off inside the block, restored as it was after.
    collect: one full collection first, outside any capture (dead graphs freed, and their
    memory, before new ones are captured; once a batch of captures, not per stretch)."""
    if collect:
        gc.collect()
    on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if on:
            gc.enable()
