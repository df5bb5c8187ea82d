"""Parallel streams with an expert store (-np N: runtime/gpu_model.round, offload/admission.py).

Three streams of the micro MoE (two with the CPU workers: their contract kernels cost the
interpreter more), a bank of 3 of its 12 experts, admissions paced so they happen mid-run,
started one step apart, in shared passes: each stream's tokens are its
plain greedy tokens alone on a one-slot model whose experts never leave one tier (without
CPU workers: every expert resident; with them: every expert in the bank, nothing posted),
plain, with the copy drafter's drafts riding in the shared rounds, and priced by the
store's misses (the allotment reading spec/offload_costs.py). The passes feed the store
(its policy counts every row of every stream, admissions happen); a round of several
streams admits for each of them; the footprint learns a mixed round from its rows in pass
order; and the admission measurement (bench/offload_streams_admission.py) at a small size.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from alphallama.engine import Engine
from alphallama.gguf.reader import GGUFFile
from alphallama.offload.admission import round_budget
from alphallama.offload.estimate import MissRates
from alphallama.offload.footprint import Footprint
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides
from alphallama.spec.config import SpecConfig
from alphallama.spec.gate import MAX_WIDTH, CostTable
from alphallama.tokenizer import Tokenizer

from streamutil import drive

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH = Path(__file__).resolve().parents[2] / "bench"
CHEAP = Overrides(decode_gemv="f32", moe_gemv="f32", attention_tiles=(16, 4))
CTX, N_NEW = 40, 4
PROMPTS = [[155, 140, 140, 140, 140, 140], [9, 148, 10], [250, 17, 42]]   # the copy drafter drafts in 0 and 1
STREAMS = {"pcie": 3, "cpu-workers": 2}   # (the contract's kernels cost the interpreter more: two streams)
TABLE = CostTable([1.0 + 0.05 * (w - 1) for w in range(1, MAX_WIDTH + 1)], MAX_WIDTH)
DEAR = MissRates(pcie=1e-8, mapped=2e-8, cpu=2e-8, share=0.5)   # s/byte: a micro expert ~0.13 ms a miss


def _engine(model: GPUModel, f: GGUFFile, slots: int) -> Engine:
    return Engine(f, model, Tokenizer.from_metadata(f.metadata), None, CTX, slots=slots)


def _made(path: str, tier: str):
    """(the store's model, the file, the prompts, each one's plain greedy tokens alone on one
    tier); tier: "pcie" (no CPU workers) or "cpu-workers"."""
    f = GGUFFile(path)
    workers = tier == "cpu-workers"
    prompts = PROMPTS[:STREAMS[tier]]
    # one tier alone: without workers the store runs the resident kernels; with them the
    # contract's, so the reference is the store with every expert in the bank
    ref = GPUModel(f, CTX, device="cpu", expert_slots=12 if workers else None, cpu_tier=workers, overrides=CHEAP)
    e = _engine(ref, f, 1)
    alone = []
    for p in prompts:
        e.reset()
        alone.append(list(e.generate(p, N_NEW)))
    if workers:
        assert int(ref.cpu_link.seq.item()) == 0                    # nothing reached the CPU
    model = GPUModel(f, CTX, device="cpu", expert_slots=3, cpu_tier=workers, miss_rates=DEAR, overrides=CHEAP)
    assert (model.cpu_link is not None) == workers
    s = model.store
    s.policy.margin = 0.0
    s.admit_bytes_per_round, s.chunk_bytes = 4096, 1024        # an expert (~13 KiB) over a few rounds
    return model, f, prompts, alone


@pytest.fixture(scope="module")
def pcie(micro_moe):
    return _made(micro_moe, "pcie")


@pytest.fixture(scope="module")
def workers(micro_moe):
    return _made(micro_moe, "cpu-workers")


def _spec(name: str, engine: Engine) -> SpecConfig:
    if name == "plain":
        return SpecConfig("none")
    if name == "ngram":
        return SpecConfig("ngram", 4, 1, gate=False)
    spec = SpecConfig("ngram", 4, 1)                            # priced: the table with the store's misses
    spec.memory.for_engine(engine, True)[1].table = TABLE
    return spec


# (plain rounds: the drafted cases' rounds carry plain rows too; CI time)
@pytest.mark.parametrize("spec", ["ngram", "priced"])
def test_streams_over_pcie_get_their_tokens_alone(pcie, spec):
    _together(pcie, spec)


@pytest.mark.parametrize("spec", ["ngram"])
def test_streams_with_cpu_workers_get_their_tokens_alone(workers, spec):
    _together(workers, spec)


def _together(made, spec: str) -> None:
    """The streams started one step apart on the store's model: each one's tokens are its
    tokens alone, and the store served the shared passes (the module docstring)."""
    model, f, prompts, alone = made
    s = model.store
    before = (s.stats.admissions, s.stats.lookups, s.stats.rounds,
              int(model.cpu_link.seq.item()) if model.cpu_link is not None else 0)
    e = _engine(model, f, len(prompts))
    rounds: list = []                                           # (streams in the round, its rows)
    got, gens, runs = drive(e, prompts, N_NEW, [_spec(spec, e) for _ in prompts], rounds=rounds)
    assert got == alone
    s.before_round()                                              # (the last pass's routing observed)
    assert any(n > 1 for n, _ in rounds)                          # rounds of several streams ran
    assert s.stats.admissions > before[0]                         # the bank changed mid-run
    rows = sum(sum(r.rows) for r in runs)
    assert s.stats.lookups - before[1] >= rows * 2 * s.top_k      # every stream's rows fed the policy
    if model.cpu_link is not None:
        assert int(model.cpu_link.seq.item()) > before[3]        # the workers took host pairs
    drafted = sum(g.stats.draft_n for g in gens)
    assert (drafted > 0) == (spec != "plain")


def test_a_round_of_several_streams_admits_for_each(micro_moe):
    """after_launch(W, streams): `streams` times the one-stream budget is queued (+ the chunk
    that crosses it); one stream's round is today's budget."""
    assert round_budget(2048, 3) == 6144 and round_budget(2048, 1) == 2048
    with pytest.raises(ValueError):
        round_budget(2048, 0)
    queued = []
    for streams in (1, 3):
        m = GPUModel(GGUFFile(micro_moe), 64, device="cpu", expert_slots=2, cpu_tier=False, graphs=False)
        s = m.store
        s.policy.margin = 0.0
        s.admit_bytes_per_round, s.chunk_bytes = 2048, 1024
        for layer in s.moe_layers:                              # every host expert hot: more to copy than a round takes
            s.policy.score[layer, ~s.resident[layer]] = 100.0
        s.after_launch(1, streams)
        queued.append(s.stats.admitted_bytes)
    assert 2048 <= queued[0] < 2048 + 1024
    assert 3 * 2048 <= queued[1] < 3 * 2048 + 1024


def test_the_footprint_prices_a_mixed_round_from_its_pass_order():
    """Two streams on disjoint experts, one row each a round, observed in pass order (A's row,
    then B's): two consecutive rows are one of each, so w = 2 misses both streams' experts,
    where one stream's rows alone miss its own k."""
    k, E = 2, 16
    resident = np.zeros((1, E), dtype=bool)
    alone, mixed = (Footprint(1, E, k, 0.0, 64.0, 0.0) for _ in range(2))
    for _ in range(200):
        alone.observe(np.array([[[0, 1]]]), resident)                          # [L, W = 1, k]
        mixed.observe(np.array([[[0, 1], [2, 3]]]), resident)                  # [L, W = 2, k]: A, B
    assert alone.missed()[0, 1] == pytest.approx(2.0, rel=1e-3)          # (the first rows, decayed, saw none)
    assert mixed.missed()[0, 1] == pytest.approx(4.0, rel=1e-3)
    assert mixed.missed()[0, 0] == pytest.approx(2.0, rel=1e-3)


def test_the_admission_measurement_follows_n_contexts():
    """bench/offload_streams_admission.py, small: at N = 1 the budget per round and per stream
    are one rule (the same run); at N = 4 a budget per round leaves the bank behind the four
    drifting contexts (a lower hit rate) where each stream's budget keeps up."""
    sys.path.insert(0, str(BENCH))
    from offload_streams_admission import measure
    res = measure(ns=(1, 4), rounds=900, warmup=300, arms=("round", "stream"))
    by = {(r["N"], r["arm"]): r for r in res["runs"]}
    assert by[1, "round"]["hit_rate"] == by[1, "stream"]["hit_rate"]
    assert by[4, "stream"]["admissions_per_round"] > by[4, "round"]["admissions_per_round"]
    assert by[4, "stream"]["hit_rate"] > by[4, "round"]["hit_rate"]
