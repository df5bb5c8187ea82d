"""Where a round's rows sit: one stream's position, or a row table for several streams.

A round of one stream passes `pos`, int32 [1] on the device: row r is at position
pos + r and its K/V live at cache row pos + r (the single-stream form, every kernel's
default). A round of several streams (parallel streams, `-np N`) passes a row table,
int32 [3, R] on the device (R >= the round's rows, a graph input of fixed shape):

    table[POSITION, r]   row r's position in its own sequence (RoPE, causal length)
    table[BASE, r]       its stream's first cache row (its slot's KV base)
    table[FIRST, r]      the position of its stream's first row in this round

so row r writes its K/V at cache row base + position and attends to cache rows
base .. base + position. Its arithmetic is a function of its position and its own keys
alone, exactly as in the single-stream form (the same integers index the same values),
so a stream's rows get the same bits alone or beside other streams' rows.
FIRST is what the attention's early loads need (decode.py: rows below it were written
by earlier rounds).
"""
from __future__ import annotations

import torch

POSITION, BASE, FIRST = 0, 1, 2


def rows_stride(pos: torch.Tensor) -> int:
    """The kernels' ROWS constexpr: 0 for the single-stream pos [1], else the table's row length."""
    return 0 if pos.dim() == 1 else pos.shape[1]


def fill_table(table: torch.Tensor, parts: list[tuple[int, int, int]], pad_base: int) -> None:
    """table int32 [3, R] <- the rows of `parts`, each (rows, position of its first row,
    KV base), side by side from row 0; the rows past them (a bucket's padding) at
    positions 0.. of base pad_base (a spare region no real row reads)."""
    host = torch.zeros(3, table.shape[1], dtype=torch.int32)                 # [3, R]
    r = 0
    for n, pos, base in parts:
        host[POSITION, r:r + n] = torch.arange(pos, pos + n, dtype=torch.int32)
        host[BASE, r:r + n] = base
        host[FIRST, r:r + n] = pos
        r += n
    if r > table.shape[1]:
        raise ValueError(f"{r} rows do not fit a row table of {table.shape[1]}")
    pad = table.shape[1] - r
    host[POSITION, r:] = torch.arange(pad, dtype=torch.int32)
    host[BASE, r:] = pad_base
    table.copy_(host)


def row_positions(pos: torch.Tensor, W: int) -> torch.Tensor:
    """Each of W rows' position, [W] (device): pos + r, or the table's positions."""
    if pos.dim() == 1:
        return pos + torch.arange(W, device=pos.device, dtype=pos.dtype)
    return pos[POSITION, :W]
