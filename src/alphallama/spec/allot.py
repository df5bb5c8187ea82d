"""The round's rows allotted across streams: drafts priced at their marginal cost.

One stream alone, the gate (spec/gate.py) verifies the n leading drafts that maximize
E_n / (c(1 + n) + overhead): its drafts cost c(1 + n) - c(1). With N streams in one
round (streams.py) the round's width is the sum of every stream's rows, so a stream's
drafts really cost the *marginal* rows, c(W + d) - c(W) at the round's current total W.

Each stream with drafts makes a `Claim`: what each further draft of its chain is
expected to yield (S_k, the chance drafts 1..k are all accepted: non-increasing) and how
its gate prices them. `allot` then, per round:

  1. orders the drafts greedily: at each step the next draft of the stream that yields
     the most (a row's marginal cost at the current total is the same whichever stream
     it goes to, so the most tokens per marginal ms is the highest yield), taking only a
     stream's next draft (its drafts are a chain: draft k+1 is worthless without k), and
     stopping when the round is full (`room`: MAX_WIDTH rows in all), so a stream's room
     shrinks when the others fill the round;
  2. keeps the prefix of that order that maximizes the round's expected tokens per ms,
     (N + the kept yields) / (c(N + m) + the streams' overheads), ties to the narrower
     round: as the single-stream gate, taking the best prefix rather than stopping at
     the first row that does not pay lets rows past a dearer width (a new bucket) pay
     for it.

Claims whose gate does not price (a `--spec-p-min` floor: its drafts at or above the
floor; `--no-gate`: all of them) are wanted whatever they cost: their drafts come first
in the order and are always kept, up to the room; priced claims compete for the rest.

At N = 1 this is exactly the gate's rule: the one stream's drafts in its own order, the
same expected tokens and the same costs, so the same width (`Gate.width`; the tests
compare them on the same inputs). The one-stream driver (Engine.generate) sets no room,
as the gate never did (a draft is at most `--spec-draft-max` <= 64).

The driver answers each claim with a `Seat` (`seats`): its drafts, and the rest of the
round around them (the other rows, what they are expected to commit, the other streams'
drafting ms), which the policy prices its samples on (spec/seated.py). Every stream whose
drafter ran claims, with or without drafts: a chain that drafted nothing still spent its
ms, which the round's rate must count. Alone, the seat is `Seat(n)`: nothing beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .drafter import Draft
from .gate import MAX_WIDTH, Gate, RoundCosts, expected_tokens


@dataclass(frozen=True)
class Claim:
    """One stream's drafts on offer for a round (what a stream yields to its driver, which
    answers how many of them to verify)."""
    conf: tuple[float, ...]     # [n drafts]: S_k, the chance drafts 1..k are all accepted
    gate: Gate                  # how its drafts are priced: a cost table, a p_min floor, or not at all
    overhead: float = 0.0       # ms its drafting added to the round (the MTP head's chain)

    def wanted(self) -> int:
        """How many leading drafts are on offer at all (a p_min floor cuts; else all)."""
        if self.gate.p_min is not None:
            return self.gate.width(list(self.conf))
        return len(self.conf)

    @property
    def priced(self) -> bool:
        """Its drafts must pay for their rows (the gate prices by the table)."""
        return self.gate.p_min is None and self.gate.table is not None


@dataclass(frozen=True)
class Seat:
    """The driver's answer to a Claim: how many of its drafts the round verifies, and what else
    the round holds (every other stream's rows, drafts included), as the allotment priced it."""
    drafts: int
    rows: int = 0               # the round's other rows
    tokens: float = 0.0         # what they are expected to commit (allot's N + kept S, theirs)
    overhead: float = 0.0       # the other streams' drafting ms (their MTP chains)


def seats(claims: list[Claim], fixed: int, drafts: list[int]) -> list[Seat]:
    """Each claim's seat once `allot` gave it drafts[i]: the other rows are the fixed ones (one
    token each) and every other claim's row and drafts (1 + S_1 + .. + S_n tokens).
    -> [len(claims)]; one claim and nothing fixed: [Seat(drafts[0])]."""
    rows = [1 + n for n in drafts]
    tokens = [expected_tokens(list(c.conf[:n]))[-1] for c, n in zip(claims, drafts)]
    out = []
    for i, n in enumerate(drafts):
        others = [j for j in range(len(claims)) if j != i]
        out.append(Seat(n, fixed + sum(rows[j] for j in others), sum((tokens[j] for j in others), float(fixed)),
                        sum((claims[j].overhead for j in others), 0.0)))
    return out


def allot(claims: list[Claim], fixed: int = 0, room: int | None = None) -> list[int]:
    """How many drafts each claim's stream verifies this round (the module docstring).

    claims: the streams with drafts, in arrival order (ties go to the earlier one);
    fixed: rows already in the round besides the claims' own first rows (streams without
    drafts, one row each); room: the most drafts the round can still take (MAX_WIDTH -
    every row without drafts: `round_room`), None: unbounded (one stream alone).
    -> [len(claims)] drafts per claim."""
    want = [c.wanted() for c in claims]
    taken = [0] * len(claims)
    order: list[tuple[int, float]] = []              # (claim, yield) per draft, in the greedy order
    left = sum(want) if room is None else max(0, room)
    while left > 0:
        open_ = [i for i in range(len(claims)) if taken[i] < want[i]]
        if not open_:
            break
        i = min(open_, key=lambda i: (claims[i].priced, -claims[i].conf[taken[i]], i))
        order.append((i, claims[i].conf[taken[i]]))
        taken[i] += 1
        left -= 1
    forced = sum(not claims[i].priced for i, _ in order)          # unpriced drafts: kept, they come first
    keep = len(order)
    table = next((c.gate.table for c in claims if c.priced), None)
    if table is not None and keep > forced:
        keep = best_prefix(table, len(claims) + fixed, [y for _, y in order], forced,
                           sum(c.overhead for c in claims))
    out = [0] * len(claims)
    for i, _ in order[:keep]:
        out[i] += 1
    return out


def best_prefix(table: RoundCosts, base: int, yields: list[float], least: int, overhead: float) -> int:
    """m in least..len(yields) maximizing (base + yields[0] + .. + yields[m-1]) /
    (c(base + m) + overhead), the narrowest on ties. base: the round's rows without
    drafts (each commits one token); yields: each further row's expected tokens, in order."""
    tokens = float(base)                             # summed in order, as gate.expected_tokens
    best_m, best_rate = 0, -1.0
    for m in range(len(yields) + 1):
        if m:
            tokens += yields[m - 1]
        rate = tokens / (table.cost(base + m) + overhead)
        if m >= least and rate > best_rate:
            best_m, best_rate = m, rate
    return best_m


def round_room(rows: int, max_rows: int = MAX_WIDTH) -> int:
    """The drafts a round of `rows` rows without drafts (one a stream, and any stream's
    fixed rows) can still take: MAX_WIDTH rows in all."""
    return max(0, max_rows - rows)


def cut(d: Draft, n: int) -> Draft:
    """The draft's n leading tokens (d itself when it has n)."""
    if n == len(d):
        return d
    return Draft(d.tokens[:n], d.source if n else "none", d.match_len, d.probs[:n])

