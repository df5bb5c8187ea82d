"""Dequantizing a weight's rows on the device: into a buffer (the prefill GEMMs' scratch,
kernels/prefill/qgemm.py) or, gathered by index, as an embedding lookup (gather_rows).

The kernel reuses each format's `triton_load`/`triton_field` (formats/format.py): the same
block decoders as the GEMV, so the values are the GEMV's fp32 values (bit for bit the
gguf package's), rounded once to the output dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import use_triton
from .qweight import QuantWeight

# The dequantize kernel's tile: (weight rows, slots, warps) per program, whether a slot
# is stored whole (_dequant_kernel's WHOLE), whether bf16 is rounded by the GPU's own
# convert (HW). Every value is computed on its own and rounded to nearest even either
# way, so no choice changes a bit; bench/gpu_engine.py times them. The row and slot split
# is not the limit (every tile tried wrote at about the same rate); whole-slot stores and
# the GPU's convert made the pass ~3x faster (docs/decisions/prefill-tensor-cores.md).
DEQ_TILE = (1, 128, 4, True, True)
DEQ_ROWS_CPU = 512   # under the interpreter: fewer, larger programs (it pays per program)


@triton.jit
def _cast(w, dtype: tl.constexpr, HW: tl.constexpr):
    """fp32 -> the scratch dtype. bf16 by explicit round-to-nearest-even on the bits (the
    interpreter's own cast truncates), or with HW by the GPU's convert (also to nearest
    even: the same bits for every finite value, in fewer instructions)."""
    if dtype == tl.bfloat16 and not HW:
        b = w.to(tl.int32, bitcast=True)
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return w.to(dtype)


@triton.jit
def _pair(words, h, s1, s2, FIELD: tl.constexpr, m: tl.constexpr, one):
    """Fields 2m, 2m+1 of the V words: the 2V consecutive values 2mV.. of each slot
    (interleaved, formats.slot_positions): [NT, BN, 2V]."""
    w_a = FIELD(words, h, s1, s2, 2 * m, one)  # [NT, BN, V]
    w_b = FIELD(words, h, s1, s2, 2 * m + 1, one)
    return tl.reshape(tl.join(w_a, w_b), (w_a.shape[0], w_a.shape[1], 2 * w_a.shape[2]))  # a0 b0 a1 b1 ..


@triton.jit
def _quad(words, h, s1, s2, FIELD: tl.constexpr, m: tl.constexpr, one):
    """Pairs 2m, 2m+1 joined: [NT, BN, 2V, 2]."""
    return tl.join(_pair(words, h, s1, s2, FIELD, 2 * m, one), _pair(words, h, s1, s2, FIELD, 2 * m + 1, one))


@triton.jit
def slot_values(words, h, s1, s2, FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, one):
    """The values of NT slots of BN rows in k order: [NT, BN, SLOT] float32 (P in 1, 4, 8, 16).
    Pairs m = j2 * 2 + j1 (P = 8) are joined as [.., 2V, j1, j2], then put in (m, 2V) order;
    P = 16 (the 2-bit K-quants) the same with a third join, m = j3 * 4 + j2 * 2 + j1."""
    if P == 1:
        w = FIELD(words, h, s1, s2, 0, one)  # [NT, BN, V]: word v is value v of the slot
    elif P == 16:
        t = tl.join(tl.join(_quad(words, h, s1, s2, FIELD, 0, one), _quad(words, h, s1, s2, FIELD, 1, one)),
                    tl.join(_quad(words, h, s1, s2, FIELD, 2, one), _quad(words, h, s1, s2, FIELD, 3, one)))
        w = tl.reshape(tl.permute(t, (0, 1, 5, 4, 3, 2)), (t.shape[0], t.shape[1], V * P))  # [NT, BN, j3, j2, j1, 2V]
    elif P == 8:
        t = tl.join(tl.join(_pair(words, h, s1, s2, FIELD, 0, one), _pair(words, h, s1, s2, FIELD, 1, one)),
                    tl.join(_pair(words, h, s1, s2, FIELD, 2, one), _pair(words, h, s1, s2, FIELD, 3, one)))
        w = tl.reshape(tl.permute(t, (0, 1, 4, 3, 2)), (t.shape[0], t.shape[1], V * P))
    else:
        tl.static_assert(P == 4, "slot_values takes P in 1, 4, 8, 16")
        t = tl.join(_pair(words, h, s1, s2, FIELD, 0, one), _pair(words, h, s1, s2, FIELD, 1, one))
        w = tl.reshape(tl.permute(t, (0, 1, 3, 2)), (t.shape[0], t.shape[1], V * P))
    return w


@triton.jit(do_not_specialize=["one"])
def _dequant_kernel(out, qs, qh, sc, sd, N, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
                    FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, SLOT: tl.constexpr,
                    BN: tl.constexpr, NT: tl.constexpr, WHOLE: tl.constexpr, HW: tl.constexpr,
                    IDX=None, GATHER: tl.constexpr = False, NROWS=1):
    """Rows pid(0)*BN.. and slots pid(1)*NT.. of the weight -> out [N, n_slots * SLOT].
    GATHER: out row n is weight row IDX[n] (N = rows of out: an embedding lookup), an id
    outside the NROWS weight rows read as the nearest row, never past the planes (the
    server rejects such ids before they get here).
    WHOLE: a slot's values are put in k order in registers and stored at once (the
    compiler may then spread a slot's run over several threads: whole sectors per warp
    store); else each field pair is stored as it comes (one 16-byte run per thread)."""
    K: tl.constexpr = n_slots * SLOT
    n = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    dst = tl.minimum(n, N - 1).to(tl.int64)[None, :]  # [1, BN]; past N: reload N-1, not stored
    if GATHER:
        row = tl.minimum(tl.maximum(tl.load(IDX + dst).to(tl.int64), 0), NROWS - 1)  # [1, BN]
    else:
        row = dst
    s0 = tl.program_id(1) * NT
    words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)
    u = (s0 + tl.arange(0, NT))[:, None, None]  # [NT, 1, 1]
    mask = (u < n_slots) & (n < N)[None, :, None]  # [NT, BN, 1]
    base = out + dst[:, :, None] * K + u * SLOT  # [NT, BN, 1]: the slot's first value
    dt: tl.constexpr = out.dtype.element_ty
    if P == 1 or WHOLE:
        w = slot_values(words, h, s1, s2, FIELD, V, P, one)  # [NT, BN, SLOT] in k order
        tl.store(base + tl.arange(0, SLOT)[None, None, :], _cast(w, dt, HW), mask=mask)
    else:
        k2 = tl.arange(0, 2 * V)[None, None, :]  # [1, 1, 2V]
        for m in tl.static_range(0, P // 2):
            w = _pair(words, h, s1, s2, FIELD, m, one)  # [NT, BN, 2V]
            tl.store(base + m * (2 * V) + k2, _cast(w, dt, HW), mask=mask)


def launch_dequant(w: QuantWeight, planes: tuple, out: torch.Tensor, tile: tuple,
            idx: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize the rows whose plane slices are `planes` (or, with idx, rows idx of
    them) into out [n, K] (contiguous)."""
    fmt, n = w.fmt, out.shape[0]
    rows, slots, warps, whole, hw = tile
    if not out.is_cuda:
        rows, hw = DEQ_ROWS_CPU, False     # the interpreter's own cast truncates
    NT = min(slots, triton.next_power_of_2(w.n_slots))
    grid = (triton.cdiv(n, rows), triton.cdiv(w.n_slots, NT))
    _dequant_kernel[grid](out, *planes, n, 1, n_slots=w.n_slots, LOAD=fmt.triton_load, FIELD=fmt.triton_field,
                          V=fmt.V, P=fmt.P, SLOT=fmt.slot, BN=rows, NT=NT, WHOLE=whole, HW=hw, num_warps=warps,
                          enable_fp_fusion=False, IDX=idx, GATHER=idx is not None, NROWS=w.N)
    return out


