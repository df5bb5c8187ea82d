"""Admission that follows the context: a prompt's prefill chunks hand their routing to the
bank's policy (gpu_prefill.moe_loop -> store.learn_prompt), each pick weighted as a decode
round of one row would be (decay^(rows after it)), so the first decode round admits the
prompt's experts instead of waiting ~half_life rounds for the decode's own counts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides

CHEAP = Overrides(decode_gemv="f32", moe_gemv="f32", attention_tiles=(16, 4))
PROMPT = 100     # > MAX_W (64): the prefill path, one chunk


def _model(path: str) -> GPUModel:
    m = GPUModel(GGUFFile(path), 256, device="cpu", expert_slots=2, cpu_tier=False, overrides=CHEAP)
    assert m.prefill_path == "dequant" and m.store is not None
    return m


def _recording_routes(m: GPUModel) -> dict[int, list[torch.Tensor]]:
    """Every MoE layer's expert picks [T, k] as its router makes them (the instance's route
    wrapped: the record is independent of the policy's own counting)."""
    seen: dict[int, list[torch.Tensor]] = {}
    for L in m.layers:
        moe = L.moe
        if moe is None:
            continue
        route = moe.route

        def recorded(logits, *a, _route=route, _layer=moe.layer, **kw):
            w, e = _route(logits, *a, **kw)
            seen.setdefault(_layer, []).append(e.detach().cpu().clone())
            return w, e
        moe.route = recorded
    return seen


def test_the_prefill_hands_its_routing_to_the_policy(micro_moe):
    m = _model(micro_moe)
    seen = _recording_routes(m)
    prompt = torch.tensor([(7 * i) % 50 + 3 for i in range(PROMPT)])
    m.forward(prompt, 0, m.new_cache())
    policy = m.store.policy
    decay = policy.decay
    for layer in m.store.moe_layers.tolist():
        [picks] = seen[layer]                                           # [T, k]: one chunk
        T, k = picks.shape
        want = np.zeros(m.store.E)
        for t in range(T):
            for e in picks[t].tolist():
                want[e] += decay ** (T - 1 - t)
        np.testing.assert_allclose(policy.score[layer], want, rtol=1e-12, atol=1e-12)
        assert policy.score[layer].sum() == pytest.approx(k * (1 - decay ** T) / (1 - decay))
    assert policy.stats.lookups == 0 and policy.stats.hits == 0   # hit counts stay the decode's
    # the first decode round admits the experts the prompt's end used most (within the round's budget)
    m.store.after_launch(1)
    chosen = [a.flat for a in m.store._admissions]
    assert chosen, "no admission after a prompt"
    top = np.argsort(-policy.score.ravel(), kind="stable")
    assert set(chosen) <= set(top[:len(chosen) + 2].tolist())


def test_a_frozen_store_learns_nothing_from_a_prefill(micro_moe):
    m = _model(micro_moe)
    with m.store.frozen():
        m.forward(torch.arange(3, 3 + PROMPT) % 60, 0, m.new_cache())
    assert not m.store.policy.score.any()
