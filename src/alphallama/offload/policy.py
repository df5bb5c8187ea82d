"""Which experts the VRAM bank holds: recency x frequency, decided between rounds.

Every (layer, expert) has a score: the number of (row, rank) picks it got in each round,
decayed by half every `half_life` rounds, so the bank follows the context (a topic
change moves the hot set within a few dozen rounds) while a single odd round moves
nothing. A candidate replaces the weakest resident of its class only when it beats it
by `margin` (hysteresis: no ping-pong between two experts of equal use).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class HitStats:
    lookups: int = 0        # (row, rank) picks routed
    hits: int = 0           # of those, picks of a bank-resident expert
    admissions: int = 0     # experts copied into the bank
    admitted_bytes: int = 0
    rounds: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_dict(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "hit_rate": self.hit_rate,
                "admissions": self.admissions, "admitted_bytes": self.admitted_bytes, "rounds": self.rounds}


class UsagePolicy:
    def __init__(self, n_layers: int, n_experts: int, half_life: float, margin: float):
        if half_life <= 0 or margin < 0:
            raise ValueError(f"half_life must be > 0 and margin >= 0, got {half_life}, {margin}")
        self.shape = (n_layers, n_experts)
        self.score = np.zeros(self.shape, dtype=np.float64)   # [L, E]
        self.decay = 0.5 ** (1.0 / half_life)
        self.margin = margin
        self.stats = HitStats()

    def observe(self, ids: np.ndarray, layers: np.ndarray, resident: np.ndarray) -> None:
        """One round: ids [L', W, k] (expert picks of the MoE layers `layers` [L']),
        resident [L, E] bool (the table the round ran with)."""
        L, E = self.shape
        flat = (layers[:, None, None] * E + ids.astype(np.int64)).ravel()   # [L' W k]
        counts = np.bincount(flat, minlength=L * E).reshape(L, E)           # [L, E]
        self.score *= self.decay
        self.score += counts
        self.stats.lookups += int(flat.size)
        self.stats.hits += int(counts[resident].sum())
        self.stats.rounds += 1

    def learn_prompt(self, layer: int, weighted: np.ndarray, rows: int) -> None:
        """A prompt chunk's picks in one MoE layer, as `rows` rounds of one row each:
        weighted [E] holds each pick at decay^(rows after its row), so the prompt's last rows
        count most and the bank follows a new context from the first decode round instead of
        ~half_life rounds later. No hit counts: the prefill reads each expert once a chunk,
        whatever its tier. Layers are independent rows of `score`, so each is decayed here."""
        self.score[layer] *= self.decay ** rows
        self.score[layer] += weighted

    def choose(self, owners: np.ndarray, candidates: np.ndarray, busy: set[int], limit: int) -> list[tuple[int, int]]:
        """Up to `limit` (slot, flat expert) admissions for one bank class.

        owners [S]: the flat (layer * E + expert) each slot holds, -1 if free, -2 if
        being filled; candidates: the flat ids of this class's experts that may be
        admitted (not resident); busy: flat ids already being copied. The strongest
        candidates replace the weakest residents (free slots first)."""
        if limit <= 0 or candidates.size == 0:
            return []
        score = self.score.ravel()
        cand = candidates[np.argsort(-score[candidates], kind="stable")]
        cand = [int(c) for c in cand[:limit + len(busy)] if int(c) not in busy][:limit]
        free = [s for s in range(owners.size) if owners[s] == -1]
        held = [s for s in range(owners.size) if owners[s] >= 0]
        held.sort(key=lambda s: score[owners[s]])
        victims = free + held
        out = []
        for c, s in zip(cand, victims):
            if score[c] <= 0:
                break
            if owners[s] >= 0 and score[c] <= score[owners[s]] * (1.0 + self.margin):
                break
            out.append((s, c))
        return out
