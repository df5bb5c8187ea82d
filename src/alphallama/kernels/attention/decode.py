"""Decode/verify attention over the KV cache, split over the KV length.

W query rows at positions pos..pos+W-1 attend causally to keys 0..pos+row. One program
per (row, kv head, split): it loads the row's `group` query heads that share the kv
head (padded to 16 for tl.dot), so each K/V tile is read once for the whole group, and
runs an online softmax over its split's keys. A combine kernel merges the splits.

The split size is a function of the row's own length L = pos + row + 1 only:
split(L) = BLOCK_N * cdiv(L, BLOCK_N * MAX_SPLITS), the smallest whole number of tiles
that needs at most MAX_SPLITS splits. A row has cdiv(L, BLOCK_N) live splits up to
BLOCK_N * MAX_SPLITS keys (16 at depth 512), more than MAX_SPLITS / 2 beyond: a short
context spreads over many SMs instead of walking its keys in a few programs, and a long
one keeps each program's serial walk at split(L) / BLOCK_N tiles. (A power-of-two split
would fall back to about MAX_SPLITS / 2 live splits at every doubling; this rule falls to
MAX_SPLITS * (T - 1) / T at its T-th step.)
The fp32 partials cost group / split(L) of the K/V bytes (at most 1 / 8 for 8 query
heads per kv head past depth 2048), written and read back through L2.
The grid is fixed, (W, n_kv, MAX_SPLITS), the same at every position (CUDA-graph
capturable); programs past a row's live splits exit at once and write nothing.

Row invariance (exact mode): a program handles exactly one query row; its split
boundaries, tile boundaries and the combine's live set are functions of L alone; tile
shapes and the combine's reduction tree are constexprs (independent of W and max_len).
So a row's bits depend only on its query, its keys 0..L-1 and L: never on the round's
width, the row's column or the cache's capacity.

Sliding window (WINDOW > 0, gemma3's SWA layers): a row of length L sees only the keys
lo = max(0, L - WINDOW) .. L-1. The splits then cover those n = L - lo keys as above, from
lo: split(n), boundaries lo + s * split(n), the combine's live set cdiv(n, split(n)): still
functions of the row's own L (and the layer's window, a constexpr) alone. WINDOW = 0 is
the code without a window (the same integer arithmetic, lo = 0: the same bits).

Attention sinks (SINKS, gpt-oss): one more logit per query head, sinks[h], with no value,
joins the softmax's denominator. The splits do not see it; the combine takes it as one
more term: m = max(m_s..., sink), out = sum_s w_s o_s / (sum_s w_s l_s + exp(sink - m)),
w_s = exp(m_s - m). A constant per head: a row's bits still depend on its own L alone.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..pdl import pdl_kwargs, pdl_start, pdl_trigger, pdl_wait
from ..gemv.q8k_act import Q8K, emit_q8k, new_q8k
from ..gemv.qmatvec_i8 import emit_q8, new_q8
from .rows import rows_stride

BLOCK_N = 32       # keys per tile, and the smallest split: 16 splits at depth 512. 64 is no faster at W = 1
                   # and within noise at W = 8 (docs/decisions/launch-cuts-kept.md)
MAX_SPLITS = 64    # live splits per (row, kv head) at most: with 4 kv heads still 256 programs (~2 an SM)
NUM_WARPS = 4
COMBINE_WARPS = 4  # the combine (one program per row and query head)


class Tiles(NamedTuple):
    """(keys a tile, splits at most): a float order of a row's length alone (tests pass small ones)."""
    block_n: int = BLOCK_N
    max_splits: int = MAX_SPLITS


TILES = Tiles()


def split_size(length: int, tiles: Tiles = TILES) -> int:
    """Keys per split for a row that sees `length` keys: the kernels' rule, in Python."""
    return tiles.block_n * triton.cdiv(length, tiles.block_n * tiles.max_splits)


def live_splits(length: int, tiles: Tiles = TILES) -> int:
    return triton.cdiv(length, split_size(length, tiles))


