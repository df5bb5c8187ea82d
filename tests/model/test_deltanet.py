"""The Gated DeltaNet reference (model/deltanet.py) against float64 references written here
in numpy: the recurrence token by token, and its chunked form (the triangular solve a GPU
prefill kernel uses), which must agree with the recurrence in float64 to rounding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from alphallama.model.deltanet import RecurrentInputs, causal_conv, delta_rule, l2_normalize, replay

T, H, DK, DV = 200, 4, 32, 32


def _inputs(seed: int = 0, t: int = T):
    g = np.random.default_rng(seed)
    q = g.standard_normal((t, H, DK))
    k = g.standard_normal((t, H, DK))
    q /= np.sqrt((q * q).sum(-1, keepdims=True))
    k /= np.sqrt((k * k).sum(-1, keepdims=True))
    v = g.standard_normal((t, H, DV))
    decay = -np.exp(g.uniform(-4.5, 0.5, (t, H)))               # log-decay in (-1.6, -0.01)
    beta = 1 / (1 + np.exp(-g.standard_normal((t, H))))
    s0 = 0.3 * g.standard_normal((H, DK, DV))
    return q, k, v, decay, beta, s0


def recurrence_f64(q, k, v, g, beta, s0):
    """S <- e^g S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q / sqrt(dk), per head."""
    out = np.zeros_like(v)
    S = s0.copy()
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            S[h] *= np.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - S[h].T @ k[t, h])
            S[h] += np.outer(k[t, h], u)
            out[t, h] = S[h].T @ q[t, h] / np.sqrt(q.shape[2])
    return out, S


def chunked_f64(q, k, v, g, beta, s0, chunk: int = 16):
    """The same rule a chunk at a time: with G the within-chunk cumulative log-decay,
    (I + A) U = beta (V - e^G K S0), A[s, r] = beta_s e^(G_s - G_r) k_s.k_r for r < s;
    o_t = e^G_t S0^T q_t + sum_{s<=t} e^(G_t - G_s) (q_t.k_s) u_s;  S = e^G_C S0 + sum_s e^(G_C - G_s) k_s u_s^T."""
    n, nh, dk = q.shape
    out = np.zeros_like(v)
    S = s0.copy()
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(c0 + chunk, n))
        for h in range(nh):
            Q, K, V, B = q[sl, h], k[sl, h], v[sl, h], beta[sl, h]
            G = np.cumsum(g[sl, h])                                   # [C]
            D = np.exp(G[:, None] - G[None, :])                       # [C, C] e^(G_s - G_r)
            A = np.tril(B[:, None] * D * (K @ K.T), -1)
            U = np.linalg.solve(np.eye(len(G)) + A, B[:, None] * (V - np.exp(G)[:, None] * (K @ S[h])))
            out[sl, h] = (np.exp(G)[:, None] * (Q @ S[h]) + np.tril(D * (Q @ K.T)) @ U) / np.sqrt(dk)
            S[h] = np.exp(G[-1]) * S[h] + (np.exp(G[-1] - G)[:, None] * K).T @ U
    return out, S


def _t(x):
    return torch.from_numpy(x).float()


def test_chunked_form_is_the_recurrence_in_f64():
    args = _inputs(1, 70)
    o1, s1 = recurrence_f64(*args)
    o2, s2 = chunked_f64(*args)
    assert np.abs(o1 - o2).max() < 1e-10 and np.abs(s1 - s2).max() < 1e-10


def test_float32_delta_rule_matches_f64():
    q, k, v, g, beta, s0 = _inputs()
    o64, s64 = recurrence_f64(q, k, v, g, beta, s0)
    o, s = delta_rule(_t(q), _t(k), _t(v), _t(g), _t(beta), _t(s0))
    assert np.abs(o.double().numpy() - o64).max() / np.abs(o64).max() < 2e-6
    assert np.abs(s.double().numpy() - s64).max() / np.abs(s64).max() < 2e-6


def test_states_out_and_replay_give_each_prefix():
    q, k, v, g, beta, s0 = (_t(x) for x in _inputs(2, 12))
    states: list[torch.Tensor] = []
    _, last = delta_rule(q, k, v, g, beta, s0, states)
    assert len(states) == 12 and torch.equal(states[-1], last)
    mix = torch.randn(12, 8)
    conv0 = torch.randn(3, 8)
    inputs = RecurrentInputs(mix, q, k, v, g, beta)
    for n in (1, 5, 12):
        conv, ssm = replay(inputs, n, conv0, s0)
        _, direct = delta_rule(q[:n], k[:n], v[:n], g[:n], beta[:n], s0)
        assert torch.equal(ssm, direct) and torch.equal(ssm, states[n - 1])
        assert torch.equal(conv, torch.cat([conv0, mix[:n]])[-3:])


@pytest.mark.parametrize("split", [1, 5, 17])
def test_causal_conv_in_pieces_matches_f64(split):
    g = np.random.default_rng(3)
    x, w, st = g.standard_normal((20, 6)), g.standard_normal((6, 4)), g.standard_normal((3, 6))
    full = np.concatenate([st, x])
    want = np.array([[(full[t:t + 4, c] * w[c]).sum() for c in range(6)] for t in range(20)])
    want = want / (1 + np.exp(-want))                                 # SiLU
    a, s = causal_conv(_t(x[:split]), _t(st), _t(w))
    b, s = causal_conv(_t(x[split:]), s, _t(w))
    got = torch.cat([a, b]).double().numpy()
    assert np.abs(got - want).max() < 1e-5
    assert torch.equal(s, _t(x[-3:]))


def test_l2_normalize_is_llamacpps():
    x = torch.randn(5, 32)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert torch.allclose(l2_normalize(x, 1e-6), want, atol=1e-7)
