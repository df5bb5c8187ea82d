"""The expert store's admissions: their per-round budget and their paced copies.

An admission copies one expert's planes from the host tier (or the mapped file) into a
bank slot, in chunks queued on a side stream after a round was launched, so a copy never
delays a round's own inputs (store.py says when the slot is published).

The budget is per stream of the round. The store's other per-round quantities already
are: the policy's counts decay once a round (policy.py), and a round of N streams is one
round of each of them, so each stream's usage keeps the memory it has alone (32 of its
own rounds); and its rows' picks add up, so the bank holds the experts the round's rows
use most, whichever stream they are. What a single budget per round would not follow is
the drift: each stream's context moves its hot set as it does alone, so N streams move
the union about N times as far a round, and a budget sized for one stream's rounds would
let the bank lag behind N contexts (bench/offload_streams_admission.py measures it: the
store's own policy and copies driven by N streams' synthetic routing with drifting
topics, the hit rate and the admissions per round at N = 1, 2, 4 with the budget per
round and per stream). So a round carrying rows of `streams` streams may queue
`streams` times the one-stream budget (`round_budget`): each stream brings the
admission it has at -np 1, and -np 1 is unchanged. The count is the round's own (the
streams whose rows it carried), not -np: idle slots bring nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Admission:
    slot: int
    flat: int                                         # layer * E + expert
    chunks: list[tuple[torch.Tensor, torch.Tensor]]   # (dst, src) pairs still to queue
    ready: object = None                              # cuda Event after the last chunk (None on CPU: done)


def round_budget(per_stream: int, streams: int) -> int:
    """Bytes of admission copies a round may queue: per_stream (the store's
    admit_bytes_per_round, a one-stream round's) for each stream the round carried."""
    if streams < 1:
        raise ValueError(f"a round carries at least one stream's rows, got {streams}")
    return per_stream * streams


def queue_copies(admissions: list[Admission], budget: int, copy_stream, stats) -> None:
    """Queue the admissions' next chunks, in order, until `budget` bytes are queued (the
    chunk that crosses it goes too). copy_stream: the side stream (None: no CUDA, the
    copies are synchronous); stats: the policy's HitStats (admitted_bytes)."""
    for a in admissions:
        while a.chunks and budget > 0:
            dst, src = a.chunks.pop(0)
            n = dst.numel() * dst.element_size()
            if copy_stream is not None:
                with torch.cuda.stream(copy_stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            budget -= n
            stats.admitted_bytes += n
        if not a.chunks and copy_stream is not None and a.ready is None:
            a.ready = torch.cuda.Event()
            a.ready.record(copy_stream)
        if budget <= 0:
            break
