"""Q4_0, Q5_0, Q8_0, Q4_1, Q5_1: 32-value blocks with an fp16 scale d (and min m).

value = d * (q - mid): Q4_0 q in 0..15 (mid 8), Q5_0 q in 0..31 (mid 16, fifth bit
in qh), Q8_0 q is int8. Q4_1/Q5_1: value = d * q + m, q in 0..15 / 0..31 (the fifth
bit in qh as Q5_0's). Each product is an fp16 times a small integer, exact in fp32,
so the only rounding is Q4_1/Q5_1's one addition of m: these match gguf's numpy
dequantizers bit for bit (and the kernels' fused multiply-add rounds the same way).
A Q4_0/Q5_0/Q4_1/Q5_1 slot is a block; a Q8_0 slot is half a block (16 values, one
16-byte load) and two share d. Q4_1/Q5_1 keep d and m side by side in an fp16 sc
plane [R, nb * 2] (the file's first 4 bytes of each block, as they are).
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


def _codes_5bit(p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Q5_0/Q5_1 codes 0..31 in k order: int32 [R, ns, 32]."""
    return torch_fields(p["qs"], 4, 4) | (torch_high(p["qh"], 1, 4, 8) << 4)


def _torch_q5_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = _codes_5bit(p).float() - 16  # [R, ns, 32]
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


# --- Q4_1, Q5_1: value = d * q + m ---------------------------------------------------

def _dm_plane(blocks: torch.Tensor) -> torch.Tensor:
    """The fp16 d and m of each block, side by side: [R, nb, >= 4] bytes -> float16 [R, nb * 2]."""
    return blocks[..., 0:4].contiguous().view(torch.float16).flatten(1)  # [R, nb * 2]: d0 m0 d1 m1 ..


def _with_min(q: torch.Tensor, dm: torch.Tensor, K: int) -> torch.Tensor:
    """codes [R, ns, 32] and the dm plane [R, ns * 2] -> d * q + m: float32 [R, K]."""
    d, m = dm.float().reshape(dm.shape[0], -1, 2).unbind(-1)  # [R, ns] each
    return (q.float() * d[..., None] + m[..., None]).reshape(-1, K)


def _pack_q4_1(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 20]
    return {"qs": pack_slots(_nibble_codes(blocks[..., 4:]), 4, 4),  # [R, nb * 4]
            "sc": _dm_plane(blocks)}  # [R, nb * 2]


def _torch_q4_1(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    return _with_min(torch_fields(p["qs"], 4, 4), p["sc"], K)


Q4_1 = Format(T.Q4_1, slot=32, V=4, P=8, pack=_pack_q4_1, dequantize=_torch_q4_1)


def _pack_q5_1(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 24]
    return {"qs": pack_slots(_nibble_codes(blocks[..., 8:]), 4, 4),  # [R, nb * 4]
            "qh": pack_high(_high_bits(blocks[..., 4:8]), 1, 4),  # [R, nb]
            "sc": _dm_plane(blocks)}  # [R, nb * 2]


def _torch_q5_1(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    return _with_min(_codes_5bit(p), p["sc"], K)


Q5_1 = Format(T.Q5_1, slot=32, V=4, P=8, pack=_pack_q5_1, dequantize=_torch_q5_1)
