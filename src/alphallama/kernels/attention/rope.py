"""The attention's input: bias, q/k RMSNorm, RoPE and the KV-cache write in one launch
(one program per row and head). RoPE turns the whole head, or (rope_dim < head_dim: the
hybrids' partial rope, NEOX) its first rope_dim dims, pairs (i, i + rope_dim/2), the rest
passing through (model.layers.apply_rope)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_kwargs, pdl_start
from .rows import rows_stride


@triton.jit
def _qkv_rope_kernel(QKV, BIAS, QN, KN, COS, SIN, QOUT, KC, VC, pos_ptr, eps,
                     stride_kc_h, stride_kc_n, stride_vc_h, stride_vc_n,
                     N_HEADS: tl.constexpr, N_KV: tl.constexpr, HD: tl.constexpr,
                     HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, NEOX: tl.constexpr, PDL: tl.constexpr = False,
                     ROT: tl.constexpr = 0, ROWS: tl.constexpr = 0):
    """One program per (row, head) over the fused [W, (H + 2*n_kv) * hd] projection.
    ROT: the rotated dims of a partial rope (0: the whole head). ROWS (0: row r at
    pos_ptr[0] + r, its K/V at the same cache row) > 0: pos_ptr is a row table int32
    [3, ROWS] (rows.py): row r at position pos_ptr[r], its K/V written at cache row
    pos_ptr[ROWS + r] + pos_ptr[r] (its stream's KV base); RoPE takes the position."""
    pdl_start(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)                     # 0..H-1 query, H..H+n_kv-1 key, then value
    if ROWS:
        pos = tl.load(pos_ptr + row)
        kvpos = tl.load(pos_ptr + ROWS + row) + pos
    else:
        pos = tl.load(pos_ptr) + row
        kvpos = pos
    QKV_W: tl.constexpr = (N_HEADS + 2 * N_KV) * HD
    if ROT:
        _partial_head(QKV + row * QKV_W + head * HD, BIAS + head * HD, QN, KN, COS, SIN, QOUT, KC, VC, pos,
                      kvpos, row, head, eps, stride_kc_h, stride_kc_n, stride_vc_h, stride_vc_n,
                      N_HEADS, N_KV, HD, ROT, HAS_BIAS, QK_NORM)
    else:
        HALF: tl.constexpr = HD // 2
        i = tl.arange(0, HALF)
        base = QKV + row * QKV_W + head * HD
        if NEOX:       # pairs (i, i + HD/2)
            ia, ib = i, i + HALF
        else:          # pairs (2i, 2i + 1)
            ia, ib = 2 * i, 2 * i + 1
        a = tl.load(base + ia)
        b = tl.load(base + ib)
        if HAS_BIAS:
            a += tl.load(BIAS + head * HD + ia)
            b += tl.load(BIAS + head * HD + ib)
        if head >= N_HEADS + N_KV:                  # value: straight into the cache
            vh = head - N_HEADS - N_KV
            tl.store(VC + vh * stride_vc_h + kvpos * stride_vc_n + ia, a.to(tl.float16))
            tl.store(VC + vh * stride_vc_h + kvpos * stride_vc_n + ib, b.to(tl.float16))
        else:
            if QK_NORM:
                nw = QN if head < N_HEADS else KN
                r = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / HD + eps)
                a = a * r * tl.load(nw + ia)
                b = b * r * tl.load(nw + ib)
            c = tl.load(COS + pos * HALF + i)
            s = tl.load(SIN + pos * HALF + i)
            ra = a * c - b * s
            rb = a * s + b * c
            if head < N_HEADS:
                tl.store(QOUT + (row * N_HEADS + head) * HD + ia, ra)
                tl.store(QOUT + (row * N_HEADS + head) * HD + ib, rb)
            else:
                kh = head - N_HEADS
                tl.store(KC + kh * stride_kc_h + kvpos * stride_kc_n + ia, ra.to(tl.float16))
                tl.store(KC + kh * stride_kc_h + kvpos * stride_kc_n + ib, rb.to(tl.float16))


