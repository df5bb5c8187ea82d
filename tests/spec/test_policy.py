"""The drafter policy (DESIGN §5), one test per rule, and exact mode with it on: output
token-identical to plain greedy decoding."""
from __future__ import annotations

import pytest

from alphallama.engine import Engine, Generation
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.spec import config as spec_config
from alphallama.spec.config import SpecConfig
from alphallama.spec.drafter import NO_DRAFT, Draft
from alphallama.spec.gate import CostTable, Gate
from alphallama.spec.policy import PolicyDrafter, PolicyMemory, PolicyRules, Rate



pytestmark = pytest.mark.usefixtures("one_thread")

def linear_table(per_column: float = 0.05) -> CostTable:
    return CostTable([1.0 + per_column * w for w in range(64)], measured=64)


class Script:
    """A drafter that proposes what it is told and remembers what it was shown."""

    def __init__(self, name: str):
        self.name = name
        self.next = NO_DRAFT
        self.seen: list[int] = []
        self.last_tokens: list[int] | None = None    # MTPDrafter: its chain, under min-p too

    def begin(self, prompt_ids):
        self.seen = list(prompt_ids)

    def propose(self, max_n):
        return Draft(self.next.tokens[:max_n], self.next.source, self.next.match_len, self.next.probs[:max_n])

    def accept(self, tokens):
        self.seen.extend(tokens)


def policy(memory: PolicyMemory | None = None, gate: Gate = Gate()):
    """The scripted drafters cost nothing: a clock that stands still keeps the MTP head's
    measured cost (spec/policy.py, DrafterCost) at 0 ms, so the figures below are the table's."""
    mtp, copy = Script("mtp"), Script("ngram")
    p = PolicyDrafter(mtp, copy, gate, memory or PolicyMemory(), linear_table(), PolicyRules(), clock=lambda: 0.0)
    p.begin([1, 2, 3])
    return p, mtp, copy


def mtp_draft(*tokens, p=0.9):
    return Draft(list(tokens), "mtp", probs=(p,) * len(tokens))


def copy_draft(*tokens, match_len):
    return Draft(list(tokens), "ngram", match_len)


def test_agreement_check():
    p, mtp, copy = policy()
    copy.next = copy_draft(5, 6, 7, 8, 9, match_len=12)
    mtp.next = mtp_draft(4, 5)                              # disagrees on the first token: MTP
    assert p.propose(16).source == "mtp"
    mtp.next = mtp_draft(5, 9)                              # agrees: a long match takes the copy
    assert p.propose(16).tokens == [5, 6, 7, 8, 9]
    mtp.next = NO_DRAFT                                     # MTP made no chain: no veto
    assert p.propose(16).source == "ngram"
    mtp.last_tokens = [4, 5]                                # a chain under min-p is no opinion: no veto
    assert p.propose(16).source == "ngram"
    assert p.memory.decisions == {"disagree": 1, "long match": 3}


def test_no_match_keeps_mtp():
    p, mtp, copy = policy()
    mtp.next = mtp_draft(5, 6, 7)
    assert p.propose(16).tokens == [5, 6, 7]
    assert p.memory.decisions == {"no match": 1}


def test_long_match_takes_the_copy_and_short_one_is_priced():
    p, mtp, copy = policy()
    mtp.next = mtp_draft(5, 6)
    copy.next = copy_draft(5, 6, 7, match_len=6)
    assert p.propose(16).source == "ngram"                  # 6 tokens: long, nothing learned needed
    copy.next = copy_draft(5, 6, 7, match_len=5)
    assert p.propose(16).source == "mtp"                    # 5: priced, and nothing is known yet
    assert p.memory.decisions == {"long match": 1, "short match, learning": 1}


@pytest.mark.parametrize("copy_advantage, want", [(1.025, "mtp"), (1.035, "ngram")])
def test_short_match_pricing_needs_a_3_percent_margin(copy_advantage, want):
    mem = PolicyMemory()
    mem.rates[("mtp", 3)] = Rate(n=10, tokens=20.0, ms=10.0)                  # 2 tokens per ms
    mem.rates[("ngram", 3)] = Rate(n=10, tokens=20.0 * copy_advantage, ms=10.0)
    p, mtp, copy = policy(mem)
    mtp.next = mtp_draft(5, 6)
    copy.next = copy_draft(5, 6, 7, 8, match_len=3)
    assert p.propose(16).source == want
    mem.rates[("ngram", 3)].n = 3                           # too few rounds seen at this length: MTP
    assert p.propose(16).source == "mtp"


