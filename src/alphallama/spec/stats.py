"""Speculation statistics: rounds, tokens per round, and per drafter the conditional hit
rate and chain survival at each depth (DESIGN §5 terms); the share of rounds each
drafter took; for drafters that give probabilities, calibration per depth (the
draft's probability, binned, against how often it was accepted); for the copy drafter,
hit rates per match length."""
from __future__ import annotations

from dataclasses import dataclass, field

CALIBRATION_BINS = 10


def match_bucket(m: int) -> str:
    """Match lengths 1..7 on their own, then powers of two (8-15, 16-31, 32-63, 64+)."""
    if m < 8:
        return str(m)
    lo = 8
    while lo * 2 <= m and lo < 64:
        lo *= 2
    return f"{lo}+" if lo == 64 else f"{lo}-{2 * lo - 1}"


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

    def merge(self, other: "DepthCounts") -> None:
        self.reached = _add(self.reached, other.reached)
        self.hits = _add(self.hits, other.hits)

    def conditional(self) -> list[float]:
        return [h / r if r else 0.0 for h, r in zip(self.hits, self.reached)]

    def survival(self) -> list[float]:
        out, p = [], 1.0
        for c in self.conditional():
            p *= c
            out.append(p)
        return out

    def to_dict(self) -> dict:
        return {"reached": self.reached, "hits": self.hits, "conditional_hit_rate": self.conditional(),
                "chain_survival": self.survival()}


@dataclass
class Calibration:
    """Per depth k and probability bin: examined drafts, accepted ones, sum of their
    probabilities (mean predicted = p_sum / examined, to set against accepted / examined)."""
    examined: list[list[int]] = field(default_factory=list)    # [k][bin]
    accepted: list[list[int]] = field(default_factory=list)    # [k][bin]
    p_sum: list[list[float]] = field(default_factory=list)     # [k][bin]

    def _grow(self, depth: int) -> None:
        while len(self.examined) < depth:
            for table, zero in ((self.examined, 0), (self.accepted, 0), (self.p_sum, 0.0)):
                table.append([zero] * CALIBRATION_BINS)

    def record(self, probs: tuple[float, ...], accepted: int) -> None:
        examined = min(len(probs), accepted + 1)
        self._grow(examined)
        for k in range(examined):
            b = min(int(probs[k] * CALIBRATION_BINS), CALIBRATION_BINS - 1)
            self.examined[k][b] += 1
            self.accepted[k][b] += k < accepted
            self.p_sum[k][b] += probs[k]

    def merge(self, other: "Calibration") -> None:
        self._grow(len(other.examined))
        for k in range(len(other.examined)):
            for b in range(CALIBRATION_BINS):
                self.examined[k][b] += other.examined[k][b]
                self.accepted[k][b] += other.accepted[k][b]
                self.p_sum[k][b] += other.p_sum[k][b]

    def to_dict(self) -> list[dict]:
        """Per depth: the non-empty bins as (bin range, n, mean predicted, observed)."""
        out = []
        for k, (ex, ac, ps) in enumerate(zip(self.examined, self.accepted, self.p_sum)):
            bins = [{"bin": [b / CALIBRATION_BINS, (b + 1) / CALIBRATION_BINS], "n": n,
                     "predicted": ps[b] / n, "observed": ac[b] / n} for b, n in enumerate(ex) if n]
            n = sum(ex)
            out.append({"depth": k + 1, "n": n, "predicted": sum(ps) / n if n else 0.0,
                        "observed": sum(ac) / n if n else 0.0, "bins": bins})
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
    rounds_by_source: dict[str, int] = field(default_factory=dict)     # "none": rounds verified without drafts
    calibration: dict[str, Calibration] = field(default_factory=dict)  # drafters that give probabilities
    by_match_len: dict[str, DepthCounts] = field(default_factory=dict)  # copy drafts, per match_bucket

    def record(self, source: str, proposed: int, accepted: int, committed: int,
               match_len: int = 0, probs: tuple[float, ...] = ()) -> None:
        self.rounds += 1
        self.tokens += committed
        self.proposed += proposed
        self.accepted += accepted
        source = source if proposed else "none"
        self.rounds_by_source[source] = self.rounds_by_source.get(source, 0) + 1
        if not proposed:
            return
        self.by_drafter.setdefault(source, DepthCounts()).record(proposed, accepted)
        if probs:
            self.calibration.setdefault(source, Calibration()).record(probs[:proposed], accepted)
        if match_len:
            self.by_match_len.setdefault(match_bucket(match_len), DepthCounts()).record(proposed, accepted)

    def merge(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.tokens += other.tokens
        self.proposed += other.proposed
        self.accepted += other.accepted
        for name, n in other.rounds_by_source.items():
            self.rounds_by_source[name] = self.rounds_by_source.get(name, 0) + n
        for mine, theirs, make in ((self.by_drafter, other.by_drafter, DepthCounts),
                                   (self.calibration, other.calibration, Calibration),
                                   (self.by_match_len, other.by_match_len, DepthCounts)):
            for name, x in theirs.items():
                mine.setdefault(name, make()).merge(x)

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    def share_of_rounds(self) -> dict[str, float]:
        return {name: n / self.rounds for name, n in sorted(self.rounds_by_source.items())} if self.rounds else {}

    def to_dict(self) -> dict:
        by_len = sorted(self.by_match_len.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))
        return {
            "rounds": self.rounds, "tokens": self.tokens, "tokens_per_round": self.tokens_per_round,
            "drafts_proposed": self.proposed, "drafts_accepted": self.accepted,
            "share_of_rounds": self.share_of_rounds(),
            "drafters": {name: dc.to_dict() for name, dc in self.by_drafter.items()},
            "calibration": {name: c.to_dict() for name, c in self.calibration.items()},
            "copy_by_match_len": {k: dc.to_dict() for k, dc in by_len},
        }
