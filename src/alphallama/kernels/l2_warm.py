"""The weights ahead read into L2 on a side branch of the round (engine.l2_warm_mb).

Why: with PDL on, an 8B round is 1.46 ms of GEMVs and 0.51 ms of small kernels (norms,
RoPE, attention, SiLU: bench/results/gpu_decode_ablate-qwen3-8b-20261201-220144.json),
and during the small kernels HBM is nearly idle: ~14 us a layer, ~56 MB at the copy
rate. A kernel on a second stream, forked right after a GEMV (so it starts when that
GEMV ends) and joined at the end of the round, reads the next budget's worth of the
round's weight stream (the next GEMVs' rows in the order their programs read them)
through L2 (`.cg`: not kept in L1) while the main chain's latency-bound kernels run on a
few SMs; the GEMVs' first programs then find their rows in L2.

Session 17 tried L2 prefetch from inside the small kernels (cp.async.bulk.prefetch.L2,
one instruction per 64 KB chunk before their PDL wait) and the rounds got 3-4x slower:
the prefetches were served at 0.3-0.4 TB/s and the issuing kernels waited on them. Here
the reads are ordinary vector loads spread over many CTAs, in a kernel nothing on the
main chain waits for. Bits: untouched (nothing is written but a sink, never in practice).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 4096          # int32 words a program a step: 32 a thread at 4 warps (8 16-byte loads in flight)
PROGRAMS = 264        # 2 a H200 SM: enough bytes in flight, few enough to leave the main chain room
SEGMENTS = 4          # (pointer, words) pairs a launch


@triton.jit
def _touch(p, n, acc, BLOCK: tl.constexpr, P: tl.constexpr):
    """acc ^ every int32 word of p[0:n] this program's share covers (P programs interleave by BLOCK)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = 0
    while start < n:                  # (a while: the interpreter takes no run-time range() bound)
        acc ^= tl.load(p + start + offs, mask=start + offs < n, other=0, cache_modifier=".cg")
        start += P * BLOCK
    return acc


@triton.jit
def _warm_kernel(p0, n0, p1, n1, p2, n2, p3, n3, sink, flag, BLOCK: tl.constexpr, P: tl.constexpr):
    """Reads the words of up to four segments (n = 0: none) over a grid of P programs; the xor
    of what a program read goes to sink[program] only if flag != 0, which the round never
    sets: the loads must look used, or the compiler drops them."""
    acc = tl.zeros([BLOCK], tl.int32)
    acc = _touch(p0, n0, acc, BLOCK, P)
    acc = _touch(p1, n1, acc, BLOCK, P)
    acc = _touch(p2, n2, acc, BLOCK, P)
    acc = _touch(p3, n3, acc, BLOCK, P)
    tl.store(sink + tl.program_id(0), tl.xor_sum(acc, axis=0), mask=flag != 0)


def rows_words(w, f0: float, f1: float) -> list[torch.Tensor]:
    """The rows [floor(f0 N), ceil(f1 N)) of every plane of weight w (a GEMV's programs read
    its rows in order, all planes of a row together; a split run's halves are in the same
    row), as flat int32 views cut to whole 16-word groups (the JIT then knows n % 16 == 0
    and the loads become 16-byte ones)."""
    out = []
    for p in w.planes.values():
        rows = p.reshape(-1, p.shape[-1])                                     # [N, per_row]
        r0, r1 = math.floor(rows.shape[0] * f0), math.ceil(rows.shape[0] * f1)
        flat = rows[r0:r1].reshape(-1).view(torch.uint8)                      # [(r1 - r0) * row_bytes]
        words = flat[:flat.numel() // 64 * 64].view(torch.int32)
        if words.numel():
            out.append(words)
    return out


def stream_plan(gemvs: list[list], budget: int) -> list[list[torch.Tensor]]:
    """The round's dense GEMVs in order (each a list of QuantWeights) as one stream of bytes;
    the warm launch after GEMV k keeps the `budget` bytes from GEMV k + 1's first byte warm:
    it reads what of them the earlier launches did not (never a GEMV that ran, and never
    more than `budget` ahead, or with two launches a layer and 11 MB of weights a layer
    (30B-A3B) the reads would run ahead of the round and out of L2). -> the segments of each
    of the len(gemvs) - 1 launches (after the last GEMV there is nothing ahead)."""
    starts, weights, end = [], [], 0          # each GEMV's first byte; (first byte, weight) of every weight
    for g in gemvs:
        starts.append(end)
        for w in g:
            weights.append((end, w))
            end += w.nbytes
    cursor, plan = 0, []
    for k in range(len(gemvs) - 1):
        a = max(cursor, starts[k + 1])
        b = min(end, starts[k + 1] + budget)
        segs = []
        for off, w in weights:
            if off < b and off + w.nbytes > a:
                segs += rows_words(w, max(0.0, (a - off) / w.nbytes), min(1.0, (b - off) / w.nbytes))
        plan.append(segs)
        cursor = max(a, b)
    return plan


class L2Warm:
    """Launches that read segments into L2; sink and flag are this object's (flag 0)."""

    def __init__(self, device, programs: int = PROGRAMS):
        self.programs = programs
        self.sink = torch.zeros(programs, dtype=torch.int32, device=device)
        self.flag = 0

    def warm(self, segments: list[torch.Tensor]) -> None:
        for i in range(0, len(segments), SEGMENTS):
            group = segments[i:i + SEGMENTS]
            args = []
            for s in group:
                args += [s, s.numel()]
            args += [self.sink, 0] * (SEGMENTS - len(group))      # (no segment: nothing read)
            _warm_kernel[(self.programs,)](*args, self.sink, self.flag, BLOCK=BLOCK, P=self.programs, num_warps=4)
