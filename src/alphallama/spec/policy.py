"""The drafter policy (DESIGN §5): which drafter's drafts a round verifies, and how many.

Each round both drafters propose (the copy's lookup is a few host operations; MTP's
drafts are wanted anyway for the agreement check), unless MTP is switched off (below:
then the round is the copy's alone). The round prefers MTP and switches
to the copy only when a suffix match exists and MTP's first draft agrees with the copy's
first token. Only a draft MTP would verify (at or above min-p) can veto: a first token
under min-p is no opinion. (Measured on the H200, Qwen2.5-Coder-0.5B + its distilled head,
set R: letting sub-min-p tokens veto left the policy at 5.6 tokens per round against the
copy's 9.6 alone.)

- a match of `long_match` (6) tokens or more: the copy;
- a shorter one: the copy only if its expected tokens per ms at this match length beat
  MTP's by `copy_margin` (3%), both learned online (below); until each side has
  `min_obs` rounds at that length, MTP.

Then the gate (spec/gate.py) keeps the leading drafts worth their columns; with several
streams in one round, spec/allot.py does, at the rows' marginal cost (`offer`: the draft
and its confidences before the cut; `seat`: the driver's answer, the round it was seated in).

Learning without extra host syncs: in exact mode a round commits exactly the drafts
that equal the output that follows, so every proposal, verified or not, can be scored
later against the committed tokens (the `Ledger`). Each relevant round gives both
drafters a sample of "tokens this round would commit (accepted + bonus) / the cost
table's ms for that width", and every copy draft, ungated, a sample of per-depth
acceptance for its match length (what the gate prices copy drafts with); in a round of
several streams, priced as the allotment prices it (spec/seated.py; alone: as above).
Under sampling the same scoring is an estimate. What is learned lives in a `PolicyMemory`
that outlives the request, one per slot of a model and device (spec/config.py): acceptance
is a property of a stream's text; the costs (the table, `DrafterCost`) are the model's.

Both drafters see every committed token, whichever one drafted.

Whether MTP runs at all (`MTPSwitch`): the head's chain is not free (on the H200 with
Qwen2.5-Coder-0.5B it adds ~0.45 ms to a 0.67 ms round, about what a plain round costs)
and the round pays it whatever is verified afterwards. The policy times each MTP
proposal (`DrafterCost`, the median of recent ones) and prices every MTP round with it:
each round MTP ran gives a paired sample, scored by the ledger: the T tokens it
committed took the verify ms for its width plus the head's ms; without MTP the same
T tokens would have cost T times what the round without MTP (the copy's gated draft, or
a W = 1 round) would have paid per token it commits. (Per token, not per round: the
round without MTP may commit more than T, and the next MTP round would count those
again.) When the recent MTP rounds took longer for their tokens than the rounds
without MTP would have, MTP is switched off: the round is exactly what the copy alone
(or plain decoding) does, and the head only makes its cache entries, batched
(spec/mtp.py). It is switched on again for a probe after `probe_wait` rounds, a wait that
doubles after every on-phase that did not pay overall (up to `probe_wait_max`) and
starts again from `probe_wait` after one that did. So `mtp,ngram` is the copy alone
wherever MTP does not pay for itself next to it, and `mtp` is plain decoding wherever
it does not pay against W = 1 rounds. The switch lives in the slot's `PolicyMemory`, so
a new request starts where the last one left off; it is asked once a round (its waits are
rounds); `--spec-mtp-always` turns it off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .allot import Claim, Seat, cut
from .drafter import NO_DRAFT, Draft, Drafter, common_prefix
from .gate import CopyConfidence, Gate, RoundCosts, cumulative
from .seated import Pending, RoundNote, priced


@dataclass(frozen=True)
class PolicyRules:
    long_match: int = 6
    copy_margin: float = 0.03
    min_obs: int = 4
    switch_min_obs: int = 4        # paired samples an on-phase needs before MTP may be switched off
    switch_horizon: int = 32       # the on-phase's window: a sample's weight decays by 1 - 1/horizon a sample
    probe_wait: int = 16           # rounds off before MTP is tried again (doubled per on-phase that lost)
    probe_wait_max: int = 256


@dataclass
class Rate:
    """Tokens committed and ms spent over the rounds seen: tokens per ms = their ratio."""
    n: int = 0
    tokens: float = 0.0
    ms: float = 0.0

    def add(self, tokens: float, ms: float) -> None:
        self.n += 1
        self.tokens += tokens
        self.ms += ms

    @property
    def per_ms(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


@dataclass
class DrafterCost:
    """ms a drafter's proposals take (the MTP head: its entries, the chain and the host
    sync that returns it): the median of the last `keep`, so a graph's first replay or
    a batched extend after rounds without drafts does not move it much."""
    keep: int = 31
    samples: list[float] = field(default_factory=list)
    n: int = 0

    def add(self, ms: float) -> None:
        self.samples.append(ms)
        if len(self.samples) > self.keep:
            del self.samples[0]
        self.n += 1

    @property
    def ms(self) -> float:
        if not self.samples:
            return 0.0
        return sorted(self.samples)[len(self.samples) // 2]


@dataclass
class Paired:
    """The tokens MTP's rounds committed, the ms those rounds took (the head's cost
    included), and the ms the same tokens would have taken without MTP. Sums;
    `add(..., decay)` scales the earlier ones first."""
    tokens: float = 0.0
    on_ms: float = 0.0
    off_ms: float = 0.0
    n: int = 0

    def add(self, tokens: float, on_ms: float, off_ms: float, decay: float = 1.0) -> None:
        self.tokens = decay * self.tokens + tokens
        self.on_ms = decay * self.on_ms + on_ms
        self.off_ms = decay * self.off_ms + off_ms
        self.n += 1

    @property
    def on_rate(self) -> float:
        return self.tokens / self.on_ms if self.on_ms > 0 else 0.0

    @property
    def off_rate(self) -> float:
        return self.tokens / self.off_ms if self.off_ms > 0 else 0.0

    @property
    def pays(self) -> bool:
        """MTP's rounds took less time for their tokens than the rounds without it would have."""
        return self.on_ms < self.off_ms

    def to_dict(self) -> dict:
        return {"n": self.n, "on_tokens_per_ms": self.on_rate, "off_tokens_per_ms": self.off_rate}


