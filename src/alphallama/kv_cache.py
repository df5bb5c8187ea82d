"""The KV cache: preallocated per-layer K and V, and a committed length.

Rows are written at their positions by the forward pass; `length` says how many are
committed. Rolling back a rejected speculative suffix is `truncate(n)`: attention only
ever reads positions below the current row, so rows past `length` leave no trace and
are simply overwritten later. (A recurrent state cannot forget rows: hybrid_cache.py
keeps the positions it can return to; `restorable` and `checkpoint` are the common interface.)

Parallel streams (`-np N`) share one cache in N slots (`split`): slot s is rows
s * S .. s * S + S - 1 of every layer, a view with its own committed length, so each
stream's prefill and the CPU model write what looks like a sequence of its own, and the
GPU round reads the slot's base (KVSlot.base) from its row table.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (n_layers, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, n_kv, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, n_kv, max_len, head_dim]
        self.max_len = max_len
        self.length = 0

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {n}")
        self.length = n

    def restorable(self, n: int) -> int:
        """The longest prefix of at most n rows the cache can return to (any, up to its length)."""
        return min(n, self.length)

    boundary = None     # a recurrent cache's remembered point (hybrid_cache.py); none here

    def checkpoint(self) -> None:
        """Nothing to remember: any prefix of the rows is restorable."""

    @contextmanager
    def trial(self) -> Iterator[int]:
        """Rows run inside are thrown away: inside, truncate(start) returns to the start (a
        hybrid's recurrent state too, through a checkpoint there); on exit the cache is at its
        length again with the points it had (the prompt boundary a next turn continues from)."""
        start, kept = self.length, self.boundary
        self.checkpoint()
        try:
            yield start
        finally:
            self.truncate(start)
            self.boundary = kept

    def split(self, n: int, rows: int) -> list["KVSlot"]:
        """n slots of `rows` rows each, at bases 0, rows, 2 rows, ...; the rows past them stay spare."""
        if n * rows > self.max_len:
            raise ValueError(f"{n} slots of {rows} rows do not fit a cache of {self.max_len}")
        return [KVSlot(self, s * rows, rows) for s in range(n)]


class KVSlot(KVCache):
    """One stream's slot of a shared KVCache: rows base .. base + max_len - 1 of every layer."""

    def __init__(self, parent: KVCache, base: int, max_len: int):   # (no allocation: views of the parent)
        self.parent, self.base = parent, base
        self.k = parent.k[:, :, base:base + max_len]   # [L, n_kv, max_len, head_dim] a view
        self.v = parent.v[:, :, base:base + max_len]   # [L, n_kv, max_len, head_dim]
        self.max_len = max_len
        self.length = 0
