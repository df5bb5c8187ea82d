"""F32, F16, BF16 weights: no scales; a slot is one 16-byte vector of values."""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T

from .format import Format


def _packer(dtype: torch.dtype):
    def pack(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, K, itemsize]
        return {"qs": blocks.contiguous().view(dtype).flatten(1)}  # [R, K]
    return pack


def _torch_float(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    return p["qs"].float().reshape(-1, K)


F32 = Format(T.F32, slot=4, V=4, P=1, pack=_packer(torch.float32), dequantize=_torch_float, qs_dtype=torch.float32)
F16 = Format(T.F16, slot=8, V=8, P=1, pack=_packer(torch.float16), dequantize=_torch_float, qs_dtype=torch.float16)
BF16 = Format(T.BF16, slot=8, V=8, P=1, pack=_packer(torch.bfloat16), dequantize=_torch_float, qs_dtype=torch.bfloat16)
