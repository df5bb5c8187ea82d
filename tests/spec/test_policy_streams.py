"""The policy at -np N (spec/seated.py, spec/allot.py's seats, spec/config.py's per-slot memory):
what a stream learns is its own (a memory per slot: acceptance, rates, the MTP switch), what a
round costs is the model's (the table, the chain's ms); an off phase waits its stream's rounds;
samples are priced in the round the stream was seated in, as the allotment prices it; a stream
whose chain drafted nothing still claims its chain's ms. At N = 1 the decisions are today's:
the same samples through `propose`, Engine.generate's claim and seat, and Streams' seat give the
same drafts and the same memory, and the one recorded from the code before -np's policy."""
from __future__ import annotations

import hashlib
import itertools
import json
import random

import pytest

from alphallama.spec.allot import Claim, Seat, allot, cut, round_room, seats
from alphallama.spec.config import ModelMemory
from alphallama.spec.drafter import NO_DRAFT, Draft, common_prefix
from alphallama.spec.gate import MAX_WIDTH, CostTable, Gate, cumulative
from alphallama.spec.ngram import NgramDrafter
from alphallama.spec.policy import PolicyDrafter, PolicyMemory, PolicyRules
from alphallama.spec.seated import width_in

from test_mtp_switch import ROUND_MS, Clock, Script, h200_table

H200 = h200_table()


class RandomMTP:
    """An MTP drafter from a seeded script: k drafts (0..3), the first a of them right, each
    with a probability drawn from a few; each proposal costs head_ms on the clock."""
    name = "mtp"

    def __init__(self, truth: list[int], clock: Clock, head_ms: float, seed: int, right: float):
        self.truth, self.clock, self.head_ms, self.rng = truth, clock, head_ms, random.Random(seed)
        self.right = right                # how often all k are right (else a uniform 0..k are)
        self.pos = 0

    def begin(self, prompt_ids):
        self.pos = len(prompt_ids)

    def accept(self, tokens):
        self.pos += len(tokens)

    def propose(self, max_n):
        self.clock.t += self.head_ms / 1000
        k = self.rng.randint(0, 3)
        a = k if self.rng.random() < self.right else self.rng.randint(0, k)
        toks = [t if j < a else -1 for j, t in enumerate(self.truth[self.pos:self.pos + k])][:max_n]
        return Draft(toks, "mtp", probs=tuple(self.rng.choice([0.3, 0.6, 0.9, 0.97]) for _ in toks))


def copy_text(seed: int, source_len: int = 300, out_len: int = 900) -> tuple[list[int], int]:
    """A prompt holding a source and an output copying spans of it between fresh tokens."""
    r = random.Random(seed)
    fresh = iter(r.sample(range(1000, 200000), source_len + out_len))
    source = [next(fresh) for _ in range(source_len)]
    out: list[int] = []
    while len(out) < out_len:
        i = r.randrange(source_len - 40)
        out += source[i:i + r.randint(2, 40)] + [next(fresh) for _ in range(r.randint(1, 8))]
    return source + out[:out_len], source_len - 1


# -- the one-stream path: three drivers, one set of decisions, today's -----------------------
def by_propose(p: PolicyDrafter, max_n: int) -> Draft:
    return p.propose(max_n)


def by_generate(p: PolicyDrafter, max_n: int) -> Draft:
    """Engine.generate: the claim answered with the gate's width, alone."""
    d, claim = p.offer(max_n)
    n = allot([claim])[0]
    p.seat(Seat(n))
    return cut(d, n)


def by_streams(p: PolicyDrafter, max_n: int) -> Draft:
    """Streams.step with one stream: the allotment within a round's room, its seat."""
    d, claim = p.offer(max_n)
    drafts = allot([claim], 0, round_room(1))
    (seat,) = seats([claim], 0, drafts)
    p.seat(seat)
    return cut(d, drafts[0])


def one_stream_run(drive) -> tuple[str, str]:
    """Two requests (one memory) of `mtp,ngram` under the switch, over copy texts, with a head
    right more often in the first request than in the second, costing 0.15 ms a chain
    -> (each round's draft, the memory learned)."""
    clock, mem, trace = Clock(), PolicyMemory(), []
    rules = PolicyRules(probe_wait=8, probe_wait_max=32)
    for seed, right in ((1, 0.8), (2, 0.3)):
        truth, prompt_len = copy_text(seed)
        mtp, copy = RandomMTP(truth, clock, 0.15, seed, right), NgramDrafter(ngram_min=2, draft_max=16)
        p = PolicyDrafter(mtp, copy, Gate(H200), mem, H200, rules, clock=clock)
        pos = prompt_len + 1
        p.begin(truth[:pos])
        while pos < len(truth):
            d = drive(p, min(16, len(truth) - pos - 1)) if len(truth) - pos > 1 else NO_DRAFT
            step = common_prefix(d.tokens, truth[pos:]) + 1
            p.accept(truth[pos:pos + step])
            pos += step
            trace.append(f"{d.source[0]}{len(d)}")
    return " ".join(trace), json.dumps(mem.to_dict(), sort_keys=True)


