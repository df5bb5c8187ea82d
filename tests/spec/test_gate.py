"""The confidence gate: which leading drafts are worth their verify columns, when the gate
is off, and the cost table it prices columns with (timed once, cached on disk)."""
from __future__ import annotations

import json
import os

import pytest

from alphallama.engine import Engine
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.spec import gate as gate_mod
from alphallama.spec.config import SpecConfig
from alphallama.spec.gate import CopyConfidence, CostTable, Gate, cumulative



pytestmark = pytest.mark.usefixtures("one_thread")

def table(ms: list[float]) -> CostTable:
    """A hand-built table: ms for W = 1..len(ms), the last value held up to W = 64."""
    return CostTable(ms + [ms[-1]] * (64 - len(ms)), measured=len(ms))


def tau(t: CostTable, conf: list[float], n: int) -> float:
    """DESIGN §5's price of column n+1 (draft n): its cost over the time per token of the
    round without it, computed here longhand."""
    e_before = 1 + sum(conf[:n - 1])
    return (t.cost(n + 1) - t.cost(n)) / (t.cost(n) / e_before)


def test_worth_a_column_rule_by_hand():
    t = table([1.0, 1.1, 1.2, 1.3, 1.4])
    conf = [0.9, 0.5, 0.1, 0.05]
    # E_n = 1, 1.9, 2.4, 2.5, 2.55; tokens/ms = 1, 1.727, 2.0, 1.923, 1.821: two drafts
    assert Gate(t).width(conf) == 2
    assert conf[1] > tau(t, conf, 2) and conf[2] < tau(t, conf, 3)    # tau_2 = 0.173, tau_3 = 0.2
    assert Gate(t).width([0.99, 0.98, 0.97, 0.96]) == 4
    assert Gate(t).width([0.05, 0.04]) == 0                           # 0.05 < tau_1 = 0.1
    assert Gate(t).width([]) == 0


def test_a_dearer_bucket_is_paid_for_by_the_drafts_after_it():
    # widths 1..4 cost the same; 5..8 half as much again (a padded graph bucket)
    t = table([1.0] * 4 + [1.5] * 4)
    conf = cumulative([0.99] * 7)
    # stopping at the first column that does not pay would keep 3 (tau_4 = 0.5 * 3.94 > S_4)
    assert conf[3] < tau(t, conf, 4)
    # but 8 rows commit 7.72 tokens in 1.5 ms (5.1/ms) against 3.94 in 1 ms
    assert Gate(t).width(conf) == 7


def test_p_min_is_a_fixed_floor_and_no_gate_verifies_all():
    conf = [0.9, 0.5, 0.2]
    assert Gate(p_min=0.4).width(conf) == 2
    assert Gate(p_min=0.95).width(conf) == 0
    steep = table([1.0, 2.0, 3.0, 4.0])
    assert SpecConfig("ngram", p_min=0.4).make_gate(steep).width(conf) == 2
    off = SpecConfig("ngram", gate=False, p_min=0.4).make_gate(steep)
    assert not off.on and off.width(conf) == 3


def test_gate_turns_itself_off_where_columns_are_nearly_free():
    flat = table([1.0, 1.01, 1.02, 1.03] + [1.05] * 13)       # W = 17 costs 5% more than W = 1
    steep = table([1.0 + 0.1 * w for w in range(17)])
    spec = SpecConfig("ngram", draft_max=16)
    assert not spec.make_gate(flat).on
    g = spec.make_gate(steep)
    assert g.on and g.table is steep and g.width(cumulative([0.6] * 16)) < 16
    # the widest round asked for decides: MTP drafts 3 and W = 4 is nearly free on `steep`'s scale
    mtp = SpecConfig("mtp", mtp_depth=3)
    assert not mtp.make_gate(table([1.0, 1.02, 1.04, 1.06, 5.0])).on


def test_copy_confidence_is_learned_per_match_length():
    cc = CopyConfidence()
    assert cc.conf(3, 2) == [0.5, 0.25]                       # Laplace prior
    for _ in range(8):
        cc.record(3, proposed=4, accepted=4)                  # every draft right at match length 3
    cc.record(3, proposed=4, accepted=1)
    # depth 1: 9/9 hits -> 10/11; depth 2: 8/9 -> 9/11; depths 3, 4: 8/8 -> 9/10
    want = [10 / 11, 10 / 11 * 9 / 11, 10 / 11 * 9 / 11 * 9 / 10]
    assert cc.conf(3, 3) == pytest.approx(want)
    assert cc.conf(20, 1) == [0.5]                            # another match length learned nothing


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gate") / "tiny.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, quant="F32", seed=2, ctx_len=512), path)
    return Engine.load(str(path), ctx_size=256, device="cpu")


def test_cost_table_is_timed_once_and_cached_on_disk(tiny, tmp_path, monkeypatch):
    spec = SpecConfig("ngram", cost_cache_dir=str(tmp_path), cost_budget_s=0.3)
    t = spec.cost_table(tiny)
    assert not t.from_cache and len(t.ms) == 64 and t.measured >= 4 and t.measure_s > 0
    assert all(a <= b for a, b in zip(t.ms, t.ms[1:]))
    # the CPU reference verifies an exact round as W single-row passes: 4 rows cost several
    assert t.cost(4) > 2 * t.cost(1)
    files = list((tmp_path / "round-costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["verify"] == "exact"
    assert spec.cost_table(tiny) is t                          # in memory for later requests

    def no_timing(*a, **k):
        raise AssertionError("timed again")
    monkeypatch.setattr(gate_mod, "measure", no_timing)
    again = SpecConfig("ngram", cost_cache_dir=str(tmp_path), cost_budget_s=0.3).cost_table(tiny)   # a fresh process
    assert again.from_cache and again.ms == t.ms
    # another verify mode (or model file, device, engine version) is a miss
    with pytest.raises(AssertionError, match="timed again"):
        SpecConfig("ngram", fast=True, cost_cache_dir=str(tmp_path), cost_budget_s=0.3).cost_table(tiny)
    st = os.stat(tiny.gguf.path)
    os.utime(tiny.gguf.path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(AssertionError, match="timed again"):
        SpecConfig("ngram", cost_cache_dir=str(tmp_path), cost_budget_s=0.3).cost_table(tiny)


def test_timing_leaves_the_cache_as_it_was(tiny, tmp_path):
    ids = tiny.encode_prompt("hello there")
    before = list(tiny.generate(ids, 8))
    n = tiny.cache.length
    k = tiny.cache.k[:, :, :n].clone()
    SpecConfig("ngram", fast=True, cost_cache_dir=str(tmp_path / "x"), cost_budget_s=0.3).cost_table(tiny)
    assert tiny.cache.length == n and bool((tiny.cache.k[:, :, :n] == k).all())
    assert list(tiny.generate(ids, 8)) == before
