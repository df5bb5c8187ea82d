"""The store's mapped tier on CPU (the interpreter and the C workers): with the host tier's
RAM capped below the experts' bytes, the layers past the cap stay in the GGUF file's
mapping, and the logits (so the tokens) are bit-identical to the all-in-RAM store's,
also while admissions copy mapped experts into the bank; read-ahead hints the likely ones."""
from __future__ import annotations

import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.offload.mapped import MAPPED
from alphallama.runtime.gpu_model import GPUModel
from tests.offload.test_store import TOKENS, _teacher_forced


def _store_model(f: GGUFFile, slots: int, host_bytes: int | None) -> GPUModel:
    m = GPUModel(f, 64, device="cpu", expert_slots=slots, cpu_tier=True, cpu_threads=1, host_bytes=host_bytes)
    m.store.policy.margin = 0.0
    m.store.admit_bytes_per_round, m.store.chunk_bytes = 8192, 1024   # an expert (~13 KiB) takes two rounds
    return m


def test_mapped_tier_same_logits_as_ram(micro_moe):
    f = GGUFFile(micro_moe)
    ram = _store_model(f, 3, None)
    ref = _teacher_forced(ram, TOKENS)
    one_layer = ram.store.layer_bytes(0)
    for cap, tokens in ((one_layer, TOKENS), (0, TOKENS[:5])):   # layer 1 mapped; both mapped
        m = _store_model(f, 3, cap)
        s = m.store
        assert sorted(s.mapped) == ([1] if cap else [0, 1])
        assert s.host_bytes == (one_layer if cap else 0) and s.mapped_bytes > 0
        assert bool((s.table[1][s.table[1] < 0] == MAPPED).all())
        hinted = []
        s.readahead.advise = lambda v: hinted.append(v.nbytes) or True
        got = _teacher_forced(m, tokens)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"cap={cap}"
        assert s.readahead.hints >= 1 and len(hinted) == 3 * s.readahead.hints   # gate, up, down of each
        assert int(m.cpu_link.seq.item()) >= len(tokens) - 3   # the mapped pairs went to the workers
        if cap:   # mapped experts were admitted from the file: a slot holds what the host tier would have
            assert s.stats.admissions >= 1
            c, _ = s._class_of[1]
            host = ram.store.layer(1).host_down.planes
            owned = [(slot, flat % s.E) for slot, flat in enumerate(c.owners) if flat >= 0 and flat // s.E == 1]
            assert owned and all(torch.equal(c.bank_down.planes[n][slot], p[e])
                                 for slot, e in owned for n, p in host.items())


def test_mapped_tier_needs_the_cpu_workers(micro_moe):
    f = GGUFFile(micro_moe)
    try:
        GPUModel(f, 64, device="cpu", expert_slots=2, cpu_tier=False, host_bytes=0)
    except RuntimeError as e:
        assert "mapped file" in str(e)
    else:
        raise AssertionError("a mapped tier without CPU workers was accepted")
