"""Replay: what the copy drafter would have done, computed from a plain greedy run.

In exact mode a round commits exactly the drafts that equal the plain run's next
tokens, so a single plain run determines everything speculation would do: at every
output position, what the drafter proposes and how much of it the plain run
confirms, and (walking the rounds) tokens per round. `simulate` must agree with a real
speculative run round for round; the tests check that.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import SpecConfig
from .drafter import NO_DRAFT, common_prefix
from .stats import SpecStats


@dataclass
class Replay:
    positions: list[dict] = field(default_factory=list)   # per output position: proposed, confirmed, match_len
    rounds: SpecStats = field(default_factory=SpecStats)  # the simulated speculative run

    def to_dict(self) -> dict:
        return {"positions": self.positions, "simulated": self.rounds.to_dict()}


def replay(prompt_ids: list[int], gen_ids: list[int], spec: SpecConfig, max_tokens: int | None = None) -> Replay:
    """gen_ids: the plain greedy output (with its end-of-generation token appended when
    it ended on one); max_tokens: the request's budget, which caps drafts as the engine
    does. Positions are 'after output token i was committed'."""
    out = Replay()
    drafter = spec.make_drafter()
    if drafter is None or not gen_ids:
        return out
    n = len(gen_ids)
    budget = n if max_tokens is None else max_tokens

    def room(i: int) -> int:   # drafts the engine allows after output token i: the bonus needs one slot
        return min(spec.draft_max, budget - (i + 1) - 1)

    # every position, as if a round started there
    drafter.begin(list(prompt_ids) + gen_ids[:1])
    for i in range(n):
        d = drafter.propose(room(i)) if room(i) > 0 else None
        if d is not None and len(d):
            out.positions.append({"pos": i, "proposed": len(d), "confirmed": common_prefix(d.tokens, gen_ids[i + 1:]),
                                  "match_len": d.match_len})
        else:
            out.positions.append({"pos": i, "proposed": 0, "confirmed": 0, "match_len": 0})
        if i + 1 < n:
            drafter.accept(gen_ids[i + 1:i + 2])
    # the rounds a speculative run takes: start at 0, jump by accepted + 1
    drafter.begin(list(prompt_ids) + gen_ids[:1])
    i = 0
    while i < n - 1:
        d = drafter.propose(room(i)) if room(i) > 0 else NO_DRAFT
        acc = common_prefix(d.tokens, gen_ids[i + 1:])
        step = acc + 1
        out.rounds.record(d.source, len(d), acc, step, d.match_len, d.probs)
        drafter.accept(gen_ids[i + 1:i + 1 + step])
        i += step
    return out
