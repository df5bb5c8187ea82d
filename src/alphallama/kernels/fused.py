"""Small fused kernels of the decode round, each beside its plain-torch reference.

One program per row (or per row and head): a row's arithmetic never depends on the
other rows or the width, which is what exact mode needs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# -- residual add + RMSNorm -------------------------------------------------------------
@triton.jit
def _add_rmsnorm_kernel(X, Y, Wt, H, D: tl.constexpr, BLOCK: tl.constexpr, eps, HAS_Y: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(X + row * D + d, mask=mask, other=0.0)
    if HAS_Y:
        x += tl.load(Y + row * D + d, mask=mask, other=0.0)
        tl.store(X + row * D + d, x, mask=mask)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    tl.store(H + row * D + d, (x * r * tl.load(Wt + d, mask=mask, other=0.0)).to(H.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x += y (in place, when y is given); returns rmsnorm(x) * w in out_dtype (bf16 on
    the GPU: the quantized GEMV reads half the activation bytes). x, y: [W, D] fp32."""
    W, D = x.shape
    out = torch.empty(W, D, device=x.device, dtype=out_dtype)
    _add_rmsnorm_kernel[(W,)](x, y if y is not None else x, w, out, D, triton.next_power_of_2(D), eps,
                              HAS_Y=y is not None)
    return out


def add_rmsnorm_ref(x, y, w, eps):
    x = x + y if y is not None else x
    return x, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# -- SiLU(gate) * up ----------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(GU, OUT, F: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    f = blk * BLOCK + tl.arange(0, BLOCK)
    mask = f < F
    g = tl.load(GU + row * 2 * F + f, mask=mask, other=0.0)
    u = tl.load(GU + row * 2 * F + F + f, mask=mask, other=0.0)
    tl.store(OUT + row * F + f, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gu: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gu: [W, 2F] (gate then up) -> silu(gate) * up [W, F] in out_dtype."""
    W, F2 = gu.shape
    F = F2 // 2
    out = torch.empty(W, F, device=gu.device, dtype=out_dtype)
    BLOCK = 1024
    _silu_mul_kernel[(W, triton.cdiv(F, BLOCK))](gu, out, F, BLOCK)
    return out


def silu_mul_ref(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


# -- bias, q/k RMSNorm, RoPE, KV-cache write ------------------------------------------------
@triton.jit
def _qkv_rope_kernel(QKV, BIAS, QN, KN, COS, SIN, QOUT, KC, VC, pos_ptr, eps,
                     stride_kc_h, stride_kc_n, stride_vc_h, stride_vc_n,
                     N_HEADS: tl.constexpr, N_KV: tl.constexpr, HD: tl.constexpr,
                     HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, NEOX: tl.constexpr):
    """One program per (row, head) over the fused [W, (H + 2*n_kv) * hd] projection."""
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
             neox: bool) -> torch.Tensor:
    """qkv: [W, (H + 2 n_kv) hd] fp32 -> roped q [W, H, hd] fp32; k, v written (fp16) into
    k_cache/v_cache [n_kv, max_len, hd] at rows pos..pos+W-1. cos/sin: [max_len, hd/2]."""
    W = qkv.shape[0]
    q = torch.empty(W, n_heads, hd, device=qkv.device, dtype=torch.float32)
    dummy = qkv
    _qkv_rope_kernel[(W, n_heads + 2 * n_kv)](
        qkv, bias if bias is not None else dummy, q_norm if q_norm is not None else dummy,
        k_norm if k_norm is not None else dummy, cos, sin, q, k_cache, v_cache, pos, eps,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        N_HEADS=n_heads, N_KV=n_kv, HD=hd, HAS_BIAS=bias is not None, QK_NORM=q_norm is not None, NEOX=neox)
    return q
