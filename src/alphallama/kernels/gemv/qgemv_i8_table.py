"""qgemv_i8_table: the int8 form of the table formats (IQ4_NL, IQ4_XS, MXFP4) in the dense
decode GEMV (qgemv_i8), which the expert contract (expert_q8.SLOT_TERMS) does not have.

Their 4-bit codes index 16 non-linear int8 levels (fmt_iq4.py; MXFP4's doubled E2M1
levels, fmt_misc.E2M1_WORDS: 0, 1, 2, 3, 4, 6, 8, 12 and their negations), so a qs word's codes
cannot go straight into dp4a's byte lanes as the affine formats' do: each lane takes a
table lookup first. The lanes hold the biased levels (level + 128, fmt_iq4.level_words:
0..255, dp4a's unsigned operand) and the slot's integer sum takes BIAS * xsum off, as
Q8_0's does (its load flips the bytes' sign bits). So per slot and x row

    isum = sum of dp4a(biased levels, x) - 128 * xsum = sum_k level_k xq_k     (exact)
    t    = A * float(isum)        A = d (IQ4_NL) or d * sc (IQ4_XS): exact in fp32;
                                  MXFP4: A = d = 2^(e - 128) (the load's, from e's bits)

(float(isum) exact: |isum| < 2^24; one rounding in A * isum, as every format's. MXFP4's
is exact too: |isum| <= 32 * 12 * 127 < 2^16 and A a power of two, so t is the slot's
exact sum of d * level * xq wherever d is normal and t finite, e in 2..239; the fp32
GEMV's d * level products are exact as well)
and qgemv_i8 goes on as for any format (its float order, tiles, split runs, epilogue
add). The lanes are those of unpack_lanes (lo: fields 0, 2, 4, 6 of a qs word; hi: 1, 3,
5, 7), so the activations are Q4_K's lane order (qmatvec_i8.lane_order: one prepare
serves both).

On CUDA the lookup is byte permutes (PTX prmt: a 4-byte result from an 8-byte pool by
four 3-bit selectors), as llama.cpp's get_int_from_table_16: for a qs word's codes
0..3, one permute over the table's levels 0..7 and one over 8..15 by the codes' low 3
bits, then one picking each byte from either by the code's bit 3; the same for codes
4..7 (selectors c[15:0] only: the word shifted by 16); two permutes sort the 8 bytes
into the lo and hi lanes. 14 instructions a word of 8 codes. Under TRITON_INTERPRET=1
(no inline asm) the same integers come from selects and shifts (the DP4A constexpr).

The 2-bit formats' slot is one qs word of 16 codes (fmt_kquant_low.py, fmt_misc.py):
crumb_lanes spreads it by shifts and masks into 4 words of 8-bit lanes in Q8_0's lane
order (ACT_ORDER (16, 4, 8): Q8_0, Q3_K, Q2_K and TQ share one prepare); Q3_K ORs its
hmask bit on top (q3k_lanes, BIAS 4, t = (d sc) isum). Q2_K is affine, as the K-quants'
contract forms: codes 0..3, BIAS 0,

    t = A * float(isum) - B * float(xsum)     A = d * sc, B = dmin * m (the load's: exact)

(isum and xsum exact; A * isum, B * xsum and their difference each rounded once, as Q4_K's).
TQ2_0 (and TQ1_0, decoded to TQ2_0's planes at load): BIAS 1, t = d * isum, exact (d an fp16,
|isum| <= 16 * 2 * 127 < 2^12: 23 significant bits at most).
"""
from __future__ import annotations

import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from ..formats.fmt_iq4 import LEVEL_WORDS
from ..formats.fmt_misc import E2M1_WORDS
from ..formats.fmt_triton import levels16_biased
from ..moe.expert_q8_gpu import CODES
from .qgemv_i8_grid import GRID_CODES

