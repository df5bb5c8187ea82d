"""The policy's samples priced in the round its stream was seated in (parallel streams, -np N).

The policy (spec/policy.py) learns from samples the ledger scores against the committed
tokens: per match length, the tokens per ms of MTP's draft and of the copy's ("rate"); per
MTP round, that round against the same round without the head's chain ("switch"). Alone in
its rounds a stream's round is its own: c(1 + drafts) ms (+ the chain's h). In a round it
shares with other streams (streams.py) its rows cost what they add to the round, and the
allotment (spec/allot.py) gives it drafts by the round's expected tokens per ms. So each
sample is priced as the allotment prices a round: the whole round, with one variant of this
stream's rows, the other streams' as they were seated (`Seat`):

    tokens = the others' expected tokens (Seat.tokens) + what this variant commits,
    ms     = c(the others' rows + this variant's rows) + the others' drafting ms + its own,

and a variant this stream did not verify (MTP's draft when the copy's was chosen, the copy's
draft without the chain) gets the width the allotment would have given it beside the same
other rows (`width_in`). MTP then pays for a stream where its tokens raise the round's
tokens per ms, which is the allotment's question; a row that is nearly free in a wide round
(a bucket already paid for) makes drafts cheap, the chain's fixed ms weigh on every stream's
tokens in the round. Alone (`Seat(n)`: no other rows, tokens or ms) every price here is the
one-stream price, to the bit: 0.0 + x, c(0 + w) and c + 0.0 are x, c(w) and c.

`RoundNote` is what `PolicyDrafter.offer` knew when it drafted (the drafts, the confidences
they are gated by, the chain's ms, which samples are due); `priced` turns it into the
ledger's `Pending` samples once the driver's seat arrives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .allot import Seat, cut
from .drafter import Draft
from .gate import Gate, RoundCosts, expected_tokens


@dataclass
class Pending:
    start: int                 # where in the sequence the draft's first token would land
    tokens: list[int]
    what: str                  # "depth": copy acceptance sample | "rate": tokens/ms sample | "switch": MTP on/off
    drafter: str = ""
    match_len: int = 0
    ms: float = 0.0
    alt: list[int] = field(default_factory=list)   # "switch": the draft the round would have verified without MTP
    alt_ms: float = 0.0
    phase: int = 0
    base: float = 0.0          # the other streams' expected tokens in the round (0: alone)


@dataclass
class RoundNote:
    """An MTP round's drafts, waiting for its seat (PolicyDrafter.offer -> .seat)."""
    start: int                 # the draft's first position
    h: float                   # ms the chain cost (the median of recent chains)
    mtp: Draft                 # MTP's draft and the confidences that price it
    mtp_conf: list[float]
    copy: Draft                # the copy's draft and its confidences (learned per match length)
    copy_conf: list[float]
    chosen: Draft              # the draft the round verifies (before the driver's cut)
    rate_len: int | None = None      # a short match: a "rate" sample per drafter at this match length
    phase: int | None = None         # the switch's on-phase: a "switch" sample for it


def width_in(gate: Gate, conf: list[float], seat: Seat, overhead: float = 0.0) -> int:
    """The drafts the allotment gives a claim (conf, its drafting ms `overhead`) beside the
    seat's other rows: the n maximizing (seat.tokens + E_n) / (c(seat.rows + 1 + n) +
    seat.overhead + overhead), the narrowest on ties; a gate that does not price: its width.
    Alone: Gate.width(conf, overhead), to the bit."""
    if gate.p_min is not None or gate.table is None:
        return gate.width(conf, overhead)
    e = expected_tokens(conf)
    rates = [(seat.tokens + e[n]) / (gate.table.cost(seat.rows + n + 1) + seat.overhead + overhead)
             for n in range(len(e))]
    return max(range(len(rates)), key=lambda n: (rates[n], -n))


def round_ms(table: RoundCosts, seat: Seat, rows: int, overhead: float) -> float:
    """The round's ms with this stream's `rows` rows and drafting ms beside the seat's."""
    return table.cost(seat.rows + rows) + seat.overhead + overhead


def priced(note: RoundNote, seat: Seat, gate: Gate, table: RoundCosts) -> list[Pending]:
    """The samples the note's round is due, priced in its seat (the module docstring)."""
    out = []
    if note.rate_len is not None:                      # each drafter's draft as the round would verify it
        for name, d, conf in (("mtp", note.mtp, note.mtp_conf), ("ngram", note.copy, note.copy_conf)):
            g = cut(d, width_in(gate, conf, seat, note.h) if len(d) else 0)
            out.append(Pending(note.start, list(g.tokens), "rate", name, note.rate_len,
                               round_ms(table, seat, 1 + len(g), note.h), base=seat.tokens))
    if note.phase is not None:                         # this round against the same round without MTP
        d = cut(note.chosen, seat.drafts)
        alt = cut(note.copy, width_in(gate, note.copy_conf, seat) if len(note.copy) else 0)
        out.append(Pending(note.start, list(d.tokens), "switch", ms=round_ms(table, seat, 1 + len(d), note.h),
                           alt=list(alt.tokens), alt_ms=round_ms(table, seat, 1 + len(alt), 0.0),
                           phase=note.phase, base=seat.tokens))
    return out
