"""The GPU arrangement of GGUF weight bits, shared by every quant format.

A GGUF row is a run of blocks. At load time each row is cut into *slots*: the
values that share one scale (32 values; 16 for Q6_K). A slot's bits are spread over
up to four *planes*, each a contiguous tensor with one row per output feature:

    qs  int32 [N, n_slots * V]   the low 4 (or 8) bits of every value, V words per slot
    qh  int32 [N, n_slots]       the top bits (Q5_0, Q5_K, Q6_K), one word per slot
    sc        [N, n_slots]       the per-slot scale field(s)
    sd        [N, n_slots // S]  the per-super-block fp16 fields (K-quants)

Inside a slot, value `v * P + i` is field i (lowest bits first) of qs word v, and its
top bits (if any) are nibble i of the qh word (packed_hi_f32 says why). A thread that
loads a slot's V words (one 8- or 16-byte load) holds a whole scale group at
consecutive k, so its activations come in with vector loads too. These are the same
bits as the file, re-ordered (K-quants' 6-bit scales and mins are widened to a byte
each: +4 bytes per 144-byte Q4_K block), so a token reads about the GGUF size.

The Triton kernels dequantize a tile of [NT slots, BN rows, V words, P fields]; the
plain-torch `dequantize` of each format computes the same values from the same planes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

PLANES = ("qs", "qh", "sc", "sd")


@dataclass(frozen=True)
class Format:
    """How one GGUF type is laid out on the GPU and turned back into floats."""
    qtype: GGMLQuantizationType
    slot: int            # values per slot (one scale)
    V: int               # qs words per slot
    P: int               # values per qs word (32 // bits, or 1 for floats)
    pack: Callable[[torch.Tensor], dict[str, torch.Tensor]]   # blocks [R, nb, type_size] -> planes
    dequantize: Callable[[dict[str, torch.Tensor], int], torch.Tensor]  # planes, K -> f32 [R, K]
    triton_dequant: object   # @triton.jit (qs, qh, sc, sd, row, u, n_slots, V, P) -> [BN, NT, V, P]
    qs_dtype: torch.dtype = torch.int32

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


# --- host-side packing helpers (torch, any device) ---------------------------------

def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block: [R, nb] float16."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0]  # [R, nb]


def unpack_fields(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes -> their 8 // bits fields, lowest bits first: uint8 [..., k] -> [..., 8 // bits, k]."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)  # [8 // bits]
    return (x.unsqueeze(-2) >> shifts.unsqueeze(-1)) & ((1 << bits) - 1)  # [..., 8 // bits, k]


def pack_words(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Values of `bits` bits, lowest field first, into little-endian int32 words:
    uint8 [..., n] -> int32 [..., n * bits // 32]."""
    per_byte = 8 // bits
    v = vals.reshape(*vals.shape[:-1], -1, per_byte).to(torch.int32)  # [..., n / per_byte, per_byte]
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=vals.device)  # [per_byte]
    packed = (v << shifts).sum(-1).to(torch.uint8)  # [..., n / per_byte] bytes
    return packed.contiguous().view(torch.int32)  # [..., n * bits / 32]


# --- device-side helpers (Triton) ----------------------------------------------------
# Tiles are [NT slots, BN rows, ...]: slots first, so that where the compiler has no
# reason to prefer a dimension it spreads slots over the threads, one slot per
# thread with all its rows in registers: the layout the x loads get too, so no tile
# has to move between threads through shared memory.

@triton.jit
def slot_words(qs, row, s0, n_slots: tl.constexpr, NT: tl.constexpr, V: tl.constexpr):
    """The qs words of slots s0 .. s0+NT-1 of rows `row` [1, BN] (int64): [NT, BN, V] int32.
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


@triton.jit
def small_int_to_f32(q, BIAS: tl.constexpr, one):
    """Exact float of (q - BIAS) for 0 <= q < 2**23, without an int->float convert:
    OR-ing q into the mantissa of 2**23 gives the float 2**23 + q, and the subtraction
    is exact. The CUDA guide lists conversions at 16/clk/SM on sm_90 against 128 for
    FADD; this is one LOP3 and one FADD. The exponent bits are a run-time value
    (`one` is a run-time 1) so that they sit in a register: a LOP3 takes one immediate,
    and the field's mask is the other constant of the same LOP3."""
    return (q | (one * 0x4B000000)).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)


@triton.jit
def _field_pos(BITS: tl.constexpr, P: tl.constexpr):
    """Where field i sits for `packed_f32`: words are used as they are for the fields
    within the low 20 bits and shifted down by SHIFT for the rest; pos = the field's
    bit offset after that. Returns (from_shifted [P] bool, pos [P] int32, SHIFT)."""
    i = tl.arange(0, P)  # [P]
    LOW: tl.constexpr = 20 // BITS  # fields wholly inside mantissa bits 0..19
    SHIFT: tl.constexpr = (P - LOW) * BITS if P > LOW else 0
    hi = i >= LOW
    pos = tl.where(hi, i * BITS - SHIFT, i * BITS)  # [P]
    return hi, pos, SHIFT


