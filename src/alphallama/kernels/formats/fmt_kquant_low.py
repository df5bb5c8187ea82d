"""Q2_K, Q3_K: 256-value super-blocks of 16 sub-blocks of 16, 2-bit codes.

A slot is a sub-block: 16 two-bit codes are one qs word (V = 1, P = 16), in k order.
Q2_K: value = (d * sc) * q - (dmin * m), 4-bit sc and m (the file's byte per slot, sc
in the low nibble, kept as it is in a uint8 sc plane), fp16 d, dmin per super-block.
Q3_K: value = (d * sc) * (q - 4), q = the 2-bit code | the hmask bit << 2, sc a 6-bit
scale stored minus 32 (an int8 plane, as Q6_K's), fp16 d per super-block. The hmask
bits of a slot are one int16 qh word (bit i: value i): 16 bits, not a 32-bit word, so
the planes stay near the file's size (114 bytes per 110-byte block: the 12 scale bytes
widen to 16).

d * sc and its product with q are exact in fp32, so the only rounding is Q2_K's final
subtraction (the kernels' fused multiply-add rounds it the same way): gguf's numpy
dequantizers' values, bit for bit.
"""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T

from .format import Format, f16_field, pack_high, pack_slots, torch_fields, torch_high, unpack_fields


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """64 code bytes per block -> 16 slots of 16 two-bit codes in k order: [R, nb * 16, 16].
    Each half of the super-block is 32 bytes; field j of its bytes is one run of 32 values."""
    R, nb = qs.shape[:2]
    return unpack_fields(qs.reshape(R, nb, 2, 32), 2).reshape(R, nb * 16, 16)  # [R, nb, 2, 4, 32] -> slots


def _per_slot(sd: torch.Tensor, width: int) -> torch.Tensor:
    """Per-super-block fp16 fields [R, nb * width] -> float32 [R, ns, width], one row per slot."""
    return sd.float().reshape(sd.shape[0], -1, width).repeat_interleave(16, dim=1)


# --- Q2_K: scales[16] qs[64] d dmin ---------------------------------------------------

def _pack_q2_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 84]
    R, nb = blocks.shape[:2]
    return {"qs": pack_slots(_crumbs(blocks[..., 16:80]), 2, 1),  # [R, ns]
            "sc": blocks[..., :16].reshape(R, nb * 16).contiguous(),  # [R, ns] uint8: sc | m << 4
            "sd": torch.stack([f16_field(blocks, 80), f16_field(blocks, 82)], dim=-1).flatten(1)}  # [R, nb * 2]


def _torch_q2_k(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    R = p["qs"].shape[0]
    q = torch_fields(p["qs"], 2, 1)  # [R, ns, 16]
    s = p["sc"].to(torch.int32)  # [R, ns]
    d, dmin = _per_slot(p["sd"], 2).unbind(-1)  # [R, ns] each
    ds = (d * (s & 0x0F).float())[..., None]  # [R, ns, 1]
    dm = (dmin * (s >> 4).float())[..., None]
    return (ds * q.float() - dm).reshape(R, K)


Q2_K = Format(T.Q2_K, slot=16, V=1, P=16, pack=_pack_q2_k, dequantize=_torch_q2_k)


# --- Q3_K: hmask[32] qs[64] scales[12] d ----------------------------------------------

def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """The 12 scale bytes -> 16 six-bit scales minus 32: int8 [R, nb, 16]. Scale i: the
    low nibble of byte i (i < 8) or the high nibble of byte i - 8, and bits 2 (i // 4)..+1
    of byte 8 + i % 4 on top."""
    low = unpack_fields(s[..., :8], 4).flatten(-2)  # [R, nb, 2, 8] -> 16
    high = unpack_fields(s[..., 8:], 2).flatten(-2)  # [R, nb, 4, 4] -> 16
    return ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)


def _pack_q3_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 110]
    R, nb = blocks.shape[:2]
    high = unpack_fields(blocks[..., :32], 1).reshape(R, nb * 16, 16)  # bit j of byte b: value 32 j + b
    return {"qs": pack_slots(_crumbs(blocks[..., 32:96]), 2, 1),  # [R, ns]
            "qh": pack_high(high, 1, 1, torch.int16),  # [R, ns] int16
            "sc": _q3_k_scales(blocks[..., 96:108]).reshape(R, nb * 16),  # [R, ns] int8
            "sd": f16_field(blocks, 108)}  # [R, nb]


def _torch_q3_k(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    R = p["qs"].shape[0]
    q = torch_fields(p["qs"], 2, 1) | (torch_high(p["qh"], 1, 1, 16) << 2)  # [R, ns, 16] in 0..7
    ds = (_per_slot(p["sd"], 1)[..., 0] * p["sc"].float())[..., None]  # [R, ns, 1]
    return (ds * (q.float() - 4)).reshape(R, K)


Q3_K = Format(T.Q3_K, slot=16, V=1, P=16, pack=_pack_q3_k, dequantize=_torch_q3_k)
