"""Attention and the small fused kernels against plain-torch references, under the
Triton interpreter on CPU (and natively on a GPU), with the column-rotation check."""
from __future__ import annotations


import pytest
import torch


from alphallama.kernels.attention.decode import decode_attention, decode_attention_ref  # noqa: E402
from alphallama.kernels.norm.rmsnorm import add_rmsnorm, add_rmsnorm_ref
from alphallama.kernels.attention.rope import qkv_rope
from alphallama.kernels.activations.silu import silu_mul, silu_mul_ref
from alphallama.model.layers import apply_rope, rms_norm, rope_tables  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("H,n_kv,hd,pos,W,max_len", [(4, 2, 16, 5, 3, 1100), (8, 2, 32, 600, 4, 1100),
                                                     (2, 2, 16, 0, 1, 600), (4, 1, 16, 1020, 2, 1100)])
def test_attention_matches_reference_and_is_row_invariant(H, n_kv, hd, pos, W, max_len):
    g = torch.Generator().manual_seed(pos)
    kc = torch.randn(n_kv, max_len, hd, generator=g).half().to(DEV)
    vc = torch.randn(n_kv, max_len, hd, generator=g).half().to(DEV)
    q = torch.randn(W, H, hd, generator=g).to(DEV)
    out = decode_attention(q, kc, vc, torch.tensor([pos], dtype=torch.int32, device=DEV), max_len)
    ref = decode_attention_ref(q.half().float(), kc, vc, pos)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    # column rotation: each row, run alone at its position, gives the same bits
    for r in range(W):
        one = decode_attention(q[r:r + 1], kc, vc, torch.tensor([pos + r], dtype=torch.int32, device=DEV), max_len)
        assert torch.equal(one[0], out[r])


def test_add_rmsnorm_and_silu():
    g = torch.Generator().manual_seed(0)
    x, y, w = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g), torch.rand(96, generator=g)
    x_ref, h_ref = add_rmsnorm_ref(x, y, w, 1e-6)
    xx = x.clone().to(DEV)
    h = add_rmsnorm(xx, y.to(DEV), w.to(DEV), 1e-6)
    torch.testing.assert_close(h.cpu(), h_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(xx.cpu(), x_ref)          # the residual add is a plain fp32 add
    h2 = add_rmsnorm(x.clone().to(DEV), None, w.to(DEV), 1e-6)
    torch.testing.assert_close(h2.cpu(), add_rmsnorm_ref(x, None, w, 1e-6)[1], atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 160, generator=g)
    torch.testing.assert_close(silu_mul(gu.to(DEV)).cpu(), silu_mul_ref(gu), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("neox,rot", [(True, 0), (False, 0), (True, 8), (True, 4)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_qkv_rope_kv_write(neox, rot, qk_norm, bias):
    """rot > 0: a partial rope (the hybrids'): the first rot of 16 dims turn, NEOX pairs
    (i, i + rot/2), the rest pass (model.layers.apply_rope with tables of rot/2 pairs)."""
    g = torch.Generator().manual_seed(1)
    H, nkv, hd, W, pos, ml = 4, 2, 16, 3, 5, 32
    qkv = torch.randn(W, (H + 2 * nkv) * hd, generator=g)
    b = torch.randn((H + 2 * nkv) * hd, generator=g) if bias else None
    qn, kn = torch.rand(hd, generator=g), torch.rand(hd, generator=g)
    cos, sin = rope_tables(ml, rot or hd, 10000.0)
    kc = torch.zeros(nkv, ml, hd, dtype=torch.float16, device=DEV)
    vc = torch.zeros_like(kc)
    d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    q = qkv_rope(qkv.to(DEV), d(b), d(qn) if qk_norm else None, d(kn) if qk_norm else None, cos.to(DEV),
                 sin.to(DEV), kc, vc, torch.tensor([pos], dtype=torch.int32, device=DEV), H, nkv, hd, 1e-6, neox,
                 rope_dim=rot or None)
    t = qkv + b if bias else qkv
    qr, kr = t[:, :H * hd].view(W, H, hd), t[:, H * hd:(H + nkv) * hd].view(W, nkv, hd)
    vr = t[:, (H + nkv) * hd:].view(W, nkv, hd)
    if qk_norm:
        qr, kr = rms_norm(qr, qn, 1e-6), rms_norm(kr, kn, 1e-6)
    c, s = cos[pos:pos + W], sin[pos:pos + W]
    qr, kr = apply_rope(qr, c, s, neox), apply_rope(kr, c, s, neox)
    torch.testing.assert_close(q.cpu(), qr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc[:, pos:pos + W].float().cpu(), kr.transpose(0, 1), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(vc[:, pos:pos + W].float().cpu(), vr.transpose(0, 1), atol=2e-3, rtol=1e-3)
    assert kc[:, :pos].abs().sum() == 0 and kc[:, pos + W:].abs().sum() == 0   # nothing outside its rows
