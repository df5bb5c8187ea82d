"""The Triton side of the codebook formats (fmt_grid.py), MXFP4 and the ternary types
(fmt_misc.py): their `load` / `field` pairs, the same contract as fmt_triton.py's.

The codebook loads gather each group's point bytes from the format's table (the kernels'
qh argument, QuantWeight.plane_args): two int16 loads a word, in L1 / L2 (1 to 16 KiB).
Signs are the sign bit of the float, flipped by an XOR (the same bits as gguf's product
with -1, zeros included).
"""
from __future__ import annotations

import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .fmt_misc import E2M1_WORDS
from .fmt_triton import (
    TritonFormat,
    codes_f32,
    field_scale,
    levels16_f32,
    slot_field,
    slot_words,
    small_f32,
)

_MX_W0: tl.constexpr = tl.constexpr(E2M1_WORDS[0])
_MX_W1: tl.constexpr = tl.constexpr(E2M1_WORDS[1])
_MX_W2: tl.constexpr = tl.constexpr(E2M1_WORDS[2])
_MX_W3: tl.constexpr = tl.constexpr(E2M1_WORDS[3])

# --- IQ2_*, IQ3_*, IQ1_*: a slot is a group of 8 values, V = 2 words of 4 byte fields ------


@triton.jit
def grid_load(g, d, tab, one, PTS: tl.constexpr, C: tl.constexpr):
    """For group words g [NT, BN] and the super-blocks' d [NT, BN]: the groups' point bytes
    as words [NT, BN, 2] (word v: bytes 2v, 2v + 1, 4 + 2v, 5 + 2v of the group,
    slot_positions(2, 4)), g, and db = d (2 s + 1) C [NT, BN]. PTS: values a point (8: one
    point a group, its index in bits 0..10; 4: two, bits 0..10 and 11..19)."""
    db = d * small_f32(((g >> 27) & 0x1E) | 1, one) * C  # exact: d (11 bits) times 2 s + 1 (5 bits)
    a = g & 0x7FF
    if PTS == 8:
        pa = a * 4  # half-words of the point: 4
        pb = pa + 2
    else:
        pa = a * 2
        pb = ((g >> 11) & 0x1FF) * 2
    v = tl.arange(0, 2)[None, None, :]  # [1, 1, 2]
    lo = tl.load(tab + pa[:, :, None] + v).to(tl.int32) & 0xFFFF  # [NT, BN, 2]
    hi = tl.load(tab + pb[:, :, None] + v).to(tl.int32)
    return lo | (hi << 16), g, db


