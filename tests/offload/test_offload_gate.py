"""The confidence gate under an expert store (spec/offload_costs.py): a verify column is
priced with the misses of the experts it adds. With every expert in the bank the prices
are the cost table's exactly (so every decision is); with dear misses the gate verifies
fewer drafts, and not where the routing only meets bank experts; the table is timed with
the bank left as it was and its own misses kept (then taken off); exact mode still
gives plain greedy's tokens with the pricing on (the micro MoE, its experts read over
PCIe: the CPU workers' exactness is test_store's)."""
from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest
import torch

from alphallama.engine import Engine, Generation
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import write_synthetic
from alphallama.offload.estimate import MissRates
from alphallama.offload.store import ExpertStore
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides
from alphallama.runtime.weights import BlockNames
from alphallama.spec.allot import best_prefix
from alphallama.spec.config import SpecConfig
from alphallama.spec.gate import MAX_WIDTH, CostTable, Gate, cumulative, load_or_measure
from alphallama.spec.offload_costs import (
    RESIDENT_FLOOR,
    SCALE_BOUNDS,
    OffloadCosts,
    fit_scale,
    priced,
    store_timing,
)
from alphallama.tokenizer import Tokenizer
from tests.offload.conftest import MICRO_MOE

pytestmark = pytest.mark.usefixtures("one_thread")
# fp32 GEMVs and small attention tiles: the interpreter's cost is per program
CHEAP = Overrides(decode_gemv="f32", moe_gemv="f32", attention_tiles=(16, 4))
TABLE = CostTable([1.0 + 0.05 * (w - 1) for w in range(1, MAX_WIDTH + 1)], MAX_WIDTH)
DEAR = MissRates(pcie=1e-8, mapped=2e-8)                  # s/byte: a micro expert (~13 KiB) ~0.13 ms a miss
FREE = MissRates(pcie=0.0, mapped=0.0)


def _model(f: GGUFFile, slots: int, rates: MissRates, max_len: int = 64) -> GPUModel:
    return GPUModel(f, max_len, device="cpu", expert_slots=slots, cpu_tier=False, miss_rates=rates, overrides=CHEAP)


def _routing(store, rows: int, experts, seed: int = 0) -> None:
    """Feed the store's footprint `rows` one-row rounds picking k of `experts` per layer."""
    rng = np.random.default_rng(seed)
    resident = store.resident[store.moe_layers]
    for _ in range(rows):
        ids = np.stack([rng.choice(experts(layer), store.top_k, replace=False) for layer in store.moe_layers])
        store.footprint.observe(ids[:, None], resident)


CONFS = [cumulative([p] * n) for p in (0.3, 0.5, 0.7, 0.9, 0.97) for n in (1, 3, 8, 16)]


def test_every_expert_in_the_bank_prices_as_the_table(micro_moe):
    m = _model(GGUFFile(micro_moe), 12, DEAR)                 # 2 layers x 6 experts: all in the bank
    _routing(m.store, 40, lambda layer: np.arange(6))
    timed = CostTable(TABLE.ms, MAX_WIDTH, missed=[[0.0, 0.0, 0.0]] * MAX_WIDTH)   # as timed: nothing missed
    for table in (TABLE, timed):
        p = priced(table, m)
        assert isinstance(p, OffloadCosts)
        assert [p.cost(w) for w in range(1, MAX_WIDTH + 1)] == table.ms          # exactly, so every decision:
        for conf in CONFS:
            assert Gate(p).width(conf) == Gate(table).width(conf)
            assert Gate(p).width(conf, 0.4) == Gate(table).width(conf, 0.4)
            assert best_prefix(p, 2, conf, 0, 0.0) == best_prefix(table, 2, conf, 0, 0.0)
        assert p.columns_free(17, 0.1) == table.columns_free(17, 0.1)
    assert priced(TABLE, GPUModel(GGUFFile(micro_moe), 64, device="cpu", overrides=CHEAP)) is TABLE   # resident
    no_plan = GPUModel(GGUFFile(micro_moe), 64, device="cpu", expert_slots=2, cpu_tier=False, overrides=CHEAP)
    assert no_plan.miss_rates == MissRates.assumed(0)                       # without a plan's bandwidths


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Stores of the micro MoE with 64 experts a layer (k = 2): w rows' picks keep meeting
    new experts up to w ~ 16, as a real router's 8 of 128 do."""
    path = tmp_path_factory.mktemp("wide") / "wide-moe.gguf"
    write_synthetic(replace(MICRO_MOE, name="wide-moe", n_experts=64), path)
    f = GGUFFile(str(path))
    layers = {i: tuple(f.tensors[x] for x in BlockNames(f"blk.{i}.").experts) for i in range(2)}
    return lambda slots, host_bytes=None: ExpertStore(layers, 2, 64, 2, slots, "cpu", MAX_WIDTH, host_bytes=host_bytes)


