"""The IQ formats (importance-matrix quants): codebook indices, sign bits and small
scales, in torch. The codebooks and the sign table are in iq_tables.py.

Order of the float ops, as in gguf.quants: the sub-block scale `db` first (fp16 d times
the scale expression, left to right), then `db * grid`, then `* sign`. Every product is
exact in fp32 (fp16 d times integers of a few bits), so kernels may reorder them.
"""
from __future__ import annotations

import torch
from gguf.constants import QK_K
from gguf.constants import GGMLQuantizationType as T

from . import iq_tables as tab
from .quant_base import (
    RANDOM_WEIGHT_MAX,
    QuantType,
    f16,
    f16_from_bits,
    le_words,
    random_bytes,
    sign_bits,
    uniform,
    unpack,
    unpack_bytewise,
)


def _lookup(grid: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Codebook points of `index` [...] -> float32 [..., dim]."""
    return grid.to(index.device)[index.long()]


def _levels(codes: torch.Tensor) -> torch.Tensor:
    """IQ4's 4-bit codes [...] -> their non-linear levels as float32 [...]."""
    return tab.IQ4_LEVELS.to(codes.device)[codes.long()].float()


class IQ4_NL(QuantType, qtype=T.IQ4_NL):
    """32 values, value = d * level[q]: fp16 d, 16 bytes of 4-bit codes (values 0-15 in
    the low nibbles, 16-31 in the high)."""
    f16_fields = (0,)
    max_q = 127.0

    @staticmethod
    def dequantize_blocks(blocks):
        return f16(blocks, 0) * _levels(unpack(blocks[:, 2:], 4).reshape(blocks.shape[0], 32))


class IQ4_XS(QuantType, qtype=T.IQ4_XS):
    """8 sub-blocks of 32, value = (d * (sc - 32)) * level[q] with a 6-bit sc.

    Layout: d (fp16), scales_h (u16: bits 2i..2i+1 are sc i's top bits), scales_l[4]
    (sc i's low nibble: nibble i % 2 of byte i // 2), qs[128] (16 bytes a sub-block,
    low nibbles first)."""
    f16_fields = (0,)
    max_q = 32 * 127.0

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        low = unpack_bytewise(blocks[:, 4:8], 4).to(torch.int16)  # [n, 8]
        shifts = torch.arange(0, 16, 2, dtype=torch.int64, device=blocks.device)  # [8]
        high = (le_words(blocks[:, 2:4], 2) >> shifts) & 3  # [n, 8]
        sc = (low | (high.to(torch.int16) << 4)) - 32  # [n, 8] in -32..31
        dl = (f16(blocks, 0) * sc.float()).unsqueeze(-1)  # [n, 8, 1]
        q = unpack(blocks[:, 8:].reshape(n, 8, 16), 4).reshape(n, 8, 32)  # [n, 8, 32]
        return (dl * _levels(q)).reshape(n, QK_K)


class _Grid8(QuantType):
    """IQ2_XXS / IQ2_XS / IQ2_S: groups of 8 values, one codebook point each, scale
    db = d * (0.5 + s) * 0.25 with a 4-bit s; value = db * point * sign."""
    f16_fields = (0,)
    max_q = 15.5 * 0.25 * 43


class IQ2_XXS(_Grid8, qtype=T.IQ2_XXS):
    """8 sub-blocks of 32, each two u32 words: word 0 the 4 point indices (bytes), word 1
    four 7-bit sign indices (bits 7j..) and the scale s (bits 28-31)."""

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        aux = le_words(blocks[:, 2:], 4).reshape(n, 8, 2)  # [n, 8, 2]
        db = f16(blocks, 0) * (0.5 + (aux[..., 1] >> 28).float()) * 0.25  # [n, 8]
        shifts = torch.arange(0, 28, 7, dtype=torch.int64, device=blocks.device)  # [4]
        signs = tab.signs_of((aux[..., 1:] >> shifts) & 127)  # [n, 8, 4, 8]
        points = _lookup(tab.GRID_IQ2_XXS, blocks[:, 2:].reshape(n, 8, 8)[..., :4])  # [n, 8, 4, 8]
        return (db[..., None, None] * points * signs).reshape(n, QK_K)


class IQ2_XS(_Grid8, qtype=T.IQ2_XS):
    """32 u16 codes (bits 0-8 a point index of 512, bits 9-15 a sign index), then 8
    bytes of 4-bit scales (nibble j of byte b: the 16 values 32 b + 16 j..)."""

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        codes = le_words(blocks[:, 2:66], 2)  # [n, 32]
        s = unpack_bytewise(blocks[:, 66:74], 4)  # [n, 16]
        db = f16(blocks, 0) * (0.5 + s.float()) * 0.25  # [n, 16]
        signs = tab.signs_of(codes >> 9).reshape(n, 16, 2, 8)
        points = _lookup(tab.GRID_IQ2_XS, codes & 511).reshape(n, 16, 2, 8)
        return (db[..., None, None] * points * signs).reshape(n, QK_K)


class IQ2_S(_Grid8, qtype=T.IQ2_S):
    """qs[32] (low 8 bits of point indices of 1024), signs[32] (one bit a value),
    qh[8] (2 high index bits a point, 4 points a byte), scales[8] as IQ2_XS."""

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        s = unpack_bytewise(blocks[:, 74:82], 4)  # [n, 16]
        db = f16(blocks, 0) * (0.5 + s.float()) * 0.25  # [n, 16]
        signs = sign_bits(blocks[:, 34:66]).reshape(n, 16, 2, 8)
        index = blocks[:, 2:34].long() | (unpack_bytewise(blocks[:, 66:74], 2).long() << 8)  # [n, 32]
        points = _lookup(tab.GRID_IQ2_S, index).reshape(n, 16, 2, 8)
        return (db[..., None, None] * points * signs).reshape(n, QK_K)


class IQ3_XXS(QuantType, qtype=T.IQ3_XXS):
    """8 sub-blocks of 32: qs[64] point indices (points of 4), then one u32 a sub-block
    (four 7-bit sign indices, scale s in bits 28-31); db = d * (0.5 + s) * 0.5."""
    f16_fields = (0,)
    max_q = 15.5 * 0.5 * 62

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        aux = le_words(blocks[:, 66:98], 4)  # [n, 8]
        db = f16(blocks, 0) * (0.5 + (aux >> 28).float()) * 0.5  # [n, 8]
        shifts = torch.arange(0, 28, 7, dtype=torch.int64, device=blocks.device)  # [4]
        signs = tab.signs_of((aux.unsqueeze(-1) >> shifts) & 127)  # [n, 8, 4, 8]
        points = _lookup(tab.GRID_IQ3_XXS, blocks[:, 2:66]).reshape(n, 8, 4, 8)
        return (db[..., None, None] * points * signs).reshape(n, QK_K)


class IQ3_S(QuantType, qtype=T.IQ3_S):
    """8 sub-blocks of 32: qs[64] low 8 bits of point indices of 512, qh[8] (bit 8 of
    point 8 b + j), signs[32] (one bit a value), scales[4] (4-bit, nibble j of byte b for
    sub-block 2 b + j); db = d * (1 + 2 s)."""
    f16_fields = (0,)
    max_q = 31 * 15.0

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        s = unpack_bytewise(blocks[:, 106:110], 4)  # [n, 8]
        db = f16(blocks, 0) * (1 + 2 * s).float()  # [n, 8]
        index = blocks[:, 2:66].long() | (unpack_bytewise(blocks[:, 66:74], 1).long() << 8)  # [n, 64]
        points = _lookup(tab.GRID_IQ3_S, index).reshape(n, 8, 4, 8)
        signs = sign_bits(blocks[:, 74:106]).reshape(n, 8, 4, 8)
        return (db[..., None, None] * points * signs).reshape(n, QK_K)


class _Grid1(QuantType):
    """IQ1_S / IQ1_M: groups of 8 values, a point of {-1, 0, 1}^8 plus or minus delta,
    value = (d * (2 s + 1)) * (point + delta) with a 3-bit s."""
    max_q = 15 * (1 + 1 / 8)


class IQ1_S(_Grid1, qtype=T.IQ1_S):
    """d (fp16), qs[32] (low 8 index bits of 32 points of 2048), qh[8] u16 a sub-block
    of 32: bits 3j..3j+2 index bits 8-10 of point j, bits 12-14 s, bit 15 delta's sign."""
    f16_fields = (0,)

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        qh = le_words(blocks[:, 34:50], 2)  # [n, 8]
        dl = f16(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).float()  # [n, 8]
        delta = torch.where(qh & 0x8000 == 0, tab.IQ1_DELTA, -tab.IQ1_DELTA)  # [n, 8]
        shifts = torch.arange(0, 12, 3, dtype=torch.int64, device=blocks.device)  # [4]
        index = blocks[:, 2:34].long() | (((qh.unsqueeze(-1) >> shifts) & 7) << 8).reshape(n, 32)
        points = _lookup(tab.GRID_IQ1_S, index).reshape(n, 8, 4, 8)
        return (dl[..., None, None] * (points + delta[..., None, None])).reshape(n, QK_K)


class IQ1_M(_Grid1, qtype=T.IQ1_M):
    """qs[32] (low 8 index bits), qh[16] (a nibble a point: index bits 8-10, bit 3
    delta's sign), scales as 4 u16: bits 3j..3j+2 the s of each 16 values, and the top
    nibbles of the 4 words together the fp16 d (the only format whose d is split)."""

    @staticmethod
    def _d(sc: torch.Tensor) -> torch.Tensor:
        """4 u16 scale words [n, 4] -> d as float32 [n, 1]."""
        shifts = torch.tensor([12, 8, 4, 0], dtype=torch.int64, device=sc.device)
        bits = ((sc & 0xF000) >> shifts).sum(-1, keepdim=True)  # [n, 1], nibbles disjoint
        return f16_from_bits(bits)

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        sc = le_words(blocks[:, 48:56], 2)  # [n, 4]
        shifts = torch.arange(0, 12, 3, dtype=torch.int64, device=blocks.device)  # [4]
        s = ((sc.unsqueeze(-1) >> shifts) & 7).reshape(n, 16)  # [n, 16]
        dl = IQ1_M._d(sc) * (2 * s + 1).float()  # [n, 16]
        qh = unpack_bytewise(blocks[:, 32:48], 4)  # [n, 32]
        delta = torch.where(qh & 8 == 0, tab.IQ1_DELTA, -tab.IQ1_DELTA)  # [n, 32]
        points = _lookup(tab.GRID_IQ1_S, blocks[:, :32].long() | ((qh & 7).long() << 8))  # [n, 32, 8]
        x = points.reshape(n, 16, 2, 8) + delta.reshape(n, 16, 2, 1)
        return (dl[..., None, None] * x).reshape(n, QK_K)

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        blocks = random_bytes(n_blocks, cls.type_size, generator)  # [n, 56]
        d = uniform(n_blocks, 0.5, 1.0, generator) * (RANDOM_WEIGHT_MAX / cls.max_q)
        bits = d.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF  # [n]
        sc = le_words(blocks[:, 48:56], 2) & 0x0FFF  # [n, 4]
        shifts = torch.tensor([12, 8, 4, 0], dtype=torch.int64, device=blocks.device)
        sc |= ((bits.unsqueeze(-1) << shifts) & 0xF000)
        words = torch.stack([sc & 0xFF, sc >> 8], dim=-1).reshape(n_blocks, 8)
        blocks[:, 48:56] = words.to(torch.uint8)
        return blocks