# qtype -> (BITS, HBITS, BIAS, HAS_MIN, TABLE): qgemv_i8's constexprs; TABLE (how a slot's
# words become dp4a lanes) 0 for the contract's formats (expert_q8_gpu.CODES: unpack_lanes),
# 1 for IQ4's levels, 2 for 2-bit codes in 8-bit lanes (crumb_lanes: Q2_K, value A q - B; TQ, q - 1;
# HBITS 1: Q3_K's 3-bit codes, q3k_lanes, value = q - 4),
# 3 for the codebook formats' signed points (qgemv_i8_grid.grid_lanes: value = lane - 128),
# 4 for MXFP4's levels (TABLE 1's lookup on E2M1_WORDS)
TABLE_MX = 4
TABLE_CODES: dict[T, tuple[int, int, int, bool, int]] = {
    T.IQ4_NL: (4, 0, 128, False, 1), T.IQ4_XS: (4, 0, 128, False, 1), T.Q3_K: (8, 1, 4, False, 2),
    **GRID_CODES, T.MXFP4: (4, 0, 128, False, TABLE_MX), T.Q2_K: (8, 0, 0, True, 2),
    T.TQ2_0: (8, 0, 1, False, 2), T.TQ1_0: (8, 0, 1, False, 2)}
# the activations' lane order (qmatvec_i8.lane_order) where it is not the format's own
# (slot, V, BITS): the 2-bit formats' one qs word of 16 codes a slot is spread into Q8_0's 4 words
ACT_ORDER: dict[T, tuple[int, int, int]] = {t: (16, 4, 8) for t in (T.Q3_K, T.Q2_K, T.TQ2_0, T.TQ1_0)}


def i8_codes(qtype: T) -> tuple[int, int, int, bool, int]:
    """The dense int8 GEMV's (BITS, HBITS, BIAS, HAS_MIN, TABLE) of a GGUF type (KeyError: none)."""
    return (*CODES[qtype], 0) if qtype in CODES else TABLE_CODES[qtype]


def has_dense_i8_form(qtype: T) -> bool:
    """Has qgemv_i8 (the dense decode GEMV) an integer form of this type? The contract's
    formats, the table ones and the codebook ones (qgemv_i8_grid.GRID_CODES)."""
    return qtype in CODES or qtype in TABLE_CODES


def _u32(v: int) -> str:
    return f"0x{v & 0xFFFFFFFF:08x}"


def _lookup_asm(words: tuple[int, int, int, int]) -> str:
    """PTX: $2 (a qs word), $3 and $4 (words[0] and words[2]) -> $0 lo, $1 hi lanes of
    biased levels (bytes of `words`, fmt_iq4.level_words). s: the codes' low 3 bits
    (prmt's byte index; bit 3 of a selector would ask for sign replication); h: 0..3 or
    4..7 by the code's bit 3 (the low permute's byte or the high one's)."""
    w1, w3 = _u32(words[1]), _u32(words[3])
    return "\n".join([
        "{", ".reg .b32 s, h, a, b, x0, x1;",
        "and.b32 s, $2, 0x77777777;",
        "shr.u32 h, $2, 1;",
        "and.b32 h, h, 0x44444444;",
        "or.b32 h, h, 0x32103210;",
        f"prmt.b32 a, $3, {w1}, s;",
        f"prmt.b32 b, $4, {w3}, s;",
        "prmt.b32 x0, a, b, h;",                 # levels of codes 0..3 (fields 0..3)
        "shr.u32 s, s, 16;",
        "shr.u32 h, h, 16;",
        f"prmt.b32 a, $3, {w1}, s;",
        f"prmt.b32 b, $4, {w3}, s;",
        "prmt.b32 x1, a, b, h;",                 # fields 4..7
        "prmt.b32 $0, x0, x1, 0x6420;",          # fields 0, 2, 4, 6
        "prmt.b32 $1, x0, x1, 0x7531;",          # fields 1, 3, 5, 7
        "}"])


IQ4_ASM = _lookup_asm(LEVEL_WORDS)
MX_ASM = _lookup_asm(E2M1_WORDS)
_IQ4_ASM: tl.constexpr = tl.constexpr(IQ4_ASM)
_MX_ASM: tl.constexpr = tl.constexpr(MX_ASM)
_W0: tl.constexpr = tl.constexpr(LEVEL_WORDS[0])
_W1: tl.constexpr = tl.constexpr(LEVEL_WORDS[1])
_W2: tl.constexpr = tl.constexpr(LEVEL_WORDS[2])
_W3: tl.constexpr = tl.constexpr(LEVEL_WORDS[3])
_MX0: tl.constexpr = tl.constexpr(E2M1_WORDS[0])
_MX1: tl.constexpr = tl.constexpr(E2M1_WORDS[1])
_MX2: tl.constexpr = tl.constexpr(E2M1_WORDS[2])
_MX3: tl.constexpr = tl.constexpr(E2M1_WORDS[3])