@dataclass
class MTPSwitch:
    """Whether the MTP head drafts this round (see the module docstring)."""
    on: bool = True
    phase_id: int = 0                                     # on-phases so far; samples carry theirs
    window: Paired = field(default_factory=Paired)        # this on-phase, recent samples weighted more
    phase: Paired = field(default_factory=Paired)         # this on-phase, every sample alike
    fails: int = 0                                        # on-phases in a row that did not pay
    wait: int = 0                                         # rounds left before the next probe (off)
    switched_off: int = 0

    def allow(self, rules: PolicyRules) -> bool:
        """Called once per round that could draft: run MTP this round?"""
        if self.on:
            if self.window.n >= rules.switch_min_obs and not self.window.pays:
                self.on = False
                self.switched_off += 1
                self.fails = 0 if self.phase.pays else self.fails + 1
                self.wait = min(rules.probe_wait << self.fails, rules.probe_wait_max)
            return self.on
        self.wait -= 1
        if self.wait > 0:
            return False
        self.on = True                                    # a probe: a fresh on-phase
        self.phase_id += 1
        self.window, self.phase = Paired(), Paired()
        return True

    def record(self, phase_id: int, tokens: int, on_ms: float, off_ms: float, rules: PolicyRules) -> None:
        """A round MTP ran committed `tokens` in `on_ms`; without MTP they would have taken `off_ms`."""
        if phase_id != self.phase_id or not self.on:      # resolved after its on-phase ended
            return
        self.window.add(tokens, on_ms, off_ms, 1.0 - 1.0 / rules.switch_horizon)
        self.phase.add(tokens, on_ms, off_ms)

    def to_dict(self) -> dict:
        return {"on": self.on, "on_phases": self.phase_id + 1, "switched_off": self.switched_off,
                "fails": self.fails, "wait": self.wait, "window": self.window.to_dict(),
                "phase": self.phase.to_dict()}


