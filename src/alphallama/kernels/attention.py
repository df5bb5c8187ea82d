"""Decode/verify attention over the KV cache, split over the KV length.

W query rows at positions pos..pos+W-1 attend causally to keys 0..pos+row. One program
per (row, kv head, split): it loads the row's `group` query heads that share the kv
head (padded to 16 for tl.dot) and runs an online softmax over its split's keys. A
combine kernel merges the splits in order.

Row invariance (exact mode): a program handles exactly one query row, the split
boundaries sit at fixed absolute positions (multiples of SPLIT), and tile shapes do not
depend on W; so a row's result depends only on its own query and its own keys, never
on the round's width or the row's column.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT = 512      # keys per split: the split depends on the length only
BLOCK_N = 64     # keys per inner tile


@triton.jit
def _attn_split_kernel(Q, K, V, O, M, L, pos_ptr, scale,
                       stride_qw, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn,
                       stride_ow, stride_oh, stride_os, n_splits: tl.constexpr,
                       N_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                       SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(pos_ptr) + row + 1          # keys this row may see
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    o_ptrs = O + row * stride_ow + heads[:, None] * stride_oh + s * stride_os + d[None, :]
    ml_off = (row * N_HEADS + heads) * n_splits + s            # M, L: [W, H, S] contiguous
    start = s * SPLIT
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HD], tl.float32)
    if start < length:
        q = tl.load(Q + row * stride_qw + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        q = (q * scale).to(tl.float16)                                      # [G_PAD, HD]
        end = tl.minimum(start + SPLIT, length)
        # a fixed trip count (tiles past `end` are fully masked and change nothing):
        # the loop shape is the same for every row, width and position
        for t in range(0, SPLIT // BLOCK_N):
            n = start + t * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < end
            k = tl.load(K + kvh * stride_kh + n[:, None] * stride_kn + d[None, :], mask=nmask[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k))                                     # [G_PAD, BLOCK_N]
            sc = tl.where(nmask[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kvh * stride_vh + n[:, None] * stride_vn + d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            m_i = m_new
    tl.store(o_ptrs, acc, mask=gmask[:, None])
    tl.store(M + ml_off, m_i, mask=gmask)
    tl.store(L + ml_off, l_i, mask=gmask)


@triton.jit
def _attn_combine_kernel(O, M, L, OUT, n_splits: tl.constexpr, stride_ow, stride_oh, stride_os, stride_outw,
                         HD: tl.constexpr, N_HEADS: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HD)
    base = (row * N_HEADS + h) * n_splits
    m = tl.load(M + base)
    for s in range(1, n_splits):
        m = tl.maximum(m, tl.load(M + base + s))
    acc = tl.zeros([HD], tl.float32)
    l_sum = 0.0
    for s in range(0, n_splits):                  # fixed order: invariant
        w = tl.exp(tl.load(M + base + s) - m)
        l_sum += tl.load(L + base + s) * w
        acc += tl.load(O + row * stride_ow + h * stride_oh + s * stride_os + d) * w
    tl.store(OUT + row * stride_outw + h * HD + d, (acc / l_sum).to(OUT.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     max_len: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [W, n_heads, hd] (fp32 or fp16); k_cache/v_cache: [n_kv, max_len, hd] fp16 holding
    the rows up to pos+W-1; pos: int32 [1] on the device (a graph input).
    -> [W, n_heads * hd] in out_dtype. The grid covers max_len, so it is the same for every
    position (capturable); splits past a row's length exit at once."""
    W, n_heads, hd = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    n_splits = triton.cdiv(max_len, SPLIT)
    o = torch.empty(W, n_heads, n_splits, hd, device=q.device, dtype=torch.float32)   # [W, H, S, hd]
    m = torch.empty(W, n_heads, n_splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    out = torch.empty(W, n_heads * hd, device=q.device, dtype=out_dtype)
    _attn_split_kernel[(W, n_kv, n_splits)](
        q, k_cache, v_cache, o, m, l, pos, hd ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        o.stride(0), o.stride(1), o.stride(2), n_splits,
        N_HEADS=n_heads, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HD=hd, SPLIT=SPLIT, BLOCK_N=BLOCK_N)
    _attn_combine_kernel[(W, n_heads)](o, m, l, out, n_splits, o.stride(0), o.stride(1), o.stride(2),
                                       out.stride(0), HD=hd, N_HEADS=n_heads)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int) -> torch.Tensor:
    """Plain-torch reference (float64): same contract as decode_attention."""
    W, n_heads, hd = q.shape
    group = n_heads // k_cache.shape[0]
    out = []
    for r in range(W):
        L = pos + r + 1
        k = k_cache[:, :L].double().repeat_interleave(group, 0)             # [H, L, hd]
        v = v_cache[:, :L].double().repeat_interleave(group, 0)
        p = torch.softmax((q[r].double()[:, None, :] @ k.transpose(1, 2)) / hd ** 0.5, -1)   # [H, 1, L]
        out.append((p @ v).reshape(-1))
    return torch.stack(out).float()
