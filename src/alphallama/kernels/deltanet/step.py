"""The Gated DeltaNet layer's rows of a decode / verify round, and the commit of a verify
round, in one Triton kernel (a constexpr picks the mode).

Per row p = pos + t of ONE sequence, in order: the causal depthwise conv + SiLU of the mix
row (common.conv_silu, its taps from the round's rows or the conv ring), q and k L2-normalised
per key head, the gates (g, beta), then per value head j with state S [dk, dv]:

    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q / sqrt(dk)

(model.deltanet.delta_rule's order). Grid (hv * dv / BV, L): a program owns the columns
vb*BV..vb*BV+BV of one value head's state and walks the rows in a loop, S in registers;
it recomputes its key head's q and k (every program of that head runs the same code on
the same loads: the same bits). L is 1 for a layer's round; the commit takes every
recurrent layer at once (the tensors stacked [L, ...]).

Modes (the decision doc hybrid-recurrent-state.md chose replay for speculative rounds):
- step (decode, exact mode's W = 1 rows, the last prompt row): outputs, the mix rows into
  the ring, the state written back.
- verify: the same without writing the state; `snaps`, if given, receives the state after
  every row (the snapshot alternative, and the tests' witness).
- commit: the first n rows of the round again (n: a device int, the accepted prefix),
  reading the mix rows from the ring (verify wrote them) and alpha / beta from the round's
  buffers; no outputs, the state written back. The conv state needs nothing: the ring
  already holds the accepted rows.

Parallel streams (`-np N`, deltanet_slots): a launch takes several streams' rows, each
stream a segment of the round (the table SEG_*: its slot, position, first row, rows and
whether its state is written); program (column block, g) walks segment g's rows on its
slot's ring, state and gates exactly as a launch of that stream alone walks them.

Row invariance (exact mode): a row's arithmetic is the loop body, whose float order
depends only on constexprs (dk, BV, d_conv, the warps), never on W, the row's column or
the mode; the state between rows stays in fp32 registers, exactly what a W = 1 launch
stores and the next one loads. Launched with enable_fp_fusion=False, so the compiler
cannot contract a row's mul + add differently by context, and W is not specialised (a
W = 1 launch runs the same compiled loop as a W = 64 one). So W rows in one launch give
the bits of W launches of one row, and a commit of n rows the state of n steps.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import W_MAX, DeltaNetShape, check_ring, conv_silu, gates, key_head, l2_normalize

BLOCK_V = 32       # state columns a program owns: a float-order constant (fixed per model, never per W)
NUM_WARPS = 4
# the segment table of deltanet_slots, int32 [5, G]: per stream of the round
SEG_SLOT, SEG_POS, SEG_ROW, SEG_ROWS, SEG_WRITE = range(5)
_SLOT, _POS, _ROW, _ROWS, _WRITE = (tl.constexpr(i) for i in range(5))     # the kernel's names for them


class DeltaNetWeights(NamedTuple):
    """A recurrent layer's small tensors (fp32), or every layer's stacked [L, ...] for the commit."""
    conv_w: torch.Tensor     # [C, d_conv]  ssm_conv1d.weight
    dt_bias: torch.Tensor    # [Hv]         ssm_dt.bias
    ssm_a: torch.Tensor      # [Hv]         ssm_a (= -exp(A_log))


@triton.jit(do_not_specialize=["W"])     # W = 1 must not compile a kernel of its own: one code for every width
def _step_kernel(MIX, ALPHA, BETA, RING, CONVW, DTB, SSMA, STATE, OUT, SNAP, POS, NROWS,
                 W, R, stride_ab, ls_ab, ls_ring, ls_convw, ls_gate, ls_state, scale, eps,
                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BV: tl.constexpr, D_CONV: tl.constexpr, TILED: tl.constexpr,
                 FROM_RING: tl.constexpr, WRITE_OUT: tl.constexpr, WRITE_STATE: tl.constexpr,
                 HAS_SNAP: tl.constexpr, SEGS: tl.constexpr = 0):
    """SEGS > 0: POS is a segment table int32 [5, SEGS] (SEG_*) and axis 1 its segments."""
    C: tl.constexpr = 2 * HK * DK + HV * DV
    NVB: tl.constexpr = DV // BV
    j = tl.program_id(0) // NVB                                  # value head
    vb = tl.program_id(0) % NVB                                  # its column block
    at = tl.program_id(1).to(tl.int64)                           # along the stacked axis: the commit's layer
    if SEGS:                                                     # ... or the segment's slot
        seg = tl.program_id(1)
        at = tl.load(POS + _SLOT * SEGS + seg).to(tl.int64)
        row0 = tl.load(POS + _ROW * SEGS + seg)
        MIX += row0 * C
        OUT += row0 * (HV * DV)
    ALPHA += at * ls_ab
    BETA += at * ls_ab
    RING += at * ls_ring
    CONVW += at * ls_convw
    DTB += at * ls_gate
    SSMA += at * ls_gate
    STATE += at * ls_state
    kh = key_head(j, HK, HV, TILED)
    if TILED:
        owns_qk = (vb == 0) & (j < HK)                           # the first value head of its key head
    else:
        owns_qk = (vb == 0) & (j % (HV // HK) == 0)
    dki = tl.arange(0, DK)
    vi = vb * BV + tl.arange(0, BV)
    qch = kh * DK + dki                                          # [DK] channels of q
    kch = HK * DK + kh * DK + dki                                # [DK] channels of k
    vch = 2 * HK * DK + j * DV + vi                              # [BV] channels of v
    true_k = dki < DK
    true_v = vi < DV
    s_off = j * DK * DV + dki[:, None] * DV + vi[None, :]        # [DK, BV]
    S = tl.load(STATE + s_off)                                   # [DK, BV]
    if SEGS:
        pos = tl.load(POS + _POS * SEGS + seg)
        n = tl.load(POS + _ROWS * SEGS + seg)
    else:
        pos = tl.load(POS)
        if FROM_RING:
            n = tl.load(NROWS)
        else:
            n = W
    t = 0
    while t < n:                                                 # a while loop: the interpreter takes no run-time range()
        p = pos + t
        q = conv_silu(MIX, RING, CONVW, p, pos, R, C, qch, true_k, D_CONV, FROM_RING)   # [DK]
        k = conv_silu(MIX, RING, CONVW, p, pos, R, C, kch, true_k, D_CONV, FROM_RING)   # [DK]
        v = conv_silu(MIX, RING, CONVW, p, pos, R, C, vch, true_v, D_CONV, FROM_RING)   # [BV]
        if not FROM_RING:                                        # the round's mix rows into the ring
            slot = RING + (p % R) * C
            tl.store(slot + vch, tl.load(MIX + t * C + vch))
            tl.store(slot + qch, tl.load(MIX + t * C + qch), mask=true_k & owns_qk)
            tl.store(slot + kch, tl.load(MIX + t * C + kch), mask=true_k & owns_qk)
        q = l2_normalize(q, eps, 0)
        k = l2_normalize(k, eps, 0)
        g, beta = gates(ALPHA, BETA, DTB, SSMA, t, j, stride_ab, t < n)
        S = S * tl.exp(g)
        pred = tl.sum(S * k[:, None], 0)                         # [BV] S^T k
        u = beta * (v - pred)                                    # [BV]
        S = S + k[:, None] * u[None, :]                          # [DK, BV]
        if WRITE_OUT:
            o = tl.sum(S * q[:, None], 0) * scale                # [BV]
            tl.store(OUT + t * HV * DV + j * DV + vi, o)
        if HAS_SNAP:
            tl.store(SNAP + t * HV * DK * DV + s_off, S)
        t += 1
    if WRITE_STATE:
        if SEGS:                                                 # a step's segment; a verify's leaves it
            keep = tl.load(POS + _WRITE * SEGS + seg) != 0
            tl.store(STATE + s_off, S, mask=true_k[:, None] & true_v[None, :] & keep)
        else:
            tl.store(STATE + s_off, S)


def _check(shape: DeltaNetShape, w: DeltaNetWeights, state: torch.Tensor, block_v: int) -> None:
    shape.check()
    if block_v > shape.dv or shape.dv % block_v or block_v & (block_v - 1):
        raise ValueError(f"block_v {block_v} must be a power of two dividing dv {shape.dv}")
    if state.shape[-3:] != (shape.hv, shape.dk, shape.dv) or state.dtype != torch.float32:
        raise ValueError(f"state [.., {shape.hv}, {shape.dk}, {shape.dv}] fp32, got {tuple(state.shape)} {state.dtype}")
    if w.conv_w.shape[-2:] != (shape.channels, shape.d_conv):
        raise ValueError(f"conv weight [.., {shape.channels}, {shape.d_conv}], got {tuple(w.conv_w.shape)}")
    for t in (state, w.conv_w, w.dt_bias, w.ssm_a):
        if not t.is_contiguous():
            raise ValueError("state and weights must be contiguous")


def _gate_strides(alpha: torch.Tensor, beta: torch.Tensor) -> int:
    if alpha.stride() != beta.stride() or alpha.stride(-1) != 1:
        raise ValueError("alpha and beta need the same strides, heads contiguous")
    return alpha.stride(-2)


def deltanet_step(mix: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, w: DeltaNetWeights,
                  ring: torch.Tensor, state: torch.Tensor, pos: torch.Tensor, shape: DeltaNetShape, *,
                  write_state: bool = True, snaps: torch.Tensor | None = None,
                  block_v: int = BLOCK_V) -> torch.Tensor:
    """W rows of one layer at positions pos..pos+W-1 (pos: int32 [1] on the device).

    mix [W, C] the conv inputs; alpha, beta [W, Hv] the raw gate projections (views of one
    buffer are fine); ring [R, C] the conv ring (common.py), the round's rows written into
    it; state [Hv, dk, dv] fp32, updated in place unless write_state=False (verify);
    snaps [W, Hv, dk, dv], if given, receives the state after every row.
    -> out [W, Hv, dv] (S^T q / sqrt(dk), before the gated norm)."""
    _check(shape, w, state, block_v)
    W = mix.shape[0]
    check_ring(ring, shape, W)
    if mix.shape != (W, shape.channels) or not mix.is_contiguous() or not ring.is_contiguous():
        raise ValueError(f"mix [W, {shape.channels}] and ring contiguous, got {tuple(mix.shape)}")
    if alpha.shape != (W, shape.hv) or beta.shape != (W, shape.hv):
        raise ValueError(f"alpha, beta [{W}, {shape.hv}], got {tuple(alpha.shape)}, {tuple(beta.shape)}")
    if snaps is not None and (snaps.shape != (W, *state.shape) or not snaps.is_contiguous()):
        raise ValueError(f"snaps [{W}, {shape.hv}, {shape.dk}, {shape.dv}] contiguous, got {tuple(snaps.shape)}")
    out = torch.empty(W, shape.hv, shape.dv, device=mix.device, dtype=torch.float32)
    grid = (shape.hv * (shape.dv // block_v), 1)
    _step_kernel[grid](mix, alpha, beta, ring, w.conv_w, w.dt_bias, w.ssm_a, state, out,
                       snaps if snaps is not None else out, pos, pos, W, ring.shape[0],
                       _gate_strides(alpha, beta), 0, 0, 0, 0, 0, shape.dk ** -0.5, shape.eps,
                       shape.hk, shape.hv, shape.dk, shape.dv, block_v, shape.d_conv, shape.tiled,
                       FROM_RING=False, WRITE_OUT=True, WRITE_STATE=write_state, HAS_SNAP=snaps is not None,
                       num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out


def deltanet_commit(alpha: torch.Tensor, beta: torch.Tensor, w: DeltaNetWeights, ring: torch.Tensor,
                    state: torch.Tensor, pos: torch.Tensor, n: torch.Tensor, shape: DeltaNetShape, *,
                    block_v: int = BLOCK_V) -> None:
    """Keep the first n rows of a verify round, every recurrent layer in one launch.

    alpha, beta [L, W, Hv] the round's gate projections per layer; w: the layers' weights
    stacked ([L, C, d_conv], [L, Hv], [L, Hv]); ring [L, R, C] (verify wrote the round's
    rows); state [L, Hv, dk, dv] the state before the round, left as the state after its
    first n rows (pos, n: int32 [1] on the device; n <= W)."""
    _check(shape, w, state, block_v)
    L, W = alpha.shape[:2]
    check_ring(ring, shape, W)
    if state.shape[0] != L or ring.shape[0] != L or w.conv_w.shape[0] != L or w.dt_bias.shape != (L, shape.hv) \
            or alpha.shape != (L, W, shape.hv) or beta.shape != alpha.shape or not ring.is_contiguous():
        raise ValueError(f"every tensor stacked over the {L} layers")
    grid = (shape.hv * (shape.dv // block_v), L)
    _step_kernel[grid](ring, alpha, beta, ring, w.conv_w, w.dt_bias, w.ssm_a, state, state, state, pos, n,
                       W, ring.shape[1], _gate_strides(alpha, beta), alpha.stride(0), ring.stride(0),
                       w.conv_w.stride(0), w.dt_bias.stride(0), state.stride(0), shape.dk ** -0.5, shape.eps,
                       shape.hk, shape.hv, shape.dk, shape.dv, block_v, shape.d_conv, shape.tiled,
                       FROM_RING=True, WRITE_OUT=False, WRITE_STATE=True, HAS_SNAP=False,
                       num_warps=NUM_WARPS, enable_fp_fusion=False)


def deltanet_slots(mix: torch.Tensor, ab: torch.Tensor, w: DeltaNetWeights, rings: torch.Tensor,
                   states: torch.Tensor, segs: torch.Tensor, shape: DeltaNetShape, *,
                   block_v: int = BLOCK_V) -> torch.Tensor:
    """Several streams' rows of one layer in one launch (parallel streams). Segment g of
    segs int32 [5, G] (SEG_*; on the device, a graph input) is rows SEG_ROW .. SEG_ROW +
    SEG_ROWS - 1 of mix [W, C], one stream at positions SEG_POS.. on slot s = SEG_SLOT: its
    conv ring rings[s] [R, C] (its rows written), its state states[s] [Hv, dk, dv] fp32
    (written back where SEG_WRITE, a step; left where 0, a verify round) and its rows' gates
    ab[s] [>= rows, 2 Hv] ([beta | alpha], as the round buffer of one stream). A segment of
    0 rows does nothing; rows in no segment (a bucket's padding) get zeros. Every segment's
    arithmetic is deltanet_step's for its rows alone. -> out [W, Hv, dv]."""
    _check(shape, w, states[0], block_v)
    W, G = mix.shape[0], segs.shape[1]
    check_ring(rings, shape, W_MAX)
    if mix.shape != (W, shape.channels) or not mix.is_contiguous() or not rings[0].is_contiguous():
        raise ValueError(f"mix [W, {shape.channels}] and each slot's ring contiguous, got {tuple(mix.shape)}")
    if not states[0].is_contiguous() or rings.shape[0] != states.shape[0] or ab.shape[0] < states.shape[0] \
            or ab.shape[-1] != 2 * shape.hv or ab.stride(-1) != 1:
        raise ValueError(f"per slot: a contiguous state, a ring and gates [.., {2 * shape.hv}]")
    if segs.shape != (5, G) or segs.dtype != torch.int32 or not segs.is_contiguous():
        raise ValueError(f"segs: int32 [5, G] contiguous, got {segs.dtype} {tuple(segs.shape)}")
    out = torch.zeros(W, shape.hv, shape.dv, device=mix.device, dtype=torch.float32)
    alpha, beta = ab[..., shape.hv:], ab[..., :shape.hv]
    grid = (shape.hv * (shape.dv // block_v), G)
    _step_kernel[grid](mix, alpha, beta, rings, w.conv_w, w.dt_bias, w.ssm_a, states, out, out, segs, segs,
                       W, rings.shape[1], ab.stride(1), ab.stride(0), rings.stride(0), 0, 0, states.stride(0),
                       shape.dk ** -0.5, shape.eps, shape.hk, shape.hv, shape.dk, shape.dv, block_v, shape.d_conv,
                       shape.tiled, FROM_RING=False, WRITE_OUT=True, WRITE_STATE=True, HAS_SNAP=False, SEGS=G,
                       num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
