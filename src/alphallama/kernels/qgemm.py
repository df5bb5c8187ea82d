"""qgemm: x [T, K] @ w[N, K]^T -> [T, N] float32 for prefill chunks, on the tensor cores.

Decode streams each weight once per token and is bandwidth bound (qmatmul.py). A
prefill chunk of T = 512 rows does T times the arithmetic per weight byte, so there
the CUDA-core GEMV is compute bound at a small fraction of the chip. Here each weight
is instead dequantized by a Triton kernel into a reused scratch buffer (bf16 on the
GPU, in row blocks of at most `scratch` elements) and multiplied by cuBLAS: an 8B
model's ~4.7 GB of Q4_K_M becomes ~16 GB of bf16 writes per chunk, a few ms on an
H200, against ~8 TFLOP of tensor work at T = 512.

The dequantize kernel reuses each format's `triton_load`/`triton_field` (formats.py):
the same block decoders as the GEMV, so the values are the GEMV's fp32 values (bit
for bit the gguf package's), rounded once to the scratch dtype.

Not row-invariant: cuBLAS picks its kernel (and split of K) by shape, so a row's bits
depend on T. Only prefill uses this path (gpu_model.py says what that means for exact
mode and for re-used KV rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qmatmul import _use_triton
from .qweight import QuantWeight

DEQ_SLOTS = 64       # slots per program (one per thread lane along k)
DEQ_ROWS = 4         # weight rows per program
DEQ_ROWS_CPU = 64    # under the interpreter: fewer, larger programs (each value is
                     # computed on its own, so the tile never changes a bit)
DEQ_WARPS = 4


@triton.jit
def _cast(w, dtype: tl.constexpr):
    """fp32 -> the scratch dtype. bf16 by explicit round-to-nearest-even on the bits:
    the same on the GPU and in the interpreter (which truncates)."""
    if dtype == tl.bfloat16:
        b = w.to(tl.int32, bitcast=True)
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return w.to(dtype)


@triton.jit(do_not_specialize=["one"])
def _dequant_kernel(out, qs, qh, sc, sd, N, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
                    FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, SLOT: tl.constexpr,
                    BN: tl.constexpr, NT: tl.constexpr):
    """Rows pid(0)*BN.. and slots pid(1)*NT.. of the weight -> out [N, n_slots * SLOT]."""
    K: tl.constexpr = n_slots * SLOT
    n = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    row = tl.minimum(n, N - 1).to(tl.int64)[None, :]  # [1, BN]; past N: reload N-1, not stored
    s0 = tl.program_id(1) * NT
    words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)
    u = (s0 + tl.arange(0, NT))[:, None, None]  # [NT, 1, 1]
    mask = (u < n_slots) & (n < N)[None, :, None]  # [NT, BN, 1]
    base = out + row[:, :, None] * K + u * SLOT  # [NT, BN, 1]: the slot's first value
    if P == 1:
        # float formats: word v is value v of the slot
        w = FIELD(words, h, s1, s2, 0, one)  # [NT, BN, V]
        tl.store(base + tl.arange(0, V)[None, None, :], _cast(w, out.dtype.element_ty), mask=mask)
    else:
        # fields 2m, 2m+1 of the V words are the 2V consecutive values 2mV.. (interleaved):
        # joined, they are one contiguous run per slot (formats.slot_positions)
        k2 = tl.arange(0, 2 * V)[None, None, :]  # [1, 1, 2V]
        for m in tl.static_range(0, P // 2):
            w_a = FIELD(words, h, s1, s2, 2 * m, one)  # [NT, BN, V]
            w_b = FIELD(words, h, s1, s2, 2 * m + 1, one)
            w = tl.reshape(tl.join(w_a, w_b), (NT, BN, 2 * V))  # [NT, BN, 2V]: a0 b0 a1 b1 ..
            tl.store(base + m * (2 * V) + k2, _cast(w, out.dtype.element_ty), mask=mask)


def dequantize_into(w: QuantWeight, out: torch.Tensor, r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """Rows r0..r1 of a 2-D weight, dequantized into out [r1 - r0, K] (contiguous; any
    float dtype: the fp32 values are rounded once to it)."""
    r1 = w.N if r1 is None else r1
    if len(w.shape) != 2:
        raise ValueError(f"dequantize_into takes a 2-D weight; use w.expert(e) for {w.shape}")
    if out.shape != (r1 - r0, w.K) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{r1 - r0}, {w.K}], got {tuple(out.shape)}")
    planes = [p[r0:r1] for p in w.plane_args()]   # row slices of contiguous planes: still contiguous
    if not _use_triton(out):
        return out.copy_(w.fmt.dequantize({n: p[r0:r1] for n, p in w.planes.items()}, w.K))
    fmt = w.fmt
    NT = min(DEQ_SLOTS, triton.next_power_of_2(w.n_slots))
    BN = DEQ_ROWS if out.is_cuda else DEQ_ROWS_CPU
    grid = (triton.cdiv(r1 - r0, BN), triton.cdiv(w.n_slots, NT))
    _dequant_kernel[grid](out, *planes, r1 - r0, 1, n_slots=w.n_slots, LOAD=fmt.triton_load,
                          FIELD=fmt.triton_field, V=fmt.V, P=fmt.P, SLOT=fmt.slot, BN=BN, NT=NT,
                          num_warps=DEQ_WARPS, enable_fp_fusion=False)
    return out


class Scratch:
    """The reused dequantization buffer: `elements` values of `dtype`, allocated on first use.
    The model owns one; every weight of a prefill chunk passes through it in turn."""

    def __init__(self, elements: int, dtype: torch.dtype, device: torch.device):
        self.elements, self.dtype, self.device = elements, dtype, device
        self.buf: torch.Tensor | None = None
        self.mm_out_dtype: bool | None = None   # does torch.mm(out_dtype=float32) work here? (probed once)

    def rows(self, n: int, K: int) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty(self.elements, dtype=self.dtype, device=self.device)
        return self.buf[:n * K].view(n, K)  # [n, K]

    def mm(self, x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        """x [T, K] @ wt [n, K]^T -> [T, n] float32; bf16 inputs accumulate in fp32 and,
        where torch supports it, are written as fp32 (no bf16 rounding of the output)."""
        if x.dtype == torch.float32:
            return x @ wt.T
        if self.mm_out_dtype is not False:
            try:
                y = torch.mm(x, wt.T, out_dtype=torch.float32)
                self.mm_out_dtype = True
                return y
            except (TypeError, RuntimeError, NotImplementedError):
                self.mm_out_dtype = False
        return (x @ wt.T).float()


def qgemm(x: torch.Tensor, w: QuantWeight, scratch: Scratch, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ w^T -> [T, N] float32 through dequantized row blocks of w."""
    if len(w.shape) != 2:
        raise ValueError(f"qgemm takes a 2-D weight; use w.expert(e) for {w.shape}")
    if x.dim() != 2 or x.shape[1] != w.K:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {w.shape}")
    T, N, K = x.shape[0], w.N, w.K
    x = x.to(scratch.dtype).contiguous()
    step = max(1, min(N, scratch.elements // K))
    if step >= N and out is None:
        return scratch.mm(x, dequantize_into(w, scratch.rows(N, K)))
    if out is None:
        out = torch.empty((T, N), dtype=torch.float32, device=x.device)  # [T, N]
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        out[:, r0:r1] = scratch.mm(x, dequantize_into(w, scratch.rows(r1 - r0, K), r0, r1))
    return out


def qgemm_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """float64 reference: [T, N]."""
    return x.double() @ w.dequantize().double().T  # [T, N]
