"""The k-quants: 256-value super-blocks of sub-blocks with their own scales, in torch.

Order of the float ops, as in gguf.quants: fp16 -> fp32, `d * sc`, then `* q`, then
`- dmin * m`. Every product is an fp16 scale times integers of at most 12 more bits, so
it is exact in fp32; only the final subtraction rounds.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from gguf.constants import QK_K
from gguf.constants import GGMLQuantizationType as T

from .quant_base import QuantType, f16, put_f16, unpack

# --- k-quants: 256-value super-blocks of sub-blocks with their own scales ---------

def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte scale field of Q4_K/Q5_K into 8 six-bit scales and 8 mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes
    4-7 the same for mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and
    mins 4-7 (high nibble)."""
    s, m, sm = scales.reshape(-1, 3, 4).unbind(1)  # 3 x [n, 4]
    sc = torch.cat([s & 0x3F, (sm & 0x0F) | ((s >> 2) & 0x30)], dim=1)  # [n, 8]
    mn = torch.cat([m & 0x3F, (sm >> 4) | ((m >> 2) & 0x30)], dim=1)  # [n, 8]
    return sc, mn


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 2-bit codes: 64 bytes per block -> [n, 16, 16] (sub-block, value).
    Each half of the super-block is 32 bytes; field j of its bytes is one run of 32 values."""
    return unpack(qs.reshape(qs.shape[0], 2, 32), 2).reshape(-1, 16, 16)


class Q2_K(QuantType, qtype=T.Q2_K):
    """16 sub-blocks of 16, value = (d * sc) * q - (dmin * m), 4-bit sc and m, 2-bit q.

    Layout: scales[16] (sc low nibble, m high nibble), qs[64], d, dmin (fp16)."""
    f16_fields = (80, 82)
    max_q = 15 * 1.5

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        d, dmin = f16(blocks, 80), f16(blocks, 82)  # [n, 1] each
        sc = blocks[:, :16]  # [n, 16]
        dl = (d * (sc & 0x0F).float()).unsqueeze(-1)  # [n, 16, 1]
        ml = (dmin * (sc >> 4).float()).unsqueeze(-1)  # [n, 16, 1]
        return (dl * _crumbs(blocks[:, 16:80]).float() - ml).reshape(n, QK_K)

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        # every min equal to its scale and dmin = 1.5 d: d * sc * (q - 1.5), centred on zero
        blocks = super().random_blocks(n_blocks, generator)  # [n, type_size]
        put_f16(blocks, 82, f16(blocks, 80).squeeze(1) * 1.5)
        blocks[:, :16] = (blocks[:, :16] & 0x0F) * 0x11
        return blocks


class Q3_K(QuantType, qtype=T.Q3_K):
    """16 sub-blocks of 16, value = (d * (sc - 32)) * (q - 4 * (1 - h)), 6-bit sc, 2-bit q,
    one high bit h (set: no offset).

    Layout: hmask[32] (bit j of byte b: value 32 j + b), qs[64], scales[12], d (fp16).
    Scale i: the low nibble of byte i (i < 8) or high nibble of byte i - 8, and bits
    2 (i // 4)..+1 of byte 8 + i % 4 on top."""
    f16_fields = (108,)
    max_q = 32 * 4

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        s = blocks[:, 96:108]
        low = unpack(s[:, :8], 4).reshape(n, 16)  # [n, 16]
        high = unpack(s[:, 8:], 2).reshape(n, 16)  # [n, 16]
        sc = ((low | (high << 4)).to(torch.int16) - 32).float()  # [n, 16] in -32..31
        h = unpack(blocks[:, :32], 1).reshape(n, 16, 16).to(torch.int16)  # [n, 16, 16]
        q = _crumbs(blocks[:, 32:96]).to(torch.int16) - 4 * (1 - h)  # [n, 16, 16] in -4..3
        dl = (f16(blocks, 108) * sc).unsqueeze(-1)  # [n, 16, 1]
        return (dl * q.float()).reshape(n, QK_K)


class _KWithMin(QuantType):
    """Q4_K/Q5_K: 8 sub-blocks of 32, value = (d * sc) * q - (dmin * m), 6-bit sc and m."""
    f16_fields = (0, 2)
    q_mid: ClassVar[float]   # middle of q's range

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        # Every min equal to its scale and dmin = q_mid * d make each sub-block
        # d * sc * (q - q_mid): centred on zero like real weights, |value| <= 63 q_mid d.
        blocks = super().random_blocks(n_blocks, generator)  # [n, type_size]
        put_f16(blocks, 2, f16(blocks, 0).squeeze(1) * cls.q_mid)
        blocks[:, 8:12] = blocks[:, 4:8]  # mins 0-3 and top bits of mins 4-7 = the scales'
        blocks[:, 12:16] = (blocks[:, 12:16] & 0x0F) * 0x11  # low 4 bits of min 4-7 = scale's
        return blocks


class Q4_K(_KWithMin, qtype=T.Q4_K):
    q_mid = 7.5
    max_q = 63 * 7.5
    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        d, dmin = f16(blocks, 0), f16(blocks, 2)  # [n, 1] each
        sc, m = _k_scales(blocks[:, 4:16])  # [n, 8] each
        q = unpack(blocks[:, 16:].reshape(n, 4, 32), 4).reshape(n, 8, 32)  # sub-block 2i+1 = high nibbles
        d = (d * sc.float()).unsqueeze(-1)  # [n, 8, 1]
        dm = (dmin * m.float()).unsqueeze(-1)  # [n, 8, 1]
        return (d * q.float() - dm).reshape(n, QK_K)


class Q5_K(_KWithMin, qtype=T.Q5_K):
    q_mid = 15.5
    max_q = 63 * 15.5

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        d, dmin = f16(blocks, 0), f16(blocks, 2)  # [n, 1] each
        sc, m = _k_scales(blocks[:, 4:16])  # [n, 8] each
        qh = unpack(blocks[:, 16:48], 1)  # [n, 8, 32]: sub-block k's fifth bits are bit k
        ql = unpack(blocks[:, 48:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
        q = ql | (qh << 4)  # [n, 8, 32] in 0..31
        d = (d * sc.float()).unsqueeze(-1)  # [n, 8, 1]
        dm = (dmin * m.float()).unsqueeze(-1)  # [n, 8, 1]
        return (d * q.float() - dm).reshape(n, QK_K)


class Q6_K(QuantType, qtype=T.Q6_K):
    """16 sub-blocks of 16, value = (d * sc) * (q - 32) with int8 sc and 6-bit q.

    Layout: ql[128] (low 4 bits), qh[64] (high 2 bits), sc[16] (int8), d (fp16)."""
    f16_fields = (208,)
    max_q = 128 * 32

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        # each half of the super-block (128 values) uses 64 ql bytes and 32 qh bytes
        ql = unpack(blocks[:, :128].reshape(n, 2, 64), 4).reshape(n, 8, 32)
        qh = unpack(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
        q = ((ql | (qh << 4)).float() - 32).reshape(n, 16, 16)  # [n, 16, 16] in -32..31
        sc = blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
        d = (f16(blocks, 208) * sc).unsqueeze(-1)  # [n, 16, 1]
        return (d * q).reshape(n, QK_K)