@triton.jit
def _split_size(length, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    return BLOCK_N * tl.cdiv(length, BLOCK_N * MAX_SPLITS)


@triton.jit
def _span(length, WINDOW: tl.constexpr):
    """(first key, keys) a row of `length` keys attends to: all, or its last WINDOW."""
    if WINDOW > 0:
        lo = tl.maximum(length - WINDOW, 0)
    else:
        lo = length * 0
    return lo, length - lo


@triton.jit
def _kv(K, V, kvh, n, d, mask, stride_kh, stride_kn, stride_vh, stride_vn):
    """The key and value rows n [BLOCK_N] of kv head kvh where mask, zeros elsewhere: [BLOCK_N, HD] each."""
    k = tl.load(K + kvh * stride_kh + n[:, None] * stride_kn + d[None, :], mask=mask[:, None], other=0.0)
    v = tl.load(V + kvh * stride_vh + n[:, None] * stride_vn + d[None, :], mask=mask[:, None], other=0.0)
    return k, v


@triton.jit
def _tile(q, k, v, nmask, m_i, l_i, acc):
    """One tile of keys into the online softmax: (m_i, l_i, acc) updated."""
    sc = tl.dot(q, tl.trans(k))                                     # [G_PAD, BLOCK_N]
    sc = tl.where(nmask[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])                                 # masked keys: 0
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)        # [G_PAD, HD]; the add folds into the MMA
    return m_new, l_i, acc


@triton.jit
def _split_partials(Q, K, V, O, M, L, row, kvh, s, length, first, scale,
                    stride_qw, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn, stride_ow, stride_oh, stride_os,
                    N_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                    BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, EARLY: tl.constexpr = False,
                    PDL: tl.constexpr = False, WINDOW: tl.constexpr = 0):
    """Split s of (row, kv head): the partials (O, M, L) of the group's query heads; a dead
    split writes nothing. l_i's update is an explicit fma, what fp fusion made of
    `l_i * alpha + sum` anyway: nothing contractible is left, so the bits are the same in
    a launch compiled without fusion (the fused q8 launch).
    EARLY: the first tile's keys and values below the round's first position are loaded
    before the PDL wait (PDL: the caller triggered and left the wait to this function),
    the round's own rows, which qkv_rope has just written, after it. The same values
    either way: the same bits. Valid only where no kernel of the same PDL chain wrote
    those rows: with every kernel triggering at its top, a kernel's pre-wait code may
    run while kernels several launches back still run. A decode round qualifies (a
    layer's cache rows below pos come from earlier rounds, finished before its graph
    launched); an MTP chain, whose later steps read rows its earlier steps wrote, does not.
    WINDOW > 0: the splits cover the row's last WINDOW keys only (the module docstring).
    first: the position of the round's first row of this row's stream (its rows below
    were written by earlier rounds); K, V: this row's sequence (its KV base applied)."""
    lo, n_keys = _span(length, WINDOW)
    split = _split_size(n_keys, BLOCK_N, MAX_SPLITS)
    start = lo + s * split
    if start < length:                            # a live split; the others exit at once
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        end = tl.minimum(start + split, length)
        if EARLY:
            n = start + tl.arange(0, BLOCK_N)
            k_old, v_old = _kv(K, V, kvh, n, d, (n < first) & (n < end),   # written before this round
                               stride_kh, stride_kn, stride_vh, stride_vn)
            pdl_wait(PDL)
        q = tl.load(Q + row * stride_qw + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        q = (q * scale).to(tl.float16)                                      # [G_PAD, HD]
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD], tl.float32)
        # A while loop: its trip count, split / BLOCK_N, is known only on the device, and
        # the interpreter cannot take a run-time range() bound (numpy >= 2.4). Every tile
        # holds at least one live key, so m_i is finite after the first.
        n0 = start
        if EARLY:                                 # the first tile: its old rows loaded above, the new ones now
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < end
            new = nmask & (n >= first)
            k, v = _kv(K, V, kvh, n, d, new, stride_kh, stride_kn, stride_vh, stride_vn)
            k = tl.where(new[:, None], k, k_old)
            v = tl.where(new[:, None], v, v_old)
            m_i, l_i, acc = _tile(q, k, v, nmask, m_i, l_i, acc)
            n0 += BLOCK_N
        while n0 < end:
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            # K and V issued together: two tiles in flight per program
            k, v = _kv(K, V, kvh, n, d, nmask, stride_kh, stride_kn, stride_vh, stride_vn)
            m_i, l_i, acc = _tile(q, k, v, nmask, m_i, l_i, acc)
            n0 += BLOCK_N
        ml_off = (row * N_HEADS + heads) * MAX_SPLITS + s                  # M, L: [W, H, MAX_SPLITS]
        tl.store(O + row * stride_ow + heads[:, None] * stride_oh + s * stride_os + d[None, :], acc,
                 mask=gmask[:, None])
        tl.store(M + ml_off, m_i, mask=gmask)
        tl.store(L + ml_off, l_i, mask=gmask)
    elif EARLY:
        pdl_wait(PDL)                             # a dead split waits too: every program of the grid does


