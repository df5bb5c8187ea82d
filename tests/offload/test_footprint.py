"""The footprint (offload/footprint.py): the distinct experts, and those without a bank slot,
that w consecutive rows route to, learned from rounds of any width, equal the exact
window counts over the rows seen (weighted as it decays them); its prior is the plan's
uniform-routing model; the per-round exact counts the cost table's timing keeps (whole, and
split between the CPU workers and PCIe as the post kernel splits a round's pairs); and the
counts at a tier's fractional share of a round's rows."""
from __future__ import annotations

import math

import numpy as np
import pytest

from alphallama.offload.footprint import Footprint, at_widths, missed_by_width, missed_split

L, E, K = 3, 10, 2


def _rounds(rng, widths, pick=None) -> list[np.ndarray]:
    """Rounds of synthetic routing: [L, W, K] picks per round (K distinct experts per row and layer)."""
    pick = pick or (lambda: rng.choice(E, K, replace=False))
    return [np.stack([np.stack([pick() for _ in range(W)]) for _ in range(L)]) for W in widths]


def _exact(rounds, resident, w, decay=1.0) -> tuple[np.ndarray, np.ndarray]:
    """[L] mean over every row seen of the distinct experts (and those without a slot) in the
    window of w rows ending there (fewer at the start), each row weighted decay^(rows routed
    by the rounds after its own): counted with sets."""
    rows = [r[:, m] for r in rounds for m in range(r.shape[1])]              # [L, K] per row, in order
    weight = [decay ** sum(r.shape[1] for r in rounds[i + 1:]) for i, r in enumerate(rounds) for _ in range(r.shape[1])]
    tot, miss = np.zeros(L), np.zeros(L)
    for i, wt in enumerate(weight):
        for layer in range(L):
            seen = {int(e) for row in rows[max(0, i - w + 1):i + 1] for e in row[layer]}
            tot[layer] += wt * len(seen)
            miss[layer] += wt * sum(not resident[layer, e] for e in seen)
    return tot / sum(weight), miss / sum(weight)


@pytest.mark.parametrize("half_life", [math.inf, 8.0], ids=["no-decay", "decayed"])
def test_distinct_experts_equal_exact_window_counts(half_life):
    rng = np.random.default_rng(1)
    resident = rng.random((L, E)) < 0.4
    # rounds of mixed widths (plain decode, verify rounds); some rows repeat the last one (a copied span)
    rounds = _rounds(rng, [1, 3, 1, 5, 2, 1, 7, 4, 1, 1, 2, 6])
    rounds[4][:, 1] = rounds[4][:, 0]
    f = Footprint(L, E, K, hit_rate=0.3, half_life=half_life, prior_rows=0.0, cap=16)
    for r in rounds:
        f.observe(r, resident)
    assert f.seen == sum(r.shape[1] for r in rounds)
    np.testing.assert_allclose(f.distinct()[:, 0], K)                       # one row: its k picks
    for w in (1, 2, 3, 5, 8, 16):
        tot, miss = _exact(rounds, resident, w, f.decay)
        np.testing.assert_allclose(f.distinct()[:, w - 1], tot, rtol=1e-12)
        np.testing.assert_allclose(f.missed()[:, w - 1], miss, rtol=1e-12)


def test_prior_is_the_plans_uniform_model_and_routing_replaces_it():
    k, n = 8, 128
    f = Footprint(2, n, k, hit_rate=0.25, half_life=64.0, prior_rows=16.0)
    q = k / n
    uniform = n * (1 - (1 - q) ** np.arange(1, 65))                          # independent rows, k of n each
    np.testing.assert_allclose(f.distinct()[0], uniform)
    np.testing.assert_allclose(f.missed()[0], 0.75 * uniform)                # the plan's h = slots / experts
    assert f.missed()[0, 0] == pytest.approx(k * 0.75)                       # its misses a token
    # a router that keeps picking the same 8 experts, 4 of them in the bank: 4 misses at any width
    resident = np.zeros((2, n), dtype=bool)
    resident[:, :4] = True
    same = np.broadcast_to(np.arange(8), (2, 4, 8))
    for _ in range(250):                                                     # 1000 rows: the prior's weight decays away
        f.observe(same, resident)
    assert f.distinct()[:, 63] == pytest.approx(8.0, rel=1e-3)
    assert f.missed()[:, 0] == pytest.approx(4.0, rel=1e-3) and f.missed()[:, 15] == pytest.approx(4.0, rel=1e-3)


