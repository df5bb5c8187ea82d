"""Speculation statistics: share of rounds, calibration per depth, copy hit rates per
match length, and merging (hand-counted rounds)."""
from __future__ import annotations

import argparse

import pytest

from alphallama.spec.config import SpecConfig, add_spec_arguments, spec_from_args
from alphallama.spec.stats import SpecStats, match_bucket


def test_match_buckets():
    assert [match_bucket(m) for m in (2, 7, 8, 15, 16, 40, 64, 200)] == \
        ["2", "7", "8-15", "8-15", "16-31", "32-63", "64+", "64+"]


def test_rounds_calibration_and_match_lengths_by_hand():
    a, b = SpecStats(), SpecStats()
    a.record("mtp", 3, 1, 2, probs=(0.95, 0.62, 0.9))     # depth 1 hit (bin 9), depth 2 miss (bin 6), depth 3 unseen
    a.record("ngram", 4, 4, 5, match_len=9)
    a.record("none", 0, 0, 1)
    b.record("mtp", 2, 2, 3, probs=(0.91, 0.97))
    b.record("ngram", 5, 0, 1, match_len=3)
    b.record("ngram", 0, 0, 1, match_len=3)               # a gated-away draft is a plain round
    a.merge(b)
    d = a.to_dict()
    assert d["rounds"] == 6 and d["tokens"] == 13
    assert d["share_of_rounds"] == {"mtp": 2 / 6, "ngram": 2 / 6, "none": 2 / 6}
    cal = d["calibration"]["mtp"]
    assert [c["n"] for c in cal] == [2, 2] and cal[0]["observed"] == 1.0 and cal[1]["observed"] == 0.5
    assert cal[0]["predicted"] == pytest.approx(0.93)
    assert [(x["bin"], x["n"], x["observed"]) for x in cal[1]["bins"]] == [([0.6, 0.7], 1, 0.0), ([0.9, 1.0], 1, 1.0)]
    assert list(d["copy_by_match_len"]) == ["3", "8-15"]
    assert d["copy_by_match_len"]["8-15"]["reached"] == [1, 1, 1, 1]
    assert d["copy_by_match_len"]["3"] == {"reached": [1], "hits": [0], "conditional_hit_rate": [0.0],
                                           "chain_survival": [0.0]}


def test_spec_flags():
    p = argparse.ArgumentParser()
    add_spec_arguments(p)
    spec = spec_from_args(p.parse_args(["--spec-type", "mtp,ngram", "--spec-mtp-depth", "4", "--spec-p-min", "0.3",
                                        "--no-gate", "--spec-mtp-min-p", "0.6"]))
    assert (spec.spec_type, spec.mtp_depth, spec.p_min, spec.gate, spec.mtp_min_p) == ("mtp,ngram", 4, 0.3, False, 0.6)
    defaults = spec_from_args(p.parse_args([]))
    assert defaults == SpecConfig(spec_type="auto") and defaults.gate and defaults.mtp_depth == 3
    assert defaults.mtp_min_p == 0.5
    for bad, msg in ((["--spec-mtp-depth", "6"], "1..5"), (["--spec-p-min", "1.5"], "spec-p-min"),
                     (["--spec-mtp-min-p", "-1"], "min-p")):
        with pytest.raises(ValueError, match=msg):
            spec_from_args(p.parse_args(bad))
    with pytest.raises(SystemExit):
        p.parse_args(["--spec-type", "eagle"])
    with pytest.raises(ValueError, match="MTP head"):
        SpecConfig("mtp").make_drafter(None)
