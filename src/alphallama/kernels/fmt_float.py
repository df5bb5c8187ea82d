"""F32, F16, BF16 weights: no scales; a slot is one 16-byte vector of values."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .formats import Format, slot_words


def _packer(dtype: torch.dtype):
    def pack(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, K, itemsize]
        return {"qs": blocks.contiguous().view(dtype).flatten(1)}  # [R, K]
    return pack


def _torch_float(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    return p["qs"].float().reshape(-1, K)


@triton.jit
def _load_float(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    w = slot_words(qs, row, s0, n_slots, NT, V)  # [NT, BN, V] in the weight's dtype
    return w, w, w, w


@triton.jit
def _field_float(w, h, s1, s2, I: tl.constexpr, one):
    return w.to(tl.float32)  # [NT, BN, V]


F32 = Format(T.F32, slot=4, V=4, P=1, pack=_packer(torch.float32), dequantize=_torch_float,
             triton_load=_load_float, triton_field=_field_float, qs_dtype=torch.float32)
F16 = Format(T.F16, slot=8, V=8, P=1, pack=_packer(torch.float16), dequantize=_torch_float,
             triton_load=_load_float, triton_field=_field_float, qs_dtype=torch.float16)
BF16 = Format(T.BF16, slot=8, V=8, P=1, pack=_packer(torch.bfloat16), dequantize=_torch_float,
              triton_load=_load_float, triton_field=_field_float, qs_dtype=torch.bfloat16)
