"""qgemm: x [T, K] @ w[N, K]^T -> [T, N] float32 for prefill chunks, on the tensor cores.

Decode streams each weight once per token and is bandwidth bound (qmatmul.py). A
prefill chunk of T = 512 rows does T times the arithmetic per weight byte, so there
the CUDA-core GEMV is compute bound at a small fraction of the chip. Here each weight
is instead dequantized by a Triton kernel into a reused scratch buffer (bf16 on the
GPU, in row blocks of at most `scratch` elements) and multiplied by cuBLAS: an 8B
model's layers, 4.25 GB as stored, become 13.9 GB of bf16 writes per chunk, against
7.1 TFLOP of tensor work at T = 512. An eager chunk is host-bound (its launches take
longer to issue than the GPU's work); runtime/gpu_prefill.ChunkGraphs is the answer to
that. The passes' timings: docs/decisions/prefill-tensor-cores.md.

The dequantize kernel reuses each format's `triton_load`/`triton_field` (formats.py):
the same block decoders as the GEMV, so the values are the GEMV's fp32 values (bit
for bit the gguf package's), rounded once to the scratch dtype.

Not row-invariant: cuBLAS picks its kernel (and split of K) by shape, so a row's bits
depend on T. Only prefill uses this path (gpu_model.py says what that means for exact
mode and for re-used KV rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backend import use_triton
from ..formats.dequant import launch_dequant
from ..formats.qweight import QuantWeight


@dataclass(frozen=True, eq=False)
class Unit:
    """What one scratch buffer holds for one GEMM: row blocks (w, r0, r1) of one or more
    weights of the same K, stacked in order, with their plane slices cut once."""
    pieces: tuple[tuple[QuantWeight, int, int, tuple], ...]
    K: int

    @property
    def n(self) -> int:
        return sum(r1 - r0 for _, r0, r1, _ in self.pieces)

    def dequantize(self, buf: torch.Tensor, tile: tuple) -> torch.Tensor:
        """-> the unit's values [n, K], a view of the front of buf."""
        out = buf[:self.n * self.K].view(self.n, self.K)  # [n, K]
        o = 0
        for w, r0, r1, planes in self.pieces:
            part = out[o:o + r1 - r0]  # [r1 - r0, K]: contiguous rows
            if use_triton(part):
                launch_dequant(w, planes, part, tile)
            else:
                part.copy_(w.fmt.dequantize({k: p[r0:r1] for k, p in w.planes.items()}, w.K))
            o += r1 - r0
        return out


def units_of(weights: list[QuantWeight], max_rows: int) -> list[Unit]:
    """2-D weights of one K applied to the same input (outputs concatenated) -> units of
    at most max_rows rows: small weights share a unit (one GEMM), large ones are split."""
    K = weights[0].K
    if any(len(w.shape) != 2 or w.K != K for w in weights):
        raise ValueError(f"units_of takes 2-D weights of one K, got {[w.shape for w in weights]}")
    if max_rows < 1:
        raise ValueError(f"a scratch buffer must hold at least one row of K = {K}")
    units, cur, room = [], [], max_rows
    for w in weights:
        planes = w.plane_args()
        r0 = 0
        while r0 < w.N:
            r1 = min(w.N, r0 + room)
            cur.append((w, r0, r1, tuple(p[r0:r1] for p in planes)))
            room -= r1 - r0
            r0 = r1
            if room == 0:
                units.append(Unit(tuple(cur), K))
                cur, room = [], max_rows
    if cur:
        units.append(Unit(tuple(cur), K))
    return units


def qgemm(x: torch.Tensor, w: QuantWeight, scratch) -> torch.Tensor:
    """x [T, K] @ w^T -> [T, N] float32 through dequantized row blocks of w."""
    if len(w.shape) != 2:
        raise ValueError(f"qgemm takes a 2-D weight; use w.expert(e) for {w.shape}")
    if x.dim() != 2 or x.shape[1] != w.K:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {w.shape}")
    return scratch.gemm(x, scratch.units([w], cache=False))


def qgemm_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """float64 reference: [T, N]."""
    return x.double() @ w.dequantize().double().T  # [T, N]
