"""Q4_0, Q5_0, Q8_0: 32-value blocks with one fp16 scale d; a slot is one block.

value = d * (q - mid): Q4_0 q in 0..15 (mid 8), Q5_0 q in 0..31 (mid 16, fifth bit
in qh), Q8_0 q is int8. Each product is an fp16 times a small integer, exact in
fp32, so these match gguf's numpy dequantizers bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .formats import (Format, f16_field, pack_high, pack_words, packed_f32, packed_hi_f32, packed_scale, slot_field,
                      slot_words, torch_fields, torch_high, unpack_fields)


def _nibble_codes(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes per block -> 32 values in row order (low nibbles are 0..15): [R, nb, 32]."""
    return unpack_fields(qs, 4).flatten(-2)  # [R, nb, 2, 16] -> [R, nb, 32]


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's 4 qh bytes -> the fifth bit of each of the 32 values: [R, nb, 32]."""
    return unpack_fields(qh, 1).transpose(-1, -2).flatten(-2)  # [R, nb, 8 bits, 4 bytes] -> [R, nb, 32]


# --- Q4_0 ------------------------------------------------------------------------

def _pack_q4_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 18]
    return {"qs": pack_words(_nibble_codes(blocks[..., 2:]), 4).flatten(1),  # [R, nb * 4]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_q4_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = torch_fields(p["qs"].reshape(p["qs"].shape[0], -1, 4), 4, 8).float() - 8  # [R, ns, 4, 8]
    d = p["sc"].float()[..., None, None]  # [R, ns, 1, 1]
    return (q * d).reshape(-1, K)


@triton.jit
def _triton_q4_0(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr,
                 V: tl.constexpr, P: tl.constexpr):
    q = packed_f32(slot_words(qs, row, s0, n_slots, NT, V), 4, P, 8, one)  # [NT, BN, V, P]: (q - 8) * 2**pos
    d = slot_field(sc, row, s0, one, n_slots, NT).to(tl.float32)  # [NT, BN]
    return q * (d[:, :, None, None] * packed_scale(4, P)[None, None, None, :])


Q4_0 = Format(T.Q4_0, slot=32, V=4, P=8, pack=_pack_q4_0, dequantize=_torch_q4_0,
              triton_dequant=_triton_q4_0)


# --- Q5_0 ------------------------------------------------------------------------

def _pack_q5_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 22]
    return {"qs": pack_words(_nibble_codes(blocks[..., 6:]), 4).flatten(1),  # [R, nb * 4]
            "qh": pack_high(_high_bits(blocks[..., 2:6]), 1, 4, 8),  # [R, nb]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_q5_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    low = torch_fields(p["qs"].reshape(p["qs"].shape[0], -1, 4), 4, 8)  # [R, ns, 4, 8]
    q = (low | (torch_high(p["qh"], 1, 4, 8) << 4)).float() - 16  # [R, ns, 4, 8]
    return (q * p["sc"].float()[..., None, None]).reshape(-1, K)


@triton.jit
def _triton_q5_0(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr,
                 V: tl.constexpr, P: tl.constexpr):
    words = slot_words(qs, row, s0, n_slots, NT, V)  # [NT, BN, V]
    h = slot_field(qh, row, s0, one, n_slots, NT)  # [NT, BN]
    q = packed_hi_f32(words, h, 1, P, 16, one)  # [NT, BN, V, P]: (q - 16) * 2**pos
    d = slot_field(sc, row, s0, one, n_slots, NT).to(tl.float32)  # [NT, BN]
    return q * (d[:, :, None, None] * packed_scale(4, P)[None, None, None, :])


Q5_0 = Format(T.Q5_0, slot=32, V=4, P=8, pack=_pack_q5_0, dequantize=_torch_q5_0,
              triton_dequant=_triton_q5_0)


# --- Q8_0 ------------------------------------------------------------------------
# A slot is half a block (16 values, 4 words: one 16-byte load), two slots share d.
# The int8 values read as little-endian words are already "value 4v + i is byte i of
# word v": the plane is the block's bytes without the scale.

def _pack_q8_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 34]
    return {"qs": blocks[..., 2:].contiguous().view(torch.int32).flatten(1),  # [R, nb * 8]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_q8_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = p["qs"].reshape(p["qs"].shape[0], -1, 8).contiguous().view(torch.int8).float()  # [R, nb, 32]
    return (q * p["sc"].float()[..., None]).reshape(-1, K)


@triton.jit
def _triton_q8_0(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr,
                 V: tl.constexpr, P: tl.constexpr):
    # flipping each byte's sign bit turns int8 q into q + 128 in 0..255
    words = slot_words(qs, row, s0, n_slots, NT, V) ^ -0x7F7F7F80  # [NT, BN, V]; ^ 0x80808080
    q = packed_f32(words, 8, P, 128, one)  # [NT, BN, V, P]: q * 2**pos
    d = slot_field(sc, row, s0, one, n_slots, NT, 2).to(tl.float32)  # [NT, BN]
    return q * (d[:, :, None, None] * packed_scale(8, P)[None, None, None, :])


Q8_0 = Format(T.Q8_0, slot=16, V=4, P=4, pack=_pack_q8_0, dequantize=_torch_q8_0,
              triton_dequant=_triton_q8_0)