@triton.jit
def packed_f32(words, BITS: tl.constexpr, P: tl.constexpr, BIAS: tl.constexpr, one):
    """The P BITS-bit fields of int32 words [NT, BN, V] as exact floats
    (q_i - BIAS) * 2**pos_i: [NT, BN, V, P]; multiply by `packed_scale` to get q - BIAS.

    Why not shift each field down: a field that already lies in mantissa bits 0..19
    becomes the float 2**23 + q * 2**pos with one LOP3 ((w & mask) | exponent of 2**23)
    and one exact FADD; the higher fields take one shift per word for all of them.
    The 2**-pos goes into the per-slot scale, which is computed once per slot."""
    hi, pos, SHIFT = _field_pos(BITS, P)
    w = words[:, :, :, None]  # [NT, BN, V, 1]
    src = tl.where(hi[None, None, None, :], w >> SHIFT, w)  # [NT, BN, V, P]
    mask = ((1 << BITS) - 1) << pos  # [P]
    f = ((src & mask[None, None, None, :]) | (one * 0x4B000000)).to(tl.float32, bitcast=True)
    return f - (8388608.0 + BIAS * (1 << pos).to(tl.float32))[None, None, None, :]


@triton.jit
def packed_hi_f32(words, h, HBITS: tl.constexpr, P: tl.constexpr, BIAS: tl.constexpr, one):
    """5- and 6-bit codes: low nibbles in words [NT, BN, V] (as packed_f32, BITS=4) and
    the top HBITS bits of value (v, i) at bits 4i + HBITS*v of the slot's word h [NT, BN]
    (HBITS * V = 4: nibble i of h holds field i's top bits for every word).
    Returns (q - BIAS) * 2**pos_i as exact floats [NT, BN, V, P].

    The top bits are shifted to sit just above their nibble (one shift per word for
    the low fields, one for the high ones), made into 2**23 + hi * 2**(pos + 4) by one
    LOP3 each, and added in float: two exact FADDs instead of integer merging."""
    hi_sel, pos, SHIFT = _field_pos(4, P)
    V: tl.constexpr = words.shape[2]
    exp23 = one * 0x4B000000
    w = words[:, :, :, None]  # [NT, BN, V, 1]
    lo = tl.where(hi_sel[None, None, None, :], w >> SHIFT, w)  # [NT, BN, V, P]
    f_lo = ((lo & (15 << pos)[None, None, None, :]) | exp23).to(tl.float32, bitcast=True)
    hv = h[:, :, None, None]  # [NT, BN, 1, 1]
    v = tl.arange(0, V)[None, None, :, None] * HBITS  # [1, 1, V, 1]
    top = tl.where(hi_sel[None, None, None, :], hv >> (8 + v), hv << (4 - v))  # [NT, BN, V, P]
    top_mask = (((1 << HBITS) - 1) << (pos + 4))[None, None, None, :]
    f_hi = ((top & top_mask) | exp23).to(tl.float32, bitcast=True)  # 2**23 + hi * 2**(pos+4)
    bias = (16777216.0 + BIAS * (1 << pos).to(tl.float32))[None, None, None, :]
    return (f_lo - bias) + f_hi


@triton.jit
def packed_scale(BITS: tl.constexpr, P: tl.constexpr):
    """2**-pos_i of `packed_f32`: [P] float32."""
    hi, pos, SHIFT = _field_pos(BITS, P)
    return 1.0 / (1 << pos).to(tl.float32)


# --- the same in plain torch, for the references ------------------------------------

def torch_fields(words: torch.Tensor, bits: int, P: int) -> torch.Tensor:
    """int32 [..., V] -> unsigned fields [..., V, P] (int32), lowest first."""
    shift = torch.arange(P, dtype=torch.int32, device=words.device) * bits  # [P]
    return (words.unsqueeze(-1) >> shift) & ((1 << bits) - 1)  # [..., V, P]


def pack_high(high: torch.Tensor, bits: int, V: int, P: int) -> torch.Tensor:
    """Top bits of each value of a slot, uint8 [R, ns, V * P] in slot order, into the
    slot's qh word: value (v, i) at bits bits*(i*V + v) (see packed_hi_f32): int32 [R, ns]."""
    by_field = high.reshape(*high.shape[:-1], V, P).transpose(-1, -2)  # [R, ns, P, V]
    return pack_words(by_field.flatten(-2), bits)[..., 0]  # [R, ns]


def torch_high(qh: torch.Tensor, bits: int, V: int, P: int) -> torch.Tensor:
    """The inverse of pack_high: int32 [R, ns] -> [R, ns, V, P] (int32)."""
    shift = (torch.arange(P, dtype=torch.int32, device=qh.device)[None, :] * V
             + torch.arange(V, dtype=torch.int32, device=qh.device)[:, None]) * bits  # [V, P]
    return (qh[..., None, None] >> shift) & ((1 << bits) - 1)  # [R, ns, V, P]