def test_gate_narrows_where_misses_are_dear(wide):
    s = wide(32)                                              # a quarter of the experts in the bank, 16 a layer
    p = OffloadCosts(TABLE, s, DEAR, cpu_workers=False)
    extra = [p.cost(w) - TABLE.cost(w) for w in range(1, 17)]
    assert extra[0] > 0 and all(b > a for a, b in pairwise(extra))      # each column adds misses
    per = sum(s.layer_bytes(i) for i in (0, 1)) / 64                         # an expert of each layer
    assert extra[0] == pytest.approx(1e3 * 2 * 0.75 * per * DEAR.pcie)        # the plan's k (1 - h) a layer
    conf = cumulative([0.8] * 16)
    assert Gate(TABLE).width(conf) == 8 and Gate(p).width(conf) < 4
    free = OffloadCosts(TABLE, s, FREE, cpu_workers=False)
    assert all(Gate(free).width(c) == Gate(TABLE).width(c) for c in CONFS)
    # routing that meets only bank experts: the learned misses go (the prior decays), the widths are the table's
    banked = {int(i): np.nonzero(s.resident[i])[0] for i in s.moe_layers}
    _routing(s, 1500, lambda layer: banked[int(layer)])
    assert p.cost(16) - TABLE.cost(16) < 1e-3 and all(Gate(p).width(c) == Gate(TABLE).width(c) for c in CONFS)
    _routing(s, 300, lambda layer: np.arange(64), seed=1)                       # every expert again: dear again
    assert Gate(p).width(conf) < 4
    # the mapped tier's rate prices the mapped layers' misses (the CPU workers from the file)
    mapped = wide(32, host_bytes=0)
    assert sorted(mapped.mapped) == [0, 1]
    m = OffloadCosts(TABLE, mapped, DEAR, cpu_workers=True).miss_ms()
    np.testing.assert_allclose(m, OffloadCosts(TABLE, wide(32), DEAR, cpu_workers=True).miss_ms() * 2)


def test_cpu_workers_price_a_missed_expert_once_a_round(wide):
    """With CPU workers a layer's host pairs are split, the first share to the workers, the
    rest over PCIe, at once. The workers read a missed expert once a round for all its pairs:
    rows that repeat one token's experts cost them one read each however wide the round.
    PCIe's price counts its rows' distinct experts too (a floor: its kernels read per pair,
    the per-pair price beside it in to_dict); at W = 1 the price is the plan's."""
    s = wide(32)
    rates = MissRates(pcie=1e-8, mapped=2e-8, cpu=4e-8, share=0.5)
    p = OffloadCosts(TABLE, s, rates, cpu_workers=True)
    b = sum(s.layer_bytes(i) for i in (0, 1)) / 64                            # an expert of each layer
    assert p.miss_ms()[0] == pytest.approx(1e3 * 2 * 0.75 * b * rates.host)  # the prior: k (1 - h), the plan's rate
    two = {int(i): np.nonzero(~s.resident[i])[0][:2] for i in s.moe_layers}   # every row: the same 2 misses a layer
    _routing(s, 2000, lambda layer: two[int(layer)])
    m, d = p.miss_ms(), p.to_dict()
    assert m[0] == pytest.approx(1e3 * b * rates.cpu)                        # a row: one miss each side, CPU-bound
    assert m[1:16] == pytest.approx([1e3 * 2 * b * rates.cpu] * 15)          # then both, once: flat in W
    pairs = [1e3 * max(min(w, 2) * b * rates.cpu, 0.5 * w * 2 * b * rates.pcie) for w in (1, 2, 4, 8, 16)]
    assert list(d["miss_ms_pcie_per_pair"].values()) == pytest.approx(pairs) and d["cpu_share"] == 0.5
    # rows of new experts each: every width adds misses on both sides (the workers' share grows with W)
    _routing(s, 2000, lambda layer: np.nonzero(~s.resident[int(layer)])[0], seed=2)
    m = p.miss_ms()
    assert all(b_ > a_ for a_, b_ in pairwise(m[:16])) and m[7] > 3 * m[0]
    # the timed misses come off at the same prices: [CPU, PCIe, mapped] bytes a width
    t = CostTable([float(w) for w in range(1, MAX_WIDTH + 1)], 2, missed=[[1e4, 3e4, 0.0], [2e4, 1e4, 1e3]])
    q = OffloadCosts(t, s, rates, cpu_workers=True)
    assert q.resident[:2] == pytest.approx([1.0 - 1e3 * max(1e4 * 4e-8, 3e4 * 1e-8),
                                            2.0 - 1e3 * (max(2e4 * 4e-8, 1e4 * 1e-8) + 1e3 * 2e-8)])


