"""Q4_0, Q5_0, Q8_0: 32-value blocks with one fp16 scale d.

value = d * (q - mid): Q4_0 q in 0..15 (mid 8), Q5_0 q in 0..31 (mid 16, fifth bit
in qh), Q8_0 q is int8. Each product is an fp16 times a small integer, exact in
fp32, so these match gguf's numpy dequantizers bit for bit. A Q4_0/Q5_0 slot is a
block; a Q8_0 slot is half a block (16 values, one 16-byte load) and two share d.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .formats import (Format, codes_f32, f16_field, field_scale, pack_high, pack_slots, slot_field,
                      slot_words, torch_fields, torch_high, unpack_fields, word_order)


def _nibble_codes(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes per block -> 32 values in k order (low nibbles are 0..15): [R, nb, 32]."""
    return unpack_fields(qs, 4).flatten(-2)  # [R, nb, 2, 16] -> [R, nb, 32]


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's 4 qh bytes -> the fifth bit of each of the 32 values: [R, nb, 32]."""
    return unpack_fields(qh, 1).transpose(-1, -2).flatten(-2)  # [R, nb, 8 bits, 4 bytes] -> [R, nb, 32]


@triton.jit
def _load_d(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Words and the per-slot d (as both scale outputs): Q4_0."""
    d = slot_field(sc, row, s0, one, n_slots, NT).to(tl.float32)  # [NT, BN]
    return slot_words(qs, row, s0, n_slots, NT, V), d, d, d


# --- Q4_0 ------------------------------------------------------------------------

def _pack_q4_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 18]
    return {"qs": pack_slots(_nibble_codes(blocks[..., 2:]), 4, 4),  # [R, nb * 4]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_q4_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = torch_fields(p["qs"], 4, 4).float() - 8  # [R, ns, 32]
    return (q * p["sc"].float()[..., None]).reshape(-1, K)


@triton.jit
def _field_q4_0(words, h, d, s2, I: tl.constexpr, one):
    q = codes_f32(words, h, I, 4, 0, 8, one)  # [NT, BN, V]: (q - 8) * 2**pos
    return q * (d * field_scale(I, 4))[:, :, None]


Q4_0 = Format(T.Q4_0, slot=32, V=4, P=8, pack=_pack_q4_0, dequantize=_torch_q4_0,
              triton_load=_load_d, triton_field=_field_q4_0)


# --- Q5_0 ------------------------------------------------------------------------

def _pack_q5_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 22]
    return {"qs": pack_slots(_nibble_codes(blocks[..., 6:]), 4, 4),  # [R, nb * 4]
            "qh": pack_high(_high_bits(blocks[..., 2:6]), 1, 4),  # [R, nb]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_q5_0(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = (torch_fields(p["qs"], 4, 4) | (torch_high(p["qh"], 1, 4, 8) << 4)).float() - 16  # [R, ns, 32]
    return (q * p["sc"].float()[..., None]).reshape(-1, K)


@triton.jit
def _load_q5_0(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    d = slot_field(sc, row, s0, one, n_slots, NT).to(tl.float32)  # [NT, BN]
    return slot_words(qs, row, s0, n_slots, NT, V), slot_field(qh, row, s0, one, n_slots, NT), d, d


@triton.jit
def _field_q5_0(words, h, d, s2, I: tl.constexpr, one):
    q = codes_f32(words, h, I, 4, 1, 16, one)  # [NT, BN, V]: (q - 16) * 2**pos
    return q * (d * field_scale(I, 4))[:, :, None]


Q5_0 = Format(T.Q5_0, slot=32, V=4, P=8, pack=_pack_q5_0, dequantize=_torch_q5_0,
              triton_load=_load_q5_0, triton_field=_field_q5_0)


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


@triton.jit
def _load_q8_0(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    # flipping each byte's sign bit turns int8 q into q + 128 in 0..255
    words = slot_words(qs, row, s0, n_slots, NT, V) ^ -0x7F7F7F80  # [NT, BN, V]; ^ 0x80808080
    d = slot_field(sc, row, s0, one, n_slots, NT, 2).to(tl.float32)  # [NT, BN]
    return words, words, d, d


@triton.jit
def _field_q8_0(words, h, d, s2, I: tl.constexpr, one):
    q = codes_f32(words, h, I, 8, 0, 128, one)  # [NT, BN, V]: q * 2**pos
    return q * (d * field_scale(I, 8))[:, :, None]


Q8_0 = Format(T.Q8_0, slot=16, V=4, P=4, pack=_pack_q8_0, dequantize=_torch_q8_0,
              triton_load=_load_q8_0, triton_field=_field_q8_0)
