"""The split launch doing qkv_rope's work (attention.RoPEInput, engine.rope_in_attention):
against the float64 model of bias, q/k RMSNorm, RoPE and attention (model/layers.py); the
cache it leaves against qkv_rope's (bit for bit: the same operations) without reading the
rows it writes; a row's bits against the round's width and its column; the sm_90 compile."""
from __future__ import annotations

import os

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the first kernel launch

from alphallama.kernels import attention as A  # noqa: E402
from alphallama.kernels.attention import (RoPEInput, decode_attention, decode_attention_q8,  # noqa: E402
                                          decode_attention_ref)
from alphallama.kernels.fused import qkv_rope  # noqa: E402
from alphallama.kernels.expert_q8_gpu import CODES  # noqa: E402
from alphallama.kernels.qweight import FORMATS  # noqa: E402
from alphallama.model.layers import apply_rope, rms_norm, rope_tables  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, N_KV, HD, CAP = 4, 2, 32, 160


@pytest.fixture
def small_splits(monkeypatch):
    """16-key tiles, 4 splits: a round's new rows straddle tiles and splits at these depths."""
    monkeypatch.setattr(A, "BLOCK_N", 16)
    monkeypatch.setattr(A, "MAX_SPLITS", 4)


def _layer(seed: int, W: int, bias: bool, qk_norm: bool):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(W, (H + 2 * N_KV) * HD, generator=g)
    b = torch.randn((H + 2 * N_KV) * HD, generator=g) if bias else None
    qn, kn = (torch.rand(HD, generator=g) + 0.5, torch.rand(HD, generator=g) + 0.5) if qk_norm else (None, None)
    kc = torch.randn(N_KV, CAP, HD, generator=g).half()
    vc = torch.randn(N_KV, CAP, HD, generator=g).half()
    return qkv, b, qn, kn, kc, vc


def _d(t):
    return None if t is None else t.to(DEV)


def _rope_input(qkv, b, qn, kn, cos, sin, neox):
    return RoPEInput(qkv.to(DEV), H, _d(b), _d(qn), _d(kn), cos.to(DEV), sin.to(DEV), 1e-6, neox)


