"""The round's CUDA graphs: one per width bucket, captured once per cache (static token and
position buffers, one memory pool), replayed for every round up to 64 rows."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .capture import collector_paused
from .widths import BUCKETS, bucket_of

if TYPE_CHECKING:
    from .gpu_model import GPUModel


def capture(m: "GPUModel") -> float:
    """m.graphs[b] = (graph, logits, hidden) for every bucket b; -> the seconds it took."""
    t0 = time.perf_counter()
    cache = m.cache
    pool = torch.cuda.graph_pool_handle()
    m._pos.zero_()
    m._tokens.zero_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in BUCKETS:                 # compile every kernel at every width first
            m._rows(m._tokens[:b], m._pos, cache)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with collector_paused(collect=True):      # no graph's reset mid-capture (runtime/capture.py)
        for b in reversed(BUCKETS):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                logits, hidden = m._rows(m._tokens[:b], m._pos, cache)
            m.graphs[b] = (g, logits, hidden)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def replay(m: "GPUModel", part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """part [W] tokens (m._pos already set) through its bucket's graph -> the graph's static
    (logits [W, V], hidden [W, D]), valid until the next replay."""
    W = part.shape[0]
    b = bucket_of(W)
    m._tokens[:W].copy_(part)
    if b > W:   # padding rows: any token; their K/V land past the real rows and are overwritten later
        m._tokens[W:b].fill_(0)
    g, g_logits, g_hidden = m.graphs[b]
    g.replay()
    return g_logits[:W], g_hidden[:W]