@dataclass
class PolicyMemory:
    """What the policy has learned for one model on one device, from one slot's streams
    (mtp_cost: the model's, one object shared by its slots' memories)."""
    copy_conf: CopyConfidence = field(default_factory=CopyConfidence)
    rates: dict[tuple[str, int], Rate] = field(default_factory=dict)   # (drafter, match length) ->
    decisions: dict[str, int] = field(default_factory=dict)            # why rounds went the way they did
    mtp_cost: DrafterCost = field(default_factory=DrafterCost)         # ms an MTP proposal takes
    switch: MTPSwitch = field(default_factory=MTPSwitch)

    def rate(self, drafter: str, match_len: int) -> Rate:
        return self.rates.setdefault((drafter, match_len), Rate())

    def count(self, why: str) -> None:
        self.decisions[why] = self.decisions.get(why, 0) + 1

    def to_dict(self) -> dict:
        return {"decisions": dict(sorted(self.decisions.items())),
                "tokens_per_ms": {f"{d}@{m}": {"n": r.n, "tokens_per_ms": r.per_ms}
                                  for (d, m), r in sorted(self.rates.items())},
                "copy_acceptance": {b: dc.to_dict() for b, dc in self.copy_conf.counts.items()},
                "mtp_ms": {"median": self.mtp_cost.ms, "n": self.mtp_cost.n},
                "mtp_switch": self.switch.to_dict()}


def score(tokens: list[int], seq: list[int], start: int) -> tuple[int, bool]:
    """(drafts the sequence confirms, whether the sequence decides that count yet)."""
    known = seq[start:start + len(tokens)]
    n = common_prefix(tokens, known)
    return n, n == len(tokens) or n < len(known)


class Ledger:
    """Proposals waiting for the committed tokens that score them."""

    def __init__(self, memory: PolicyMemory, rules: PolicyRules = PolicyRules()):
        self.memory, self.rules = memory, rules
        self.items: list[Pending] = []

    def add(self, p: Pending) -> None:
        self.items.append(p)

    def resolve(self, seq: list[int], final: bool = False) -> None:
        """Score every proposal whose outcome the sequence now decides; final: the request
        ended, so score what is known (accepted depths only) and drop the rest."""
        keep = []
        for p in self.items:
            n, decided = score(p.tokens, seq, p.start)
            if p.what == "switch":
                n_alt, alt_decided = score(p.alt, seq, p.start)
                decided = decided and alt_decided
            if not decided and not final:
                keep.append(p)
            elif p.what == "depth":
                self.memory.copy_conf.record(p.match_len, len(p.tokens) if decided else n, n)
            elif not decided:
                continue
            elif p.what == "rate":          # (base: the other streams' tokens in the round; alone 0)
                self.memory.rate(p.drafter, p.match_len).add(p.base + n + 1, p.ms)
            elif p.what == "switch":
                # the same tokens without MTP: at what the round without it would have paid per token
                tokens = p.base + n + 1
                self.memory.switch.record(p.phase, tokens, p.ms, tokens * p.alt_ms / (p.base + n_alt + 1), self.rules)
        self.items = keep


def gated(d: Draft, conf: list[float], gate: Gate, overhead: float = 0.0) -> Draft:
    """The draft's leading drafts the gate verifies with it alone in the round."""
    return cut(d, gate.width(conf, overhead) if len(d) else 0)


def offer(drafter: Drafter, max_n: int) -> tuple[Draft, Claim]:
    """A drafter's draft before the gate's cut and the claim that prices it (spec/allot.py):
    the policy's own; a drafter without the policy runs ungated, so it wants all its
    drafts, valued by their probabilities where it has them (MTP), else alike."""
    if isinstance(drafter, PolicyDrafter):
        return drafter.offer(max_n)
    d = drafter.propose(max_n)
    conf = cumulative(d.probs) if len(d.probs) == len(d) else [1.0] * len(d)
    return d, Claim(tuple(conf), Gate())


def seated(drafter: Drafter, seat: Seat) -> None:
    """Tell a drafter the seat its last claim got (the policy prices its samples in it)."""
    if isinstance(drafter, PolicyDrafter):
        drafter.seat(seat)