@pytest.mark.parametrize("neox,bias,qk_norm", [(True, False, True), (False, True, False), (True, True, True)])
@pytest.mark.parametrize("W,pos,early", [(1, 0, False), (3, 14, True), (5, 45, False), (2, 62, True)])
def test_matches_qkv_rope_then_attention(small_splits, neox, bias, qk_norm, W, pos, early):
    qkv, b, qn, kn, kc, vc = _layer(W * 1000 + pos, W, bias, qk_norm)
    cos, sin = rope_tables(CAP, HD, 10000.0)
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    # the control: qkv_rope writes the round's rows, the attention reads them back
    kc1, vc1 = kc.clone().to(DEV), vc.clone().to(DEV)
    q = qkv_rope(qkv.to(DEV), _d(b), _d(qn), _d(kn), cos.to(DEV), sin.to(DEV), kc1, vc1, p, H, N_KV, HD, 1e-6, neox)
    want = decode_attention(q, kc1, vc1, p, CAP, early=early)
    # fused: the round's rows start as junk the launch must not read, and it writes them
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, pos:pos + W], vc2[:, pos:pos + W] = 1e4, -1e4
    kc2, vc2 = kc2.to(DEV), vc2.to(DEV)
    got = decode_attention(_rope_input(qkv, b, qn, kn, cos, sin, neox), kc2, vc2, p, CAP, early=early)
    assert torch.equal(kc2.cpu(), kc1.cpu()) and torch.equal(vc2.cpu(), vc1.cpu())   # and nothing else written
    assert torch.equal(got.cpu(), want.cpu())
    # the float64 model: bias, norm and RoPE in torch, then attention over the cache qkv_rope left
    t = qkv + b if bias else qkv
    qr = t[:, :H * HD].view(W, H, HD)
    if qk_norm:
        qr = rms_norm(qr, qn, 1e-6)
    qr = apply_rope(qr, cos[pos:pos + W], sin[pos:pos + W], neox)
    ref = decode_attention_ref(qr.half().float(), kc1.cpu(), vc1.cpu(), pos)
    torch.testing.assert_close(got.cpu(), ref, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("neox", [True, False])
def test_row_bits_against_width_and_column(small_splits, neox):
    """Row r of a round of W at pos gives the bits of the same row alone at pos + r (a plain
    decode step over the cache the round left below it): exact mode's invariant."""
    W, pos = 6, 27
    qkv, b, qn, kn, kc, vc = _layer(3, W, True, True)
    cos, sin = rope_tables(CAP, HD, 10000.0)
    kc, vc = kc.to(DEV), vc.to(DEV)
    wide = decode_attention(_rope_input(qkv, b, qn, kn, cos, sin, neox), kc, vc,
                            torch.tensor([pos], dtype=torch.int32, device=DEV), CAP, early=True)
    for r in (0, 2, W - 1):
        k1, v1 = kc.clone(), vc.clone()
        k1[:, pos + r:], v1[:, pos + r:] = 0, 0      # the rows this step writes: not yet there
        one = decode_attention(_rope_input(qkv[r:r + 1], b, qn, kn, cos, sin, neox), k1, v1,
                               torch.tensor([pos + r], dtype=torch.int32, device=DEV), CAP, early=True)
        assert torch.equal(one[0], wide[r]), r
        assert torch.equal(k1[:, pos + r], kc[:, pos + r]) and torch.equal(v1[:, pos + r], vc[:, pos + r])


def test_q8_output_and_bad_input(small_splits):
    """With the o projection's int8 activations: the same output and codes as from roped
    queries; a projection of the wrong width is refused."""
    W, pos = 3, 20
    qkv, b, qn, kn, kc, vc = _layer(9, W, False, True)
    cos, sin = rope_tables(CAP, HD, 10000.0)
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    f = FORMATS[T.Q4_K]
    order = (f.slot, f.V, CODES[T.Q4_K][0])            # qmatvec_i8.lane_order of a Q4_K o projection
    k1, v1 = kc.clone().to(DEV), vc.clone().to(DEV)
    q = qkv_rope(qkv.to(DEV), None, _d(qn), _d(kn), cos.to(DEV), sin.to(DEV), k1, v1, p, H, N_KV, HD, 1e-6, True)
    want, q8w = decode_attention_q8(q, k1, v1, p, torch.float32, (order,))
    k2, v2 = kc.clone().to(DEV), vc.clone().to(DEV)
    got, q8g = decode_attention_q8(_rope_input(qkv, None, qn, kn, cos, sin, True), k2, v2, p, torch.float32, (order,))
    assert torch.equal(got, want)
    assert all(torch.equal(x, y) for x, y in zip(q8g[order], q8w[order]))
    with pytest.raises(ValueError, match="RoPEInput.qkv"):
        decode_attention(_rope_input(qkv[:, :-HD], None, qn, kn, cos, sin, True), k2, v2, p, CAP)


def compile_sm90() -> None:
    from tests.kernels.sm90 import compile_sm90 as compile_kernel
    types = ["*fp32", "*fp16", "*fp16", "*fp32", "*fp32", "*fp32", "*i32", "fp32"] + ["i32"] * 9 \
        + ["*fp32"] * 5 + ["fp32"]
    for neox, bias, qk_norm in ((True, False, True), (False, True, False)):
        ptx = compile_kernel(A._attn_split_kernel, types,
                             dict(N_HEADS=32, GROUP=4, G_PAD=16, HD=128, BLOCK_N=A.BLOCK_N, MAX_SPLITS=A.MAX_SPLITS,
                                  EARLY=True, PDL=True, ROPE=True, N_KV=8, HAS_BIAS=bias, QK_NORM=qk_norm, NEOX=neox),
                             fp_fusion=True).asm["ptx"]
        assert "griddepcontrol.wait" in ptx and "mma.sync" in ptx


def test_compiles_for_sm90():
    run_in_child("test_attention_rope")
