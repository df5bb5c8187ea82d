"""decode_attention_rope: the split programs make the round's queries, keys and values from
the q|k|v projection themselves (qkv_rope's arithmetic) and write the rows' keys and values
into the cache: one launch fewer than qkv_rope + decode_attention. Against that pair: the
cache rows it writes, its output; against the float64 reference; and a row's bits alone
and in a round, whatever the round's width and the row's column."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from alphallama.kernels import attention as A  # noqa: E402
from alphallama.kernels.attention import (RopeArgs, decode_attention, decode_attention_ref,  # noqa: E402
                                          decode_attention_rope)
from alphallama.kernels.fused import qkv_rope  # noqa: E402
from alphallama.model.layers import rope_tables  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, N_KV, HD, CAP = 4, 2, 32, 96


@pytest.fixture
def small_splits(monkeypatch):
    """Splits of 16 keys, at most 4 (the split size changes every 64 keys): the round's own
    rows straddle tiles and splits at the positions below."""
    monkeypatch.setattr(A, "BLOCK_N", 16)
    monkeypatch.setattr(A, "MAX_SPLITS", 4)


def _inputs(W: int, seed: int, bias: bool, norm: bool, neox: bool):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(W, (H + 2 * N_KV) * HD, generator=g).to(DEV)                       # [W, (H + 2 n_kv) hd]
    cos, sin = rope_tables(CAP + 16, HD, 10000.0)
    rope = RopeArgs(qkv, (torch.randn((H + 2 * N_KV) * HD, generator=g) * 0.1).to(DEV) if bias else None,
                    (torch.rand(HD, generator=g) + 0.5).to(DEV) if norm else None,
                    (torch.rand(HD, generator=g) + 0.5).to(DEV) if norm else None,
                    cos.to(DEV), sin.to(DEV), H, 1e-6, neox)
    cache = (torch.randn(N_KV, CAP, HD, generator=g).half().to(DEV),                     # [n_kv, cap, hd]
             torch.randn(N_KV, CAP, HD, generator=g).half().to(DEV))
    return rope, cache


def _pair(rope: RopeArgs, cache, pos: int):
    """qkv_rope + decode_attention on copies of the cache: (out, k, v, roped q)."""
    k, v = cache[0].clone(), cache[1].clone()
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    q = qkv_rope(rope.qkv, rope.bias, rope.q_norm, rope.k_norm, rope.cos, rope.sin, k, v, p, H, N_KV, HD,
                 rope.eps, rope.neox)
    return decode_attention(q, k, v, p, CAP), k, v, q


def _fused(rope: RopeArgs, cache, pos: int, early: bool = False):
    k, v = cache[0].clone(), cache[1].clone()
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    out, q8 = decode_attention_rope(rope, k, v, p, torch.float32, early=early)
    assert q8 == {}
    return out, k, v


@pytest.mark.parametrize("bias,norm,neox", [(False, True, True), (True, False, True), (False, False, False)],
                         ids=["qk-norm-neox", "bias-neox", "plain-pairs"])
@pytest.mark.parametrize("pos", [0, 13, 45])                  # one tile; new rows across a tile; across splits
def test_matches_qkv_rope_then_attention(small_splits, bias, norm, neox, pos):
    W = 5
    rope, cache = _inputs(W, seed=pos + 7 * bias + 3 * norm, bias=bias, norm=norm, neox=neox)
    want, kw, vw, q = _pair(rope, cache, pos)
    for early in (False, True):
        out, k, v = _fused(rope, cache, pos, early)
        if DEV == "cpu":       # the same ops in the same order; on a GPU the norm's sum may lay out differently
            assert torch.equal(k, kw) and torch.equal(v, vw)
        else:
            torch.testing.assert_close(k, kw, atol=2e-3, rtol=2e-3)
            assert torch.equal(v, vw)
        torch.testing.assert_close(out, want, atol=2e-3, rtol=0)
    ref = decode_attention_ref(q.cpu(), kw.cpu(), vw.cpu(), pos)                           # float64 of the pair's inputs
    torch.testing.assert_close(out.cpu(), ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("pos", [13, 45])
def test_rows_alone_and_in_rounds(small_splits, pos):
    """A round's row r equals row r run alone at pos + r (after the round wrote rows < pos + r),
    bit for bit, and so does the same row at another column of a wider round."""
    W = 6
    rope, cache = _inputs(W, seed=pos, bias=True, norm=True, neox=True)
    out, k, v = _fused(rope, cache, pos)
    for r in range(W):
        one = RopeArgs(rope.qkv[r:r + 1].contiguous(), rope.bias, rope.q_norm, rope.k_norm, rope.cos, rope.sin,
                       H, rope.eps, rope.neox)
        o1, k1, _ = _fused(one, (k, v), pos + r)
        assert torch.equal(o1[0], out[r]), f"row {r}"
        assert torch.equal(k1, k)                     # it wrote its own row again, the same bits
    # the round's last 3 rows as a round of their own at pos + 3 (their columns move)
    tail = RopeArgs(rope.qkv[3:].contiguous(), rope.bias, rope.q_norm, rope.k_norm, rope.cos, rope.sin,
                    H, rope.eps, rope.neox)
    o3, _, _ = _fused(tail, (k, v), pos + 3)
    assert torch.equal(o3, out[3:])


def test_rejects_a_wrong_projection():
    rope, cache = _inputs(2, seed=1, bias=False, norm=False, neox=True)
    bad = RopeArgs(rope.qkv[:, :-HD].contiguous(), None, None, None, rope.cos, rope.sin, H, 1e-6, True)
    with pytest.raises(ValueError, match="qkv must be"):
        _fused(bad, cache, 3)


def compile_all() -> None:
    """The split kernel with RoPE for sm_90 at the Qwen3-8B and Qwen3-30B-A3B heads (q/k norms,
    halves), with PDL and the old keys loaded early, as the decode graphs launch it."""
    from tests.kernels.sm90 import compile_sm90

    ptrs = ["*fp32", "*fp16", "*fp16", "*fp32", "*fp32", "*fp32", "*i32"]     # Q K V O M L pos
    for H, n_kv, hd in ((32, 8, 128), (32, 4, 128)):
        group = H // n_kv
        ptx = compile_sm90(A._attn_split_kernel, [*ptrs, "fp32"] + ["i32"] * 9 + ["*fp32"] * 6 + ["fp32"],
                           dict(N_HEADS=H, GROUP=group, G_PAD=max(16, group), HD=hd, BLOCK_N=A.BLOCK_N,
                                MAX_SPLITS=A.MAX_SPLITS, PDL=True, EARLY=True, ROPE=True, QKV_W=(H + 2 * n_kv) * hd,
                                N_KV=n_kv, HAS_BIAS=False, QK_NORM=True, NEOX=True),
                           num_warps=A.NUM_WARPS, fp_fusion=True, divisible_ints=True).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        assert body[:body.index("griddepcontrol.wait")].count("ld.global") >= 3     # pos, then the old K and V


def test_compiles_for_sm90():
    from tests.kernels.sm90 import run_in_child
    run_in_child("test_attention_rope", "compile_all", timeout=600)