@triton.jit
def _field_grid(words, g, db, s2, I: tl.constexpr, one):
    """(db * point) with the sign of the value's bit (20 + its position in the group) of g."""
    val = small_f32((words >> (8 * I)) & 0xFF, one) * db[:, :, None]  # [NT, BN, 2]
    POS: tl.constexpr = 20 + (I // 2) * 4 + I % 2
    v2 = tl.arange(0, 2)[None, None, :] * 2  # word v's value of field I is 2 v + (I // 2) 4 + I % 2
    flip = ((g[:, :, None] >> (POS + v2)) & 1) << 31
    return (val.to(tl.int32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)


@triton.jit
def _field_grid1(words, g, db, delta, I: tl.constexpr, one):
    """IQ1: db * (point + delta), the table's points biased by 1."""
    p = (small_f32((words >> (8 * I)) & 0xFF, one) - 1.0) + delta[:, :, None]  # [NT, BN, 2], exact
    return p * db[:, :, None]


@triton.jit
def _short16(plane, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr):
    """A 16-bit per-group field as 0..65535: [NT, BN] int32."""
    return slot_field(plane, row, s0, one, n_slots, NT).to(tl.int32) & 0xFFFF


@triton.jit
def _d16(sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr):
    """The fp16 d of each group's super-block (32 groups): [NT, BN] float32."""
    return slot_field(sd, row, s0, one, n_slots, NT, 32).to(tl.float32)


@triton.jit
def _iq2_short(qs, sc, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, G: tl.constexpr):
    """IQ2_XXS / IQ2_XS short words (index | 7 sign bits << 9) and their s (one per G groups)
    widened to group words [NT, BN]: the 8th sign is the parity of the 7 (ksigns)."""
    h = _short16(qs, row, s0, one, n_slots, NT)  # [NT, BN]
    s = slot_field(sc, row, s0, one, n_slots, NT, G).to(tl.int32) & 0xFF
    s7 = h >> 9
    p = s7 ^ (s7 >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return (h & 0x1FF) | ((s7 | ((p & 1) << 7)) << 20) | (s << 28)


@triton.jit
def _load_iq2_xxs(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    g = _iq2_short(qs, sc, row, s0, one, n_slots, NT, 4)
    words, g, db = grid_load(g, _d16(sd, row, s0, one, n_slots, NT), qh, one, 8, 0.125)
    return words, g, db, db


@triton.jit
def _load_iq2_xs(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    g = _iq2_short(qs, sc, row, s0, one, n_slots, NT, 2)
    words, g, db = grid_load(g, _d16(sd, row, s0, one, n_slots, NT), qh, one, 8, 0.125)
    return words, g, db, db


@triton.jit
def _load_iq2_s(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Short words index | s << 10 and the 8 signs a byte (sc)."""
    h = _short16(qs, row, s0, one, n_slots, NT)  # [NT, BN]
    signs = slot_field(sc, row, s0, one, n_slots, NT).to(tl.int32) & 0xFF
    g = (h & 0x3FF) | (signs << 20) | ((h >> 10) << 28)
    words, g, db = grid_load(g, _d16(sd, row, s0, one, n_slots, NT), qh, one, 8, 0.125)
    return words, g, db, db


@triton.jit
def _iq3_short(qs, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, W: tl.constexpr):
    """IQ3 short words (the two indices' low bytes), the 8 signs a byte (sc) and the
    super-block record of W int32 (sd: d's bits, the 8 s nibbles, IQ3_S's index top bits
    two a group) widened to (group words, d) [NT, BN]."""
    h = _short16(qs, row, s0, one, n_slots, NT)  # [NT, BN]
    signs = slot_field(sc, row, s0, one, n_slots, NT).to(tl.int32) & 0xFF
    r0 = slot_field(sd, row, s0, one, n_slots, NT, 32, W, 0)  # [NT, BN] int32
    r1 = slot_field(sd, row, s0, one, n_slots, NT, 32, W, 1)
    d = (r0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    u = (s0 + tl.arange(0, NT))[:, None] % 32  # [NT, 1]: the group in its super-block
    s = (r1 >> ((u // 4) * 4)) & 0xF
    a = h & 0xFF
    b = (h >> 8) & 0xFF
    if W == 4:
        r2 = slot_field(sd, row, s0, one, n_slots, NT, 32, W, 2)
        r3 = slot_field(sd, row, s0, one, n_slots, NT, 32, W, 3)
        top = (tl.where(u < 16, r2, r3) >> ((u % 16) * 2)) & 3
        a = a | ((top & 1) << 8)
        b = b | ((top >> 1) << 8)
    return a | (b << 11) | (signs << 20) | (s << 28), d


@triton.jit
def _load_iq3_xxs(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    g, d = _iq3_short(qs, sc, sd, row, s0, one, n_slots, NT, 2)
    words, g, db = grid_load(g, d, qh, one, 4, 0.25)
    return words, g, db, db


@triton.jit
def _load_iq3_s(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    g, d = _iq3_short(qs, sc, sd, row, s0, one, n_slots, NT, 4)
    words, g, db = grid_load(g, d, qh, one, 4, 1.0)
    return words, g, db, db


@triton.jit
def _load_iq1(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """IQ1_S, IQ1_M short words (index | neg << 11 | s << 12): words, g, dl = d (2 s + 1) and
    the group's delta (+-1/8)."""
    h = _short16(qs, row, s0, one, n_slots, NT)  # [NT, BN]
    g = (h & 0x7FF) | (((h >> 11) & 1) << 20) | ((h >> 12) << 28)
    words, g, dl = grid_load(g, _d16(sd, row, s0, one, n_slots, NT), qh, one, 8, 1.0)
    delta = tl.where(((g >> 20) & 1) != 0, -0.125, 0.125)  # [NT, BN]
    return words, g, dl, delta

# --- MXFP4 -------------------------------------------------------------------------------


@triton.jit
def _load_mxfp4(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Words and d = 2^(e - 128) per 32-value slot, from e's bits as ggml builds it (e < 2:
    the subnormals 2^-128, 2^-127)."""
    e = slot_field(sc, row, s0, one, n_slots, NT).to(tl.int32) & 0xFF  # [NT, BN]
    d = tl.where(e < 2, (one * 0x00200000) << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    words = slot_words(qs, row, s0, n_slots, NT, V)
    return words, words, d, d


@triton.jit
def _field_mxfp4(words, h, d, s2, I: tl.constexpr, one):
    return levels16_f32(words, I, _MX_W0, _MX_W1, _MX_W2, _MX_W3, one) * d[:, :, None]

# --- TQ2_0, TQ1_0 (TQ2_0's planes) -----------------------------------------------------------


@triton.jit
def _load_tq(qs, qh, sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """Words and d per 16-value slot (16 slots a super-block)."""
    d = slot_field(sd, row, s0, one, n_slots, NT, 16).to(tl.float32)  # [NT, BN]
    words = slot_words(qs, row, s0, n_slots, NT, V)
    return words, words, d, d


@triton.jit
def _field_tq(words, h, d, s2, I: tl.constexpr, one):
    q = codes_f32(words, h, I, 2, 0, 1, one)  # [NT, BN, 1]: (q - 1) * 2**pos
    return q * (d * field_scale(I, 2))[:, :, None]


KERNELS: dict[T, TritonFormat] = {
    T.IQ2_XXS: TritonFormat(_load_iq2_xxs, _field_grid),
    T.IQ2_XS: TritonFormat(_load_iq2_xs, _field_grid),
    T.IQ2_S: TritonFormat(_load_iq2_s, _field_grid),
    T.IQ3_XXS: TritonFormat(_load_iq3_xxs, _field_grid),
    T.IQ3_S: TritonFormat(_load_iq3_s, _field_grid),
    T.IQ1_S: TritonFormat(_load_iq1, _field_grid1),
    T.IQ1_M: TritonFormat(_load_iq1, _field_grid1),
    T.MXFP4: TritonFormat(_load_mxfp4, _field_mxfp4),
    T.TQ2_0: TritonFormat(_load_tq, _field_tq),
    T.TQ1_0: TritonFormat(_load_tq, _field_tq),
}
