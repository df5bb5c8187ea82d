"""The hybrid round's CUDA graphs (GPUHybridModel; runtime/graphs.py is GPUModel's): the step
(one row, the recurrent states written) and the verify round of every width bucket (states
left for the commit), captured once per cache on one memory pool, replayed with the rows'
tokens copied into a static buffer.

A verify round of W rows replays its bucket b >= W with padding rows after the real ones. They
are harmless where the graph's arithmetic is row-invariant (every kernel of the round): their
K/V land past the real rows (overwritten by later rows, never read before), their conv ring
rows at positions pos + W .. pos + b - 1 overwrite slots of positions at least 72 - 64 = 8
older than the round's first row (the ring keeps 72 rows, a row reads 3 back), and their
beta / alpha rows sit past the n a commit reads. So a prompt's rows (1 < T <= 64) run as a
verify round committed to all T rows: the state of T steps (tests/runtime/test_gpu_hybrid.py).

On a HybridSlots cache (parallel streams) the graphs take the model's seats (hybrid_seats.py)
as their inputs beside the tokens: one graph a width bucket serves every mix of streams, steps
and verify rounds (the segments say which states are written), once for all the slots. The
padding rows are in no segment: they touch no ring or state.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from . import hybrid_round
from .capture import collector_paused
from .widths import BUCKETS, bucket_of

if TYPE_CHECKING:
    from .gpu_hybrid import GPUHybridModel
    from .hybrid_cache import GPUHybridCache

STEP = 0     # the key of the step's graph in m.graphs; a verify bucket's key is its width b >= 1


def capture(m: GPUHybridModel, cache: GPUHybridCache) -> float:
    """m.graphs[STEP] and m.graphs[b] for every bucket b = (graph, logits, hidden); the cache's
    states are zeroed after the warm-up rounds. -> the seconds it took."""
    t0 = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    m._pos.zero_()
    m._tokens.zero_()
    seats = m.seats
    if seats is not None:                       # the slots' passes: a bucket's graph for steps and rounds
        seats.fill([], cache.max_len)           # (no segment: the warm-ups touch no stream's state)
        shapes = [(b, b, True) for b in BUCKETS]
    else:
        shapes = [(STEP, 1, False)] + [(b, b, True) for b in BUCKETS]       # (key, rows, verify)
    pos = m._pos if seats is None else seats.table
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _, W, verify in shapes:             # compile every kernel at every width first
            hybrid_round.rows(m, m._tokens[:W], pos, cache, verify, seats)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with collector_paused(collect=True):
        for key, W, verify in reversed(shapes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                logits, hidden = hybrid_round.rows(m, m._tokens[:W], pos, cache, verify, seats)
            m.graphs[key] = (g, logits, hidden)
    torch.cuda.synchronize()
    cache.ring.zero_()                          # the warm-up's step wrote them
    cache.ssm.zero_()
    return time.perf_counter() - t0


def replay(m: GPUHybridModel, part: torch.Tensor, verify: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """part [W] tokens (m._pos or m.seats set) through the step's graph (W = 1, not verify) or
    its verify bucket's (the slots' passes: always) -> the graph's static (logits [W, V],
    hidden [W, D]), valid until the next replay."""
    W = part.shape[0]
    key = bucket_of(W) if verify else STEP
    if not verify and W != 1:
        raise ValueError(f"the step graph takes one row, got {W}")
    m._tokens[:W].copy_(part)
    if verify and key > W:
        m._tokens[W:key].fill_(0)
    g, logits, hidden = m.graphs[key]
    g.replay()
    return logits[:W], hidden[:W]