def test_uniform_routing_learned_matches_the_closed_form():
    rng = np.random.default_rng(3)
    f = Footprint(1, 32, 4, hit_rate=0.0, half_life=math.inf, prior_rows=0.0, cap=16)
    resident = np.zeros((1, 32), dtype=bool)
    for r in _rounds_1layer(rng, 600):
        f.observe(r, resident)
    w = np.arange(1, 17)
    np.testing.assert_allclose(f.distinct()[0], 32 * (1 - (1 - 4 / 32) ** w), rtol=0.03)


def _rounds_1layer(rng, n):
    return [rng.choice(32, 4, replace=False)[None, None] for _ in range(n)]


def test_missed_by_width_is_the_exact_count_of_one_round():
    rng = np.random.default_rng(2)
    resident = rng.random((L, E)) < 0.5
    ids, = _rounds(rng, [9])
    got = missed_by_width(ids, resident)                                     # [L, W]
    for layer in range(L):
        for w in range(1, 10):
            want = {int(e) for e in ids[layer, :w].ravel() if not resident[layer, e]}
            assert got[layer, w - 1] == len(want)


def test_missed_split_is_the_post_kernels_split():
    """Of a round's host pairs (no slot; row, rank order) the CPU takes the first
    (n share + 128) >> 8: each side counts its distinct experts, an expert on both sides twice."""
    ids = np.array([[[0, 1], [0, 2], [3, 0]]])                               # [L = 1, W = 3, k = 2]
    resident = np.zeros((1, 4), dtype=bool)
    resident[0, 3] = True
    cpu, pcie = missed_split(ids, resident, 128)                             # half
    # w = 1: 2 host pairs, 1 each; w = 2: 4 pairs [0 1 | 0 2]; w = 3: 5 pairs [0 1 0 | 2 0] (3 has a slot)
    assert cpu.tolist() == [[1, 2, 2]] and pcie.tolist() == [[1, 2, 2]]
    assert [c.tolist() for c in missed_split(ids, resident, 0)] == [[[0, 0, 0]], [[2, 3, 3]]]      # PCIe only
    assert [c.tolist() for c in missed_split(ids, resident, 256)] == [[[2, 3, 3]], [[0, 0, 0]]]    # CPU only
    rng = np.random.default_rng(4)
    res = rng.random((L, E)) < 0.5
    ids, = _rounds(rng, [9])
    for share in (0, 77, 154, 256):
        cpu, pcie = missed_split(ids, res, share)
        for layer in range(L):
            for w in range(1, 10):
                host = [int(e) for e in ids[layer, :w].ravel() if not res[layer, e]]
                cut = (len(host) * share + 128) >> 8
                assert (cpu[layer, w - 1], pcie[layer, w - 1]) == (len(set(host[:cut])), len(set(host[cut:])))


def test_counts_at_fractional_widths():
    counts = np.array([[2.0, 3.0, 3.5], [1.0, 1.0, 1.0]])                   # [L, cap]: w = 1, 2, 3
    np.testing.assert_allclose(at_widths(counts, np.array([1.0, 2.0, 3.0])), counts)
    np.testing.assert_allclose(at_widths(counts, np.array([0.0, 0.6, 1.5, 2.75])),
                               [[0.0, 1.2, 2.5, 3.375], [0.0, 0.6, 1.0, 1.0]])