@triton.jit
def _combine_head(O, M, L, OUT, row, h, length, stride_ow, stride_oh, stride_os, stride_outw,
                  N_HEADS: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
                  XP1, XS1, NQ: tl.constexpr, SLOT1: tl.constexpr, V1: tl.constexpr, BITS1: tl.constexpr,
                  WINDOW: tl.constexpr = 0, SINK=None, SINKS: tl.constexpr = False):
    """One (row, head): its live splits in one [MAX_SPLITS, HD] tile. Dead splits were never
    written; they are masked to exact zeros, so the fixed reduction tree (a constexpr shape)
    adds exactly the live partials, and which splits are live depends on L alone.
    SINKS: the head's sink logit SINK[h] joins the maximum and the denominator."""
    n_keys = _span(length, WINDOW)[1]
    n_live = tl.cdiv(n_keys, _split_size(n_keys, BLOCK_N, MAX_SPLITS))
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, HD)
    live = s < n_live
    ml_off = (row * N_HEADS + h) * MAX_SPLITS + s
    m_s = tl.load(M + ml_off, mask=live, other=float("-inf"))   # [MAX_SPLITS]
    l_s = tl.load(L + ml_off, mask=live, other=0.0)
    o_s = tl.load(O + row * stride_ow + h * stride_oh + s[:, None] * stride_os + d[None, :],
                  mask=live[:, None], other=0.0)                                      # [MAX_SPLITS, HD]
    m = tl.max(m_s, 0)
    if SINKS:
        sink = tl.load(SINK + h)
        m = tl.maximum(m, sink)
    w = tl.where(live, tl.exp(m_s - m), 0.0)
    l_sum = tl.sum(l_s * w, 0)
    if SINKS:
        l_sum += tl.exp(sink - m)
    acc = tl.sum(o_s * w[:, None], 0)                                                 # [HD]
    out = (acc / l_sum).to(OUT.dtype.element_ty)
    tl.store(OUT + row * stride_outw + h * HD + d, out)
    if NQ > 0:                       # the o projection's int8 activations (kernels/norm/rmsnorm.py)
        emit_q8(out.to(tl.float32), h * HD, row.to(tl.int64), XP1, XS1, N_HEADS * HD, SLOT1, V1, BITS1)
    return out


@triton.jit
def _attn_split_kernel(Q, K, V, O, M, L, pos_ptr, scale,
                       stride_qw, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn,
                       stride_ow, stride_oh, stride_os,
                       N_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                       BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, PDL: tl.constexpr = False,
                       EARLY: tl.constexpr = False, WINDOW: tl.constexpr = 0, ROWS: tl.constexpr = 0):
    """EARLY: the first tile's old keys and values before the PDL wait (_split_partials);
    pos is a graph input, written before the round, so it may be read before the wait.
    ROWS > 0: pos_ptr is a row table [3, ROWS] (rows.py): row r's position, KV base and its
    stream's first position in the round; its keys are the cache rows from its base on."""
    if EARLY:
        pdl_trigger(PDL)
    else:
        pdl_start(PDL)
    row = tl.program_id(0)
    if ROWS:
        length = tl.load(pos_ptr + row) + 1
        base = tl.load(pos_ptr + ROWS + row).to(tl.int64)
        K += base * stride_kn
        V += base * stride_vn
        first = tl.load(pos_ptr + 2 * ROWS + row)
    else:
        length = tl.load(pos_ptr) + row + 1      # keys this row may see
        first = length - row - 1                 # the round's first position
    _split_partials(Q, K, V, O, M, L, row, tl.program_id(1), tl.program_id(2), length, first, scale,
                    stride_qw, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn, stride_ow, stride_oh, stride_os,
                    N_HEADS, GROUP, G_PAD, HD, BLOCK_N, MAX_SPLITS, EARLY, PDL, WINDOW)


