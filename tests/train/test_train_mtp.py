"""The training MTP head against docs/MTP.md: the mask from the doc's wording, the batched
training forward against a one-entry-at-a-time float64 construction, the sidecar file."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from alphallama.gguf.quants import dequantize
from alphallama.gguf.reader import GGUFFile
from alphallama.train.mtp import MTPConfig, MTPHead, mtp_losses, mtp_mask, write_sidecar


def doc_mask(T: int, k: int) -> np.ndarray:
    """docs/MTP.md, literally: a depth-k query at p attends to depth-1 entries at positions
    <= p-k+1, and the depth-(k-(p-j)) entry at each position j in p-k+2..p."""
    m = np.zeros((T, k * T), dtype=bool)
    for p in range(T):
        for j in range(0, p - k + 2):
            m[p, j] = True
        for j in range(max(0, p - k + 2), p + 1):
            d = k - (p - j)
            m[p, (d - 1) * T + j] = True
    return m


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mask_is_the_documented_one(k):
    assert np.array_equal(mtp_mask(9, k).numpy(), doc_mask(9, k))


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, p, base, neox):   # x [H, hd] at position p, float64
    hd = x.shape[-1]
    inv = base ** (-np.arange(0, hd, 2) / hd)
    c, s = np.cos(p * inv), np.sin(p * inv)
    if neox:
        a, b = x[:, :hd // 2], x[:, hd // 2:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)
    a, b = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = a * c - b * s, a * s + b * c
    return out


def entrywise(head: MTPHead, hidden, tokens, embed, depths):
    """Each entry (d, p) computed alone, in float64, from its inputs and the entries it may
    see by the doc's rule; returns shared_head_norm(h') per depth [depths, T, D]."""
    c = head.cfg
    P = {n: t.detach().double().numpy() for n, t in head.named_parameters()}
    lin = lambda x, n: x @ P[n + ".weight"].T + (P[n + ".bias"] if n + ".bias" in P else 0)  # noqa: E731
    T, D = hidden.shape
    eps, g_h = c.norm_eps, c.n_heads // c.n_kv_heads
    Ks, Vs, H, out = {}, {}, {}, np.zeros((depths, T, D))
    for d in range(1, depths + 1):
        for p in range(T):
            g = np.zeros(D) if p == 0 else (hidden[p - 1] if d == 1 else H[(d - 1, p - 1)])
            e = embed[tokens[p]]
            z = lin(np.concatenate([_rms(e, P["enorm"], eps), _rms(g, P["hnorm"], eps)]), "eh_proj")
            h = _rms(z, P["attn_norm"], eps)
            q = lin(h, "wq").reshape(c.n_heads, c.head_dim)
            k = lin(h, "wk").reshape(c.n_kv_heads, c.head_dim)
            v = lin(h, "wv").reshape(c.n_kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = _rms(q, P["q_norm"], eps), _rms(k, P["k_norm"], eps)
            q, k = _rope(q, p, c.rope_base, c.rope_neox), _rope(k, p, c.rope_base, c.rope_neox)
            Ks[(d, p)], Vs[(d, p)] = k, v
            seen = [(1, j) for j in range(0, p - d + 2)] + [(d - (p - j), j) for j in range(max(0, p - d + 2), p + 1)]
            a = np.zeros((c.n_heads, c.head_dim))
            for hh in range(c.n_heads):
                kk = np.stack([Ks[s][hh // g_h] for s in seen])
                vv = np.stack([Vs[s][hh // g_h] for s in seen])
                sc = kk @ q[hh] / math.sqrt(c.head_dim)
                w = np.exp(sc - sc.max())
                a[hh] = (w / w.sum()) @ vv
            x = z + lin(a.reshape(-1), "wo")
            f = _rms(x, P["ffn_norm"], eps)
            silu = lambda u: u / (1 + np.exp(-u))  # noqa: E731
            x = x + lin(silu(lin(f, "gate")) * lin(f, "up"), "down")
            H[(d, p)] = x
            out[d - 1, p] = _rms(x, P["shared_head_norm"], eps)
    return out


@pytest.mark.parametrize("flags", [dict(qk_norm=True), dict(qkv_bias=True), dict(rope_neox=False)])
def test_training_forward_equals_entrywise_construction(flags):
    torch.manual_seed(0)
    cfg = MTPConfig(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, rope_base=10000.0, **flags)
    head = MTPHead(cfg).double()
    with torch.no_grad():   # non-trivial norms and biases
        for n, p in head.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    T, V = 7, 20
    hidden, tokens, embed = torch.randn(1, T, 32, dtype=torch.float64), torch.randint(0, V, (1, T)), torch.randn(V, 32, dtype=torch.float64)
    got = torch.stack(head(hidden, tokens, embed, depths=3)).detach().numpy()[:, 0]
    want = entrywise(head, hidden[0].numpy(), tokens[0].numpy(), embed.numpy(), 3)
    # float32 inside: RoPE tables and RMSNorm are computed in float32 (as in training)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_losses_count_the_documented_positions():
    T, V, D = 6, 11, 4
    tokens = torch.randint(0, V, (2, T))
    states = [torch.randn(2, T, D) for _ in range(2)]
    out = torch.randn(V, D)
    got = mtp_losses(states, out, tokens)
    for k, s in enumerate(states, start=1):   # positions p = k .. T-2 predict tokens[p + 1]
        lg = torch.stack([s[:, p] @ out.T for p in range(k, T - 1)], 1)
        want = torch.nn.functional.cross_entropy(lg.flatten(0, 1), tokens[:, k + 1:].flatten())
        assert torch.allclose(got[k - 1], want, atol=1e-6)


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0])
def test_sidecar_follows_the_contract(tmp_path, qtype):
    cfg = MTPConfig(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, qk_norm=True)
    head = MTPHead(cfg)
    path = tmp_path / "m.mtp.gguf"
    write_sidecar(path, head, arch="qwen3moe", n_layers=5, ctx_len=512,
                  metadata={"alphallama.training.steps": 7, "alphallama.training.command": "x"}, qtype=qtype)
    f = GGUFFile(str(path))
    md = f.metadata
    assert md["general.architecture"] == "qwen3moe"
    assert md["qwen3moe.block_count"] == 6 and md["qwen3moe.nextn_predict_layers"] == 1
    assert md["qwen3moe.embedding_length"] == 64 and md["qwen3moe.feed_forward_length"] == 96
    assert md["qwen3moe.attention.head_count"] == 4 and md["qwen3moe.attention.head_count_kv"] == 2
    assert md["qwen3moe.attention.key_length"] == 16
    assert md["alphallama.training.steps"] == 7
    want = {"blk.5.nextn.enorm.weight": (64,), "blk.5.nextn.hnorm.weight": (64,),
            "blk.5.nextn.eh_proj.weight": (64, 128), "blk.5.nextn.shared_head_norm.weight": (64,),
            "blk.5.attn_norm.weight": (64,), "blk.5.attn_q.weight": (64, 64), "blk.5.attn_k.weight": (32, 64),
            "blk.5.attn_v.weight": (32, 64), "blk.5.attn_output.weight": (64, 64),
            "blk.5.attn_q_norm.weight": (16,), "blk.5.attn_k_norm.weight": (16,), "blk.5.ffn_norm.weight": (64,),
            "blk.5.ffn_gate.weight": (96, 64), "blk.5.ffn_up.weight": (96, 64), "blk.5.ffn_down.weight": (64, 96)}
    assert {n: tuple(t.shape) for n, t in f.tensors.items()} == want
    for name, ref in head.gguf_tensors(5).items():
        t = f.tensors[name]
        got = dequantize(t.data, t.qtype, t.shape)
        tol = 0 if qtype == QT.F32 or ref.dim() == 1 else ref.abs().max().item() / 100
        assert (got - ref).abs().max().item() <= tol, name