class PolicyDrafter:
    """Drafter protocol over an MTP drafter, the copy drafter, or both (the policy).
    switch: run MTP only while it pays (MTPSwitch); clock: what MTP's proposals are timed by."""

    def __init__(self, mtp: Drafter | None, copy: Drafter | None, gate: Gate, memory: PolicyMemory,
                 table: RoundCosts | None = None, rules: PolicyRules = PolicyRules(), *, switch: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        if mtp is None and copy is None:
            raise ValueError("the policy needs at least one drafter")
        if mtp is not None and (copy is not None or switch) and table is None:
            raise ValueError("pricing MTP drafts (against the copy's, or against their own cost) needs the "
                             "round cost table")
        self.mtp, self.copy, self.gate, self.memory, self.table, self.rules = mtp, copy, gate, memory, table, rules
        self.switch = memory.switch if mtp is not None and switch else None
        self.clock = clock
        self.name = ",".join(d.name for d in (mtp, copy) if d is not None)
        self.ledger = Ledger(memory, rules)
        self.seq: list[int] = []
        self.note: RoundNote | None = None        # this round's samples, until its seat

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

    def _copy_claim(self, c: Draft, overhead: float = 0.0) -> Claim:
        return Claim(tuple(self.memory.copy_conf.conf(c.match_len, len(c))), self.gate, overhead)

    @staticmethod
    def _mtp_first(m: Draft) -> int | None:
        """MTP's first draft; None when it drafted nothing (no chain, or under min-p)."""
        return m.tokens[0] if len(m) else None

    def _propose_mtp(self, max_n: int) -> tuple[Draft, float]:
        """MTP's draft and what drafting costs a round (ms, the median of recent proposals)."""
        t0 = self.clock()
        m = self.mtp.propose(max_n)
        self.memory.mtp_cost.add(1000 * (self.clock() - t0))
        return m, self.memory.mtp_cost.ms

    def propose(self, max_n: int) -> Draft:
        """The draft a round verifies with this stream alone in it: offer's, cut by the gate
        (and the round's samples priced alone)."""
        d, claim = self.offer(max_n)
        n = self.gate.width(list(claim.conf), claim.overhead) if len(d) else 0
        self.seat(Seat(n))
        return cut(d, n)

    def offer(self, max_n: int) -> tuple[Draft, Claim]:
        """The chosen drafter's draft before the gate's cut, and the claim that prices it
        (spec/allot.py decides how many of its drafts a shared round verifies; alone, the
        gate's width). The choice between the drafters is priced with the stream alone in
        the round (it comes before the allotment); what the ledger learns from the round
        waits for `seat`, the round the driver seated it in."""
        self.note = None
        c = self.copy.propose(max_n) if self.copy is not None else NO_DRAFT
        start = len(self.seq)
        if len(c):
            self.ledger.add(Pending(start, list(c.tokens), "depth", match_len=c.match_len))
        if self.mtp is None:
            return c, self._copy_claim(c)
        if self.switch is not None and not self.switch.allow(self.rules):
            self.memory.count("mtp off")
            return c, self._copy_claim(c)
        m, h = self._propose_mtp(max_n)
        m_claim, c_claim = Claim(tuple(cumulative(m.probs)), self.gate, h), self._copy_claim(c, h)
        gc = gated(c, list(c_claim.conf), self.gate, h)
        copy_wins, rate_due = self._choose(m, c, gc) if self.copy is not None else (False, False)
        self.note = RoundNote(start, h, m, list(m_claim.conf), c, list(c_claim.conf), c if copy_wins else m,
                              c.match_len if rate_due else None,
                              self.switch.phase_id if self.switch is not None else None)
        return (c, c_claim) if copy_wins else (m, m_claim)

    def seat(self, seat: Seat) -> None:
        """The driver's answer to this round's claim: the samples the round is due (a rate
        sample per drafter at a short match, the switch's paired one), priced in it."""
        if self.note is not None:
            for p in priced(self.note, seat, self.gate, self.table):
                self.ledger.add(p)
            self.note = None

    def _choose(self, m: Draft, c: Draft, gc: Draft) -> tuple[bool, bool]:
        """MTP ran: the copy's draft (True) or its own? (gc: the copy's, gated with the chain's
        ms in the round's cost.) And is a rate sample due for each (a short match)?"""
        if not len(c):
            self.memory.count("no match")
            return False, False
        first = self._mtp_first(m)
        if first is not None and first != c.tokens[0]:
            self.memory.count("disagree")
            return False, False
        L = c.match_len
        if L >= self.rules.long_match:
            self.memory.count("long match")
            return len(gc) > 0, False
        rc, rm = self.memory.rate("ngram", L), self.memory.rate("mtp", L)
        if min(rc.n, rm.n) < self.rules.min_obs:
            self.memory.count("short match, learning")
            return False, True
        if rc.per_ms > (1 + self.rules.copy_margin) * rm.per_ms and len(gc):
            self.memory.count("short match, copy priced higher")
            return True, True
        self.memory.count("short match, mtp priced higher")
        return False, True
