"""The engine on a hybrid (recurrent + attention) model: a verify round leaves the state
of exactly the accepted prefix, speculation in exact mode gives plain greedy's tokens,
and a chat turn continues from the prompt-boundary checkpoint with the tokens a
prefill from scratch gives."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from alphallama.engine import Engine, Generation
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.hybrid_cache import REPLAY, SNAPSHOT
from alphallama.spec.config import SpecConfig
from alphallama.spec.drafter import Draft

NGRAM = SpecConfig("ngram", draft_max=16, ngram_min=2, gate=False)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["tiny-qwen35moe", "tiny-qwen3next"])
def path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("hyb") / f"{request.param}.gguf"
    write_synthetic(PRESETS[request.param](seed=3), p)
    return str(p)


def _engine(path, mode=REPLAY):
    e = Engine.load(path, ctx_size=512, device="cpu")
    e.model.state_mode = mode
    e.cache = e.model.new_cache(512)
    return e


def _prompt(n_rep=4):
    chunk = [17, 99, 45, 230, 8, 71, 150, 33, 12, 200]
    return [1] + chunk * n_rep + [5, 6]


@pytest.mark.parametrize("mode", [SNAPSHOT, REPLAY])
def test_round_leaves_the_accepted_prefix_state(path, mode):
    e = _engine(path, mode)
    m, prompt = e.model, torch.tensor(_prompt())
    rows = torch.tensor([40, 41, 42, 43, 44, 45, 46])
    for exact in (True, False):
        for n_acc in (0, 3, 6):
            cache = m.new_cache(256)
            m.forward(prompt, 0, cache)
            pos = cache.length
            m.verify(rows, pos, cache, exact=exact)
            m.verify(rows, pos, cache, exact=exact)           # a second round at the same position (timing does this)
            cache.truncate(pos + 1 + n_acc)
            ref = m.new_cache(256)
            m.forward(prompt, 0, ref)
            if exact:
                for i in range(1 + n_acc):
                    m.forward(rows[i:i + 1], pos + i, ref)
            else:
                m.forward(rows[:1 + n_acc], pos, ref)
            assert cache.length == ref.length == pos + 1 + n_acc
            same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=2e-5))
            assert same(cache.conv, ref.conv) and same(cache.ssm, ref.ssm), (mode, exact, n_acc)
            # the next row computed from there is the next row of the plain run
            a, _ = m.forward(torch.tensor([7]), pos + 1 + n_acc, cache)
            b, _ = m.forward(torch.tensor([7]), pos + 1 + n_acc, ref)
            assert same(a, b)


def test_cache_refuses_points_it_does_not_hold(path):
    e = _engine(path)
    cache = e.model.new_cache(128)
    e.model.forward(torch.tensor(_prompt()), 0, cache)
    assert cache.restorable(20) == 0
    with pytest.raises(ValueError, match="cannot return to position 20"):
        cache.truncate(20)
    cache.checkpoint()
    n = cache.length
    e.model.forward(torch.tensor([3, 4, 5]), n, cache)
    assert cache.restorable(n + 2) == n
    cache.truncate(n)                                          # back to the checkpoint
    cache.truncate(0)
    assert cache.ssm.abs().max() == 0 and cache.boundary is None


class Oracle:
    """Drafts plain greedy's next tokens (1 + round % cycle of them, at most), the last one
    wrong in rounds where round % wrong_every == wrong_at: rounds that accept everything,
    rounds that reject a suffix (commits of fewer rows than were verified)."""
    name = "oracle"

    def __init__(self, plain: list[int], cycle: int, wrong_every: int, wrong_at: int, vocab: int):
        self.plain, self.done, self.round = plain, 0, 0
        self.cycle, self.wrong_every, self.wrong_at, self.vocab = cycle, wrong_every, wrong_at, vocab

    def begin(self, prompt_ids):
        pass

    def propose(self, max_n):
        self.round += 1
        n = min(1 + self.round % self.cycle, max_n, len(self.plain) - self.done - 1)
        toks = list(self.plain[self.done + 1:self.done + 1 + max(n, 0)])
        if toks and self.round % self.wrong_every == self.wrong_at:
            toks[-1] = (toks[-1] + 1) % self.vocab
        return Draft(toks, self.name)

    def accept(self, tokens):
        self.done += len(tokens)


@dataclass
class OracleSpec:
    """A SpecConfig stand-in whose drafter is an Oracle (cycle, wrong_every, wrong_at, vocab)."""
    plain: list[int]
    cycle: int = 7
    wrong_every: int = 3
    wrong_at: int = 0
    vocab: int = 512
    fast: bool = False

    def make_drafter(self, engine=None, mtp=None, slot=None):
        return Oracle(self.plain, self.cycle, self.wrong_every, self.wrong_at, self.vocab)


@pytest.mark.parametrize("mode", [SNAPSHOT, REPLAY])
def test_exact_speculation_is_plain_greedy(path, mode):
    e = _engine(path, mode)
    prompt = _prompt()
    plain = list(e.generate(prompt, 60))
    e.reset()
    g = Generation()
    assert list(e.generate(prompt, 60, spec=OracleSpec(plain), gen=g)) == plain
    assert 0 < g.stats.draft_n_accepted < g.stats.draft_n and g.stats.rounds < 40, g.stats


def test_ngram_speculation_is_plain_greedy(path):
    """The copy drafter needs a model that repeats what it saw: the layers' outputs are
    scaled down until the next token depends mostly on the current one, and the prompt
    holds the model's own continuation of its start."""
    e = _engine(path)
    for name in e.model.w:
        if name.endswith(("ssm_out.weight", "attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight",
                          "ffn_down_shexp.weight")):
            e.model.w[name] = e.model.w[name] * 0.02
    start = _prompt(1)
    prompt = start + list(e.generate(start, 40)) + start
    e.reset()
    plain = list(e.generate(prompt, 40))
    e.reset()
    g = Generation()
    assert list(e.generate(prompt, 40, spec=NGRAM, gen=g)) == plain
    assert 0 < g.stats.draft_n_accepted < g.stats.draft_n, g.stats


