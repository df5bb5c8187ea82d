"""The MTP drafter on CPU with synthetic heads (in-file and sidecar): the min-p stop and
depth, the lifecycle through the engine (every round's chain equals a from-scratch
computation over the committed tokens), the MTP cache across prefix re-use, and exact
mode token-identical to plain greedy."""
from __future__ import annotations

import shutil

import pytest
import torch

from alphallama.engine import Engine, Generation
from alphallama.gguf.arch import find_mtp_head
from alphallama.gguf.writer import PRESETS, write_mtp_sidecar, write_synthetic
from alphallama.model.mtp import MTPHead
from alphallama.spec import mtp as spec_mtp
from alphallama.spec.drafter import Draft
from alphallama.spec.mtp import MTPDrafter, make_mtp_drafter


class FakeState:
    def __init__(self, toks, probs):
        self.out = (toks, probs)

    def draft(self, depth):
        return self.out[0][:depth], self.out[1][:depth]


def test_min_p_stop_and_depth():
    d = MTPDrafter(FakeState([5, 6, 7, 8], [0.9, 0.7, 0.4, 0.95]), depth=4, min_p=0.5)
    draft = d.propose(10)
    assert draft.tokens == [5, 6] and draft.probs == (0.9, 0.7) and draft.source == "mtp"
    assert d.last_tokens == [5, 6, 7, 8]                       # the whole chain stays visible
    assert MTPDrafter(FakeState([5, 6, 7], [0.9, 0.7, 0.6]), 3, 0.5).propose(1).tokens == [5]
    assert MTPDrafter(FakeState([5, 6], [0.3, 0.9]), 2, 0.5).propose(8).tokens == []
    assert MTPDrafter(FakeState([5, 6, 7], [0.1, 0.1, 0.1]), 2, 0.0).propose(8).tokens == [5, 6]
    for bad in (dict(depth=0, min_p=0.5), dict(depth=6, min_p=0.5), dict(depth=3, min_p=1.5)):
        with pytest.raises(ValueError):
            MTPDrafter(FakeState([], []), **bad)


class MTPSpec:
    """What Engine.generate asks of a spec config, with an MTP drafter whose rounds are
    recorded: (committed tokens when it drafted, the chain's tokens and probabilities)."""
    fast = False

    def __init__(self, depth=3, min_p=0.0, every=1):
        self.depth, self.min_p, self.every, self.rounds = depth, min_p, every, []   # every: draft every k-th round

    def make_drafter(self, engine, mtp=None, slot=None):
        d = make_mtp_drafter(engine, self.depth, self.min_p, mtp)
        propose, committed, n = d.propose, [], [0]
        d.begin = (lambda b: lambda ids: (committed.extend(ids), b(ids)))(d.begin)
        d.accept = lambda toks: committed.extend(toks)

        def recorded(max_n):
            n[0] += 1
            if n[0] % self.every:                # MTP switched off this round: the head is not run
                return Draft()
            draft = propose(max_n)
            self.rounds.append((list(committed), d.last_tokens, d.last_probs))
            return draft
        d.propose = recorded
        return d


def fresh_chain(engine, head: MTPHead, seq: list[int], depth: int):
    """docs/MTP.md from scratch: the main model over seq[:-1], MTP entries 0..n, the chain."""
    _, h = engine.model.forward(torch.tensor(seq[:-1]), 0, engine.model.new_cache(engine.ctx_size), logits=False)
    g = torch.cat([torch.zeros(1, h.shape[1]), h])                              # [n+1, D]
    return head.draft(g, torch.tensor(seq), 0, depth, head.new_cache())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    spec = PRESETS["tiny-qwen3"](n_layers=2, seed=7, ctx_len=512)
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=2, seed=7, ctx_len=512, mtp="dense"), d / "infile.gguf")
    write_synthetic(spec, d / "side.gguf")
    write_mtp_sidecar(spec, d / "side.mtp.gguf")                               # found by name
    shutil.copy(d / "side.gguf", d / "plain.gguf")
    shutil.copy(d / "side.mtp.gguf", d / "elsewhere.gguf")                       # found by --draft-head
    moe = PRESETS["tiny-qwen3moe"](n_layers=1, seed=8, ctx_len=512)
    write_synthetic(moe, d / "moe.gguf")
    write_mtp_sidecar(moe, d / "moe.mtp.gguf")                                  # a dense head on a MoE model
    return d


PROMPT = [3, 17, 99, 100, 250, 31, 7, 7, 64, 200, 11, 5, 88, 123, 42]


@pytest.mark.parametrize("name, head", [("infile", None), ("side", None), ("plain", "elsewhere.gguf"),
                                        ("moe", None)])
def test_exact_with_mtp_equals_plain_and_every_chain_is_the_reference(models, name, head):
    engine = Engine.load(str(models / f"{name}.gguf"), ctx_size=256, device="cpu",
                         draft_head=str(models / head) if head else None)
    assert engine.mtp is not None
    spec = MTPSpec(depth=3, min_p=0.0)
    g0, g1 = Generation(), Generation()
    plain = list(engine.generate(PROMPT, 16, gen=g0))
    engine.reset()
    out = list(engine.generate(PROMPT, 16, gen=g1, spec=spec))
    assert out == plain
    assert g1.stats.draft_n > 0 and g1.stats.rounds < 16
    f, hc = find_mtp_head(engine.gguf, engine.cfg, str(models / head) if head else None)
    ref = MTPHead.load(f, hc, engine.model, engine.ctx_size)
    for committed, toks, probs in spec.rounds:
        want, want_p = fresh_chain(engine, ref, committed, 3)
        assert toks == want
        assert probs == pytest.approx(want_p, rel=1e-3)


