"""qgemv_mma_k: the decode GEMV with its integer sums on the tensor cores (Q4_K, on q8_K
activations; engine.gemv_mma, off: W = 1 loses to dp4a).

Why: qgemv_i8 multiplies codes by int8 activations with dp4a, one instruction per 4 codes
per x row, so at W = 8 a Q4_K weight costs 2 dp4a a code (most of the GPU's integer issue
rate at the copy rate): a verify round cannot cost what a W = 1 round does. One mma.sync
m16n8k32 (s8 x s8 -> s32) is one 32-value slot of 16 weight rows against 8 x rows.

Triton's tl.dot did not serve (its int8 operands go through shared memory every step;
docs/decisions/lost-experiments.md), so the mma is inline PTX, and each thread's fragment
registers are the elements of one row of a [threads, 4] tensor: Triton lays a tensor
loaded with contiguous offsets of at most 16 bytes a row one row a thread, rows in thread
order (threadsPerWarp [32, 1]; checked in the TTGIR by the tests; at 32 bytes a row it
splits a row over 2 threads, which bench/gpu_mma_probe.py showed gives wrong sums). So
the operands come straight from 16-byte loads of planes laid out in fragment order:

    weights (mma_planes): per 16-row group, per step of 2 slots, per lane 4g + t:
        qs word t of rows g and g + 8 of each slot   (the mma's a0 | a1 after & 0x0F0F0F0F,
                                                      a2 | a3 after >> 4: k-groups t, 4 + t)
    x (emit_q8k): per 8-column block, per step, per lane 4g + t:
        column g's lo and hi activation words t of each slot (prepare_i8's lane order, so
        byte j of both pairs with field 2j / 2j + 1 of qs word t)

c0..c3 are the exact isums of (row g, column 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
The activations carry one scale a 256-value super-block (prepare_q8k; llama.cpp's q8_K
scales), so a super-block's slots fold into exact int32 sums (sc * isum, m * xsum) and its
float work happens once, in k order within each run of K; the runs are added in one
written-out tree (tree_sum). No sum depends on the column or W: a row's bits are the same at
every W, by construction, and qgemv_q8k (dp4a) reproduces them for narrow rounds.

Under the Triton interpreter (CPU tests) the mma is emulated with tensor ops over the
same fragments (EMULATE), so the planes, the k pairing and the float part are tested on
the CPU; the PTX itself only on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mma_layout import COLS, ROWS, mma_shape_ok
from .q8k_act import prepare_q8k
from .tree import tree_sum
from .qmatvec_i8 import dp4a
from ..pdl import pdl_kwargs, pdl_trigger, pdl_wait
from ..formats.qweight import QuantWeight, check_gemv_args


@triton.jit
def _mma_q4(w, b):
    """w, b [T, 4] int32, a step's 2 slots: (qs word t of row g, of row g + 8) and (b0, b1)
    -> (c0 c1, c2 c3) [T, 4] each: slot j's pair at elements 2 j, 2 j + 1."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a0, a1, a2, a3;\n"
        "and.b32 a0, $4, 0x0F0F0F0F;\n"
        "and.b32 a1, $5, 0x0F0F0F0F;\n"
        "shr.u32 a2, $4, 4;\n"
        "and.b32 a2, a2, 0x0F0F0F0F;\n"
        "shr.u32 a3, $5, 4;\n"
        "and.b32 a3, a3, 0x0F0F0F0F;\n"
        "mov.b32 $0, 0;\n mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;\n"
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$6, $7}, "
        "{$0, $1, $2, $3}; }",
        "=r,=r,=r,=r,r,r,r,r", [w, b], dtype=(tl.int32, tl.int32), is_pure=True, pack=2)


