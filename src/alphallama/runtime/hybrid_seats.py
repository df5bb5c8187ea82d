"""Where a parallel-streams pass's rows sit on the hybrids' GPU runtime (GPUHybridModel with
a HybridSlots cache): three graph inputs, filled before each pass, that say whose rows are
whose. Every pass of such a model goes through them, one stream's too, so a stream's bits
never depend on whether it shares a pass.

    table    int32 [3, 64]   kernels/attention/rows.py's row table: each row's position, its
                             slot's KV base and its stream's first position (the attention)
    segs     int32 [5, N]    kernels/deltanet/step.py's segments, one per stream of the pass:
                             its slot, position, first row, rows, and whether its state is
                             written (a step) or left for the commit (a verify round)
    ab_rows  int64 [64]      each row's row in a layer's gates HybridSlots.ab[i] viewed
                             [(N + 1) * 64, 2 Hv]: row t of slot s's stream at s * 64 + t, so
                             its commit finds them where one stream's cache keeps them

A pass's padding rows (its width bucket's) sit at positions 0.. of the spare KV rows, in no
segment (their recurrent outputs are zeros, no state or ring is touched) and in the spare
slot N's gates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels.attention.rows import fill_table
from ..kernels.deltanet.common import W_MAX
from ..kernels.deltanet.step import SEG_POS, SEG_ROW, SEG_ROWS, SEG_SLOT, SEG_WRITE

if TYPE_CHECKING:
    from .hybrid_cache import HybridSlot


@dataclass(frozen=True)
class Seats:
    table: torch.Tensor      # int32 [3, 64]
    segs: torch.Tensor       # int32 [5, N]
    ab_rows: torch.Tensor    # int64 [64]

    @classmethod
    def new(cls, n: int, device) -> Seats:
        return cls(torch.zeros(3, W_MAX, dtype=torch.int32, device=device),
                   torch.zeros(5, n, dtype=torch.int32, device=device),
                   torch.zeros(W_MAX, dtype=torch.int64, device=device))

    def fill(self, parts: list[tuple[HybridSlot, int, int, bool]], pad_base: int) -> None:
        """parts [(slot, first position, rows, write)], side by side from row 0 (at most one
        a slot); pad_base: the spare KV rows. No part: every row a padding row (the capture)."""
        n = self.segs.shape[1]
        if len(parts) > n or len({s.index for s, *_ in parts}) < len(parts):
            raise ValueError(f"a pass takes at most one part of each of the {n} slots")
        fill_table(self.table, [(rows, pos, s.base) for s, pos, rows, _ in parts], pad_base)
        segs = torch.zeros(5, n, dtype=torch.int32)                               # [5, N]
        ab_rows = torch.empty(W_MAX, dtype=torch.int64)                           # [64]
        r = 0
        for g, (s, pos, rows, write) in enumerate(parts):
            segs[[SEG_SLOT, SEG_POS, SEG_ROW, SEG_ROWS, SEG_WRITE], g] = torch.tensor(
                [s.index, pos, r, rows, int(write)], dtype=torch.int32)
            ab_rows[r:r + rows] = s.index * W_MAX + torch.arange(rows)
            r += rows
        ab_rows[r:] = n * W_MAX + torch.arange(W_MAX - r)                         # the spare slot's
        self.segs.copy_(segs)
        self.ab_rows.copy_(ab_rows)
