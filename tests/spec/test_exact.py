"""Exact mode: a verify round gives every row what a W = 1 pass gives it, bit for bit,
and speculative output equals plain greedy output token for token."""
from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from alphallama.engine import Engine, Generation
from alphallama.spec.config import SpecConfig
from alphallama.spec.replay import replay
from alphallama.gguf.writer import PRESETS, write_synthetic
from conftest import VOCAB, require

SUITE = [json.loads(line) for line in  # the public suite the package ships
         resources.files("alphallama.bench").joinpath("suites", "arena-public.jsonl").read_text().splitlines()
         if line.strip()]
NGRAM = SpecConfig("ngram", draft_max=16, ngram_min=2, gate=False)   # ungated: what replay simulates
pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one thread (tests/conftest.py says why)


@pytest.fixture(scope="module")
def stories(stories_path):
    return Engine.load(str(stories_path), ctx_size=1024)


def _clone_cache(cache):
    c = type(cache).__new__(type(cache))
    c.k, c.v, c.max_len, c.length = cache.k.clone(), cache.v.clone(), cache.max_len, cache.length
    return c


def column_rotation(model, vocab: int, prefix_len: int = 24, widths=range(1, 17), seed: int = 0):
    """For every width W, random rows verified in one round must equal W sequential
    W = 1 passes bitwise, in logits and in the K/V rows written; rotating the rows
    puts each token in every column."""
    g = torch.Generator().manual_seed(seed)
    base = model.new_cache(prefix_len + 40)
    model.forward(torch.randint(vocab, (prefix_len,), generator=g), 0, base)
    for W in widths:
        rows = torch.randint(vocab, (W,), generator=g)
        for r in range(W if W <= 4 else 2):               # rotations
            rot = torch.roll(rows, r)
            c1, c2 = _clone_cache(base), _clone_cache(base)
            got, _ = model.verify(rot, prefix_len, c1, exact=True)
            ref = torch.cat([model.forward(rot[i:i + 1], prefix_len + i, c2)[0] for i in range(W)])
            assert torch.equal(got, ref), (W, r)
            n = prefix_len + W
            assert torch.equal(c1.k[:, :, :n], c2.k[:, :, :n]) and torch.equal(c1.v[:, :, :n], c2.v[:, :, :n])


def test_column_rotation_stories(stories):
    column_rotation(stories.model, stories.cfg.vocab_size)


def _suite_prompt(engine, item, raw: bool):
    if raw:   # a model without a chat template: the messages' text
        return engine.encode_prompt("\n".join(m["content"] for m in item["messages"]))
    return engine.encode_chat(item["messages"])


def assert_spec_equals_plain(engine, raw: bool, budget: int, ctx_tail: int = 0):
    """Every suite prompt: ngram speculation (exact) == plain greedy, and replay of the
    plain run predicts the speculative run's rounds exactly."""
    total = Generation().spec
    for item in SUITE:
        ids = _suite_prompt(engine, item, raw)[-(engine.ctx_size - budget - 1):]
        n = min(item["max_tokens"], budget)
        g0, g1 = Generation(), Generation()
        plain = list(engine.generate(ids, n, gen=g0))
        spec = list(engine.generate(ids, n, gen=g1, spec=NGRAM))
        assert spec == plain, item["id"]
        assert g1.finish_reason == g0.finish_reason
        eog = [next(iter(engine.tokenizer.stop_ids))] if g0.finish_reason == "stop" else []
        sim = replay(ids, plain + eog, NGRAM, n).rounds
        if not eog:   # with a stop token the real run may verify drafts past it
            assert sim.to_dict() == g1.spec.to_dict(), item["id"]
        total.merge(g1.spec)
    return total


def test_spec_equals_plain_stories_suite(stories):
    total = assert_spec_equals_plain(stories, raw=True, budget=64)
    assert total.accepted > 0   # speculation actually happened


def test_fast_mode_runs_and_is_labelled(stories):
    fast = SpecConfig("ngram", 16, 2, fast=True, gate=False)
    assert fast.mode.startswith("fast") and "not token-identical" in fast.mode and NGRAM.mode == "exact"
    ids = stories.encode_prompt("Once upon a time")
    g = Generation()
    out = list(stories.generate(ids, 300, gen=g, spec=fast))
    assert len(out) == 300 and g.stats.rounds < 299 and g.stats.draft_n_accepted > 0


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen3moe"])
def synthetic(request, tmp_path_factory):
    """A random-weight model with the real Qwen2 tokenizer and ChatML template; its
    greedy output repeats itself, so the copy drafter gets long accepted runs."""
    path = tmp_path_factory.mktemp("syn") / f"{request.param}.gguf"
    write_synthetic(PRESETS[request.param](n_layers=2, quant="Q8_0", seed=4, ctx_len=4096,
                                           vocab_from=str(require(VOCAB / "ggml-vocab-qwen2.gguf"))), path)
    return Engine.load(str(path), ctx_size=4096)


@pytest.mark.shared
def test_column_rotation_synthetic(synthetic):
    column_rotation(synthetic.model, synthetic.cfg.vocab_size, widths=[1, 2, 3, 5, 8, 16])


@pytest.mark.shared
def test_spec_equals_plain_synthetic_suite(synthetic):
    total = assert_spec_equals_plain(synthetic, raw=False, budget=40)
    assert total.accepted > 0


@pytest.mark.slow
@pytest.mark.shared
def test_spec_equals_plain_qwen_suite(qwen_path):
    engine = Engine.load(str(qwen_path), ctx_size=2048)
    total = assert_spec_equals_plain(engine, raw=False, budget=24)
    assert total.accepted > 0
