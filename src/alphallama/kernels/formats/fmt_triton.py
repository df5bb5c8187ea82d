"""The Triton side of the weight formats: how a kernel loads a format's planes and
turns them back into floats (the layout and the plain-torch side: formats.py, fmt_*.py).

A format's Triton side is two functions: `load` reads NT slots of BN rows (words
[NT, BN, V] and per-slot scale tensors [NT, BN]), `field` dequantizes field i of those
words to float32 [NT, BN, V]. They live apart from the host-side packing so that the
CPU path (the reference runtime, the offload planner, the expert store) never imports
triton: Format.triton_load/triton_field import this module on a GPU kernel's first use.
"""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .fmt_iq4 import LEVEL_WORDS

# --- device-side helpers (Triton) ----------------------------------------------------
# Tiles are [NT slots, BN rows, V words]: slots first, so that where the compiler has
# no reason to prefer a dimension it spreads slots over the threads, one slot per
# thread with all its rows in registers: the layout the x loads get too, so no tile
# moves between threads through shared memory.

@triton.jit
def slot_words(qs, row, s0, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """The qs words of slots s0 .. s0+NT-1 of rows `row` [1, BN] (int64): [NT, BN, V].
    The V words of a slot are contiguous: one vector load per thread."""
    u = (s0 + tl.arange(0, NT))[:, None, None]  # [NT, 1, 1]
    offs = row[:, :, None] * (n_slots * V) + u * V + tl.arange(0, V)[None, None, :]  # [NT, BN, V]
    if n_slots % NT == 0:
        return tl.load(qs + offs)
    return tl.load(qs + offs, mask=u < n_slots, other=0)


@triton.jit
def slot_field(plane, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr,
               GROUP: tl.constexpr = 1, WIDTH: tl.constexpr = 1, INDEX: tl.constexpr = 0):
    """Element INDEX of the WIDTH-element record of each slot's group of GROUP slots
    (per-slot scales: GROUP = 1; per-super-block d: GROUP = slots per super-block):
    [NT, BN]. `one` is a run-time 1: with the slot stride unknown, the compiler does
    not vectorize across slots, which would give each thread its neighbours' scales
    and force a shuffle of them through shared memory."""
    u = (s0 + tl.arange(0, NT))[:, None]  # [NT, 1]
    offs = row * (n_slots // GROUP * WIDTH) + (u // GROUP) * (WIDTH * one) + INDEX  # [NT, BN]
    if n_slots % NT == 0:
        return tl.load(plane + offs)
    return tl.load(plane + offs, mask=u < n_slots, other=0)


@triton.constexpr_function
def field_pos(I, BITS):
    """Bit offset of field I (BITS wide) as `codes_f32` uses it: fields inside mantissa
    bits 0..19 stay where they are, the rest are shifted down together."""
    low = 20 // BITS
    return BITS * I if I < low else BITS * I - (32 - low * BITS)


@triton.constexpr_function
def field_scale(I, BITS):
    """2**-field_pos: what turns codes_f32's values into q - BIAS."""
    return 1.0 / (1 << field_pos(I, BITS))


@triton.constexpr_function
def top_shift(I, BITS, HSTRIDE):
    """The left shift (negative: right) that moves field I's top bits, at bit HSTRIDE * I
    (+ HBITS * v for word v) of the slot's qh word, to just above the field as codes_f32
    places it (bit field_pos + BITS). The 4-bit formats (HSTRIDE = HBITS * V = 4): 4 for
    the low fields, -8 for the shifted ones: one shift per word for all fields."""
    return field_pos(I, BITS) + BITS - HSTRIDE * I


@triton.jit
def codes_f32(words, h, I: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr,
              BIAS: tl.constexpr, one):
    """Field I of words [NT, BN, V] (BITS bits) plus, if HBITS, its top bits from the
    slot's qh word h [NT, BN] (int32), as the exact float (q - BIAS) * 2**field_pos(I, BITS):
    [NT, BN, V]. The caller folds the power of two into its per-slot scale.

    No int->float convert (the CUDA guide lists conversions at 16/clk/SM on sm_90
    against 128 for FADD) and no shift per field: a field that lies in mantissa bits
    0..19 becomes the float 2**23 + q * 2**pos with one LOP3 ((w & mask) | exponent of
    2**23) and the exact FADD takes 2**23 + BIAS * 2**pos off; the higher fields share
    one shift per word. Top bits are moved to just above their field (one shift per
    word for all fields) and added as a second such float. The exponent bits are a
    run-time value (`one` is a run-time 1) so that they sit in a register: a LOP3
    takes one immediate, the field's mask."""
    LOW: tl.constexpr = 20 // BITS
    POS: tl.constexpr = field_pos(I, BITS)
    exp23 = one * 0x4B000000
    if I < LOW:
        src = words
    else:
        src = words >> (32 - LOW * BITS)
    f = ((src & (((1 << BITS) - 1) << POS)) | exp23).to(tl.float32, bitcast=True)
    if HBITS == 0:
        out = f - (8388608.0 + BIAS * (1 << POS))
    else:
        # the top bits of field I of word v sit at bit HBITS * (I * V + v) of h (format.pack_high)
        V: tl.constexpr = words.shape[2]
        SHIFT: tl.constexpr = top_shift(I, BITS, HBITS * V)
        v = tl.arange(0, V)[None, None, :] * HBITS  # [1, 1, V]
        if SHIFT >= 0:
            top = h[:, :, None] << (SHIFT - v)  # to bit POS + BITS (SHIFT >= HBITS * (V - 1) here)
        else:
            top = h[:, :, None] >> (v - SHIFT)
        f_hi = ((top & (((1 << HBITS) - 1) << (POS + BITS))) | exp23).to(tl.float32, bitcast=True)
        out = (f - (16777216.0 + BIAS * (1 << POS))) + f_hi
    return out

# --- F32, F16, BF16: no scales ---------------------------------------------------

@triton.jit
def _load_float(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    w = slot_words(qs, row, s0, n_slots, NT, V)  # [NT, BN, V] in the weight's dtype
    return w, w, w, w


@triton.jit
def _field_float(w, h, s1, s2, I: tl.constexpr, one):
    return w.to(tl.float32)  # [NT, BN, V]

# --- Q4_0, Q5_0, Q8_0 (fmt_legacy.py) ---------------------------------------------

@triton.jit
def _load_d(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Words and the per-slot d (as both scale outputs): Q4_0, IQ4_NL."""
    d = slot_field(sc, row, s0, one, n_slots, NT).to(tl.float32)  # [NT, BN]
    return slot_words(qs, row, s0, n_slots, NT, V), d, d, d


@triton.jit
def _field_q4_0(words, h, d, s2, I: tl.constexpr, one):
    q = codes_f32(words, h, I, 4, 0, 8, one)  # [NT, BN, V]: (q - 8) * 2**pos
    return q * (d * field_scale(I, 4))[:, :, None]


@triton.jit
def _load_q5_0(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    d = slot_field(sc, row, s0, one, n_slots, NT).to(tl.float32)  # [NT, BN]
    return slot_words(qs, row, s0, n_slots, NT, V), slot_field(qh, row, s0, one, n_slots, NT), d, d


@triton.jit
def _field_q5_0(words, h, d, s2, I: tl.constexpr, one):
    q = codes_f32(words, h, I, 4, 1, 16, one)  # [NT, BN, V]: (q - 16) * 2**pos
    return q * (d * field_scale(I, 4))[:, :, None]


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

@triton.jit
def _load_dm(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Q4_1, Q5_1: words, qh words, d and -m per slot (the (A, B) of value = A q - B, as
    the K-quants' loads give, so that their fields and the int8 kernels' min term serve)."""
    d = slot_field(sc, row, s0, one, n_slots, NT, 1, 2, 0).to(tl.float32)  # [NT, BN]
    m = slot_field(sc, row, s0, one, n_slots, NT, 1, 2, 1).to(tl.float32)  # [NT, BN]
    return slot_words(qs, row, s0, n_slots, NT, V), slot_field(qh, row, s0, one, n_slots, NT), d, m * -1.0

# --- Q4_K, Q5_K, Q6_K (fmt_kquant.py), Q2_K, Q3_K (fmt_kquant_low.py) ---------------

@triton.jit
def small_f32(v, one):
    """Small non-negative ints v (< 2**23) as floats: OR-ed into 2**23's mantissa (see codes_f32)."""
    return (v | (one * 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _load_k_with_min(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Words, qh words, d * sc and dmin * m per slot."""
    s = slot_field(sc, row, s0, one, n_slots, NT).to(tl.int32)  # [NT, BN]: sc | m << 8
    d = slot_field(sd, row, s0, one, n_slots, NT, 8, 2, 0).to(tl.float32)  # [NT, BN]
    dmin = slot_field(sd, row, s0, one, n_slots, NT, 8, 2, 1).to(tl.float32)  # [NT, BN]
    sc_f, m_f = small_f32(s & 0xFF, one), small_f32((s >> 8) & 0xFF, one)  # the 6-bit sc and m
    return slot_words(qs, row, s0, n_slots, NT, V), slot_field(qh, row, s0, one, n_slots, NT), d * sc_f, dmin * m_f


@triton.jit
def _load_q2_k(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Words, qh words (qs stands in), d * sc and dmin * m per 16-value slot."""
    s = slot_field(sc, row, s0, one, n_slots, NT).to(tl.int32)  # [NT, BN]: sc | m << 4 (uint8)
    d = slot_field(sd, row, s0, one, n_slots, NT, 16, 2, 0).to(tl.float32)  # [NT, BN]
    dmin = slot_field(sd, row, s0, one, n_slots, NT, 16, 2, 1).to(tl.float32)  # [NT, BN]
    sc_f, m_f = small_f32(s & 0x0F, one), small_f32((s >> 4) & 0x0F, one)  # the 4-bit sc and m
    return slot_words(qs, row, s0, n_slots, NT, V), slot_field(qh, row, s0, one, n_slots, NT), d * sc_f, dmin * m_f


@triton.jit
def _field_with_min(words, h, ds, dm, I: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, one):
    """ds * q - dm with one rounding (q * ds is exact): Q4_K, Q5_K, Q2_K, Q4_1, Q5_1.
    Negations are products with -1: the interpreter's unary minus turns +0 into +0, and
    ds * q = -0 minus dm = +0 must give gguf's -0."""
    q = codes_f32(words, h, I, BITS, HBITS, 0, one)  # [NT, BN, V]: q * 2**pos
    return tl.fma(q, (ds * field_scale(I, BITS))[:, :, None], dm[:, :, None] * -1.0)


@triton.jit
def _field_q4_k(words, h, ds, dm, I: tl.constexpr, one):
    return _field_with_min(words, h, ds, dm, I, 4, 0, one)


@triton.jit
def _field_q5_k(words, h, ds, dm, I: tl.constexpr, one):
    return _field_with_min(words, h, ds, dm, I, 4, 1, one)


@triton.jit
def _field_q2_k(words, h, ds, dm, I: tl.constexpr, one):
    return _field_with_min(words, h, ds, dm, I, 2, 0, one)


@triton.jit
def _load_q6_k(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Words, qh words (as int32: Q3_K's plane is int16) and d * sc per 16-value slot: Q6_K, Q3_K."""
    d = slot_field(sd, row, s0, one, n_slots, NT, 16).to(tl.float32)  # [NT, BN]
    ds = d * slot_field(sc, row, s0, one, n_slots, NT).to(tl.float32)  # [NT, BN]
    h = slot_field(qh, row, s0, one, n_slots, NT).to(tl.int32)  # [NT, BN]
    return slot_words(qs, row, s0, n_slots, NT, V), h, ds, ds


@triton.jit
def _field_q6_k(words, h, ds, s2, I: tl.constexpr, one):
    q = codes_f32(words, h, I, 4, 2, 32, one)  # [NT, BN, V]: (q - 32) * 2**pos
    return q * (ds * field_scale(I, 4))[:, :, None]


@triton.jit
def _field_q3_k(words, h, ds, s2, I: tl.constexpr, one):
    q = codes_f32(words, h, I, 2, 1, 4, one)  # [NT, BN, 1]: (q - 4) * 2**pos, q = code | hmask bit << 2
    return q * (ds * field_scale(I, 2))[:, :, None]


# --- IQ4_NL, IQ4_XS (fmt_iq4.py) ---------------------------------------------------
# the 16 levels + 128 as bytes of four int32 words (fmt_iq4.level_words), compile-time constants
_IQ4_W0: tl.constexpr = tl.constexpr(LEVEL_WORDS[0])
_IQ4_W1: tl.constexpr = tl.constexpr(LEVEL_WORDS[1])
_IQ4_W2: tl.constexpr = tl.constexpr(LEVEL_WORDS[2])
_IQ4_W3: tl.constexpr = tl.constexpr(LEVEL_WORDS[3])


@triton.jit
def levels16_biased(q, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
    """Codes q (int32, 0..15, any shape) -> their levels + 128 (0..255), the bytes of four
    int32 constants (fmt_iq4.level_words): bits 2..3 of the code pick the word, bits 0..1
    the byte. Integer selects and shifts, the same on the GPU and in the interpreter."""
    lo = tl.where((q & 4) != 0, W1, W0)
    hi = tl.where((q & 4) != 0, W3, W2)
    return (tl.where((q & 8) != 0, hi, lo) >> ((q & 3) * 8)) & 0xFF


@triton.jit
def levels16_f32(words, I: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                 W3: tl.constexpr, one):
    """Field I (4 bits) of words [NT, BN, V] as its level of 16 (levels16_biased), an exact
    float [NT, BN, V]. IQ4's levels, MXFP4's doubled E2M1."""
    biased = levels16_biased((words >> (4 * I)) & 0xF, W0, W1, W2, W3)  # level + 128
    return small_f32(biased, one) - 128.0


@triton.jit
def iq4_levels_f32(words, I: tl.constexpr, one):
    """Field I (4 bits) of words [NT, BN, V] as its IQ4 level: [NT, BN, V]."""
    return levels16_f32(words, I, _IQ4_W0, _IQ4_W1, _IQ4_W2, _IQ4_W3, one)


@triton.jit
def _field_iq4(words, h, ds, s2, I: tl.constexpr, one):
    """ds * level: IQ4_NL (ds = d, Q4_0's load), IQ4_XS (ds = d * sc)."""
    return iq4_levels_f32(words, I, one) * ds[:, :, None]


@triton.jit
def _load_iq4_xs(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Words and d * sc per 32-value slot (8 slots per super-block)."""
    d = slot_field(sd, row, s0, one, n_slots, NT, 8).to(tl.float32)  # [NT, BN]
    ds = d * slot_field(sc, row, s0, one, n_slots, NT).to(tl.float32)  # [NT, BN]
    words = slot_words(qs, row, s0, n_slots, NT, V)
    return words, words, ds, ds


class TritonFormat(NamedTuple):
    load: object    # @triton.jit (qs, qh, sc, sd, row, s0, one, n_slots, NT, V) -> (words, h, s1, s2)
    field: object   # @triton.jit (words, h, s1, s2, I, one) -> float32 [NT, BN, V]


# Q4_K, Q4_1 and Q2_K have no qh plane: their loads pass qs in its place (the kernel gets qs for absent planes)
KERNELS: dict[T, TritonFormat] = {
    T.F32: TritonFormat(_load_float, _field_float),
    T.F16: TritonFormat(_load_float, _field_float),
    T.BF16: TritonFormat(_load_float, _field_float),
    T.Q4_0: TritonFormat(_load_d, _field_q4_0),
    T.Q5_0: TritonFormat(_load_q5_0, _field_q5_0),
    T.Q8_0: TritonFormat(_load_q8_0, _field_q8_0),
    T.Q4_1: TritonFormat(_load_dm, _field_q4_k),   # fma(q, d, m): the K-quants' fields (4 bits)
    T.Q5_1: TritonFormat(_load_dm, _field_q5_k),
    T.Q4_K: TritonFormat(_load_k_with_min, _field_q4_k),
    T.Q5_K: TritonFormat(_load_k_with_min, _field_q5_k),
    T.Q6_K: TritonFormat(_load_q6_k, _field_q6_k),
    T.Q2_K: TritonFormat(_load_q2_k, _field_q2_k),
    T.Q3_K: TritonFormat(_load_q6_k, _field_q3_k),   # d * sc per slot, as Q6_K
    T.IQ4_NL: TritonFormat(_load_d, _field_iq4),
    T.IQ4_XS: TritonFormat(_load_iq4_xs, _field_iq4),
}