@triton.jit
def _partial_head(base, bias, QN, KN, COS, SIN, QOUT, KC, VC, pos, kvpos, row, head, eps,
                  stride_kc_h, stride_kc_n, stride_vc_h, stride_vc_n, N_HEADS: tl.constexpr, N_KV: tl.constexpr,
                  HD: tl.constexpr, ROT: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr):
    """One head of a partial NEOX rope: dim j < ROT turns with its partner j +- ROT/2
    (a c - b s for the first of a pair, b c + a s for the second), dims >= ROT pass."""
    RH: tl.constexpr = ROT // 2
    j = tl.arange(0, HD)
    rot = j < ROT
    partner = tl.where(j < RH, j + RH, j - RH)
    x = tl.load(base + j)                                        # [HD]
    xp = tl.load(base + partner, mask=rot, other=0.0)            # [HD] the pair's other value (0 past ROT)
    if HAS_BIAS:
        x += tl.load(bias + j)
        xp += tl.load(bias + partner, mask=rot, other=0.0)
    if head >= N_HEADS + N_KV:                                   # value: straight into the cache
        tl.store(VC + (head - N_HEADS - N_KV) * stride_vc_h + kvpos * stride_vc_n + j, x.to(tl.float16))
    else:
        if QK_NORM:
            nw = QN if head < N_HEADS else KN
            r = tl.rsqrt(tl.sum(x * x, 0) / HD + eps)
            x = x * r * tl.load(nw + j)
            xp = xp * r * tl.load(nw + partner, mask=rot, other=0.0)
        c = tl.load(COS + pos * RH + j % RH, mask=rot, other=1.0)
        s = tl.load(SIN + pos * RH + j % RH, mask=rot, other=0.0)
        out = x * c + tl.where(j < RH, -xp, xp) * s
        if head < N_HEADS:
            tl.store(QOUT + (row * N_HEADS + head) * HD + j, out)
        else:
            tl.store(KC + (head - N_HEADS) * stride_kc_h + kvpos * stride_kc_n + j, out.to(tl.float16))


def qkv_rope(qkv: torch.Tensor, bias: torch.Tensor | None, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, pos: torch.Tensor, n_heads: int, n_kv: int, hd: int, eps: float,
             neox: bool, pdl: bool = False, rope_dim: int | None = None) -> torch.Tensor:
    """qkv: [W, (H + 2 n_kv) hd] fp32 -> roped q [W, H, hd] fp32; k, v written (fp16) into
    k_cache/v_cache [n_kv, max_len, hd] at rows pos..pos+W-1. cos/sin: [max_len, rope_dim/2];
    rope_dim (None: hd) < hd turns the first rope_dim dims only (NEOX pairs).
    pos: int32 [1] (row r at pos + r), or a row table int32 [3, R >= W] (rows.py: each row's
    position and KV base: the rows of several streams in one round)."""
    W = qkv.shape[0]
    rot = 0 if rope_dim is None or rope_dim == hd else rope_dim
    if rot and (not neox or rot % 2 or rot > hd or cos.shape[-1] != rot // 2):
        raise ValueError(f"a partial rope of {rope_dim} of {hd} dims needs NEOX pairs and tables of {rot // 2}")
    q = torch.empty(W, n_heads, hd, device=qkv.device, dtype=torch.float32)
    dummy = qkv
    _qkv_rope_kernel[(W, n_heads + 2 * n_kv)](
        qkv, bias if bias is not None else dummy, q_norm if q_norm is not None else dummy,
        k_norm if k_norm is not None else dummy, cos, sin, q, k_cache, v_cache, pos, eps,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        N_HEADS=n_heads, N_KV=n_kv, HD=hd, HAS_BIAS=bias is not None, QK_NORM=q_norm is not None, NEOX=neox,
        ROT=rot, ROWS=rows_stride(pos), **pdl_kwargs(pdl, qkv.device))
    return q
