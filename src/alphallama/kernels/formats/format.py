"""The GPU arrangement of GGUF weight bits, shared by every quant format.

A GGUF row is a run of blocks. At load time each row is cut into *slots*: the
values that share one scale (32 values; 16 for Q6_K and Q8_0). A slot's bits are
spread over up to four *planes*, each a contiguous tensor with one row per output:

    qs  int32 [N, n_slots * V]   the low 4 (8; 2 for Q2_K, Q3_K) bits of every value, V words per slot
    qh  int32 [N, n_slots]       the top bits (Q5_0, Q5_1, Q5_K, Q6_K; Q3_K: int16), one word per slot
    sc        [N, n_slots]       the per-slot scale field(s)
    sd        [N, n_slots // S]  the per-super-block fp16 fields (K-quants)

Field i (lowest bits first) of qs word v holds the value at k position
slot_positions(V, P)[v, i] of the slot, and its top bits (if any) sit at bit
HBITS (i V + v) of the slot's qh word (4 i + HBITS v for the 4-bit formats). One
thread loads a slot's V words with one 4- to 16-byte load; fields 2m and 2m+1 of its
V words are 2V consecutive k, whose
activations come in as one vector load and are split in registers. These are the same
bits as the file, re-ordered (K-quants' 6-bit scales and mins are widened to a byte
each: +4 bytes per 144-byte Q4_K block), so a token reads about the GGUF size.

The Triton side of a format is two functions: `load` reads NT slots of BN rows
(words [NT, BN, V] and per-slot scale tensors [NT, BN]), `field` dequantizes field i
of those words to float32 [NT, BN, V] (fmt_triton.py). The plain-torch `dequantize`
computes the same values from the same planes. This module and the fmt_* ones are
torch only: the CPU path packs and plans with them on a machine without triton.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
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
    qs_dtype: torch.dtype = torch.int32
    # the codebook formats' (fmt_grid.py) device table, int16 [T]: the kernels read it in
    # qh's place (QuantWeight.plane_args); None for every other format
    table: Callable[[], torch.Tensor] | None = None

    @property
    def triton_load(self):
        """The format's @triton.jit load (fmt_triton.py), imported on a GPU kernel's
        first use so that the host side of a format never needs triton."""
        return _triton(self.qtype).load

    @property
    def triton_field(self):
        """The format's @triton.jit field (fmt_triton.py); see triton_load."""
        return _triton(self.qtype).field

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


def triton_kernels() -> dict:
    """qtype -> the format's Triton (load, field) pair: fmt_triton.py's and fmt_triton_grid.py's
    (the codebook formats, MXFP4, TQ), imported here so that the host side never needs triton."""
    from .fmt_triton import KERNELS
    from .fmt_triton_grid import KERNELS as MORE
    return {**KERNELS, **MORE}


def _triton(qtype: GGMLQuantizationType):
    from .fmt_triton import KERNELS
    from .fmt_triton_grid import KERNELS as MORE
    return KERNELS[qtype] if qtype in KERNELS else MORE[qtype]


# --- host-side packing helpers (torch, any device) ---------------------------------

def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block: [R, nb] float16."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0]  # [R, nb]


def unpack_fields(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes -> their 8 // bits fields, lowest bits first: uint8 [..., k] -> [..., 8 // bits, k]."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)  # [8 // bits]
    return (x.unsqueeze(-2) >> shifts.unsqueeze(-1)) & ((1 << bits) - 1)  # [..., 8 // bits, k]


def pack_words(vals: torch.Tensor, bits: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Values of `bits` bits, lowest field first, into little-endian words of `dtype`:
    uint8 [..., n] -> [..., n * bits // (8 * itemsize)]."""
    per_byte = 8 // bits
    v = vals.reshape(*vals.shape[:-1], -1, per_byte).to(torch.int32)  # [..., n / per_byte, per_byte]
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=vals.device)  # [per_byte]
    packed = (v << shifts).sum(-1).to(torch.uint8)  # [..., n / per_byte] bytes
    return packed.contiguous().view(dtype)  # [..., n * bits / (8 * itemsize)]


def slot_positions(V: int, P: int, device=None) -> torch.Tensor:
    """k position inside the slot of field i of word v: int64 [V, P]. Fields come in
    pairs (2m, 2m+1) whose V words' values are 2V consecutive k, interleaved
    (word v's field 2m at 2v, field 2m+1 at 2v+1): one 16-byte load of bf16
    activations per pair, split in registers."""
    v = torch.arange(V, device=device)[:, None]  # [V, 1]
    i = torch.arange(P, device=device)[None, :]  # [1, P]
    if P == 1:
        return v
    return (i // 2) * (2 * V) + 2 * v + (i % 2)  # [V, P]


def word_order(vals: torch.Tensor, V: int, P: int) -> torch.Tensor:
    """Slot values in k order [..., V * P] -> word order (word v, field i) [..., V * P]."""
    return vals[..., slot_positions(V, P, vals.device).flatten()]


def pack_slots(vals: torch.Tensor, bits: int, V: int) -> torch.Tensor:
    """Low-bit codes of each slot in k order, uint8 [R, ns, slot] -> the qs plane [R, ns * V]."""
    return pack_words(word_order(vals, V, 32 // bits), bits).flatten(1)


def pack_high(high: torch.Tensor, bits: int, V: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Top bits of each slot's values in k order, uint8 [R, ns, slot] -> the qh word
    [R, ns] (int32; Q3_K's 16 bits: int16): field i of word v at bit bits * (i * V + v)."""
    P = high.shape[-1] // V
    by_field = high[..., slot_positions(V, P, high.device).T.flatten()]  # [R, ns, P * V]
    return pack_words(by_field, bits, dtype)[..., 0]


def torch_fields(qs: torch.Tensor, bits: int, V: int) -> torch.Tensor:
    """The inverse of pack_slots: int32 [R, ns * V] -> codes in k order [R, ns, V * P] (int32)."""
    P = 32 // bits
    words = qs.reshape(qs.shape[0], -1, V)  # [R, ns, V]
    shift = torch.arange(P, dtype=torch.int32, device=qs.device) * bits  # [P]
    f = (words.unsqueeze(-1) >> shift) & ((1 << bits) - 1)  # [R, ns, V, P]
    out = torch.empty_like(f.flatten(-2))  # [R, ns, V * P]
    out[..., slot_positions(V, P, qs.device).flatten()] = f.flatten(-2)
    return out


def torch_high(qh: torch.Tensor, bits: int, V: int, P: int) -> torch.Tensor:
    """The inverse of pack_high: int32 (or int16) [R, ns] -> top bits in k order [R, ns, V * P] (int32)."""
    shift = torch.arange(V * P, dtype=torch.int32, device=qh.device) * bits  # [P * V], field-major
    h = (qh.to(torch.int32).unsqueeze(-1) >> shift) & ((1 << bits) - 1)  # [R, ns, P * V]
    out = torch.empty_like(h)
    out[..., slot_positions(V, P, qh.device).T.flatten()] = h
    return out
