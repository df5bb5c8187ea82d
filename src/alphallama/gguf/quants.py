"""GGUF/ggml block formats, dequantized in plain torch: the registry and its entry points.

Meant as the reference for the GPU kernels and as the loader's path for weights that
stay in float (the CPU runtime). Every type is bit-exact against the `gguf` package's
numpy dequantizers (`gguf.quants.dequantize`): each format does its float ops in the
same order and precision (tests/gguf/test_quants.py). Works on any device: pure torch
ops, with constants moved to the input's device.

One `QuantType` subclass per format, a file per family: quants_legacy.py (floats, the
32-value blocks), quants_k.py (k-quants), quants_iq.py (IQ, tables in iq_tables.py),
quants_misc.py (MXFP4, ternary). `QUANTS` maps `GGMLQuantizationType` to them.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from .quant_base import RANDOM_WEIGHT_MAX, QuantType
from .quants_iq import (
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
)
from .quants_k import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from .quants_legacy import BF16, F16, F32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
from .quants_misc import MXFP4, TQ1_0, TQ2_0

__all__ = ["QUANTS", "RANDOM_WEIGHT_MAX", "QuantType", "as_bytes", "dequantize", "quant_type",
           "random_blocks"]

QUANTS: dict[T, type[QuantType]] = {q.qtype: q for q in (
    F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
    IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M,
    MXFP4, TQ1_0, TQ2_0)}

# Values dequantized per step and torch thread on the CPU: a format's dozen temporaries
# then stay in each core's caches (at one thread, whole-tensor steps were ~2x slower on a
# 4096 x 4096 tensor: bench/cpu_dequant.py)
CPU_CHUNK_VALUES = 1 << 18


# --- public functions ---------------------------------------------------------

def quant_type(qtype: T | int) -> type[QuantType]:
    """The registry entry for `qtype`; ValueError naming the type if unsupported."""
    q = QUANTS.get(qtype)
    if q is None:
        try:
            name = T(qtype).name
        except ValueError:
            name = f"#{int(qtype)}"
        raise ValueError(f"quant type {name} is not supported for dequantization "
                         f"(supported: {', '.join(t.name for t in QUANTS)})")
    return q


def as_bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Any array or tensor, reinterpreted as its flat bytes (uint8 [n_bytes])."""
    if isinstance(raw, np.ndarray):
        # torch cannot wrap a read-only array (an mmap'd file) without a warning and
        # the risk of a write through it; copying the raw bytes costs less than the
        # float32 result does
        raw = np.ascontiguousarray(raw) if raw.flags.writeable else np.array(raw, order="C")
        raw = torch.from_numpy(raw.reshape(-1).view(np.uint8))
    return raw.contiguous().reshape(-1).view(torch.uint8)  # [n_bytes]


def dequantize(raw: torch.Tensor | np.ndarray, qtype: T | int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's stored bytes -> float32 tensor of `shape` (torch order, last dim = row).

    `raw` may have any shape and dtype; only its bytes count (so typed F32/F16/BF16
    arrays work too). The result is on raw's device and never aliases raw."""
    q = quant_type(qtype)
    shape = tuple(int(s) for s in shape)
    n_values = int(np.prod(shape, dtype=np.int64))
    if not shape or shape[-1] % q.block_size:
        raise ValueError(f"{q.qtype.name}: row length of shape {shape} is not a multiple "
                         f"of the block size {q.block_size}")
    data = as_bytes(raw)  # [n_bytes]
    n_bytes = n_values // q.block_size * q.type_size
    if data.numel() != n_bytes:
        raise ValueError(f"{q.qtype.name} tensor of shape {shape} needs {n_bytes} bytes, got {data.numel()}")
    blocks = data.reshape(-1, q.type_size)  # [n_blocks, type_size]
    step = max(1, CPU_CHUNK_VALUES * torch.get_num_threads() // q.block_size)
    if blocks.device.type != "cpu" or blocks.shape[0] <= step:
        return q.dequantize_blocks(blocks).reshape(shape)
    out = torch.empty(blocks.shape[0], q.block_size)  # [n_blocks, block_size]
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = q.dequantize_blocks(blocks[i:i + step])
    return out.reshape(shape)


def random_blocks(qtype: T | int, n_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [n_blocks, type_size] of valid random blocks with finite values of at most
    about RANDOM_WEIGHT_MAX, on the generator's device."""
    return quant_type(qtype).random_blocks(n_blocks, generator)