def test_next_turn_continues_from_the_checkpoint(path):
    e = _engine(path)
    p1 = _prompt(2)
    a1 = list(e.generate(p1, 12))
    # the next turn re-renders the answer differently (a template dropping the thinking part):
    # the prompt shares only p1, so the engine continues from the checkpoint before p1's last row
    p2 = p1 + [9, 10, 11] + a1[3:] + [22, 23]
    g = Generation()
    a2 = list(e.generate(p2, 20, gen=g))
    assert g.stats.prompt_reused == len(p1) - 1 and g.stats.prompt_n == len(p2) - len(p1) + 1
    # a third turn extends the second conversation as cached (the answer's rows but a last one
    # that was never forwarded): continue from the current state
    p3 = e.cached + [30, 31]
    assert e.cached[:len(p2)] == p2 and len(e.cached) >= len(p2) + len(a2) - 1
    g3 = Generation()
    a3 = list(e.generate(p3, 20, gen=g3))
    assert g3.stats.prompt_reused == len(p3) - 2
    fresh = _engine(path)
    assert list(fresh.generate(p2, 20)) == a2
    fresh.reset()
    assert list(fresh.generate(p3, 20)) == a3
    # and a repeated request recomputes only its last row, with the same answer
    g4 = Generation()
    assert list(e.generate(p3, 20, gen=g4)) == a3 and g4.stats.prompt_n == 1


@pytest.mark.parametrize("preset,ffn", [("tiny-qwen35moe", "moe"), ("tiny-qwen35", "dense")])
def test_in_file_mtp_head_drafts_and_exact_stays_plain(preset, ffn, tmp_path):
    """The in-file nextn block drafts (model/qwen35_mtp.py); with every draft taken (min-p 0),
    exact mode still gives plain greedy's tokens, alone and with the copy drafter, and over
    a second turn that continues from the checkpoint."""
    p = tmp_path / f"{preset}-mtp.gguf"
    write_synthetic(PRESETS[preset](seed=4, mtp=ffn), p)
    e = Engine.load(str(p), ctx_size=512, device="cpu")
    assert e.mtp is not None and type(e.mtp.head).__name__ == "HybridMTPHead"
    p1 = _prompt(2)
    plain = list(e.generate(p1, 40))
    turn2 = p1 + plain[:5] + [44, 45]
    plain2 = list(e.generate(turn2, 30))
    for kind in ("mtp", "mtp,ngram"):
        spec = SpecConfig(kind, draft_max=8, ngram_min=2, gate=False, mtp_depth=3, mtp_min_p=0.0, mtp_switch=False)
        e.reset()
        g = Generation()
        assert list(e.generate(p1, 40, spec=spec, gen=g)) == plain
        assert g.stats.draft_n > 0
        g2 = Generation()
        assert list(e.generate(turn2, 30, spec=spec, gen=g2)) == plain2
        assert g2.stats.prompt_reused == len(p1) - 1
