"""The CPU workers' share of a round's host-tier misses, tuned on the rounds themselves.

A missed (row, rank) pair of a host-tier expert is computed either by the CPU workers, where
its weights sit, or by the GPU reading them in place over PCIe; the post kernel gives the CPU
the first `share` of a layer's host pairs and PCIe the rest, at the same time. The best share
is where both finish together, and it is a property of the host: its cores and their
neighbours, the RAM and PCIe rates under load. The plan's guess (where both pipes finish
together at the probed rates; a fixed 0.6 until session 48) was 1.7x off on an H100 host
where the workers lost to PCIe alone (docs/decisions/offload-v2.md, session 47). Exact mode does not care: the expert contract
gives a pair the same bits on either side, so the share may change between any two rounds
(it is a graph input: no recapture).

The tuner is a hill climb on the measured round period (one round's start to the next's:
the GPU's round and the launch around it). Its candidates (share - step, share, share + step)
take rounds in turn, so each sees the same stretch of context, routing and neighbours; a
candidate's cost is the median period of its rounds of one width (prefill chunks and verify
rounds of other widths are counted apart; an idle gap between requests is one outlier). The
best candidate becomes the share; when the current one wins the step halves, and below
`min_step` the share is held for `hold` rounds, then the climb starts again at `step`.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from typing import Callable


class ShareTuner:
    def __init__(self, set_share: Callable[[float], None], start: float, step: float = 0.25,
                 min_step: float = 1 / 16, samples: int = 12, hold: int = 2048,
                 clock: Callable[[], float] = time.perf_counter):
        """set_share: applies a share in [0, 1] before a round (CpuLink.set_share); start: the
        plan's share; samples: rounds of one width each candidate needs before a decision."""
        if not 0.0 <= start <= 1.0:
            raise ValueError(f"the CPU share is a fraction in [0, 1], got {start}")
        self._set, self._clock = set_share, clock
        self.share, self.step, self._step0, self._min_step = start, step, step, min_step
        self._samples, self._hold = samples, hold
        self._held = 0                                # rounds left at a settled share
        self._cands: list[float] = []
        self._times: dict[tuple[float, int], list[float]] = defaultdict(list)
        self._turns: dict[int, int] = defaultdict(int)       # each width's next candidate
        self._last: tuple[float, int, float] | None = None   # (share, W, start) of the round in flight
        self._applied: float | None = None                    # the share set_share last applied
        self.decisions: deque[tuple[float, dict[float, float]]] = deque(maxlen=64)   # (new share, ms by candidate)
        self._new_climb()

    def _new_climb(self) -> None:
        c, d = self.share, self.step
        self._cands = sorted({min(1.0, max(0.0, round(c + o, 6))) for o in (-d, 0.0, d)})
        self._times.clear()
        self._turns.clear()

    def before_round(self, W: int) -> None:
        """A round of W rows is about to launch: the last one's period is known; this one's
        share is set (the candidates take turns within each width)."""
        now = self._clock()
        if self._last is not None:
            share, w, t0 = self._last
            self._times[(share, w)].append(now - t0)
            self._decide()
        if self._held > 0:
            self._held -= 1
            if self._held == 0:
                self.step = self._step0
                self._new_climb()
            share = self.share
        else:
            turn = self._turns[W]
            self._turns[W] = turn + 1
            share = self._cands[turn % len(self._cands)]
        if share != self._applied:   # (a fill of a device tensor: only when it changes)
            self._set(share)
            self._applied = share
        self._last = (share, W, now)

    def skip(self) -> None:
        """A round that is not the share's to judge (the cost table's timing, with the store
        frozen: random rows, or every expert read from the bank) is about to launch: no period
        is taken from the last round to it, nor from it to the next."""
        self._last = None

    def _decide(self) -> None:
        if self._held > 0:
            return
        widths = {W for _, W in self._times}
        ready = [W for W in widths if all(len(self._times.get((c, W), ())) >= self._samples for c in self._cands)]
        if not ready:
            return
        W = min(ready)
        cost = {c: statistics.median(self._times[(c, W)]) for c in self._cands}
        best = min(self._cands, key=lambda c: (cost[c], abs(c - self.share)))
        self.decisions.append((best, {c: 1e3 * t for c, t in cost.items()}))
        if best == self.share:
            self.step /= 2
        self.share = best
        if self.step < self._min_step:
            self._held = self._hold
        else:
            self._new_climb()
