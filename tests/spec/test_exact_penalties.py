"""Exact mode with logit_bias and repetition penalties: a verify round's row i counts the
committed tokens and drafts[:i] (penalties.py), so speculative greedy output equals plain
greedy output with the same penalties, token for token, and the penalties do change it.

Three drafters: an oracle that drafts the plain run's own continuation (every round wide,
so a row penalized with the wrong history would change the text) with a wrong last draft
(the rejection path), the copy drafter on stories260K, and the MTP head of the embedded model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from alphallama.engine import Engine, Generation
from alphallama.sampling import SamplingParams
from alphallama.spec.config import SpecConfig
from alphallama.spec.drafter import Draft

EMBEDDED = Path(__file__).resolve().parents[2] / "src" / "alphallama" / "data" / "alphallama-embedded.gguf"
pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {   # repetition penalty, a window shorter than a round, the whole context, both signs with a bias
    "repeat": SamplingParams(repeat_penalty=1.3),
    "window-3": SamplingParams(repeat_penalty=1.6, presence_penalty=0.4, repeat_last_n=3),
    "all-context": SamplingParams(presence_penalty=0.6, frequency_penalty=0.4, repeat_last_n=-1),
    "mixed-bias": SamplingParams(repeat_penalty=1.1, frequency_penalty=-0.3, presence_penalty=0.5, repeat_last_n=16,
                                 logit_bias=((13, -100.0), (278, 3.0), (300, 1.5))),
}
STORIES_PROMPTS = ["Once upon a time", "Tom and Lily went to the park", "The cat"]
N = 120


class Oracle:
    """Drafts the next `depth` tokens of a known continuation, the last of them made wrong."""
    name = "oracle"

    def __init__(self, n_prompt: int, continuation: list[int], depth: int, n_vocab: int):
        self.n_prompt, self.continuation, self.depth, self.n_vocab = n_prompt, continuation, depth, n_vocab

    def begin(self, ids: list[int]) -> None:
        self.n = len(ids) - self.n_prompt              # continuation tokens committed

    def propose(self, max_n: int) -> Draft:
        k = min(max_n, self.depth)
        nxt = self.continuation[self.n:self.n + k]
        if nxt and len(nxt) == k:
            nxt[-1] = (nxt[-1] + 1) % self.n_vocab
        return Draft(nxt, source="ngram")

    def accept(self, tokens: list[int]) -> None:
        self.n += len(tokens)


@dataclass(frozen=True)
class OracleSpec:
    """What Engine._decode reads of a SpecConfig: the drafter it makes, and exact mode."""
    drafter: Oracle
    fast: bool = False

    def make_drafter(self, engine=None, mtp=None, slot=None) -> Oracle:
        return self.drafter


@pytest.fixture(scope="module")
def stories(stories_path):
    return Engine.load(str(stories_path), ctx_size=1024)


@pytest.fixture(scope="module")
def embedded():
    return Engine.load(str(EMBEDDED))


def _oracle(engine: Engine, ids: list[int], plain: list[int]) -> OracleSpec:
    return OracleSpec(Oracle(len(ids), plain, 8, engine.cfg.vocab_size))


def _run(engine: Engine, ids: list[int], sampling: SamplingParams, spec=SpecConfig("none")) -> tuple[list, Generation]:
    gen = Generation()
    return list(engine.generate(ids, N, sampling, gen=gen, spec=spec)), gen


def _assert_spec_equals_plain(engine: Engine, prompts: list[list[int]], spec_of) -> None:
    """Every case on every prompt: spec == plain; each case changes some output, and drafts
    were accepted under it. spec_of(ids, plain output) -> the speculative run's SpecConfig."""
    for name, sampling in CASES.items():
        changed, accepted = False, 0
        for ids in prompts:
            plain, _ = _run(engine, ids, sampling)
            drafted, gen = _run(engine, ids, sampling, spec_of(ids, plain))
            assert drafted == plain, name
            changed |= plain != _run(engine, ids, SamplingParams())[0]
            accepted += gen.stats.draft_n_accepted
        assert changed, f"{name}: the penalties changed nothing"
        assert accepted > 0, name


def test_oracle_drafts_with_penalties_are_exact(stories):
    prompts = [stories.encode_prompt(p) for p in STORIES_PROMPTS]
    _assert_spec_equals_plain(stories, prompts, lambda ids, plain: _oracle(stories, ids, plain))


def test_oracle_rounds_are_wide(stories):
    ids = stories.encode_prompt(STORIES_PROMPTS[0])
    plain, _ = _run(stories, ids, CASES["window-3"])
    _, gen = _run(stories, ids, CASES["window-3"], _oracle(stories, ids, plain))
    assert gen.stats.rounds <= len(plain) // 6          # ~7 tokens a round: rows 0..6 carry the drafts' history


def test_copy_drafter_with_penalties_is_exact(stories):
    prompts = [stories.encode_prompt(p) for p in STORIES_PROMPTS]
    ngram = SpecConfig("ngram", draft_max=16, ngram_min=1, gate=False)
    _assert_spec_equals_plain(stories, prompts, lambda ids, plain: ngram)


def test_mtp_drafter_with_penalties_is_exact(embedded):
    prompts = [embedded.encode_chat([{"role": "user", "content": p}])
               for p in ("Write a Python function that returns a list.", "def is_palindrome(s):")]
    mtp = SpecConfig("mtp", gate=False, mtp_switch=False)
    _assert_spec_equals_plain(embedded, prompts, lambda ids, plain: mtp)


def test_logit_bias_bans_and_forces(stories):
    ids = stories.encode_prompt(STORIES_PROMPTS[0])
    plain, _ = _run(stories, ids, SamplingParams())
    banned, _ = _run(stories, ids, SamplingParams(logit_bias=((plain[0], -100.0),)))
    assert banned[0] != plain[0] and plain[0] not in banned
    forced_token = 100
    forced, gen = _run(stories, ids, SamplingParams(logit_bias=((forced_token, 100.0),)))
    assert forced == [forced_token] * N and gen.finish_reason == "length"
    never, _ = _run(stories, ids, SamplingParams(logit_bias=((plain[0], float("-inf")),)))
    assert never == banned                                  # -100 on a token this model never prefers by 100