def run_rounds(p, mtp, copy, truth: list[int], rounds: int, mtp_right: int, copy_right: int, match_len: int):
    """Greedy rounds against a known output: MTP's first `mtp_right` of 3 drafts and the
    copy's first `copy_right` of 8 are right. Returns the source of each round."""
    pos, sources = 0, []
    for _ in range(rounds):
        nxt = truth[pos:pos + 8]
        mtp.next = mtp_draft(*[t if k < mtp_right else -1 for k, t in enumerate(nxt[:3])])
        copy.next = copy_draft(*[t if k < copy_right else -2 for k, t in enumerate(nxt)], match_len=match_len)
        d = p.propose(16)
        acc = 0
        while acc < len(d) and d.tokens[acc] == truth[pos + acc]:
            acc += 1
        p.accept(truth[pos:pos + acc + 1])                  # accepted drafts + the bonus
        pos += acc + 1
        sources.append(d.source)
    return sources, pos


def test_online_learning_moves_the_choice():
    truth = list(range(100, 1100))
    p, mtp, copy = policy()
    sources, _ = run_rounds(p, mtp, copy, truth, 30, mtp_right=1, copy_right=8, match_len=3)
    assert sources[0] == "mtp" and sources[-1] == "ngram"
    switch = sources.index("ngram")
    assert set(sources[switch:]) == {"ngram"} and switch <= 10
    # what it learned: the copy commits 9 tokens in a 9-row round (1.4 ms), MTP 2 in 4 rows (1.15 ms)
    assert p.memory.rate("ngram", 3).per_ms == pytest.approx(9 / 1.4)
    assert p.memory.rate("mtp", 3).per_ms == pytest.approx(2 / 1.15)
    # the same drafters where the copy goes wrong after one token: MTP keeps every round
    p, mtp, copy = policy()
    sources, _ = run_rounds(p, mtp, copy, truth, 30, mtp_right=3, copy_right=1, match_len=3)
    assert set(sources) == {"mtp"}
    assert p.memory.decisions["short match, mtp priced higher"] > 15


def test_both_drafters_see_every_committed_token():
    truth = list(range(100, 600))
    p, mtp, copy = policy()
    sources, n = run_rounds(p, mtp, copy, truth, 20, mtp_right=2, copy_right=8, match_len=3)
    assert {"mtp", "ngram"} <= set(sources)
    assert mtp.seen == copy.seen == [1, 2, 3] + truth[:n]


def test_gate_cuts_copy_drafts_by_learned_acceptance():
    """The copy's acceptance is learned from every draft it proposed, so a gate that cut
    deep drafts still learns they fail; MTP drafts are cut by their own probabilities."""
    truth = list(range(100, 1100))
    p, mtp, copy = policy(gate=Gate(linear_table(0.5)))     # dear columns: half a W = 1 round each
    run_rounds(p, mtp, copy, truth, 40, mtp_right=1, copy_right=2, match_len=7)
    dc = p.memory.copy_conf.counts["7"]
    assert dc.reached[:3] == [dc.reached[0]] * 3 and dc.hits[2] == 0         # depth 3 always examined, never right
    copy.next = copy_draft(*truth[:8], match_len=7)
    mtp.next = mtp_draft(truth[0])
    assert len(p.propose(16)) == 2                          # the third draft is not worth its column
    mtp.next = Draft([1, 2, 3], "mtp", probs=(0.9, 0.3, 0.9))
    copy.next = NO_DRAFT
    assert p.propose(16).tokens == [1]                      # S_2 = 0.27 < tau_2 = 0.5 * 1.9 / 1.5