@triton.jit
def _attn_combine_kernel(O, M, L, OUT, pos_ptr, stride_ow, stride_oh, stride_os, stride_outw,
                         N_HEADS: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
                         XP1=None, XS1=None, NQ: tl.constexpr = 0, SLOT1: tl.constexpr = 32, V1: tl.constexpr = 4,
                         BITS1: tl.constexpr = 4, PDL: tl.constexpr = False, Q8K: tl.constexpr = False,
                         XF=None, XK=None, DXK=None, XL=None, WINDOW: tl.constexpr = 0, ROWS: tl.constexpr = 0,
                         SINK=None, SINKS: tl.constexpr = False):
    """Q8K: a program combines the two heads of one 256-value super-block (HD 128), each as
    alone (the same ops: the same bits), and emits their q8_K activations (q8k_act.emit_q8k).
    ROWS > 0: pos_ptr is a row table (rows.py), the row's length its position + 1.
    SINKS: SINK [N_HEADS] fp32, each head's sink logit (_combine_head)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    if ROWS:
        length = tl.load(pos_ptr + row) + 1
    else:
        length = tl.load(pos_ptr) + row + 1
    if Q8K:
        tl.static_assert(HD == 128, "q8_K activations from the combine: two heads of 128 a super-block")
        h0 = tl.program_id(1) * 2
        a = _combine_head(O, M, L, OUT, row, h0, length, stride_ow, stride_oh, stride_os, stride_outw,
                          N_HEADS, HD, BLOCK_N, MAX_SPLITS, XP1, XS1, 0, SLOT1, V1, BITS1, WINDOW, SINK, SINKS)
        b = _combine_head(O, M, L, OUT, row, h0 + 1, length, stride_ow, stride_oh, stride_os, stride_outw,
                          N_HEADS, HD, BLOCK_N, MAX_SPLITS, XP1, XS1, 0, SLOT1, V1, BITS1, WINDOW, SINK, SINKS)
        ab = tl.reshape(tl.permute(tl.join(a, b), (1, 0)), (2 * HD,)).to(tl.float32)   # head h0, then h0 + 1
        emit_q8k(ab, h0 * HD, row.to(tl.int64), XF, XK, DXK, XL, N_HEADS * HD)
    else:
        _combine_head(O, M, L, OUT, row, tl.program_id(1), length, stride_ow, stride_oh, stride_os, stride_outw,
                      N_HEADS, HD, BLOCK_N, MAX_SPLITS, XP1, XS1, NQ, SLOT1, V1, BITS1, WINDOW, SINK, SINKS)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     max_len: int, out_dtype: torch.dtype = torch.float32, pdl: bool = False,
                     early: bool = False, tiles: Tiles = TILES, scale: float | None = None,
                     window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [W, n_heads, hd] (fp32 or fp16); k_cache/v_cache: [n_kv, max_len, hd] fp16 holding
    the rows up to pos+W-1; pos: int32 [1] on the device (a graph input), or a row table
    int32 [3, R >= W] (rows.py: the rows of several streams, each its own position and KV base).
    -> [W, n_heads * hd] in out_dtype. max_len (the cache's capacity) is accepted for the
    callers but unused: the grid is (W, n_kv, MAX_SPLITS) at every position and capacity.
    Two launches: split, combine. early: the split launch loads the rows below pos before
    its PDL wait (_split_partials says when that is valid); the same bits either way.
    tiles: (BLOCK_N, MAX_SPLITS). scale: of q.k (None: 1/sqrt(hd)); window > 0: a row of
    length L sees keys max(0, L - window) .. L-1 only (sliding-window layers). sinks [n_heads]
    fp32: each head's sink logit in the softmax's denominator (gpt-oss)."""
    return _attention(q, k_cache, v_cache, pos, out_dtype, (), pdl, early, tiles, scale, window, sinks)[0]


def decode_attention_q8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                        out_dtype: torch.dtype, orders: tuple, pdl: bool = False,
                        early: bool = False, tiles: Tiles = TILES, scale: float | None = None,
                        window: int = 0, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """decode_attention, and the int8 activations of its output in (at most) one lane
    order, made by the combine (bit for bit prepare_i8 of the output; the launch that
    combines is compiled without fp fusion, as the quantization needs). early: as in
    decode_attention, and so are scale, window and sinks. -> (out, {order: q8})."""
    return _attention(q, k_cache, v_cache, pos, out_dtype, tuple(orders), pdl, early, tiles, scale, window, sinks)