def gather_rows(w: QuantWeight, idx: torch.Tensor, out: torch.Tensor | None = None,
                tile: tuple = DEQ_TILE) -> torch.Tensor:
    """Rows idx [T] (integer, on w's device) of a 2-D weight, dequantized: [T, K] float32
    (or out's dtype), bit for bit the gguf dequantizers' values. An embedding lookup in
    one launch, so that a captured round holds one node for it, not the ~25 of a
    plain-torch dequantize."""
    if len(w.shape) != 2 or idx.dim() != 1 or idx.device != w.device:
        raise ValueError(f"gather_rows takes a 2-D weight and 1-D indices on its device, got {w.shape} on "
                         f"{w.device}, {tuple(idx.shape)} on {idx.device}")
    out = torch.empty((idx.shape[0], w.K), dtype=torch.float32, device=w.device) if out is None else out
    if out.shape != (idx.shape[0], w.K) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{idx.shape[0]}, {w.K}], got {tuple(out.shape)}")
    if idx.shape[0] == 0:
        return out
    if not use_triton(out):
        rows = idx.clamp(0, w.N - 1)
        return out.copy_(w.fmt.dequantize({n: p[rows] for n, p in w.planes.items()}, w.K))
    return launch_dequant(w, w.plane_args(), out, tile, idx)


def dequantize_into(w: QuantWeight, out: torch.Tensor, r0: int = 0, r1: int | None = None,
                    tile: tuple = DEQ_TILE) -> torch.Tensor:
    """Rows r0..r1 of a 2-D weight, dequantized into out [r1 - r0, K] (contiguous; any
    float dtype: the fp32 values are rounded once to it)."""
    r1 = w.N if r1 is None else r1
    if len(w.shape) != 2:
        raise ValueError(f"dequantize_into takes a 2-D weight; use w.expert(e) for {w.shape}")
    if out.shape != (r1 - r0, w.K) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{r1 - r0}, {w.K}], got {tuple(out.shape)}")
    if not use_triton(out):
        return out.copy_(w.fmt.dequantize({n: p[r0:r1] for n, p in w.planes.items()}, w.K))
    planes = tuple(p if p is w.table else p[r0:r1] for p in w.plane_args())   # row slices: still contiguous
    return launch_dequant(w, planes, out, tile)