# -- exact mode, through the engine -----------------------------------------------------------
class OracleMTP:
    """Stands in for the MTP drafter: proposes the plain run's next tokens with every
    fourth one wrong, under probabilities that say so."""
    name = "mtp"

    def __init__(self, prompt_len: int, plain: list[int], depth: int, vocab: int):
        self.prompt_len, self.plain, self.depth, self.vocab = prompt_len, plain, depth, vocab
        self.n = 0

    def begin(self, prompt_ids):
        self.n = len(prompt_ids)

    def accept(self, tokens):
        self.n += len(tokens)

    def propose(self, max_n):
        j = self.n - self.prompt_len
        out, probs = [], []
        for k in range(min(max_n, self.depth)):
            if j + k >= len(self.plain):
                break
            wrong = (j + k) % 4 == 3
            out.append((self.plain[j + k] + wrong) % self.vocab)
            probs.append(0.55 if wrong else 0.95)
        return Draft(out, "mtp", probs=tuple(probs))


@pytest.fixture(scope="module")
def stories(stories_path):
    return Engine.load(str(stories_path), ctx_size=512)


PROMPTS = ["Once upon a time, there was a little girl named Lily. She liked to play", "The dog ran to the park"]
N = 64


@pytest.fixture(scope="module")
def plain_runs(stories):
    return [(ids, list(stories.generate(ids, N))) for ids in map(stories.encode_prompt, PROMPTS)]


@pytest.mark.parametrize("spec_type, gated", [("mtp,ngram", False), ("mtp,ngram", True), ("mtp", True)])
def test_exact_mode_with_the_policy_equals_plain_greedy(stories, plain_runs, monkeypatch, spec_type, gated):
    spec = SpecConfig(spec_type, draft_max=16, mtp_depth=3, gate=gated)
    spec.memory.for_engine(stories, exact=True)[1].table = linear_table(0.05)   # priced as a GPU would
    total = Generation().spec
    for ids, plain in plain_runs:
        monkeypatch.setitem(spec_config.DRAFTERS, "mtp", lambda c, e, state, ids=ids, plain=plain: OracleMTP(
            len(ids) + 1, plain[1:], c.mtp_depth, e.cfg.vocab_size))
        g = Generation()
        assert list(stories.generate(ids, N, gen=g, spec=spec)) == plain
        total.merge(g.spec)
    assert total.accepted > 0 and total.tokens_per_round > 1.5
    if spec_type == "mtp,ngram":
        assert total.rounds_by_source.get("ngram", 0) > 0 and total.rounds_by_source.get("mtp", 0) > 0
        assert sum(spec.memory.for_engine(stories, True)[1].policy.decisions.values()) > 0
    cal = total.calibration["mtp"].to_dict()[0]             # depth 1: the oracle's 0.95s and 0.55s
    assert cal["n"] > 0
    assert all(b["predicted"] == pytest.approx(0.95) or b["predicted"] == pytest.approx(0.55) for b in cal["bins"])


@pytest.fixture(scope="module")
def with_head(tmp_path_factory):
    """A random-weight model with an in-file MTP head (the MTP drafter of spec/mtp.py)."""
    path = tmp_path_factory.mktemp("policy") / "mtp.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=2, seed=7, ctx_len=512, mtp="dense"), path)
    return Engine.load(str(path), ctx_size=512, device="cpu")


@pytest.mark.parametrize("gated", [False, True])
def test_exact_mode_with_the_policy_and_a_real_mtp_head(with_head, gated):
    """min-p 0: the random head drafts every round; its greedy output repeats, so the copy
    has matches too. The engine keeps the head's cache through rounds the copy drafted."""
    spec = SpecConfig("mtp,ngram", mtp_min_p=0.0, mtp_depth=3, gate=gated)
    spec.memory.for_engine(with_head, exact=True)[1].table = linear_table(0.05)
    for text in ["hello hello hello", "abc abd abe abf"]:
        ids = with_head.encode_prompt(text)
        plain = list(with_head.generate(ids, 40))
        g = Generation()
        assert list(with_head.generate(ids, 40, gen=g, spec=spec)) == plain
        if not gated:       # gated, the random head's drafts (p ~ 1/vocab) are not worth a column
            assert g.spec.rounds_by_source.get("mtp", 0) > 0
    decisions = spec.memory.for_engine(with_head, True)[1].policy.decisions
    assert sum(decisions.values()) > 0 and ("disagree" in decisions or "long match" in decisions)
