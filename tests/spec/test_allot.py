"""The round's rows allotted across streams (spec/allot.py): drafts priced at their marginal
cost on the round's total width. One stream: exactly the gate's width; several: the
confident stream gets the rows a convex table still pays for, the others none; a bucket
the round already pays for makes a stream's drafts free; a round stops at 64 rows; a
floor (p_min) or no gate wants its drafts whatever they cost, up to the room."""
from __future__ import annotations

import itertools
import random

import pytest

from alphallama.spec.allot import Claim, allot, cut, round_room
from alphallama.spec.drafter import Draft
from alphallama.spec.gate import MAX_WIDTH, CostTable, Gate, cumulative


def table(ms: list[float]) -> CostTable:
    """A hand-built table: ms for W = 1..len(ms), the last value held up to W = 64."""
    return CostTable(ms + [ms[-1]] * (MAX_WIDTH - len(ms)), measured=len(ms))


# c(W) = 1 + 0.05 (W - 1) + 0.02 (W - 1)^2 ms: every further row dearer than the last
CONVEX = CostTable([1.0 + 0.05 * (w - 1) + 0.02 * (w - 1) ** 2 for w in range(1, MAX_WIDTH + 1)], MAX_WIDTH)


def claim(conf, gate, overhead=0.0) -> Claim:
    return Claim(tuple(conf), gate, overhead)


def rate(t: CostTable, confs: list[list[float]], ns: list[int], fixed: int = 0) -> float:
    """The round's expected tokens per ms with ns[i] drafts of stream i."""
    base = len(confs) + fixed
    return (base + sum(sum(c[:n]) for c, n in zip(confs, ns))) / t.cost(base + sum(ns))


def best_by_search(t: CostTable, confs: list[list[float]], fixed: int = 0) -> list[int]:
    """The allotment maximizing the round's expected tokens per ms, by trying every one
    (the fewest rows on ties): the oracle the greedy must meet."""
    best, best_rate = None, -1.0
    for ns in sorted(itertools.product(*[range(len(c) + 1) for c in confs]), key=sum):
        r = rate(t, confs, list(ns), fixed)
        if r > best_rate + 1e-12:
            best, best_rate = list(ns), r
    return best


@pytest.mark.parametrize("mode", ["priced", "p_min", "off"])
def test_one_stream_is_the_gate(mode):
    """N = 1: the same width as the single-stream gate on the same inputs, whatever the table
    (steps, slopes, flats), the confidences and the drafting overhead; with the room of a
    round (63 drafts) as without one (Engine.generate)."""
    rng = random.Random(7)
    for _ in range(400):
        steps = [rng.choice([0.0, 0.0, 0.01, 0.05, 0.3, 1.0]) for _ in range(MAX_WIDTH)]
        t = CostTable(list(itertools.accumulate(steps, initial=0.5))[1:], MAX_WIDTH)
        gate = {"priced": Gate(t), "p_min": Gate(p_min=rng.choice([0.1, 0.4, 0.8])), "off": Gate()}[mode]
        conf = cumulative([rng.choice([0.3, 0.6, 0.9, 0.99, 1.0]) for _ in range(rng.randint(0, 16))])
        h = rng.choice([0.0, 0.0, 0.45, 2.0])
        want = gate.width(conf, h)
        assert allot([claim(conf, gate, h)]) == [want]
        assert allot([claim(conf, gate, h)], room=round_room(1)) == [want]


def test_one_stream_by_hand():
    t = table([1.0, 1.1, 1.2, 1.3, 1.4])
    # E_n = 1, 1.9, 2.4, 2.5, 2.55; tokens/ms = 1, 1.727, 2.0, 1.923, 1.821: two drafts (test_gate's case)
    assert allot([claim([0.9, 0.5, 0.1, 0.05], Gate(t))]) == [2]
    assert allot([claim([0.05, 0.04], Gate(t))]) == [0]


def test_convex_table_gives_the_rows_to_the_confident_stream():
    """A (95% a draft) and B (15%): alone, B's first draft pays (a 0.07 ms column against
    1 ms a token); beside A, whose drafts already make the round wide, every further row
    costs more than B's 0.15 tokens are worth at the round's rate, so B gets none and A
    one fewer than alone."""
    a, b = cumulative([0.95] * 8), cumulative([0.15] * 8)
    g = Gate(CONVEX)
    assert (g.width(a), g.width(b)) == (5, 1)                               # each alone
    assert allot([claim(a, g), claim(b, g)]) == [4, 0] == best_by_search(CONVEX, [a, b])
    assert allot([claim(b, g), claim(a, g)]) == [0, 4]                      # whatever the arrival order
    # three more streams without drafts make the round wider still: A's marginal rows dearer
    assert allot([claim(a, g), claim(b, g)], fixed=3) == [1, 0] == best_by_search(CONVEX, [a, b], fixed=3)


