"""QuantWeight: a GGUF tensor's bits on the device, re-laid for coalesced loads.

Weights never become a dequantized bf16 copy: decode reads every weight once per
token, so the bytes read per token are the GGUF size (formats.py says how the bits
are arranged). 2-D weights are [N, K] (torch order: N outputs, K inputs); 3-D
expert tensors [E, N, K] hold one such weight per expert (`expert(e)`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from .fmt_float import BF16, F16, F32
from .fmt_grid import GRID_FORMATS
from .fmt_iq4 import IQ4_NL, IQ4_XS
from .fmt_kquant import Q4_K, Q5_K, Q6_K
from .fmt_kquant_low import Q2_K, Q3_K
from .fmt_legacy import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
from .fmt_misc import MXFP4, TQ1_0, TQ2_0
from ...gguf.quants import as_bytes
from .format import PLANES, Format

FORMATS: dict[GGMLQuantizationType, Format] = {
    f.qtype: f for f in (F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
                         *GRID_FORMATS, MXFP4, TQ1_0, TQ2_0)}

# Rows re-laid per step at load time: bounds the temporaries (~40 bytes per value)
LOAD_CHUNK_VALUES = 1 << 25


def embedding_planes(qtype: GGMLQuantizationType | int) -> bool:
    """Whether an embedding of this type is held as planes and gathered by a kernel
    (qgemm.gather_rows); else the runtime keeps its raw GGUF rows."""
    return GGMLQuantizationType(qtype) in FORMATS


def format_of(qtype: GGMLQuantizationType | int) -> Format:
    fmt = FORMATS.get(GGMLQuantizationType(qtype))
    if fmt is None:
        raise ValueError(f"no GPU kernel for {GGMLQuantizationType(qtype).name} "
                         f"(supported: {', '.join(t.name for t in FORMATS)})")
    return fmt


@dataclass(frozen=True)
class QuantWeight:
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]            # (N, K) or (E, N, K)
    planes: dict[str, torch.Tensor]   # name -> [*shape[:-1], per_row], contiguous
    # a codebook format's table (Format.table) where the kernels read it: the planes' device,
    # or the GPU for the expert store's pinned host planes (offload/store.py passes it on)
    table: torch.Tensor | None = None

    def __post_init__(self):
        fmt = FORMATS.get(self.qtype)
        if self.table is None and fmt is not None and fmt.table is not None:   # once a weight (1-16 KiB)
            object.__setattr__(self, "table", fmt.table().to(self.planes["qs"].device))

    @classmethod
    def from_raw(cls, raw: torch.Tensor | np.ndarray, qtype: GGMLQuantizationType | int,
                 shape: tuple[int, ...], device: torch.device | str = "cpu") -> "QuantWeight":
        """Re-lay a tensor's GGUF bytes (any array whose bytes are the tensor data, e.g.
        the reader's mmap'd view) onto `device`. The work is done on `device` in row chunks."""
        fmt = format_of(qtype)
        shape = tuple(int(s) for s in shape)
        if len(shape) not in (2, 3):
            raise ValueError(f"QuantWeight takes [N, K] or [E, N, K], got {shape}")
        K = shape[-1]
        if K % fmt.block_size or K % fmt.slot:
            raise ValueError(f"{fmt.qtype.name}: K={K} is not a multiple of the block size {fmt.block_size}")
        rows = math.prod(shape[:-1])
        nb = K // fmt.block_size
        data = as_bytes(raw)
        if data.numel() != rows * nb * fmt.type_size:
            raise ValueError(f"{fmt.qtype.name} {shape} needs {rows * nb * fmt.type_size} bytes, got {data.numel()}")
        data = data.reshape(rows, nb, fmt.type_size)  # [R, nb, type_size]

        step = max(1, LOAD_CHUNK_VALUES // K)
        planes: dict[str, torch.Tensor] = {}
        for r0 in range(0, rows, step):
            part = fmt.pack(data[r0:r0 + step].to(device))  # name -> [rows_in_chunk, per_row]
            for name, p in part.items():
                if name not in planes:
                    planes[name] = torch.empty((rows, p.shape[1]), dtype=p.dtype, device=device)
                planes[name][r0:r0 + p.shape[0]] = p
        planes = {n: p.reshape(*shape[:-1], p.shape[1]) for n, p in planes.items()}
        return cls(fmt.qtype, shape, planes, fmt.table().to(device) if fmt.table else None)

    @property
    def fmt(self) -> Format:
        return FORMATS[self.qtype]

    @property
    def N(self) -> int:
        return self.shape[-2]

    @property
    def K(self) -> int:
        return self.shape[-1]

    @property
    def n_slots(self) -> int:
        return self.K // self.fmt.slot

    @property
    def device(self) -> torch.device:
        return self.planes["qs"].device

    @property
    def nbytes(self) -> int:
        """Bytes a full read of the weight moves (planes as stored)."""
        return sum(p.numel() * p.element_size() for p in self.planes.values())

    @property
    def gguf_nbytes(self) -> int:
        return math.prod(self.shape) // self.fmt.block_size * self.fmt.type_size

    def plane_args(self) -> tuple[torch.Tensor, ...]:
        """The four planes in kernel order; an absent plane is stood in for by qs, and a
        codebook format's table takes qh's place (a callback that slices or reshapes the
        planes leaves it as it is: `is w.table`)."""
        return tuple(self.table if n == "qh" and self.table is not None else self.planes.get(n, self.planes["qs"])
                     for n in PLANES)

    def expert(self, e: int) -> "QuantWeight":
        """The [N, K] weight of expert e of an [E, N, K] tensor (views, no copy)."""
        if len(self.shape) != 3:
            raise ValueError(f"expert() needs an [E, N, K] weight, this one is {self.shape}")
        return QuantWeight(self.qtype, self.shape[1:], {n: p[e] for n, p in self.planes.items()}, self.table)

    def dequantize(self) -> torch.Tensor:
        """Plain-torch float32 values [*shape], from the planes (the kernels' reference)."""
        flat = {n: p.reshape(-1, p.shape[-1]) for n, p in self.planes.items()}
        return self.fmt.dequantize(flat, self.K).reshape(self.shape)


def check_gemv_args(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None, name: str, *,
                    k_multiple: int = 1, triton_only: bool = True,
                    out_col_slice: bool = False) -> tuple[int, int, torch.Tensor]:
    """The argument checks of the GEMV wrappers (x [W, K] @ w^T -> [W, N] float32), in
    this order; `name` (the kernel) heads the messages. ValueError unless w is a 2-D
    [N, K] weight, x is [W, K] and K is a multiple of `k_multiple`; RuntimeError if
    `triton_only` and x is neither on CUDA nor under TRITON_INTERPRET=1 (read at call
    time); ValueError unless `out` is float32 [W, N] and contiguous, or with
    `out_col_slice` of unit column stride (any row stride: a column slice of a wider
    buffer). Returns (W, N, out), with out allocated (contiguous) when None."""
    if len(w.shape) != 2:
        raise ValueError(f"{name} takes a 2-D weight; use w.expert(e) for {w.shape}")
    if x.dim() != 2 or x.shape[1] != w.K:
        raise ValueError(f"{name}: x {tuple(x.shape)} does not match weight {w.shape}")
    if w.K % k_multiple:
        raise ValueError(f"{name} needs K a multiple of {k_multiple}, got K={w.K}")
    if triton_only and not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError(f"{name} runs on CUDA or under TRITON_INTERPRET=1")
    W, N = x.shape[0], w.N
    if out is None:
        return W, N, torch.empty((W, N), dtype=torch.float32, device=x.device)   # [W, N]
    if out_col_slice:
        if out.shape != (W, N) or out.dtype != torch.float32 or out.stride(1) != 1:
            raise ValueError(f"{name}: out must be float32 [{W}, {N}] with unit column stride, "
                             f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    elif out.shape != (W, N) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous float32 [{W}, {N}], "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    return W, N, out
