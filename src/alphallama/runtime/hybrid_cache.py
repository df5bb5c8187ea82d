"""The GPU runtime's cache of a hybrid model: K/V rows (fp16) for its attention layers, and per
recurrent (Gated DeltaNet) layer the conv ring [72, C] and the delta-rule state [Hv, dk, dv]
(fp32), stacked over the layers so one commit launch takes them all
(kernels/deltanet/step.py). It answers the engine as the CPU model's cache does
(hybrid_cache.HybridCache: restorable, checkpoint, truncate), with the GPU's replay commit:

- A verify round of W > 1 rows (`open_round`) leaves the state as it was before the round
  (the verify kernel writes outputs and ring rows, not the state) and keeps its rows' alpha /
  beta in `ab`; the round stays open, its rows are points, until a truncate (or the next
  forward) settles it: `deltanet_commit` replays the first n rows into every layer's state
  in one launch (n on the device). The ring needs nothing: it already holds every row.
- `checkpoint()` copies the rings and states (the prompt boundary a next turn continues
  from); truncating to it copies them back; truncating to 0 zeroes them.

Parallel streams (`-np N`): `HybridSlots` holds N streams' K/V rows (slot s at KV base s * S,
as KVCache.split), rings, states and round gates side by side, so one round's kernels reach
every stream's (the row table and deltanet_slots' segments say whose rows are whose); its
`split` gives each stream a `HybridSlot`, a GPUHybridCache over its views with its own
length, points and open round.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.deltanet.common import RING_ROWS, W_MAX
from ..kv_cache import KVCache


class GPUHybridCache(KVCache):
    def __init__(self, n_attn: int, n_kv: int, max_len: int, head_dim: int, n_rec: int, channels: int,
                 ssm_shape: tuple[int, int, int], commit: Callable[[GPUHybridCache, int, int], None], device):
        """commit(cache, pos, n): replay the first n rows of the round at pos into the states (the model's)."""
        super().__init__(n_attn, n_kv, max_len, head_dim, dtype=torch.float16, device=device)
        hv = ssm_shape[0]
        self.ring = torch.zeros(n_rec, RING_ROWS, channels, dtype=torch.float32, device=device)   # [Lr, R, C]
        self.ssm = torch.zeros(n_rec, *ssm_shape, dtype=torch.float32, device=device)             # [Lr, Hv, dk, dv]
        self.ab = torch.zeros(n_rec, W_MAX, 2 * hv, dtype=torch.float32, device=device)          # [Lr, 64, beta | alpha]
        self._points_init(commit)

    def _points_init(self, commit: Callable[[GPUHybridCache, int, int], None]) -> None:
        self._commit = commit
        self.boundary: tuple[int, torch.Tensor, torch.Tensor] | None = None   # (length, ring, ssm) copies
        self.round: tuple[int, int] | None = None     # (pos, W) of the open verify round

    # -- rounds ------------------------------------------------------------------------
    def open_round(self, pos: int, W: int) -> None:
        """A verify round of W rows at pos ran (state not written): its rows become points."""
        self.round = (pos, W)

    def _settle(self, n: int) -> None:
        """Close the open round keeping its first n - pos rows (pos <= n <= pos + W)."""
        pos, _ = self.round
        self.round = None
        if n > pos:
            self._commit(self, pos, n - pos)

    # -- points ------------------------------------------------------------------------
    def _points(self) -> list[int]:
        pts = [0, self.length]
        if self.boundary is not None:
            pts.append(self.boundary[0])
        if self.round is not None:
            pts += range(self.round[0], self.length + 1)
        return pts

    def restorable(self, n: int) -> int:
        return max(p for p in self._points() if p <= n)

    def checkpoint(self) -> None:
        """Remember the state at the current length (the prompt boundary)."""
        if self.round is not None:
            self._settle(self.length)
        self.boundary = (self.length, self.ring.clone(), self.ssm.clone())

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {n}")
        if self.round is not None and self.round[0] <= n:
            self._settle(n)
        elif n != self.length or self.round is not None:
            self.round = None
            if self.boundary is not None and self.boundary[0] == n:
                self.ring.copy_(self.boundary[1])
                self.ssm.copy_(self.boundary[2])
            elif n == 0:
                self.ring.zero_()
                self.ssm.zero_()
            else:
                raise ValueError(f"the recurrent state cannot return to position {n} "
                                 f"(it can to {sorted(set(self._points()))})")
        self.length = n
        if self.boundary is not None and self.boundary[0] > n:
            self.boundary = None

    def prepare(self, pos: int) -> None:
        """Before rows at pos run: the state made the one at pos (an open round settled)."""
        if pos != self.length or self.round is not None:
            if self.restorable(pos) != pos:
                raise ValueError(f"a forward at position {pos} needs the state there; the cache can return to "
                                 f"{sorted(set(self._points()))}")
            self.truncate(pos)


class HybridSlots(KVCache):
    """N streams' storage (parallel streams): K/V of N slots of `rows` rows and the spare rows
    a padded round's padding writes (KVCache.split's layout), and per slot the rings, states
    and round gates of a GPUHybridCache, stacked on a leading slot axis. The gates have one
    slot more, the padding rows': [Lr, N + 1, 64, 2 Hv], so that slot s's view [Lr, 64, 2 Hv]
    is what its commit reads and a round's layer i scatters its rows into ab[i]."""

    def __init__(self, n: int, rows: int, n_attn: int, n_kv: int, head_dim: int, n_rec: int, channels: int,
                 ssm_shape: tuple[int, int, int], commit: Callable[[GPUHybridCache, int, int], None], device):
        super().__init__(n_attn, n_kv, n * rows + W_MAX, head_dim, dtype=torch.float16, device=device)
        self.max_len = n * rows                 # (the W_MAX rows past it: the padding's)
        self.n, self.rows = n, rows
        self.ring = torch.zeros(n, n_rec, RING_ROWS, channels, dtype=torch.float32, device=device)  # [N, Lr, R, C]
        self.ssm = torch.zeros(n, n_rec, *ssm_shape, dtype=torch.float32, device=device)            # [N, Lr, Hv, dk, dv]
        self.ab = torch.zeros(n_rec, n + 1, W_MAX, 2 * ssm_shape[0], dtype=torch.float32,
                              device=device)                                             # [Lr, N + 1, 64, 2Hv]
        self._commit = commit

    def split(self, n: int, rows: int) -> list[HybridSlot]:
        if (n, rows) != (self.n, self.rows):
            raise ValueError(f"this storage holds {self.n} slots of {self.rows} rows, not {n} of {rows}")
        return [HybridSlot(self, s) for s in range(n)]


class HybridSlot(GPUHybridCache):
    """Slot `index` of a HybridSlots: a GPUHybridCache over views of its rows (no allocation)."""

    def __init__(self, parent: HybridSlots, index: int):
        self.parent, self.index = parent, index
        self.base = index * parent.rows
        self.k = parent.k[:, :, self.base:self.base + parent.rows]     # [La, n_kv, rows, hd] views
        self.v = parent.v[:, :, self.base:self.base + parent.rows]
        self.ring, self.ssm = parent.ring[index], parent.ssm[index]    # [Lr, R, C], [Lr, Hv, dk, dv]
        self.ab = parent.ab[:, index]                                  # [Lr, 64, 2Hv]
        self.max_len, self.length = parent.rows, 0
        self._points_init(parent._commit)
