"""Round decisions: greedy acceptance on hand-built logits, and the statistical check that
speculative sampling leaves the output distribution equal to the target's (as vLLM
tests its rejection sampler)."""
from __future__ import annotations

import torch

from alphallama.sampling import Sampler, SamplingParams
from alphallama.spec.stats import DepthCounts, SpecStats
from alphallama.spec.verify import greedy_accept, speculative_sample


def onehot_logits(best: list[int], V: int = 10) -> torch.Tensor:
    x = torch.zeros(len(best), V)
    x[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return x


def test_greedy_accept():
    # rows' argmax: 4, 5, 6, 7 ; drafts 4, 5, 9 -> accept 4, 5, bonus 6
    assert greedy_accept([4, 5, 9], onehot_logits([4, 5, 6, 7])) == [4, 5, 6]
    assert greedy_accept([4, 5, 6], onehot_logits([4, 5, 6, 7])) == [4, 5, 6, 7]   # all + bonus
    assert greedy_accept([1], onehot_logits([4, 5])) == [4]                           # first rejected
    assert greedy_accept([], onehot_logits([3])) == [3]                               # plain decoding


def _empirical_first_token(p: torch.Tensor, drafts, draft_probs, trials: int, seed: int) -> torch.Tensor:
    V = p.numel()
    logits = p.log().expand(len(drafts) + 1, V).clone()
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    counts = torch.zeros(V)
    for _ in range(trials):
        counts[speculative_sample(drafts, logits, sampler, draft_probs)[0]] += 1
    return counts / trials


def _assert_close(emp: torch.Tensor, p: torch.Tensor, trials: int):
    sigma = (p * (1 - p) / trials).sqrt()
    assert ((emp - p).abs() <= 5 * sigma + 1e-4).all(), (emp, p)
    assert 0.5 * (emp - p).abs().sum() < 0.02


def test_speculative_sampling_preserves_distribution_deterministic_draft():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=g) * 1.5, 0)
    trials = 20_000
    for draft in (int(p.argmax()), int(p.argmin())):   # a likely and an unlikely draft
        _assert_close(_empirical_first_token(p, [draft, 3], None, trials, seed=draft), p, trials)


def test_speculative_sampling_preserves_distribution_stochastic_draft():
    """With a drafter distribution q, drafts drawn from q, output still follows p."""
    g = torch.Generator().manual_seed(1)
    V, trials = 6, 20_000
    p = torch.softmax(torch.randn(V, generator=g), 0)
    q = torch.softmax(torch.randn(V, generator=g) * 2, 0)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    logits = p.log().expand(2, V).clone()
    counts = torch.zeros(V)
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=g))
        counts[speculative_sample([d], logits, sampler, q[None])[0]] += 1
    _assert_close(counts / trials, p, trials)


def test_second_token_distribution_after_acceptance():
    """Given the first draft was accepted, the bonus token is drawn from the next row's p."""
    p1 = torch.tensor([0.7, 0.2, 0.1])
    p2 = torch.tensor([0.1, 0.3, 0.6])
    logits = torch.stack([p1.log(), p2.log()])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    second = torch.zeros(3)
    n = 0
    for _ in range(20_000):
        out = speculative_sample([0], logits, sampler)
        if out[0] == 0:
            assert len(out) == 2
            second[out[1]] += 1
            n += 1
    assert abs(n / 20_000 - 0.7) < 0.02
    _assert_close(second / n, p2, n)


def test_depth_counts():
    dc = DepthCounts()
    dc.record(proposed=4, accepted=2)   # drafts 0,1 hit; 2 examined and missed; 3 not reached
    dc.record(proposed=2, accepted=2)   # both hit
    dc.record(proposed=3, accepted=0)   # draft 0 missed
    assert dc.reached == [3, 2, 1] and dc.hits == [2, 2, 0]
    assert dc.conditional() == [2 / 3, 1.0, 0.0]
    assert dc.survival() == [2 / 3, 2 / 3, 0.0]
    s = SpecStats()
    s.record("ngram", 4, 2, 3)
    s.record("none", 0, 0, 1)
    assert s.rounds == 2 and s.tokens == 4 and s.tokens_per_round == 2.0 and list(s.by_drafter) == ["ngram"]
