"""qgemv_i8_grid: the int8 form of the codebook ("grid") formats in the dense decode GEMV
(qgemv_i8): IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S (the signed ones; IQ1's delta is not
a sign, so IQ1_S / IQ1_M have none).

A slot is the format's group of 8 values (fmt_grid.py), loaded by the fp32 GEMV's own load
(fmt_triton_grid.grid_load): its point bytes as 2 words (word v: values 2v, 2v + 1, 4 + 2v,
5 + 2v of the group), the group word g (the 8 signs at bits 20..27, bit j = value j) and
db = d (2 s + 1) C, the same float the fp32 GEMV multiplies by (exact in fp32: gguf's
d (0.5 + s) 0.5 for IQ3_XXS, C = 1/4; d (1 + 2 s) for IQ3_S, C = 1; d (0.5 + s) 0.25 for
the IQ2s, C = 1/8; IQ2_XXS's and IQ2_XS's eighth sign is the parity of their 7, made by
the load). The points' values
are small and unsigned (IQ3_XXS: 4..62, IQ3_S 1..15, IQ2 8..43: all < 128), so each byte
becomes the biased signed value

    lane = 128 + sign * point  (66..190: dp4a's unsigned operand)

with no carry between bytes (grid_lanes: a byte mask of the signs, an XOR and an add of
1 where negative, 128 - p = (p ^ 0x7F) + 1). The 8 activations of a slot are in the
words' byte order (qmatvec_i8.lane_order (8, 2, 8): slot 8, 2 words of 8-bit lanes; one
record (sum of q, dx) a group), and per slot and x row

    isum = dp4a(lane word 0, x) + dp4a(lane word 1, x) - 128 * xsum
         = sum_k sign_k point_k xq_k                       exact (|isum| <= 8 * 62 * 127: IQ3_XXS's
                                                            largest point; IQ3_S's is 15)
    t    = db * float(isum)                                 db exact; one rounding, as the
                                                            other formats' A * float(isum)

so a weight's value is db * sign * point, the fp32 GEMV's (and gguf's) bit for bit, and the
kernel's float order is qgemv_i8's (a row's bits do not depend on W or its column).
The lanes are integer shifts and masks, the same on the GPU and in the interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

TABLE_GRID = 3          # qgemv_i8's TABLE constexpr of these formats (qgemv_i8_table.TABLE_CODES)

# qtype -> (BITS, HBITS, BIAS, HAS_MIN, TABLE): 8-bit lanes, biased by 128, no min term
GRID_CODES: dict[T, tuple[int, int, int, bool, int]] = {
    T.IQ3_XXS: (8, 0, 128, False, TABLE_GRID), T.IQ3_S: (8, 0, 128, False, TABLE_GRID),
    T.IQ2_XXS: (8, 0, 128, False, TABLE_GRID), T.IQ2_XS: (8, 0, 128, False, TABLE_GRID),
    T.IQ2_S: (8, 0, 128, False, TABLE_GRID)}


@triton.jit
def grid_lanes(words, g):
    """A step's point words [NT, BN, 2] and group words g [NT, BN] -> the biased values
    128 + sign * point in the words' byte lanes, int32 [NT, BN, 2]."""
    v = tl.arange(0, 2)[None, None, :]                                   # [1, 1, 2]
    gu = g.to(tl.uint32, bitcast=True)[:, :, None]                       # [NT, BN, 1]
    t = (gu >> (20 + 2 * v)) & 0x33           # signs of word v's bytes 0, 1 at bits 0, 1; of bytes 2, 3 at 4, 5
    t = t | (t << 7)                          # byte 1's at bit 8, byte 3's at 12
    m = (t | (t << 12)) & 0x01010101          # bits 0, 8, 16, 24: 1 in each negative byte
    u = words.to(tl.uint32, bitcast=True)
    lanes = (u ^ (m * 0xFF) ^ 0x80808080) + m  # + p: p ^ 0x80; - p: (p ^ 0x7F) + 1 (no carry: p < 128)
    return lanes.to(tl.int32, bitcast=True)
