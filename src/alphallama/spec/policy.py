"""The drafter policy (DESIGN §5): which drafter's drafts a round verifies, and how many.

Each round both drafters propose (the copy's lookup is a few host operations; MTP's
drafts are wanted anyway for the agreement check). The round prefers MTP and switches
to the copy only when a suffix match exists and MTP's first draft agrees with the copy's
first token. Only a draft MTP would verify (at or above min-p) can veto: a first token
under min-p is no opinion. (Measured on the H200, Qwen2.5-Coder-0.5B + its distilled head,
set R: letting sub-min-p tokens veto left the policy at 5.6 tokens per round against the
copy's 9.6 alone.)

- a match of `long_match` (6) tokens or more: the copy;
- a shorter one: the copy only if its expected tokens per ms at this match length beat
  MTP's by `copy_margin` (3%), both learned online (below); until each side has
  `min_obs` rounds at that length, MTP.

Then the gate (spec/gate.py) keeps the leading drafts worth their columns.

Learning without extra host syncs: in exact mode a round commits exactly the drafts
that equal the output that follows, so every proposal, verified or not, can be scored
later against the committed tokens (the `Ledger`). Each relevant round gives both
drafters a sample of "tokens this round would commit (accepted + bonus) / the cost
table's ms for that width", and every copy draft, ungated, a sample of per-depth
acceptance for its match length (what the gate prices copy drafts with). Under
sampling the same scoring is an estimate. What is learned lives in a `PolicyMemory`
that outlives the request (spec/config.py keeps one per model and device).

Both drafters see every committed token, whichever one drafted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .drafter import NO_DRAFT, Draft, Drafter, common_prefix
from .gate import CopyConfidence, CostTable, Gate, cumulative


@dataclass(frozen=True)
class PolicyRules:
    long_match: int = 6
    copy_margin: float = 0.03
    min_obs: int = 4


@dataclass
class Rate:
    """Tokens committed and ms spent over the rounds seen: tokens per ms = their ratio."""
    n: int = 0
    tokens: float = 0.0
    ms: float = 0.0

    def add(self, tokens: int, ms: float) -> None:
        self.n += 1
        self.tokens += tokens
        self.ms += ms

    @property
    def per_ms(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


@dataclass
class PolicyMemory:
    """What the policy has learned for one model on one device."""
    copy_conf: CopyConfidence = field(default_factory=CopyConfidence)
    rates: dict[tuple[str, int], Rate] = field(default_factory=dict)   # (drafter, match length) ->
    decisions: dict[str, int] = field(default_factory=dict)            # why rounds went the way they did

    def rate(self, drafter: str, match_len: int) -> Rate:
        return self.rates.setdefault((drafter, match_len), Rate())

    def count(self, why: str) -> None:
        self.decisions[why] = self.decisions.get(why, 0) + 1

    def to_dict(self) -> dict:
        return {"decisions": dict(sorted(self.decisions.items())),
                "tokens_per_ms": {f"{d}@{m}": {"n": r.n, "tokens_per_ms": r.per_ms}
                                  for (d, m), r in sorted(self.rates.items())},
                "copy_acceptance": {b: dc.to_dict() for b, dc in self.copy_conf.counts.items()}}


@dataclass
class Pending:
    start: int                 # where in the sequence the draft's first token would land
    tokens: list[int]
    what: str                  # "depth": copy acceptance sample | "rate": tokens/ms sample
    drafter: str = ""
    match_len: int = 0
    ms: float = 0.0


class Ledger:
    """Proposals waiting for the committed tokens that score them."""

    def __init__(self, memory: PolicyMemory):
        self.memory = memory
        self.items: list[Pending] = []

    def add(self, p: Pending) -> None:
        self.items.append(p)

    def resolve(self, seq: list[int], final: bool = False) -> None:
        """Score every proposal whose outcome the sequence now decides; final: the request
        ended, so score what is known (accepted depths only) and drop the rest."""
        keep = []
        for p in self.items:
            known = seq[p.start:p.start + len(p.tokens)]
            n = common_prefix(p.tokens, known)
            decided = n == len(p.tokens) or n < len(known)
            if not decided and not final:
                keep.append(p)
            elif p.what == "depth":
                self.memory.copy_conf.record(p.match_len, len(p.tokens) if decided else n, n)
            elif decided:
                self.memory.rate(p.drafter, p.match_len).add(n + 1, p.ms)
        self.items = keep


def gated(d: Draft, conf: list[float], gate: Gate) -> Draft:
    n = gate.width(conf) if len(d) else 0
    if n == len(d):
        return d
    return Draft(d.tokens[:n], d.source if n else "none", d.match_len, d.probs[:n])


class PolicyDrafter:
    """Drafter protocol over an MTP drafter, the copy drafter, or both (the policy)."""

    def __init__(self, mtp: Drafter | None, copy: Drafter | None, gate: Gate, memory: PolicyMemory,
                 table: CostTable | None = None, rules: PolicyRules = PolicyRules()):
        if mtp is None and copy is None:
            raise ValueError("the policy needs at least one drafter")
        if mtp is not None and copy is not None and table is None:
            raise ValueError("choosing between drafters needs the round cost table")
        self.mtp, self.copy, self.gate, self.memory, self.table, self.rules = mtp, copy, gate, memory, table, rules
        self.name = ",".join(d.name for d in (mtp, copy) if d is not None)
        self.ledger = Ledger(memory)
        self.seq: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self.ledger.resolve(self.seq, final=True)      # the previous request's loose ends
        self.seq = list(prompt_ids)
        for d in (self.mtp, self.copy):
            if d is not None:
                d.begin(prompt_ids)

    def accept(self, tokens: list[int]) -> None:
        for d in (self.mtp, self.copy):
            if d is not None:
                d.accept(tokens)
        self.seq.extend(tokens)
        self.ledger.resolve(self.seq)

    def _gate_copy(self, c: Draft) -> Draft:
        return gated(c, self.memory.copy_conf.conf(c.match_len, len(c)), self.gate)

    @staticmethod
    def _mtp_first(m: Draft) -> int | None:
        """MTP's first draft; None when it drafted nothing (no chain, or under min-p)."""
        return m.tokens[0] if len(m) else None

    def _cost(self, d: Draft) -> float:
        return self.table.cost(1 + len(d))

    def propose(self, max_n: int) -> Draft:
        c = self.copy.propose(max_n) if self.copy is not None else NO_DRAFT
        m = self.mtp.propose(max_n) if self.mtp is not None else NO_DRAFT
        start = len(self.seq)
        if len(c):
            self.ledger.add(Pending(start, list(c.tokens), "depth", match_len=c.match_len))
        gc = self._gate_copy(c)
        gm = gated(m, cumulative(m.probs), self.gate)
        if self.copy is None:
            return gm
        if self.mtp is None:
            return gc
        return self._choose(m, gm, c, gc, start)

    def _choose(self, m: Draft, gm: Draft, c: Draft, gc: Draft, start: int) -> Draft:
        if not len(c):
            self.memory.count("no match")
            return gm
        first = self._mtp_first(m)
        if first is not None and first != c.tokens[0]:
            self.memory.count("disagree")
            return gm
        L = c.match_len
        if L >= self.rules.long_match:
            self.memory.count("long match")
            return gc if len(gc) else gm
        for d, g in (("mtp", gm), ("ngram", gc)):      # a sample for each side at this length
            self.ledger.add(Pending(start, list(g.tokens), "rate", d, L, self._cost(g)))
        rc, rm = self.memory.rate("ngram", L), self.memory.rate("mtp", L)
        if min(rc.n, rm.n) < self.rules.min_obs:
            self.memory.count("short match, learning")
            return gm
        if rc.per_ms > (1 + self.rules.copy_margin) * rm.per_ms and len(gc):
            self.memory.count("short match, copy priced higher")
            return gc
        self.memory.count("short match, mtp priced higher")
        return gm
