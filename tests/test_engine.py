"""Engine behaviour around the decode loop: prefix re-use, repeat determinism,
cancellation during prefill, reset, context limits."""
from __future__ import annotations

import pytest

from alphallama.engine import ContextOverflow, Engine, Generation


@pytest.fixture(scope="module")
def engine(stories_path):
    return Engine.load(str(stories_path), ctx_size=1500)


def test_prefix_reuse_and_repeat_is_identical(engine):
    ids = engine.encode_prompt("Once upon a time there was a dog")
    g1, g2 = Generation(), Generation()
    a = list(engine.generate(ids, 40, gen=g1))
    b = list(engine.generate(ids, 40, gen=g2))
    assert a == b
    assert g2.stats.prompt_reused == len(ids) - 1 and g2.stats.prompt_n == 1
    # a continuation re-uses the whole previous conversation that was forwarded
    follow = ids + a + engine.encode_prompt(" The end.")[1:]
    g3 = Generation()
    list(engine.generate(follow, 5, gen=g3))
    assert g3.stats.prompt_reused >= len(ids) + len(a) - 1


def test_cancel_during_prefill_and_reset(engine):
    engine.reset()
    assert engine.cached == [] and engine.cache.length == 0
    ids = [1] + [300 + (i % 150) for i in range(1200)]
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > 1            # let the first chunk run, then give up
    g = Generation()
    assert list(engine.generate(ids, 10, gen=g, cancel=cancel)) == []
    assert g.finish_reason == "cancelled"
    assert engine.cache.length == len(engine.cached) == 512      # one prefill chunk was kept
    g2 = Generation()
    list(engine.generate(ids, 3, gen=g2))
    assert g2.stats.prompt_reused == 512                          # ... and is re-used


def test_context_limits(engine):
    with pytest.raises(ContextOverflow, match="1500 tokens but the context holds 1500"):
        list(engine.generate([1] * 1500, 4))
    g = Generation()
    out = list(engine.generate([1] * 1495, 50, gen=g))
    assert g.finish_reason == "length" and len(out) <= 5
