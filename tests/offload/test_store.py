"""The expert store on CPU with simulated tiers (the "VRAM" bank is ordinary memory): the
logits are bit-identical whichever tier each expert lives in, also while admissions
copy experts into the bank in the middle of a generation; the table points at the
right bytes; admissions are paced."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.offload.mailbox import DONE
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides

TOKENS = [5, 9, 100, 7, 42, 3, 250, 17]


def _teacher_forced(model: GPUModel, tokens: list[int], prefill: int = 3) -> list[torch.Tensor]:
    """Logits of a prefill of `prefill` rows, then of one row per round (a decode)."""
    cache = model.new_cache(64)
    out = [model.forward(torch.tensor(tokens[:prefill]), 0, cache)[0].clone()]
    for i in range(prefill, len(tokens)):
        out.append(model.forward(torch.tensor(tokens[i:i + 1]), i, cache)[0].clone())
    return out


def _reference(f: GGUFFile, cpu_tier: bool, tokens: list[int]) -> list[torch.Tensor]:
    """Without CPU workers the store runs the resident kernels: the reference is the model
    without a store. With them every MoE layer runs the expert contract: the reference is
    the store with every expert in the bank (no pair ever reaches the CPU)."""
    if not cpu_tier:
        return _teacher_forced(GPUModel(f, 64, device="cpu"), tokens)
    m = GPUModel(f, 64, device="cpu", expert_slots=12, cpu_tier=True)
    assert m.cpu_link is not None and int((m.store.table >= 0).sum()) == 12
    out = _teacher_forced(m, tokens)
    assert int(m.cpu_link.seq.item()) == 0          # all in the bank: nothing was posted
    return out


@pytest.mark.parametrize("cpu_tier", [False, True], ids=["pcie", "cpu-workers"])
def test_logits_identical_whichever_tier(micro_moe, cpu_tier):
    f = GGUFFile(micro_moe)
    ref = _reference(f, cpu_tier, TOKENS[:4])
    for slots in (0, 5):   # all in the host tier, a mix over both classes
        m = GPUModel(f, 64, device="cpu", expert_slots=slots, cpu_tier=cpu_tier)
        m.store.admit_bytes_per_round = 0   # no admissions: the start layout throughout
        assert m.store.slots == slots
        assert int((m.store.table >= 0).sum()) == slots
        assert (m.cpu_link is not None) == cpu_tier
        got = _teacher_forced(m, TOKENS[:4])
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"slots={slots}"
        if cpu_tier:   # the host pairs were the workers': every MoE layer of every round posted
            assert int(m.cpu_link.seq.item()) >= 2 * 2
            assert int(m.cpu_link.mailbox.ctl[DONE]) == int(m.cpu_link.seq.item())


def test_identical_while_the_cpu_share_is_tuned(micro_moe):
    """The share tuner (offload/share_tuner.py; on CUDA it times the rounds) moves the split of
    the host pairs between CPU workers and PCIe between rounds: the bits do not move."""
    from alphallama.offload.share_tuner import ShareTuner
    f = GGUFFile(micro_moe)
    ref = _reference(f, True, TOKENS)
    m = GPUModel(f, 64, device="cpu", expert_slots=0, cpu_tier=True)
    applied = []
    m.share_tuner = ShareTuner(lambda s: (applied.append(s), m.cpu_link.set_share(s)), 0.5, samples=1)
    got = _teacher_forced(m, TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert len(set(applied)) >= 3 and {0.25, 0.5, 0.75} <= set(applied)   # rounds at different splits


@pytest.mark.parametrize("cpu_tier", [False, True], ids=["pcie", "cpu-workers"])
def test_identical_while_admissions_happen(micro_moe, cpu_tier):
    f = GGUFFile(micro_moe)
    ref = _reference(f, cpu_tier, TOKENS)
    m = GPUModel(f, 64, device="cpu", expert_slots=3, cpu_tier=cpu_tier)
    s = m.store
    s.policy.margin = 0.0
    s.admit_bytes_per_round, s.chunk_bytes = 8192, 1024   # an expert (~13 KiB) takes two rounds
    tables = []
    got = []
    cache = m.new_cache(64)
    got.append(m.forward(torch.tensor(TOKENS[:3]), 0, cache)[0].clone())
    for i in range(3, len(TOKENS)):
        tables.append(s.table.clone())
        got.append(m.forward(torch.tensor(TOKENS[i:i + 1]), i, cache)[0].clone())
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert s.stats.admissions >= 1
    assert any(not torch.equal(a, b) for a, b in zip(tables, tables[1:])), "the table never changed"
    # every resident entry points at a slot holding that expert's bytes
    for c in s.classes:
        for slot, flat in enumerate(c.owners):
            if flat < 0:
                continue
            layer, e = divmod(int(flat), s.E)
            assert int(s.table[layer, e]) == slot
            v = s.layer(layer)
            for n, p in v.host_gate_up.planes.items():
                assert torch.equal(c.bank_gate_up.planes[n][slot], p[e])
            for n, p in v.host_down.planes.items():
                assert torch.equal(c.bank_down.planes[n][slot], p[e])
    s.before_round()   # the last round's routing is observed at the next round
    assert s.stats.lookups == len(TOKENS) * 2 * 2 and 0 < s.stats.hits < s.stats.lookups
    _figures_are_the_stores(m, cpu_tier)


def _figures_are_the_stores(m: GPUModel, cpu_tier: bool) -> None:
    """What /metrics shows of a store (StoreRounds.store_figures) is its counters and tiers."""
    from alphallama.server.metrics import Metrics
    s, fig = m.store, m.store_figures()
    assert [fig[k] for k in ("lookups", "hits", "admissions", "admitted_bytes")] == \
        [s.stats.lookups, s.stats.hits, s.stats.admissions, s.stats.admitted_bytes]
    assert fig["bank_bytes"] == s.bank_bytes > 0 and fig["host_bytes"] == s.host_bytes > 0 and fig["mapped_bytes"] == 0
    assert fig["cpu_share"] == (int(m.cpu_link.share.item()) / 256 if cpu_tier else None)
    text = Metrics().render(0, 0, True, fig)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert int(samples["alphallama_expert_hits_total"]) == s.stats.hits
    assert int(samples["alphallama_expert_lookups_total"]) == s.stats.lookups
    assert int(samples["alphallama_expert_admissions_total"]) == s.stats.admissions
    assert int(samples['alphallama_expert_tier_bytes{tier="bank"}']) == s.bank_bytes
    assert ("alphallama_expert_cpu_share" in samples) == cpu_tier
    if cpu_tier:   # the workers' clock: they served the CPU's pairs of these rounds
        c = fig["cpu_clock"]
        assert c == m.cpu_experts.clock() and c["posts"] > 0 and c["pairs"] >= c["groups"] >= c["posts"]
        assert int(samples["alphallama_expert_cpu_posts_total"]) == c["posts"]
        assert float(samples["alphallama_expert_cpu_busy_seconds_total"]) == c["busy_ns"] / 1e9 > 0
    else:
        assert fig["cpu_clock"] is None and "alphallama_expert_cpu_posts_total" not in samples


def test_admission_is_paced_and_waits_for_its_copy(micro_moe):
    f = GGUFFile(micro_moe)
    m = GPUModel(f, 64, device="cpu", expert_slots=2, graphs=False)
    s = m.store
    s.policy.margin = 0.0
    s.admit_bytes_per_round, s.chunk_bytes = 2048, 1024
    c = s.classes[0]
    layer = c.layers[0]
    cold = [e for e in range(s.E) if not s.resident[layer, e]][0]
    s.policy.score[layer, cold] = 100.0   # make one host expert hot
    s._pending_routes = None
    s.after_launch(1)
    adm = [a for a in s._admissions if a.flat == layer * s.E + cold]
    assert adm, "the hot expert was not chosen"
    a = adm[0]
    assert c.owners[a.slot] == -2 and int(s.table[layer, cold]) == -1
    total = sum(d.numel() * d.element_size() for d, _ in s._sources(c, a.slot, a.flat))
    rounds = 1
    while a.chunks:
        assert int(s.table[layer, cold]) == -1      # not usable before its copy is complete
        assert s.stats.admitted_bytes <= rounds * 2048 + 1024   # at most the per-round budget (+ one chunk)
        s.before_round()
        s.after_launch(1)
        rounds += 1
    assert rounds >= total // (2048 + 1024)
    s.before_round()
    assert int(s.table[layer, cold]) == a.slot and s.resident[layer, cold]


def test_routes_recorded_for_the_policy(micro_moe):
    f = GGUFFile(micro_moe)
    m = GPUModel(f, 64, device="cpu", expert_slots=4)
    m.store.admit_bytes_per_round = 0
    cache = m.new_cache(64)
    m.forward(torch.tensor(TOKENS[:2]), 0, cache)
    ids = m.store.routes[:, :2].clone()            # [L, W, k] as routed by the kernels
    m.store.before_round()                         # observes that round
    counts = np.zeros((2, 6))
    for layer in range(2):
        for e in ids[layer].flatten().tolist():
            counts[layer, e] += 1
    np.testing.assert_allclose(m.store.policy.score, counts)
    assert m.store.stats.lookups == 2 * 2 * 2


def test_reset_returns_to_the_start_layout(micro_moe):
    m = GPUModel(GGUFFile(micro_moe), 64, device="cpu", expert_slots=3, cpu_tier=False)
    s = m.store
    start = s.table.clone()
    s.policy.margin = 0.0
    s.admit_bytes_per_round, s.chunk_bytes = 1 << 20, 1 << 20
    cache = m.new_cache(64)
    for i, t in enumerate(TOKENS):
        m.forward(torch.tensor([t]), i, cache)
    assert s.stats.admissions >= 1 and not torch.equal(s.table, start)
    s.reset()
    assert torch.equal(s.table, start) and s.stats.admissions == 0 and s.stats.lookups == 0
    for c in s.classes:   # the start layout's bytes are back in their slots
        for slot, flat in enumerate(c.owners):
            layer, e = divmod(int(flat), s.E)
            for n, p in s.layer(layer).host_down.planes.items():
                assert torch.equal(c.bank_down.planes[n][slot], p[e])


def test_long_prompt_prefill_through_the_store(micro_moe):
    """More than 64 rows take the GEMM prefill also with a store: each hit expert from its
    slot or straight from the host tier, the same bits as the resident model's per-expert
    prefill (the store's algorithm), close to its grouped GEMMs (another summation: equal
    on some CPUs' BLAS, 3e-5 apart on an AMD EPYC's), and the bank untouched."""
    f = GGUFFile(micro_moe)
    prompt = torch.tensor([(7 * i + 3) % 250 for i in range(80)])
    want = {}
    for fused in (True, False):
        # resident MoE defaults to the decode graphs
        ref = GPUModel(f, 128, device="cpu", overrides=Overrides(prefill_path="dequant", moe_prefill_fused=fused))
        want[fused] = ref.forward(prompt, 0, ref.new_cache(128))[0].clone()
    m = GPUModel(f, 128, device="cpu", expert_slots=5, cpu_tier=False)
    assert m.prefill_path == "dequant"
    table = m.store.table.clone()
    got = m.forward(prompt, 0, m.new_cache(128))[0]
    assert torch.equal(got, want[False])
    torch.testing.assert_close(got, want[True], atol=1e-4 * want[True].abs().max().item(), rtol=0)
    assert torch.equal(m.store.table, table)


def test_launch_thread_kept_apart_from_the_workers(micro_moe):
    import os
    import threading
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one cpu: nothing to keep apart")
    out = {}

    m = GPUModel(GGUFFile(micro_moe), 64, device="cpu", expert_slots=0, cpu_tier=True)

    def launch():   # a thread of its own, so pinning it leaves the test runner alone
        m._keep_launch_thread_apart()   # what every CUDA round does first in its launching thread
        out["mine"], out["workers"] = os.sched_getaffinity(0), set(m.cpu_experts.cpus)
    t = threading.Thread(target=launch)
    t.start()
    t.join()
    m.cpu_experts.stop()
    assert out["mine"] and not (out["mine"] & out["workers"])
    assert out["mine"] | out["workers"] <= set(os.sched_getaffinity(0))