def test_infile_and_sidecar_heads_draft_alike(models):
    """Same seed and shapes: the in-file head and the sidecar hold the same tensors."""
    runs = []
    for name in ("infile", "side"):
        engine = Engine.load(str(models / f"{name}.gguf"), ctx_size=256, device="cpu")
        spec = MTPSpec(depth=2, min_p=0.0)
        list(engine.generate(PROMPT, 12, spec=spec))
        runs.append([r[1] for r in spec.rounds])
    assert runs[0] == runs[1] and runs[0]


def test_prefix_reuse_keeps_the_mtp_cache_consistent(models):
    engine = Engine.load(str(models / "side.gguf"), ctx_size=256, device="cpu")
    f, hc = find_mtp_head(engine.gguf, engine.cfg)
    ref = MTPHead.load(f, hc, engine.model, engine.ctx_size)

    def check(spec):
        for committed, toks, _ in spec.rounds:
            assert toks == fresh_chain(engine, ref, committed, 3)[0]

    a = MTPSpec()
    first = list(engine.generate(PROMPT, 10, spec=a))
    check(a)
    # the conversation goes on: rows are re-used, the MTP cache continues
    b = MTPSpec()
    g = Generation()
    list(engine.generate(PROMPT + first + [9, 10, 11], 8, gen=g, spec=b))
    assert g.stats.prompt_reused >= len(PROMPT) + len(first) - 2
    check(b)
    # a request without MTP moves the KV cache on; the next MTP request recomputes what it must
    other = PROMPT[:5] + [1, 2, 3, 4, 5, 6]
    list(engine.generate(other, 6))
    c = MTPSpec()
    list(engine.generate(other + [77, 78], 8, spec=c))
    check(c)
    # a diverging prompt truncates both caches
    d = MTPSpec()
    list(engine.generate(PROMPT[:3] + [400, 401, 402], 8, spec=d))
    check(d)
    assert engine.mtp.seq[:6] == PROMPT[:3] + [400, 401, 402]


def test_rounds_without_a_draft_stage_their_rows_for_the_next_one(models, monkeypatch):
    """Rounds where MTP is not run (the policy switched it off) extend nothing: their rows
    wait and the next draft makes them with its chain; STAGE_MAX rows make theirs without
    a draft. Every chain still equals the one computed from scratch."""
    monkeypatch.setattr(spec_mtp, "STAGE_MAX", 3)
    engine = Engine.load(str(models / "side.gguf"), ctx_size=256, device="cpu")
    f, hc = find_mtp_head(engine.gguf, engine.cfg)
    ref = MTPHead.load(f, hc, engine.model, engine.ctx_size)
    plain = list(engine.generate(PROMPT, 24))
    engine.reset()
    for every in (2, 5):
        spec = MTPSpec(depth=3, min_p=0.0, every=every)
        assert list(engine.generate(PROMPT, 24, spec=spec)) == plain
        assert len(spec.rounds) >= 3
        for committed, toks, _ in spec.rounds:
            assert toks == fresh_chain(engine, ref, committed, 3)[0]
    assert engine.mtp.length + sum(len(t) for _, t, _ in engine.mtp.staged) == len(engine.cached) + 1


def test_draft_vocabulary_subset_in_the_engine(models):
    engine = Engine.load(str(models / "side.gguf"), ctx_size=256, device="cpu")
    engine.mtp.vocab.size = 200                # fewer rows than the vocabulary: a subset is scored
    spec = MTPSpec(depth=2)
    list(engine.generate(PROMPT, 10, spec=spec))
    ids = engine.mtp.head.vocab_ids
    assert ids is not None and len(ids) == 200
    f, hc = find_mtp_head(engine.gguf, engine.cfg)
    ref = MTPHead.load(f, hc, engine.model, engine.ctx_size)
    ref.set_vocab(ids)
    allowed = set(ids.tolist())
    for committed, toks, _ in spec.rounds:
        assert set(toks) <= allowed
        assert toks == fresh_chain(engine, ref, committed, 2)[0]


def test_no_head_is_a_clear_error(models):
    engine = Engine.load(str(models / "plain.gguf"), ctx_size=64, device="cpu")
    assert engine.mtp is None
    with pytest.raises(ValueError, match="needs a model with an MTP head"):
        make_mtp_drafter(engine, 3, 0.5)


def test_running_into_the_context_end(models):
    """The token after a full context gets an MTP entry too (made by the next request)."""
    engine = Engine.load(str(models / "side.gguf"), ctx_size=24, device="cpu")
    g = Generation()
    out = list(engine.generate(PROMPT, 100, gen=g, spec=MTPSpec(depth=3)))
    assert g.finish_reason == "length" and len(PROMPT) + len(out) >= 24
    spec = MTPSpec(depth=3)
    list(engine.generate(PROMPT + out[:3], 4, spec=spec))
    assert spec.rounds