# what `one_stream_run(by_propose)` gave before the policy took seats (main at 4197c54)
BEFORE = {"rounds": 460, "trace_sha256": "2aeaae882a2d7f28663c718107fede0750850492a7871938e82a88aa8e2fbdf8",
          "memory_sha256": "769216f6526753c9f80b2a9c9db89b8ff68941d3eff35a3984df52a4dc99f38a"}


def test_one_stream_decides_as_before():
    runs = {drive.__name__: one_stream_run(drive) for drive in (by_propose, by_generate, by_streams)}
    assert runs["by_generate"] == runs["by_propose"] == runs["by_streams"]
    trace, memory = runs["by_propose"]
    learned = json.loads(memory)
    # the run exercises the switch (phases off and probes), the short matches' rates, the copy's gate
    assert learned["mtp_switch"]["switched_off"] >= 2 and learned["mtp_switch"]["on_phases"] >= 3
    assert {"mtp off", "short match, learning", "long match", "no match"} <= set(learned["decisions"])
    assert len(learned["tokens_per_ms"]) >= 4
    got = {"rounds": len(trace.split()), "trace_sha256": hashlib.sha256(trace.encode()).hexdigest(),
           "memory_sha256": hashlib.sha256(memory.encode()).hexdigest()}
    assert got == BEFORE


def test_width_in_a_round_alone_is_the_gate():
    """Seat(n) (nothing beside the stream): the gate's width on the same inputs, whatever the
    table, the confidences and the chain's ms; beside other rows, the allotment's cut."""
    rng = random.Random(3)
    for _ in range(400):
        steps = [rng.choice([0.0, 0.0, 0.01, 0.05, 0.3, 1.0]) for _ in range(MAX_WIDTH)]
        t = CostTable(list(itertools.accumulate(steps, initial=0.5))[1:], MAX_WIDTH)
        conf = cumulative([rng.choice([0.3, 0.6, 0.9, 0.99, 1.0]) for _ in range(rng.randint(0, 16))])
        h = rng.choice([0.0, 0.45, 2.0])
        for gate in (Gate(t), Gate(p_min=0.5), Gate()):
            assert width_in(gate, conf, Seat(0), h) == gate.width(conf, h)
            assert width_in(gate, conf, Seat(5), h) == gate.width(conf, h)      # its own drafts: no matter
    # W <= 4 costs W = 1's, a fifth row 5x: alone a draft rides free, beside 3 rows it would be the fifth
    t = CostTable([1.0] * 4 + [5.0] * (MAX_WIDTH - 4), MAX_WIDTH)
    assert width_in(Gate(t), [0.5], Seat(0)) == 1
    assert width_in(Gate(t), [0.5], Seat(0, rows=3, tokens=3.0)) == 0
    assert width_in(Gate(t), [0.5], Seat(0, rows=3, tokens=3.0, overhead=100.0)) == 1  # dear chains: rows are cheap


# -- per slot and per model ------------------------------------------------------------------
def test_each_slot_learns_its_own_and_the_costs_are_the_models():
    mm = ModelMemory()
    a, b = mm.policy_for(0), mm.policy_for(1)
    assert a is mm.policy and mm.policy_for(1) is b and b is not a                   # -np 1: the one memory
    assert b.mtp_cost is a.mtp_cost                                                 # the chain's ms: the model's
    assert b.switch is not a.switch and b.copy_conf is not a.copy_conf and b.rates is not a.rates