def test_prices_follow_the_tuned_share(wide):
    """The CPU share's tuner (offload/share_tuner.py) moves the split between rounds: the
    prices follow it, and equal a fixed plan's at the same share."""
    s = wide(32)
    rates = MissRates(pcie=1e-8, mapped=2e-8, cpu=4e-8, share=0.5)

    class Tuner:
        share = 0.5

    tuner = Tuner()
    p = OffloadCosts(TABLE, s, rates, cpu_workers=True, tuner=tuner)
    _routing(s, 500, lambda layer: np.nonzero(~s.resident[int(layer)])[0], seed=3)
    np.testing.assert_allclose(p.miss_ms(), OffloadCosts(TABLE, s, rates, cpu_workers=True).miss_ms())
    tuner.share = 0.0                                      # PCIe alone: the CPU's dearer rate is gone
    pcie_alone = MissRates(pcie=1e-8, mapped=2e-8, cpu=4e-8, share=0.0)
    np.testing.assert_allclose(p.miss_ms(), OffloadCosts(TABLE, s, pcie_alone, cpu_workers=True).miss_ms())
    assert p.miss_ms()[0] < OffloadCosts(TABLE, s, rates, cpu_workers=True).miss_ms()[0]
    assert p.to_dict()["cpu_share"] == 0.0


def test_timing_leaves_the_bank_and_keeps_its_misses(micro_moe, tmp_path):
    f = GGUFFile(micro_moe)
    m = _model(f, 4, DEAR, max_len=128)
    s = m.store
    cache = m.new_cache(128)
    m.forward(torch.tensor([5]), 0, cache)
    s.before_round()                                         # the real round's routing learned first
    before = (s.table.clone(), s.policy.score.copy(), s.stats.to_dict(), s.footprint.version, len(s._admissions))
    t = load_or_measure(m, cache, micro_moe, m.cfg.vocab_size, True, str(tmp_path), 0.05, store_timing(m))
    assert torch.equal(s.table, before[0]) and np.array_equal(s.policy.score, before[1])
    assert (s.stats.to_dict(), s.footprint.version, len(s._admissions)) == before[2:]
    assert t.key["experts"] == "store, PCIe; bank timed" and len(t.missed) == t.measured >= 4 and cache.length == 1
    assert len(t.bank) == len(t.ms) and all(a <= b for a, b in pairwise(t.bank))   # the bank-only rounds, timed
    assert t.missed[-1][1] > 0 and all(a[1] <= b[1] for a, b in pairwise(t.missed))   # 8 of 12 without a slot
    ids = s.routes[:, :t.measured]                           # the timing's last round: its widest
    for w in range(1, t.measured + 1):
        want = sum(len({int(e) for e in ids[i, :w].flatten() if not s.resident[i, e]}) * s.layer_bytes(i) / s.E
                   for i in s.moe_layers)
        assert t.missed[w - 1] == [0.0, pytest.approx(want), 0.0]                 # no CPU workers: all PCIe's
    again = load_or_measure(m, cache, micro_moe, m.cfg.vocab_size, True, str(tmp_path), 0.05, store_timing(m))
    assert again.from_cache and again.missed == t.missed and again.bank == t.bank
    # the rounds' own cost is the bank-only table; the misses' price is scaled to what they cost in it
    p, unscaled = priced(t, m), priced(replace(t, bank=[]), m)
    np.testing.assert_allclose(p.miss_ms(), p.rates_scale * unscaled.miss_ms())
    assert p.resident == t.bank and p.rates_scale == pytest.approx(fit_scale(
        t.ms[:t.measured], t.bank[:t.measured], [1e3 * x[1] * DEAR.pcie for x in t.missed]))
    # a table timed before the bank-only rounds existed: the timed misses come off at the plan's rates
    p, top = priced(replace(t, bank=[]), m), 0.0
    for w in range(1, t.measured + 1):
        top = max(top, t.ms[w - 1] - 1e3 * t.missed[w - 1][1] * DEAR.pcie, RESIDENT_FLOOR * t.ms[w - 1])
        assert p.resident[w - 1] == pytest.approx(top)
    assert p.rates_scale == 1.0