def test_greedy_meets_the_best_allotment():
    """Three streams' chains on random tables: the greedy order's best prefix is the best of
    every allotment (a row costs the same whichever stream it goes to, and each chain's
    yields only fall)."""
    rng = random.Random(3)
    for _ in range(60):
        steps = [rng.choice([0.0, 0.02, 0.1, 0.4]) for _ in range(MAX_WIDTH)]
        t = CostTable(list(itertools.accumulate(steps, initial=1.0))[1:], MAX_WIDTH)
        confs = [cumulative([rng.choice([0.2, 0.5, 0.8, 0.95]) for _ in range(4)]) for _ in range(3)]
        fixed = rng.randint(0, 3)
        got, best = allot([claim(c, Gate(t)) for c in confs], fixed), best_by_search(t, confs, fixed)
        assert rate(t, confs, got, fixed) == pytest.approx(rate(t, confs, best, fixed), abs=1e-12)
        assert sum(got) == sum(best)          # equal yields may go to either stream: the same rows


def test_a_bucket_the_round_already_pays_for_makes_drafts_free():
    """W = 1 costs 1 ms, W = 2..8 2 ms (a padded bucket): alone, a stream's drafts never pay
    for the step; in a round that two plain streams already make 3 rows wide, rows up to 8
    cost nothing more, so it verifies five drafts."""
    t = table([1.0] + [2.0] * 7 + [3.0])
    conf = cumulative([0.5] * 8)
    assert Gate(t).width(conf) == 0
    assert allot([claim(conf, Gate(t))], fixed=2) == [5]


def test_a_full_round_stops_at_64_rows():
    """Five streams (two without drafts) and three chains of 30 drafts each, nearly free
    columns: 59 drafts fill the round to 64 rows, the most probable ones kept."""
    flat = table([1.0, 1.001])
    confs = [cumulative([0.99] * 30), cumulative([0.9] * 30), cumulative([0.5] * 30)]
    for gate in (Gate(flat), Gate()):
        got = allot([claim(c, gate) for c in confs], fixed=2, room=round_room(5))
        assert sum(got) == MAX_WIDTH - 5
        kept = [s for c, n in zip(confs, got) for s in c[:n]]
        left = [s for c, n in zip(confs, got) for s in c[n:]]
        assert min(kept) >= max(left)
        assert got[0] == 30 and got[2] < got[1] < 30
    assert round_room(MAX_WIDTH) == round_room(70) == 0
    assert allot([claim(confs[0], Gate())], fixed=MAX_WIDTH - 1, room=0) == [0]   # a full round: no drafts


def test_a_floor_or_no_gate_is_kept_first_up_to_the_room():
    """A --spec-p-min stream wants its drafts at or above the floor and a --no-gate stream all
    of its drafts, whatever they cost; a priced stream beside them pays for what is left."""
    steep = CostTable([float(w) for w in range(1, MAX_WIDTH + 1)], MAX_WIDTH)      # c(W) = W ms
    floor, off, priced = Gate(p_min=0.4), Gate(), Gate(steep)
    conf, weak = [0.9, 0.5, 0.2], [0.2, 0.04]
    # 2 + 1.4 tokens in 4 ms (0.85 a ms) beat 3.6 in 5 ms: the priced stream's draft does not pay
    assert allot([claim(conf, floor), claim(weak, priced)]) == [2, 0]
    assert allot([claim(conf, off), claim(weak, priced)]) == [3, 0]
    assert allot([claim(conf, priced), claim(conf, floor)], room=1) == [0, 1]
    assert allot([claim([0.3], off), claim([0.9], off)], room=1) == [0, 1]    # the room to the likelier draft
    assert allot([claim([0.9], off), claim([0.9], off)], room=1) == [1, 0]    # ties: the earlier stream


def test_each_streams_mtp_chain_is_in_the_rounds_price():
    """Two streams each ran its own MTP chain (1 ms each, the claims' overheads) before a round
    of c(W) = 1 + 0.3 (W - 1) ms: the round pays both, 2 + c(W) ms, so a 0.2-token draft pays
    for its 0.3 ms row ((2.2) / 3.6 > 2 / 3.3); priced as if one chain ran, it would not
    (2.2 / 2.6 < 2 / 2.3)."""
    t = CostTable([1.0 + 0.3 * (w - 1) for w in range(1, MAX_WIDTH + 1)], MAX_WIDTH)
    assert allot([claim([0.2], Gate(t), 1.0), claim([0.01], Gate(t), 1.0)]) == [1, 0]
    assert allot([claim([0.2], Gate(t), 1.0), claim([0.01], Gate(t), 0.0)]) == [0, 0]


def test_cut_keeps_the_leading_drafts():
    d = Draft([5, 6, 7], "mtp", 0, (0.9, 0.8, 0.7))
    assert cut(d, 3) is d
    assert cut(d, 1) == Draft([5], "mtp", 0, (0.9,))
    assert cut(d, 0) == Draft([], "none", 0, ())