def test_an_off_phase_waits_its_streams_rounds():
    """Two streams in every round, each switched off for 5 rounds: each probes at its 5th round
    (a switch asked by both streams would have ended the wait in 3), and each drafts by its own."""
    clock, mm = Clock(), ModelMemory()
    mtps, ps = [], []
    for slot in (0, 1):
        mem = mm.policy_for(slot)
        mem.switch.on, mem.switch.wait = False, 5
        mtps.append(Script("mtp", clock, 0.4))
        mtps[-1].next = Draft([7], "mtp", probs=(0.9,))
        ps.append(PolicyDrafter(mtps[-1], None, Gate(H200), mem, H200, clock=clock))
        ps[-1].begin([1, 2])
    ran = []
    for _ in range(6):
        offers = [p.offer(8) for p in ps]
        claims = [c for _, c in offers]
        drafts = allot(claims, 0, round_room(2))
        for p, seat in zip(ps, seats(claims, 0, drafts)):
            p.seat(seat)
            p.accept([9])
        ran.append([m.calls for m in mtps])
    assert ran == [[0, 0]] * 4 + [[1, 1], [2, 2]]
    assert all(mm.policy_for(s).decisions == {"mtp off": 4} for s in (0, 1))
    assert mm.policy.mtp_cost.n == 4 and mm.policy.mtp_cost.ms == pytest.approx(0.4)


# -- samples priced in their round -----------------------------------------------------------
def test_seats_are_the_rest_of_the_allotted_round():
    """Two rows without claims, and three claims: drafts (0.9, 0.45) with a chain of 0.45 ms, a
    chain that drafted nothing (0.45 ms), a copy draft (0.8): each seat is the others'."""
    g = Gate(H200)
    claims = [Claim((0.9, 0.45), g, 0.45), Claim((), g, 0.45), Claim((0.8,), g)]
    got = seats(claims, 2, [2, 0, 1])
    want = [(5, 2 + 1.0 + 1.8, 0.45), (7, 2 + 2.35 + 1.8, 0.45), (6, 2 + 2.35 + 1.0, 0.9)]
    assert [s.drafts for s in got] == [2, 0, 1]
    for s, (rows, tokens, overhead) in zip(got, want):
        assert (s.rows, s.tokens, s.overhead) == (rows, pytest.approx(tokens), pytest.approx(overhead))
    assert seats([claims[0]], 0, [1]) == [Seat(1)]                       # alone: nothing beside it


def test_a_chain_that_drafted_nothing_is_in_the_rounds_price():
    """c(2) = 1.2, c(3) = 1.6: beside another row a 0.25 draft does not pay (2 / 1.2 > 2.25 / 1.6);
    with the other stream's 3 ms chain in the round it does (2 / 4.2 < 2.25 / 4.6). The stream
    whose chain drafted nothing claims (it did not, before: its row was a fixed one, its ms lost)."""
    t = CostTable([1.0, 1.2] + [1.6] * (MAX_WIDTH - 2), MAX_WIDTH)
    a, empty = Claim((0.25,), Gate(t)), Claim((), Gate(t), 3.0)
    assert allot([a], fixed=1) == [0]
    assert allot([a, empty]) == [1, 0]


def test_samples_are_priced_in_the_round_they_were_seated_in():
    clock = Clock()
    mtp, copy = Script("mtp", clock, ms=0.5), Script("ngram")
    mem = PolicyMemory()
    p = PolicyDrafter(mtp, copy, Gate(H200), mem, H200, clock=clock)
    p.begin([1, 2, 3])
    mtp.next = Draft([4, 5], "mtp", probs=(0.9, 0.9))
    d, claim = p.offer(16)
    assert d.tokens == [4, 5] and claim.overhead == pytest.approx(0.5)
    p.seat(Seat(2, rows=3, tokens=3.5, overhead=0.25))          # three other rows, their chain 0.25 ms
    p.accept([4, 5, 6])
    w = mem.switch.phase
    assert w.n == 1 and w.tokens == pytest.approx(3.5 + 3)
    assert w.on_ms == pytest.approx(ROUND_MS[5] + 0.25 + 0.5)                  # W = 3 + 3, both chains
    # without the chain: this stream's one row beside the same three, its three tokens at that round's rate
    assert w.off_ms == pytest.approx((3.5 + 3) * (ROUND_MS[3] + 0.25) / (3.5 + 1))
    # a short match: each drafter's draft priced at the width the round would give it, in the round
    copy.next = Draft([7, 8, 9], "ngram", match_len=2)
    mtp.next = Draft([7, 11], "mtp", probs=(0.9, 0.2))
    p.offer(16)
    seat = Seat(1, rows=3, tokens=3.5, overhead=0.25)
    p.seat(seat)
    rate = {x.drafter: x for x in p.ledger.items if x.what == "rate"}
    for name, conf in (("mtp", cumulative((0.9, 0.2))), ("ngram", mem.copy_conf.conf(2, 3))):
        n = width_in(Gate(H200), conf, seat, 0.5)
        assert len(rate[name].tokens) == n and rate[name].base == 3.5
        assert rate[name].ms == pytest.approx(H200.cost(3 + 1 + n) + 0.25 + 0.5)