def test_bank_only_rounds_read_the_bank_and_give_the_table_back(micro_moe):
    """store.bank_only: inside, every expert of a class with slots points at one of its slots
    (no pair for PCIe or the CPU), a hit keeps its own slot; after it, and after an error
    inside, the table and the routes are as they were."""
    m = _model(GGUFFile(micro_moe), 4, DEAR, max_len=32)
    s, cache = m.store, m.new_cache(32)
    m.forward(torch.tensor([5, 9, 13]), 0, cache)
    table, routes = s.table.clone(), s.routes.clone()
    assert (table[s.moe_layers] < 0).any()
    with s.bank_only():
        for c in s.classes:
            t = s.table[c.layers]
            assert (t >= 0).all() and (t < c.owners.size).all()
            assert torch.equal(t[table[c.layers] >= 0], table[c.layers][table[c.layers] >= 0])   # hits stay
    assert torch.equal(s.table, table) and torch.equal(s.routes, routes)
    with pytest.raises(RuntimeError), s.bank_only():
        raise RuntimeError("inside")
    assert torch.equal(s.table, table)


def test_fit_scale_prices_the_timed_misses_at_what_they_cost():
    priced_ms = [0.0, 0.5, 1.0, 2.0]
    bank = [1.0, 1.1, 1.2, 1.4]
    assert fit_scale([b + 2.5 * p for b, p in zip(bank, priced_ms)], bank, priced_ms) == pytest.approx(2.5)
    assert fit_scale(bank, bank, [0.0] * 4) == 1.0                                    # nothing missed: the rates
    assert fit_scale([b + 100 * p for b, p in zip(bank, priced_ms)], bank, priced_ms) == SCALE_BOUNDS[1]
    assert fit_scale(bank, [b + 1 for b in bank], priced_ms) == SCALE_BOUNDS[0]       # noise: never below the floor


def test_exact_mode_spec_equals_plain_with_the_pricing_on(micro_moe):
    f = GGUFFile(micro_moe)
    m = _model(f, 4, DEAR)
    e = Engine(f, m, Tokenizer.from_metadata(f.metadata), None, 64)
    prompt, n_new = [155, 140, 140, 140, 140, 140], 7         # it copies 140s, then 225s: drafts, some rejected
    plain = list(e.generate(prompt, n_new))
    runs, specs = {}, {}
    for name, spec in (("ungated", SpecConfig("ngram", draft_max=4, ngram_min=1, gate=False)),
                       ("priced", SpecConfig("ngram", draft_max=4, ngram_min=1))):
        spec.memory.for_engine(e, True)[1].table = TABLE      # the table as timed at load (not timed here)
        g = Generation()
        assert list(e.generate(prompt, n_new, gen=g, spec=spec)) == plain, name
        runs[name], specs[name] = g.stats, spec
    assert runs["priced"].draft_n >= 1                        # it verified drafts ...
    assert runs["priced"].draft_n < runs["ungated"].draft_n  # ... fewer than ungated: the columns' misses
    d = specs["priced"].make_drafter(e)                      # one price for the gate and the policy (MTP switch)
    assert isinstance(d.gate.table, OffloadCosts) and d.table is d.gate.table
