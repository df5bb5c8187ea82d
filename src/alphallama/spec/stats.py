"""Speculation statistics: rounds, tokens per round, and per drafter the conditional hit
rate and chain survival at each depth (DESIGN §5 terms)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DepthCounts:
    reached: list[int] = field(default_factory=list)   # [k]: rounds whose draft k was examined
    hits: list[int] = field(default_factory=list)      # [k]: ... and accepted

    def record(self, proposed: int, accepted: int) -> None:
        """Draft k (0-based) is examined when drafts 0..k-1 were all accepted."""
        examined = min(proposed, accepted + 1)
        while len(self.reached) < examined:
            self.reached.append(0)
            self.hits.append(0)
        for k in range(examined):
            self.reached[k] += 1
            if k < accepted:
                self.hits[k] += 1

    def conditional(self) -> list[float]:
        return [h / r if r else 0.0 for h, r in zip(self.hits, self.reached)]

    def survival(self) -> list[float]:
        out, p = [], 1.0
        for c in self.conditional():
            p *= c
            out.append(p)
        return out


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


@dataclass
class SpecStats:
    rounds: int = 0
    tokens: int = 0             # committed by decode rounds (accepted drafts + bonus)
    proposed: int = 0
    accepted: int = 0
    by_drafter: dict[str, DepthCounts] = field(default_factory=dict)

    def record(self, source: str, proposed: int, accepted: int, committed: int) -> None:
        self.rounds += 1
        self.tokens += committed
        self.proposed += proposed
        self.accepted += accepted
        if proposed:
            self.by_drafter.setdefault(source, DepthCounts()).record(proposed, accepted)

    def merge(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.tokens += other.tokens
        self.proposed += other.proposed
        self.accepted += other.accepted
        for name, dc in other.by_drafter.items():
            mine = self.by_drafter.setdefault(name, DepthCounts())
            mine.reached = _add(mine.reached, dc.reached)
            mine.hits = _add(mine.hits, dc.hits)

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds, "tokens": self.tokens, "tokens_per_round": self.tokens_per_round,
            "drafts_proposed": self.proposed, "drafts_accepted": self.accepted,
            "drafters": {name: {"reached": dc.reached, "hits": dc.hits, "conditional_hit_rate": dc.conditional(),
                                "chain_survival": dc.survival()} for name, dc in self.by_drafter.items()},
        }