def _attention(q, k_cache, v_cache, pos, out_dtype, orders: tuple, pdl: bool,
               early: bool = False, tiles: Tiles = TILES, scale: float | None = None,
               window: int = 0, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    BLOCK_N, MAX_SPLITS = tiles
    W, n_heads, hd = q.shape
    if orders and (hd % 32 or len(orders) > 1):
        raise ValueError(f"int8 attention output needs head_dim % 32 == 0 and one lane order, got {hd}, {orders}")
    if Q8K in orders and (hd != 128 or n_heads % 2):
        raise ValueError(f"q8_K attention output needs head_dim 128 and whole head pairs, got {n_heads} x {hd}")
    qargs, heads = {}, n_heads
    q8: dict = {}
    for order in orders:
        if order == Q8K:            # two heads a combine program: one 256-value super-block
            q8[order] = xf, xs, dxs, xl = new_q8k(W, n_heads * hd, q.device)
            qargs = {"Q8K": True, "XF": xf.view(torch.int8), "XK": xs, "DXK": dxs, "XL": xl.view(torch.int8),
                     "enable_fp_fusion": False}
            heads = n_heads // 2
            continue
        q8[order] = xp, xsd = new_q8(W, n_heads * hd, order, q.device)
        qargs = {"XP1": xp.view(torch.int8), "XS1": xsd, "NQ": 1, "SLOT1": order[0], "V1": order[1],
                 "BITS1": order[2], "enable_fp_fusion": False}
    if sinks is not None:
        if tuple(sinks.shape) != (n_heads,) or sinks.dtype != torch.float32:
            raise ValueError(f"sinks must be fp32 [{n_heads}], got {sinks.dtype} {tuple(sinks.shape)}")
        qargs = qargs | {"SINK": sinks, "SINKS": True}
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    o = torch.empty(W, n_heads, MAX_SPLITS, hd, device=q.device, dtype=torch.float32)   # [W, H, S, hd]
    m = torch.empty(W, n_heads, MAX_SPLITS, device=q.device, dtype=torch.float32)       # [W, H, S]
    l = torch.empty_like(m)
    out = torch.empty(W, n_heads * hd, device=q.device, dtype=out_dtype)
    split_args = (q, k_cache, v_cache, o, m, l)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               o.stride(0), o.stride(1), o.stride(2))
    split_const = dict(N_HEADS=n_heads, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HD=hd,
                       BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS, num_warps=NUM_WARPS)
    # a split s is live where s * split < keys <= the cache's rows (split >= BLOCK_N): the
    # programs past cdiv(rows, BLOCK_N) could only exit, so short caches launch fewer
    splits = min(MAX_SPLITS, triton.cdiv(k_cache.shape[1], BLOCK_N))
    _attn_split_kernel[(W, n_kv, splits)](*split_args, pos, hd ** -0.5 if scale is None else scale, *strides,
                                              **split_const, EARLY=early, WINDOW=window, ROWS=rows_stride(pos),
                                              **pdl_kwargs(pdl, q.device))
    _attn_combine_kernel[(W, heads)](o, m, l, out, pos, o.stride(0), o.stride(1), o.stride(2), out.stride(0),
                                       N_HEADS=n_heads, HD=hd, BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS,
                                       num_warps=COMBINE_WARPS, WINDOW=window, ROWS=rows_stride(pos), **qargs,
                                       **pdl_kwargs(pdl, q.device))
    return out, q8


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int,
                         scale: float | None = None, window: int = 0,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference (float64): same contract as decode_attention."""
    W, n_heads, hd = q.shape
    group = n_heads // k_cache.shape[0]
    out = []
    for r in range(W):
        L = pos + r + 1
        lo = max(0, L - window) if window else 0
        k = k_cache[:, lo:L].double().repeat_interleave(group, 0)           # [H, L - lo, hd]
        v = v_cache[:, lo:L].double().repeat_interleave(group, 0)
        sc = q[r].double()[:, None, :] @ k.transpose(1, 2)                   # [H, 1, L - lo]
        sc = sc / hd ** 0.5 if scale is None else sc * scale
        if sinks is not None:                        # one more logit a head, no value
            sc = torch.cat([sc, sinks.double()[:, None, None]], -1)          # [H, 1, L - lo + 1]
            v = torch.cat([v, v.new_zeros(n_heads, 1, hd)], 1)
        p = torch.softmax(sc, -1)
        out.append((p @ v).reshape(-1))
    return torch.stack(out).float()
