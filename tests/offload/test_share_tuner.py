"""The CPU share's hill climb (offload/share_tuner.py) on simulated rounds: a round's period
is a function of the share the tuner set for it (the time both tiers take to finish a
layer's misses), read through a fake clock. It finds the best share of a host where the
workers win, of one where they lose (share 0: PCIe alone), keeps widths apart, shrugs off
idle gaps between requests, and climbs again after holding."""
from __future__ import annotations

import random

import pytest

from alphallama.offload.share_tuner import ShareTuner


class Rounds:
    """Rounds whose period is cost(share, W) (+ noise), timed by a fake clock."""

    def __init__(self, cost, start=0.6, seed=0, **kw):
        self.t, self.cost, self.rng = 0.0, cost, random.Random(seed)
        self.applied = []
        self.tuner = ShareTuner(self.applied.append, start, clock=lambda: self.t, **kw)

    def run(self, n, widths=(1,), noise=0.02, gap_every=0):
        for i in range(n):
            W = widths[i % len(widths)]
            self.tuner.before_round(W)
            self.t += self.cost(self.applied[-1], W) * (1 + noise * self.rng.uniform(-1, 1))
            if gap_every and i % gap_every == gap_every - 1:
                self.t += 5.0          # an idle gap between requests: seconds, not milliseconds
        return self.tuner.share


def tiers(cpu_rate, pcie_rate, fixed=0.8e-3, misses=30e6):
    """A round: fixed work, then the misses' bytes split by the share, both tiers at once."""
    return lambda s, W: fixed * W ** 0.5 + max(s * misses / cpu_rate, (1 - s) * misses / pcie_rate)


@pytest.mark.parametrize("cpu, pcie", [(60e9, 50e9), (20e9, 50e9), (100e9, 25e9)])
def test_finds_where_both_tiers_finish_together(cpu, pcie):
    best = cpu / (cpu + pcie)              # s / cpu = (1 - s) / pcie
    r = Rounds(tiers(cpu, pcie))
    share = r.run(600)
    assert abs(share - best) <= 1 / 16 + 1e-9, (share, best)
    assert r.tuner.decisions                       # it reports what it measured


def test_workers_that_lose_everywhere_get_nothing():
    r = Rounds(lambda s, W: 1e-3 + 4e-3 * s)       # every pair the CPU takes costs more
    assert r.run(600) == 0.0


def test_widths_are_compared_apart():
    # verify rounds of 5 rows cost 3x a plain one whatever the share: mixing them would be noise
    cost = tiers(30e9, 50e9)
    r = Rounds(lambda s, W: cost(s, 1) * (3 if W == 5 else 1))
    share = r.run(900, widths=(1, 5, 1))
    assert abs(share - 30 / 80) <= 1 / 16 + 1e-9


def test_idle_gaps_between_requests_do_not_mislead_it():
    r = Rounds(tiers(20e9, 50e9))
    assert abs(r.run(800, gap_every=37) - 20 / 70) <= 1 / 16 + 1e-9


def test_holds_then_climbs_again_when_the_host_changes():
    host = {"cost": tiers(80e9, 40e9)}
    r = Rounds(lambda s, W: host["cost"](s, W), hold=200)
    assert abs(r.run(400) - 2 / 3) <= 1 / 16 + 1e-9
    host["cost"] = tiers(10e9, 40e9)               # neighbours took the cores
    assert abs(r.run(1200) - 0.2) <= 1 / 16 + 1e-9


def test_every_applied_share_is_a_fraction():
    r = Rounds(tiers(60e9, 50e9), start=1.0)
    r.run(300)
    assert all(0.0 <= s <= 1.0 for s in r.applied)
    with pytest.raises(ValueError):
        ShareTuner(lambda s: None, 1.5)


def test_skipped_rounds_give_no_periods():
    """Rounds the tuner is told to skip (the cost table's timing) add no period, neither
    their own nor the one from the round before them."""
    r = Rounds(tiers(60e9, 50e9))
    r.run(5)
    kept = {k: list(v) for k, v in r.tuner._times.items()}
    for _ in range(3):
        r.tuner.skip()
        r.t += 0.5                                  # slow rounds: a period of them would mislead it
    r.tuner.before_round(1)                         # the next round starts a period, ends none
    assert {k: list(v) for k, v in r.tuner._times.items()} == kept
