"""The geometry of qgemv_mma_k's tensor-core tiles (qgemv_mma.py), without triton.

The offload planner asks which weights fast mode will copy into fragment order before
any weight exists, on any machine: it reads these constants, not the kernel module."""
from __future__ import annotations

from gguf.constants import GGMLQuantizationType as T

from ..formats.qweight import FORMATS

ROWS = 16               # weight rows a warp (the mma's M)
COLS = 8                # x rows a program (the mma's N)
STEP = 2                # slots a step: 16 bytes a thread a plane (at 32 Triton splits a row over 2 threads)


def mma_shape_ok(qtype, N: int, K: int) -> bool:
    """Can an [N, K] weight of this type run on qgemv_mma_k (the plan asks before any weight exists)?"""
    return qtype == T.Q4_K and N % ROWS == 0 and (K // FORMATS[T.Q4_K].slot) % (2 * STEP) == 0
