"""Every valid sampling parameter gives a real distribution: no NaN, no empty kept set,
whatever the float32 range (top_p of 1e-46 once rounded to 0 and dropped every token)."""
from __future__ import annotations

import pytest
import torch

from alphallama.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
ONE_HOT = torch.tensor([1.0, 0, 0, 0, 0, 0])


def dist(logits=LOGITS, **kw):
    d = Sampler(SamplingParams(seed=0, **{"temperature": 1.0, **kw})).distribution(logits)
    assert torch.isfinite(d).all() and abs(float(d.sum()) - 1) < 1e-5, d
    return d


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-300, 1e-8])
def test_tiny_top_p_keeps_the_top_token(top_p):
    torch.testing.assert_close(dist(top_p=top_p), ONE_HOT)


@pytest.mark.parametrize("t", [5e-324, 1e-300, 1e-46, 1e-9])
def test_tiny_temperature_is_greedy(t):
    torch.testing.assert_close(dist(temperature=t), ONE_HOT)


@pytest.mark.parametrize("t", [1e6, 1e38, 1e300, 1.7e308])
def test_huge_temperature_is_uniform_over_the_kept(t):
    torch.testing.assert_close(dist(temperature=t), torch.full((6,), 1 / 6))
    torch.testing.assert_close(dist(temperature=t, top_k=3), torch.tensor([1 / 3] * 3 + [0.0] * 3))


def test_tiny_temperature_with_huge_logits():
    logits = torch.tensor([3e38, 2e38, -3e38])
    torch.testing.assert_close(dist(logits, temperature=1e-9), torch.tensor([1.0, 0, 0]))


@pytest.mark.parametrize("kw, kept", [
    (dict(min_p=1.0), 1), (dict(min_p=5e-324), 6), (dict(top_k=6), 6), (dict(top_k=2 ** 62), 6),
    (dict(top_k=0), 6), (dict(top_p=1.0, min_p=1.0, top_k=1), 1), (dict(top_p=0.999999, min_p=1e-46), 6),
])
def test_edge_filters(kw, kept):
    assert int((dist(**kw) > 0).sum()) == kept


def test_sampling_at_the_edges_draws_the_top_token():
    for kw in (dict(top_p=1e-46), dict(temperature=1e-300), dict(min_p=1.0)):
        s = Sampler(SamplingParams(seed=1, **{"temperature": 0.8, **kw}))
        assert all(s.sample(LOGITS) == 0 for _ in range(5))


MASKED = torch.tensor([2.0, float("-inf"), 0.5, float("-inf"), -1.0, -3.0])   # a grammar's mask


@pytest.mark.parametrize("t", [1e-9, 0.8, 1e38, 7.7e305, 1.7e308])
@pytest.mark.parametrize("top_k", [0, 2, 5, 6])
def test_masked_tokens_are_never_kept(t, top_k):
    """-inf logits (a grammar's mask, logit_bias false) stay at probability 0 at every
    temperature: once kept, a temperature over float32's range made them -inf / inf = NaN
    (a 500 on a strict tool call with temperature 7.7e305, found by schemathesis)."""
    d = dist(MASKED, temperature=t, top_k=top_k)
    assert d[1] == 0 and d[3] == 0
    kept = min(top_k or 4, 4)
    if t > 1e30:    # uniform over what the filters kept
        torch.testing.assert_close(d[d > 0], torch.full((kept,), 1 / kept))
