"""The cache of a hybrid model: K/V rows for its attention layers and, for its recurrent
(Gated DeltaNet) layers, the conv window and the delta-rule state.

A KV cache rolls back by forgetting rows; a recurrent state cannot: it holds one
position, the last. So the cache keeps the positions it can return to ("points"):

- 0 (the empty state) and the current length, always;
- the prompt boundary, saved by `checkpoint()` (the engine calls it before a prompt's
  last row), so that the next chat turn, which re-uses the prompt but not necessarily
  the answer as it was generated, continues from there instead of from scratch;
- within a verify round (`begin_round` .. `truncate`), every row of the round: either a
  copy of the state after each row ("snapshot") or the round's recurrence inputs, from
  which the state of any accepted prefix is recomputed from the state before the round
  ("replay"; no projections are redone, only the recurrence).

`restorable(n)` says the longest prefix of at most n rows the cache can return to, and
`truncate(n)` returns there; every point past n is dropped (its rows are about to be
overwritten by other tokens).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .kv_cache import KVCache

State = tuple[torch.Tensor, torch.Tensor]    # conv [R, d_conv-1, C], ssm [R, H, dk, dv]
SNAPSHOT, REPLAY = "snapshot", "replay"


class HybridCache(KVCache):
    def __init__(self, n_attn_layers: int, n_kv_heads: int, max_len: int, head_dim: int,
                 n_rec_layers: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                 replay: Callable[[list, int, State], State], mode: str = REPLAY,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """replay(inputs, n, state): the state after the first n rows of a round whose per-layer
        recurrence inputs are `inputs`, from the round's starting state (model-provided)."""
        if mode not in (SNAPSHOT, REPLAY):
            raise ValueError(f"state commit mode must be {SNAPSHOT!r} or {REPLAY!r}, not {mode!r}")
        super().__init__(n_attn_layers, n_kv_heads, max_len, head_dim, dtype, device)
        self.conv = torch.zeros((n_rec_layers, *conv_shape), dtype=torch.float32, device=device)
        self.ssm = torch.zeros((n_rec_layers, *ssm_shape), dtype=torch.float32, device=device)
        self.mode = mode
        self._replay = replay
        self.boundary: tuple[int, State] | None = None
        self.round_pos: int | None = None           # first position of the open round
        self.round_pre: State | None = None         # the state there
        self.round_snaps: list[State] = []          # snapshot: state after each row of the round
        self.round_inputs: list[list] = []          # replay: per forward of the round, per-layer inputs

    # -- points ------------------------------------------------------------------
    def _state(self) -> State:
        return self.conv.clone(), self.ssm.clone()

    def _set(self, s: State) -> None:
        self.conv.copy_(s[0])
        self.ssm.copy_(s[1])

    def _points(self) -> list[int]:
        pts = [0, self.length]
        if self.boundary is not None:
            pts.append(self.boundary[0])
        if self.round_pos is not None:
            pts += range(self.round_pos, self.length + 1)
        return pts

    def restorable(self, n: int) -> int:
        return max(p for p in self._points() if p <= n)

    def checkpoint(self) -> None:
        """Remember the state at the current length (the prompt boundary)."""
        self.boundary = (self.length, self._state())

    def _state_at(self, n: int) -> State | None:
        """The state at a point n != length (None: the empty state)."""
        if self.round_pos is not None and self.round_pos <= n < self.length:
            k = n - self.round_pos
            if k == 0:
                return self.round_pre
            if self.mode == SNAPSHOT:
                return self.round_snaps[k - 1]
            return self._replay(self.round_inputs, k, self.round_pre)
        if self.boundary is not None and self.boundary[0] == n:
            return self.boundary[1]
        if n == 0:
            return None
        raise ValueError(f"the recurrent state cannot return to position {n} (it can to {sorted(set(self._points()))})")

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {n}")
        if n != self.length:
            s = self._state_at(n)
            if s is None:
                self.conv.zero_()
                self.ssm.zero_()
            else:
                self._set(s)
        self.length = n
        if self.boundary is not None and self.boundary[0] > n:
            self.boundary = None
        self._close_round()

    # -- rounds --------------------------------------------------------------------
    def _close_round(self) -> None:
        self.round_pos, self.round_pre = None, None
        self.round_snaps, self.round_inputs = [], []

    def begin_round(self, pos: int) -> None:
        """A verify round starts at pos (= length): its rows become points."""
        self.prepare(pos)
        self._close_round()
        self.round_pos, self.round_pre = pos, self._state()

    def _refuse(self, pos: int) -> None:
        raise ValueError(f"a round at position {pos} needs the state there; the cache can return to "
                         f"{sorted(set(self._points()))}")

    def prepare(self, pos: int) -> None:
        """Make the state the one at pos before rows starting there run (a forward at
        pos < length re-runs rows: the state must be returned there first)."""
        if pos != self.length:
            if self.restorable(pos) != pos:
                self._refuse(pos)
            self.truncate(pos)

    def record(self, per_row_states: list[State] | None, inputs: list | None) -> None:
        """A forward inside the round ran: its per-row states (snapshot) or inputs (replay)."""
        if self.round_pos is None:
            return
        if self.mode == SNAPSHOT:
            self.round_snaps += per_row_states or []
        else:
            self.round_inputs.append(inputs)

    @property
    def recording(self) -> str | None:
        """What the model should hand to `record` for the rows it runs now (None: nothing)."""
        return None if self.round_pos is None else self.mode

