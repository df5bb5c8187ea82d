"""IQ4_NL, IQ4_XS: 4-bit codes that index 16 non-linear int8 levels.

IQ4_NL: 32-value blocks, value = d * level[q], fp16 d: Q4_0's layout with the level in
place of q - 8. IQ4_XS: 256-value super-blocks of 8 sub-blocks of 32, value =
(d * sc) * level[q] with a 6-bit sc stored minus 32 (an int8 sc plane) and fp16 d per
super-block (the sd plane). A slot is 32 values (one scale) in both.

The levels are a published table of the format (gguf/iq_tables.py reads the gguf
package's). The kernels hold them as four int32 words of biased bytes (level + 128, byte
q % 4 of word q // 4: `level_words`), picked by the code's bits with three selects and a
shift, no memory lookup. d * level (IQ4_NL) and d * sc are exact in fp32; IQ4_XS's
(d * sc) * level rounds once, in the same order as gguf's numpy dequantizers: bit for bit.
"""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T

from ...gguf.iq_tables import IQ4_LEVELS
from .format import Format, f16_field, pack_slots, torch_fields, unpack_fields


def level_words(levels: torch.Tensor) -> tuple[int, int, int, int]:
    """The 16 int8 levels as four int32 words (Python ints in the int32 range): byte b of
    word j holds level 4 j + b plus 128."""
    biased = (levels.to(torch.int32) + 128).tolist()  # [16] in 0..255
    words = [sum(biased[4 * j + b] << (8 * b) for b in range(4)) for j in range(4)]
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)


def words_levels(words: tuple[int, ...]) -> torch.Tensor:
    """The inverse of level_words, as the kernels read it: int8 [16]."""
    w = torch.tensor(words, dtype=torch.int64)  # [4]
    q = torch.arange(16)
    return (((w[q // 4] >> (8 * (q % 4))) & 0xFF) - 128).to(torch.int8)


LEVEL_WORDS = level_words(IQ4_LEVELS)


def _codes(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes per 32 values -> 32-value slots of codes in k order (low nibbles
    first): uint8 [R, nb, 16 n] -> [R, nb * n, 32]."""
    R = qs.shape[0]
    return unpack_fields(qs.reshape(R, -1, 16), 4).flatten(-2)  # [R, nb * n, 2, 16] -> [R, nb * n, 32]


def _levels(p: dict[str, torch.Tensor]) -> torch.Tensor:
    """The planes' codes as their levels: float32 [R, ns, 32]."""
    return IQ4_LEVELS.to(p["qs"].device)[torch_fields(p["qs"], 4, 4).long()].float()


# --- IQ4_NL: d, qs[16] -----------------------------------------------------------------

def _pack_iq4_nl(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 18]
    return {"qs": pack_slots(_codes(blocks[..., 2:]), 4, 4),  # [R, nb * 4]
            "sc": f16_field(blocks, 0)}  # [R, nb]


def _torch_iq4_nl(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    return (p["sc"].float()[..., None] * _levels(p)).reshape(-1, K)


IQ4_NL = Format(T.IQ4_NL, slot=32, V=4, P=8, pack=_pack_iq4_nl, dequantize=_torch_iq4_nl)


# --- IQ4_XS: d, scales_h (u16), scales_l[4], qs[128] ------------------------------------

def _iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """The 8 six-bit scales minus 32: int8 [R, nb, 8]. Scale i: nibble i % 2 of scales_l
    byte i // 2, and bits 2 i..2 i + 1 of scales_h on top."""
    low = unpack_fields(blocks[..., 4:8], 4).transpose(-1, -2).flatten(-2)  # [R, nb, 4 bytes, 2] -> 8
    high = unpack_fields(blocks[..., 2:4], 2).transpose(-1, -2).flatten(-2)  # [R, nb, 2 bytes, 4] -> 8
    return ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)


def _pack_iq4_xs(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 136]
    R, nb = blocks.shape[:2]
    return {"qs": pack_slots(_codes(blocks[..., 8:]), 4, 4),  # [R, ns * 4]
            "sc": _iq4_xs_scales(blocks).reshape(R, nb * 8),  # [R, ns] int8
            "sd": f16_field(blocks, 0)}  # [R, nb]


def _torch_iq4_xs(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    d = p["sd"].float().repeat_interleave(8, dim=1)  # [R, ns]
    return ((d * p["sc"].float())[..., None] * _levels(p)).reshape(-1, K)


IQ4_XS = Format(T.IQ4_XS, slot=32, V=4, P=8, pack=_pack_iq4_xs, dequantize=_torch_iq4_xs)
