"""The attention's input: bias, q/k RMSNorm, RoPE and the KV-cache write in one launch
(one program per row and head)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_kwargs, pdl_start


@triton.jit
def _qkv_rope_kernel(QKV, BIAS, QN, KN, COS, SIN, QOUT, KC, VC, pos_ptr, eps,
                     stride_kc_h, stride_kc_n, stride_vc_h, stride_vc_n,
                     N_HEADS: tl.constexpr, N_KV: tl.constexpr, HD: tl.constexpr,
                     HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, NEOX: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (row, head) over the fused [W, (H + 2*n_kv) * hd] projection."""
    pdl_start(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)                     # 0..H-1 query, H..H+n_kv-1 key, then value
    pos = tl.load(pos_ptr) + row
    QKV_W: tl.constexpr = (N_HEADS + 2 * N_KV) * HD
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
        tl.store(VC + vh * stride_vc_h + pos * stride_vc_n + ia, a.to(tl.float16))
        tl.store(VC + vh * stride_vc_h + pos * stride_vc_n + ib, b.to(tl.float16))
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
            tl.store(KC + kh * stride_kc_h + pos * stride_kc_n + ia, ra.to(tl.float16))
            tl.store(KC + kh * stride_kc_h + pos * stride_kc_n + ib, rb.to(tl.float16))


def qkv_rope(qkv: torch.Tensor, bias: torch.Tensor | None, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, pos: torch.Tensor, n_heads: int, n_kv: int, hd: int, eps: float,
             neox: bool, pdl: bool = False) -> torch.Tensor:
    """qkv: [W, (H + 2 n_kv) hd] fp32 -> roped q [W, H, hd] fp32; k, v written (fp16) into
    k_cache/v_cache [n_kv, max_len, hd] at rows pos..pos+W-1. cos/sin: [max_len, hd/2]."""
    W = qkv.shape[0]
    q = torch.empty(W, n_heads, hd, device=qkv.device, dtype=torch.float32)
    dummy = qkv
    _qkv_rope_kernel[(W, n_heads + 2 * n_kv)](
        qkv, bias if bias is not None else dummy, q_norm if q_norm is not None else dummy,
        k_norm if k_norm is not None else dummy, cos, sin, q, k_cache, v_cache, pos, eps,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        N_HEADS=n_heads, N_KV=n_kv, HD=hd, HAS_BIAS=bias is not None, QK_NORM=q_norm is not None, NEOX=neox,
        **pdl_kwargs(pdl, qkv.device))
    return q