@triton.jit
def _mma_q4_emulated(w, b, WARPS: tl.constexpr):
    """_mma_q4 with tensor ops across the threads' rows (the Triton interpreter)."""
    Tn: tl.constexpr = 32 * WARPS
    w6 = tl.reshape(w, (WARPS, 8, 4, 2, 2))                            # [W, g, t, j, h]
    a = tl.join(w6 & 0x0F0F0F0F, (w6 >> 4) & 0x0F0F0F0F)              # [W, g, t, j, h, e]: k-group 4 e + t
    a = tl.reshape(tl.permute(a, (0, 3, 4, 1, 5, 2)), (WARPS, 2, 16, 8))   # [W, j, row 8 h + g, k-group]
    b5 = tl.reshape(b, (WARPS, 8, 4, 2, 2))                            # [W, column g, t, j, e]
    bb = tl.reshape(tl.permute(b5, (0, 3, 1, 4, 2)), (WARPS, 2, 8, 8))     # [W, j, column, k-group]
    prod = dp4a(a[:, :, :, None, :], bb[:, :, None, :, :], 0, False)  # [W, j, 16, 8, 8]
    isum = tl.sum(prod, axis=4)                                        # [W, j, row, column]
    isum = tl.reshape(isum, (WARPS, 2, 2, 8, 4, 2))                    # [W, j, h, g, t, column bit]
    c = tl.permute(isum, (0, 3, 4, 1, 5, 2))                           # [W, g, t, j, cb, h]
    c_lo, c_hi = tl.split(c)
    return tl.reshape(c_lo, (Tn, 4)), tl.reshape(c_hi, (Tn, 4))


@triton.jit
def _isums(w, b, WARPS: tl.constexpr, EMULATE: tl.constexpr):
    if EMULATE:
        return _mma_q4_emulated(w, b, WARPS)
    return _mma_q4(w, b)


