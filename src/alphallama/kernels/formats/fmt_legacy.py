"""Q4_0, Q5_0, Q8_0: 32-value blocks with one fp16 scale d.

value = d * (q - mid): Q4_0 q in 0..15 (mid 8), Q5_0 q in 0..31 (mid 16, fifth bit
in qh), Q8_0 q is int8. Each product is an fp16 times a small integer, exact in
fp32, so these match gguf's numpy dequantizers bit for bit. A Q4_0/Q5_0 slot is a
block; a Q8_0 slot is half a block (16 values, one 16-byte load) and two share d.
"""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T

from .format import Format, f16_field, pack_high, pack_slots, torch_fields, torch_high, unpack_fields, word_order


def _nibble_codes(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes per block -> 32 values in k order (low nibbles are 0..15): [R, nb, 32]."""
    return unpack_fields(qs, 4).flatten(-2)  # [R, nb, 2, 16] -> [R, nb, 32]


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's 4 qh bytes -> the fifth bit of each of the 32 values: [R, nb, 32]."""
    return unpack_fields(qh, 1).transpose(-1, -2).flatten(-2)  # [R, nb, 8 bits, 4 bytes] -> [R, nb, 32]


# --- Q4_0 ------------------------------------------------------------------------

def _pack_q4_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 18]
    return {"qs": pack_slots(_nibble_codes(blocks[..., 2:]), 4, 4),  # [R, nb * 4]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_q4_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = torch_fields(p["qs"], 4, 4).float() - 8  # [R, ns, 32]
    return (q * p["sc"].float()[..., None]).reshape(-1, K)


Q4_0 = Format(T.Q4_0, slot=32, V=4, P=8, pack=_pack_q4_0, dequantize=_torch_q4_0)


# --- Q5_0 ------------------------------------------------------------------------

def _pack_q5_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 22]
    return {"qs": pack_slots(_nibble_codes(blocks[..., 6:]), 4, 4),  # [R, nb * 4]
            "qh": pack_high(_high_bits(blocks[..., 2:6]), 1, 4),  # [R, nb]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_q5_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = (torch_fields(p["qs"], 4, 4) | (torch_high(p["qh"], 1, 4, 8) << 4)).float() - 16  # [R, ns, 32]
    return (q * p["sc"].float()[..., None]).reshape(-1, K)


Q5_0 = Format(T.Q5_0, slot=32, V=4, P=8, pack=_pack_q5_0, dequantize=_torch_q5_0)


# --- Q8_0 ------------------------------------------------------------------------

def _pack_q8_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 34]
    R, nb = blocks.shape[:2]
    q = word_order(blocks[..., 2:].reshape(R, nb * 2, 16), 4, 4)  # [R, ns, 16] bytes in word order
    return {"qs": q.contiguous().view(torch.int32).flatten(1),  # [R, ns * 4]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_q8_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = ((torch_fields(p["qs"], 8, 4) ^ 0x80) - 128).float()  # [R, ns, 16]: bytes as int8
    d = p["sc"].float().repeat_interleave(2, dim=1)  # [R, ns]
    return (q * d[..., None]).reshape(-1, K)


Q8_0 = Format(T.Q8_0, slot=16, V=4, P=4, pack=_pack_q8_0, dequantize=_torch_q8_0)