@triton.jit
def _levels_int(c, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
    """Byte lanes of codes 0..15 -> the same lanes of biased levels (the table words W0..W3;
    integer selects: bits 2..3 of a code pick the word, bits 0..1 the byte): int32."""
    out = c * 0
    for j in tl.static_range(4):
        out = out | (levels16_biased((c >> (8 * j)) & 0xF, W0, W1, W2, W3) << (8 * j))
    return out


@triton.jit
def crumb_lanes(words):
    """A 16-value slot's qs word [NT, BN, 1] (16 two-bit codes, code k at bits 2k) -> the
    codes in Q8_0's 8-bit lane order [NT, BN, 4] (word v, byte j: k = (j // 2) 8 + 2 v + j % 2):
    Q2_K, TQ2_0 / TQ1_0 and (with the hmask bits on top, q3k_lanes) Q3_K. Integer shifts
    and masks, the same on the GPU and in the interpreter."""
    v = tl.arange(0, 4)[None, None, :]                                 # [1, 1, 4]
    t = words >> (4 * v)                                               # k = 2v, 2v+1 at bits 0..3; 8+2v, 9+2v at 16..19
    return (t & 0x00030003) | ((t << 6) & 0x03000300)                  # -> bytes 0, 1 (bits 0, 8), 2, 3 (16, 24)


@triton.jit
def q3k_lanes(words, h):
    """Q3_K: a slot's qs word [NT, BN, 1] and its int16 hmask word h [NT, BN] (bit k: code
    k's third bit) -> the 3-bit codes q = code | hbit << 2 in crumb_lanes's order [NT, BN, 4]
    (value (d sc) (q - 4))."""
    v = tl.arange(0, 4)[None, None, :]                                 # [1, 1, 4]
    hv = h[:, :, None] >> (2 * v)                                      # their top bits at bits 0, 1, 8, 9
    a = (hv & 0x3) | ((hv & 0x300) << 8)                               # bits 0, 1, 16, 17
    a = (a & 0x10001) | ((a & 0x20002) << 7)                           # bits 0, 8, 16, 24
    return crumb_lanes(words) | (a << 2)


@triton.jit
def table_lanes(words, h, one, TABLE: tl.constexpr, DP4A: tl.constexpr, HBITS: tl.constexpr = 0):
    """A step's words [NT, BN, V] (and qh words h [NT, BN]) -> (lo, hi) int32 lanes for
    slot_terms_i8. TABLE 1 (4): unpack_lanes's lanes with each code replaced by its biased
    IQ4 (MXFP4) level ([NT, BN, V] each); 2: 2-bit codes in 8-bit lanes (crumb_lanes, lo = hi),
    HBITS 1: with Q3_K's hmask bit on top (q3k_lanes). `one`: a run-time 1 (see the asm)."""
    tl.static_assert(TABLE == 1 or TABLE == 2 or TABLE == 4, "TABLE 1 (IQ4's levels), 2 (2-bit codes), 4 (MXFP4)")
    if TABLE == 2:
        if HBITS:
            lo = q3k_lanes(words, h)
        else:
            lo = crumb_lanes(words)                                    # (h: qs standing in for an absent qh)
        hi = lo
    elif DP4A:
        # levels 0..3 and 8..11 go in as registers (prmt's first operand must be one; the
        # others are immediates): a zero the compiler cannot see, per thread, keeps ptxas
        # from copying them out of uniform registers before every permute (4 moves a word)
        z = tl.arange(0, words.shape[0])[:, None, None] & (one - 1)
        if TABLE == 4:
            lo, hi = tl.inline_asm_elementwise(_MX_ASM, "=r,=r,r,r,r", [words, z | _MX0, z | _MX2],
                                               dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(_IQ4_ASM, "=r,=r,r,r,r", [words, z | _W0, z | _W2],
                                               dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    elif TABLE == 4:
        lo = _levels_int(words & 0x0F0F0F0F, _MX0, _MX1, _MX2, _MX3)
        hi = _levels_int((words >> 4) & 0x0F0F0F0F, _MX0, _MX1, _MX2, _MX3)
    else:
        lo = _levels_int(words & 0x0F0F0F0F, _W0, _W1, _W2, _W3)
        hi = _levels_int((words >> 4) & 0x0F0F0F0F, _W0, _W1, _W2, _W3)
    return lo, hi