@triton.jit
def _warp_place(W, N, WARPS: tl.constexpr, KW: tl.constexpr, GR: tl.constexpr = 1, SUB: tl.constexpr = 0):
    """A program's place for every kernel here: (its 8-column block cb, each thread's lane
    4g + t as lane, g, t [T, 1], the warp's 16-row group grp [T, 1] int64 (past N: clamped,
    recomputed, not stored), rows_ok [T, 1]: the group lies inside N, the warp's run [T, 1]).
    A program holds WARPS / KW row-group slots of KW warps each; warp w of a slot takes run
    w: super-blocks w, w + KW, w + 2 KW, .. (interleaved, so that qgemv_q8k's step of KW runs
    is KW adjacent super-blocks; _runs_sum adds the runs at the end). A slot is GR adjacent
    16-row groups (qgemv_mma_k's GR: one activation fetch for both); SUB picks one."""
    Tn: tl.constexpr = 32 * WARPS
    n_cb = tl.cdiv(W, 8)
    i = tl.arange(0, Tn)[:, None]                                      # [T, 1]: the thread
    lane = i % 32
    grp = ((tl.program_id(0) // n_cb) * (WARPS // KW) + (i // 32) // KW) * GR + SUB
    n_grp = N // 16
    return (tl.program_id(0) % n_cb, lane, lane // 4, lane % 4, tl.minimum(grp, n_grp - 1).to(tl.int64),
            grp < n_grp, (i // 32) % KW)


@triton.jit
def _fragment_at(qf, xf, cb, lane, g, t, grp, W, STEPS: tl.constexpr):
    """A Q4_K mma kernel's thread addresses from its place (_warp_place): step 0's weight and
    activation words [T, 4] in fragment order, its rows g and g + 8 [T, 1], its columns 2t,
    2t + 1 [T, 2] (clamped to W - 1; ok: inside W)."""
    e4 = tl.arange(0, 4)[None, :]                                      # [1, 4]: a thread's elements
    qrow = qf + (grp * STEPS * 32 + lane) * 4 + e4                     # [T, 4]: step 0's words
    xrow = xf + (cb * STEPS * 32 + lane) * 4 + e4
    r_lo = grp * 16 + g                                                # [T, 1]: rows g and g + 8
    col = cb * 8 + 2 * t + tl.arange(0, 2)[None, :]                    # [T, 2]: columns 2t, 2t + 1
    return qrow, xrow, r_lo, r_lo + 8, tl.minimum(col, W - 1).to(tl.int64), col < W


@triton.jit
def _runs_sum(y, KW: tl.constexpr):
    """y [T, C] of a program's warps -> [T / KW, C]: each row group's KW runs added in the
    written-out tree (tree_sum; through shared memory, once a program). Fixed by the tile,
    never by W: the same bits for a row at every W."""
    Tn: tl.constexpr = y.shape[0]
    C: tl.constexpr = y.shape[1]
    y = tl.permute(tl.reshape(y, (Tn // (32 * KW), KW, 32, C)), (0, 2, 3, 1))     # [G, 32, C, KW]
    return tree_sum(tl.reshape(y, (Tn // KW, C, KW)), KW)


@triton.jit
def _fold(ai, am, c, s, xsum):
    """A step's 2 slots into a super-block's integer sums (exact): ai += sc_j * isum_j,
    am += m_j * xsum_j. c [T, 4] (slot j, column bit), s [T, 2 (j)] (sc | m << 8), xsum
    [T, 2 (cb), 2 (j)]; ai, am [T, 2 (cb)] int32."""
    Tn: tl.constexpr = c.shape[0]
    c0, c1 = tl.split(tl.permute(tl.reshape(c, (Tn, 2, 2)), (0, 2, 1)))     # [T, cb] each
    x0, x1 = tl.split(xsum)
    s = s.to(tl.int32)
    s0, s1 = tl.split(s)                                               # [T] each
    ai = ai + (s0 & 0xFF)[:, None] * c0 + (s1 & 0xFF)[:, None] * c1
    am = am + ((s0 >> 8) & 0xFF)[:, None] * x0 + ((s1 >> 8) & 0xFF)[:, None] * x1
    return ai, am


@triton.jit
def _flush(y, ai, am, dd, dx):
    """y [T, 2 (cb)] + a super-block's terms: d dx * ai - dmin dx * am (dd [T, 2]: d, dmin
    of the row; dx [T, 2 (cb)]: the columns' super-block scale)."""
    d, dmin = tl.split(dd.to(tl.float32))                             # [T] each
    t = (d[:, None] * dx) * ai.to(tl.float32) - (dmin[:, None] * dx) * am.to(tl.float32)
    return y + t


@triton.jit
def _kfetch(qrow, sc, sd, r_lo, r_hi, sb, n_slots: tl.constexpr):
    """Super-block sb's 4 steps of weights ([T, 4] each), sc | m << 8 of its rows' slot pairs
    ([T, 2] each) and (d, dmin) of both rows: 14 loads from HBM, issued a super-block ahead."""
    j2 = tl.arange(0, 2)[None, :]
    q = qrow + sb * 512
    o_lo = sc + r_lo * n_slots + sb * 8 + j2
    o_hi = sc + r_hi * n_slots + sb * 8 + j2
    return (tl.load(q), tl.load(q + 128), tl.load(q + 256), tl.load(q + 384),
            tl.load(o_lo), tl.load(o_lo + 2), tl.load(o_lo + 4), tl.load(o_lo + 6),
            tl.load(o_hi), tl.load(o_hi + 2), tl.load(o_hi + 4), tl.load(o_hi + 6),
            tl.load(sd + r_lo * (n_slots // 4) + sb * 2 + j2), tl.load(sd + r_hi * (n_slots // 4) + sb * 2 + j2))


@triton.jit
def _xfetch(xrow, xs, dxs, col, ok, sb, n_slots: tl.constexpr):
    """Super-block sb's activations for the thread's columns (from L2): 4 steps' words
    ([T, 4] each), their slots' xsums ([T, 2 (cb), 2 (j)] each), dx [T, 2 (cb)]."""
    NSB: tl.constexpr = n_slots // 8
    xq = xrow + sb * 512
    xo = xs + col[:, :, None] * n_slots + sb[:, :, None] * 8 + tl.arange(0, 2)[None, None, :]
    m3 = ok[:, :, None]
    return (tl.load(xq), tl.load(xq + 128), tl.load(xq + 256), tl.load(xq + 384),
            tl.load(xo, mask=m3, other=0), tl.load(xo + 2, mask=m3, other=0),
            tl.load(xo + 4, mask=m3, other=0), tl.load(xo + 6, mask=m3, other=0),
            tl.load(dxs + col * NSB + sb, mask=ok, other=0.0))


@triton.jit
def _kstep(acc, w, s_lo, s_hi, xw, xsum, WARPS: tl.constexpr, EMULATE: tl.constexpr):
    """A step into the super-block's integer sums acc = (ai_lo, am_lo, ai_hi, am_hi)."""
    ai_lo, am_lo, ai_hi, am_hi = acc
    c_lo, c_hi = _isums(w, xw, WARPS, EMULATE)
    ai_lo, am_lo = _fold(ai_lo, am_lo, c_lo, s_lo, xsum)
    ai_hi, am_hi = _fold(ai_hi, am_hi, c_hi, s_hi, xsum)
    return ai_lo, am_lo, ai_hi, am_hi


@triton.jit
def _qgemv_mma_k_kernel(xf, xs, dxs, out, qf, sc, sd, W, N, stride_out, n_slots: tl.constexpr,
                        WARPS: tl.constexpr, EMULATE: tl.constexpr, KW: tl.constexpr = 1, XA: tl.constexpr = True,
                        GR: tl.constexpr = 1, PDL: tl.constexpr = False):
    """A program: WARPS / KW 16-row group slots x 8 columns, on activations with one scale a
    super-block (prepare_q8k): a super-block's 8 slots fold in integers (_fold), its float
    work happens once (_flush). KW: warps a slot, each a run of K (_warp_place); the runs'
    sums added at the end (_runs_sum). GR: 16-row groups a warp (1 or 2), which share each
    activation fetch (half the activation loads a weight byte at GR = 2; every row's
    operations are the same, so are its bits). Weights and scales are loaded a super-block
    ahead, and with XA the activations too (else at the top of their super-block)."""
    tl.static_assert(GR == 1 or GR == 2, "one or two row groups a warp")
    Tn: tl.constexpr = 32 * WARPS
    STEPS: tl.constexpr = n_slots // 2
    NSB: tl.constexpr = n_slots // 8
    tl.static_assert(WARPS % KW == 0 and NSB % KW == 0, "whole row groups and whole super-block runs")
    NR: tl.constexpr = NSB // KW                                       # super-blocks a run
    cb, lane, g, t, grp, rows_ok, run = _warp_place(W, N, WARPS, KW, GR, 0)
    qrow, xrow, r_lo, r_hi, col, ok = _fragment_at(qf, xf, cb, lane, g, t, grp, W, STEPS)
    y_lo = tl.zeros([Tn, 2], tl.float32)
    y_hi = tl.zeros([Tn, 2], tl.float32)
    sb0 = run                                                          # [T, 1]: the run's first super-block
    pdl_trigger(PDL)
    nw = _kfetch(qrow, sc, sd, r_lo, r_hi, sb0, n_slots)
    if GR == 2:
        grp2 = _warp_place(W, N, WARPS, KW, GR, 1)[4]
        qrow2, _, r_lo2, r_hi2, _, _ = _fragment_at(qf, xf, cb, lane, g, t, grp2, W, STEPS)
        y_lo2 = tl.zeros([Tn, 2], tl.float32)
        y_hi2 = tl.zeros([Tn, 2], tl.float32)
        nw2 = _kfetch(qrow2, sc, sd, r_lo2, r_hi2, sb0, n_slots)
    pdl_wait(PDL)
    nx = _xfetch(xrow, xs, dxs, col, ok, sb0, n_slots)
    for s in range(0, NR):
        cur = nw
        nb = sb0 + tl.minimum(s + 1, NR - 1) * KW                      # runs interleave: r, r + KW, ..
        nw = _kfetch(qrow, sc, sd, r_lo, r_hi, nb, n_slots)
        if GR == 2:
            cur2 = nw2
            nw2 = _kfetch(qrow2, sc, sd, r_lo2, r_hi2, nb, n_slots)
        if XA:
            xt = nx
            nx = _xfetch(xrow, xs, dxs, col, ok, nb, n_slots)
        else:
            xt = _xfetch(xrow, xs, dxs, col, ok, sb0 + s * KW, n_slots)
        y_lo, y_hi = _superblock(y_lo, y_hi, cur, xt, WARPS, EMULATE)
        if GR == 2:
            y_lo2, y_hi2 = _superblock(y_lo2, y_hi2, cur2, xt, WARPS, EMULATE)
    _store_runs(out, y_lo, y_hi, W, N, stride_out, WARPS, KW, GR, 0)
    if GR == 2:
        _store_runs(out, y_lo2, y_hi2, W, N, stride_out, WARPS, KW, GR, 1)


@triton.jit
def _superblock(y_lo, y_hi, w, x, WARPS: tl.constexpr, EMULATE: tl.constexpr):
    """A row group's super-block (_kfetch's tuple w, _xfetch's x) into y_lo, y_hi [T, 2]:
    its 4 steps' isums folded in integers, then the float part once."""
    w0, w1, w2, w3, sl0, sl1, sl2, sl3, sh0, sh1, sh2, sh3, dd_lo, dd_hi = w
    x0, x1, x2, x3, xs0, xs1, xs2, xs3, dx = x
    zero = tl.zeros(y_lo.shape, tl.int32)
    acc = (zero, zero, zero, zero)
    acc = _kstep(acc, w0, sl0, sh0, x0, xs0, WARPS, EMULATE)
    acc = _kstep(acc, w1, sl1, sh1, x1, xs1, WARPS, EMULATE)
    acc = _kstep(acc, w2, sl2, sh2, x2, xs2, WARPS, EMULATE)
    acc = _kstep(acc, w3, sl3, sh3, x3, xs3, WARPS, EMULATE)
    ai_lo, am_lo, ai_hi, am_hi = acc
    return _flush(y_lo, ai_lo, am_lo, dd_lo, dx), _flush(y_hi, ai_hi, am_hi, dd_hi, dx)


@triton.jit
def _store_runs(out, y_lo, y_hi, W, N, stride_out, WARPS: tl.constexpr, KW: tl.constexpr, GR: tl.constexpr = 1,
                SUB: tl.constexpr = 0):
    """The runs of rows g and g + 8 ([T, 2 (cb)] each) added (_runs_sum) and stored (row
    group SUB of each warp's GR)."""
    y_lo = _runs_sum(y_lo, KW)                                         # [T / KW, 2]
    y_hi = _runs_sum(y_hi, KW)
    cb, lane, g, t, grp, rows_ok, run = _warp_place(W, N, WARPS // KW, 1, GR, SUB)
    r_lo = grp * 16 + g
    col = cb * 8 + 2 * t + tl.arange(0, 2)[None, :]
    keep = (col < W) & rows_ok
    col = tl.minimum(col, W - 1).to(tl.int64)
    tl.store(out + col * stride_out + r_lo, y_lo, mask=keep)
    tl.store(out + col * stride_out + r_lo + 8, y_hi, mask=keep)


def qgemv_mma_k(x: torch.Tensor, w: QuantWeight, planes: torch.Tensor | None = None, out: torch.Tensor | None = None,
                prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, warps: int | None = None,
                runs: int | None = None, ahead: bool = True, groups: int | None = None,
                pdl: bool = False) -> torch.Tensor:
    """Q4_K x [W, K] @ w^T on prepare_q8k's activations (one scale a super-block), the isums on
    the tensor cores and a super-block's slots folded in integers. warps, runs: the program's
    warps and the runs of K a row group (None: mma_tile's, from the shape; runs alone:
    mma_runs); ahead: activations loaded a super-block ahead; groups: 16-row groups a warp
    (1 or 2, sharing the activation fetches; not in the float order; None: mma_groups)."""
    groups = mma_groups(w, x.shape[0]) if groups is None else groups
    if groups not in (1, 2):
        raise ValueError(f"qgemv_mma_k: groups must be 1 or 2, got {groups}")
    return launch_q8k_gemv(_qgemv_mma_k_kernel, "qgemv_mma_k", x, w, out, planes, prepared, mma_planes, prepare_q8k,
                           warps, runs, pdl, groups=groups, XA=ahead)


def mma_groups(w: QuantWeight, W: int) -> int:
    """qgemv_mma_k's row groups a warp for a round of W rows (the same bits either way). Two
    share each activation fetch, which the 8 live columns of a wide round make a third of a
    warp's loads; they halve the programs, which a long matrix cannot spare, and lose at
    W = 1 (docs/decisions/exact-mode-kernel-family.md)."""
    return 2 if W >= 5 and w.N <= 8192 else 1


def launch_q8k_gemv(kernel, name: str, x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None,
                    planes: torch.Tensor | None, prepared: tuple | None, make_planes, prepare, warps: int | None,
                    runs: int | None, pdl: bool, groups: int = 1, **consts) -> torch.Tensor:
    """One launch of a q8_K tensor-core GEMV (qgemv_mma_k's): x and out checked,
    the fragment planes and the activations made here where not given. warps None: the
    tile's (mma_tile); runs: warps a row group, each a run of K (mma_runs(w, warps) if None);
    a property of the weight's tile, never of W (the runs' sum is part of the float order);
    groups: 16-row groups a warp (the kernel's GR)."""
    W, N, out = check_gemv_args(x, w, out, name, k_multiple=256, out_col_slice=True)
    if warps is None:
        warps, tile_runs = mma_tile(w)
        runs = tile_runs if runs is None else runs
    kw = mma_runs(w, warps) if runs is None else runs
    if warps % kw or (w.K // 256) % kw:
        raise ValueError(f"{name}: {kw} runs need {warps} warps and {w.K // 256} super-blocks in whole runs")
    qf = planes if planes is not None else make_planes(w)
    xf, xs, dxs = (prepared if prepared is not None else prepare(x, w.n_slots, pdl))[:3]
    grid = (triton.cdiv(N // ROWS, warps // kw * groups) * triton.cdiv(W, COLS),)
    kernel[grid](xf, xs, dxs, out, qf, w.planes["sc"], w.planes["sd"], W, N, out.stride(0), n_slots=w.n_slots,
                 WARPS=warps, KW=kw, GR=groups, EMULATE=not x.is_cuda, num_warps=warps, enable_fp_fusion=False,
                 **consts, **pdl_kwargs(pdl, x.device))
    return out


def mma_runs(w: QuantWeight, warps: int, most: int | None = None) -> int:
    """Runs of K a row group (one warp each): the most (up to `most`) that divide both the
    program's warps and the row's super-blocks. A 16-row group is one warp's tile, so a
    4096-row matrix is only 256 warps; cutting K over warps multiplies the bytes in flight."""
    top = warps if most is None else min(most, warps)
    return max(r for r in range(1, top + 1) if warps % r == 0 and (w.K // 256) % r == 0)


def mma_tile(w: QuantWeight) -> tuple[int, int]:
    """(warps, runs) of a weight's tensor-core GEMV, from its shape alone (never W: the runs'
    sum is part of the float order): 8 warps in 8 runs for <= 4096 rows, 8 warps in 4 runs
    below 64K rows, 4 warps in one run for an output head, whose many row groups fill the
    GPU alone (the sweep: docs/decisions/exact-mode-kernel-family.md)."""
    if w.N >= 65536:
        return 4, 1
    warps = 8
    return warps, mma_runs(w, warps, 8 if w.N <= 4096 else 4)


def supports_mma(w: QuantWeight) -> bool:
    return mma_shape_ok(w.qtype, w.N, w.K)


def mma_planes(w: QuantWeight) -> torch.Tensor:
    """The qs plane in fragment order: int32 [N/16, n_slots/2, 32 lanes, 2 slots, 2 rows]
    (lane 4g + t holds qs word t of rows g and g + 8 of the group's 16)."""
    if not supports_mma(w):
        raise ValueError(f"qgemv_mma_k: Q4_K with N a multiple of {ROWS}, got {w.qtype.name} {w.N}x{w.K}")
    qs = w.planes["qs"].reshape(w.N // 16, 2, 8, w.n_slots // 2, 2, 4)   # [G, h, g, step, j, t]
    return qs.permute(0, 3, 2, 5, 4, 1).contiguous()                     # [G, step, g, t, j, h]
