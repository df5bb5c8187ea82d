"""GGUF/ggml block formats, dequantized in plain torch.

Meant as the reference for the Triton kernels and as the loader's path
for weights that stay in float. Every type is bit-exact against the `gguf` package's
numpy dequantizers (`gguf.quants.dequantize`), doing each float op in the same
order and precision (fp16 -> fp32 first, then `d * sc`, then `* q`, then `- dmin * m`).
Why that is robust, and what kernels may rely on: every product here is an fp16
scale (11 significant bits) times small integers (at most 12 more bits), so it is
exact in fp32; the only rounding is the final `+ m` / `- dmin * m`, and a fused
multiply-add rounds that the same way. Works on any device: pure torch ops, with
constants created on the input's device.

One `QuantType` subclass per format; `QUANTS` maps `GGMLQuantizationType` to it.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType as T

# random_blocks picks each block's fp16 scale so that the largest value the block
# can hold is about this: the size of real LLM weights (std ~0.02, tails ~0.1).
RANDOM_WEIGHT_MAX = 0.1


# --- byte-level helpers --------------------------------------------------------

def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of every block, widened to fp32: [n, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()  # [n, 1]


def _put_f16(blocks: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """Write fp32 `values` [n] as the fp16 field at byte `offset` of every block."""
    blocks[:, offset:offset + 2] = values.to(torch.float16).reshape(-1, 1).view(torch.uint8)  # [n, 2]


def _unpack(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Split each byte into its 8 // bits fields, lowest bits first: [..., k] -> [..., 8 // bits, k].

    ggml packs sub-blocks in planes: field i of bytes 0..k-1 is one run of k values,
    so the new axis goes before the byte axis."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)  # [8 // bits]
    return (x.unsqueeze(-2) >> shifts.unsqueeze(-1)) & ((1 << bits) - 1)  # [..., 8 // bits, k]


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte scale field of Q4_K/Q5_K into 8 six-bit scales and 8 mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes
    4-7 the same for mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and
    mins 4-7 (high nibble)."""
    s, m, sm = scales.reshape(-1, 3, 4).unbind(1)  # 3 x [n, 4]
    sc = torch.cat([s & 0x3F, (sm & 0x0F) | ((s >> 2) & 0x30)], dim=1)  # [n, 8]
    mn = torch.cat([m & 0x3F, (sm >> 4) | ((m >> 2) & 0x30)], dim=1)  # [n, 8]
    return sc, mn


def _uniform(n: int, lo: float, hi: float, generator: torch.Generator) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=generator, device=generator.device)  # [n]


def _random_bytes(n: int, type_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n, type_size), dtype=torch.uint8,
                         generator=generator, device=generator.device)  # [n, type_size]


# --- the registry's element type -------------------------------------------------

class QuantType:
    """One GGUF tensor type: its block geometry and how to turn blocks into floats.

    Subclasses name their type in the class statement, `class Q8_0(QuantType, qtype=T.Q8_0)`,
    and take block and byte sizes from the gguf package's table."""
    qtype: ClassVar[T]
    block_size: ClassVar[int]   # values per block
    type_size: ClassVar[int]    # bytes per block
    f16_fields: ClassVar[tuple[int, ...]] = ()   # byte offsets of the fp16 scale fields
    max_q: ClassVar[float] = 1.0   # largest |value| of a random_blocks block per unit of d

    def __init_subclass__(cls, qtype: T | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if qtype is not None:   # None: a shared base of several types
            cls.qtype = qtype
            cls.block_size, cls.type_size = GGML_QUANT_SIZES[qtype]

    @staticmethod
    def dequantize_blocks(blocks: torch.Tensor) -> torch.Tensor:
        """uint8 [n_blocks, type_size] -> float32 [n_blocks, block_size]."""
        raise NotImplementedError

    @classmethod
    def random_blocks(cls, n_blocks: int, generator: torch.Generator) -> torch.Tensor:
        """Valid random blocks, uint8 [n_blocks, type_size], with values of about
        RANDOM_WEIGHT_MAX at most: random quant bits, sane fp16 scales."""
        blocks = _random_bytes(n_blocks, cls.type_size, generator)  # [n, type_size]
        d = _uniform(n_blocks, 0.5, 1.0, generator) * (RANDOM_WEIGHT_MAX / cls.max_q)  # [n]
        _put_f16(blocks, cls.f16_fields[0], d)
        return blocks


# --- plain floats (block_size 1) ------------------------------------------------

class _Float(QuantType):
    """Shared by F32/F16/BF16: random values are normal * 0.02, stored in the type."""
    dtype: ClassVar[torch.dtype]

    @classmethod
    def random_blocks(cls, n_blocks: int, generator: torch.Generator) -> torch.Tensor:
        x = torch.randn(n_blocks, generator=generator, device=generator.device) * 0.02  # [n]
        return x.to(cls.dtype).reshape(n_blocks, 1).view(torch.uint8)  # [n, type_size]


class F32(_Float, qtype=T.F32):
    dtype = torch.float32

    @staticmethod
    def dequantize_blocks(blocks):
        # clone: the result must not alias the caller's bytes (often a read-only mmap)
        return blocks.contiguous().view(torch.float32).clone()  # [n, 1]


class F16(_Float, qtype=T.F16):
    dtype = torch.float16

    @staticmethod
    def dequantize_blocks(blocks):
        return blocks.contiguous().view(torch.float16).float()  # [n, 1]


class BF16(_Float, qtype=T.BF16):
    dtype = torch.bfloat16

    @staticmethod
    def dequantize_blocks(blocks):
        return blocks.contiguous().view(torch.bfloat16).float()  # [n, 1]


# --- legacy 32-value blocks: value = d * q (+ m) ---------------------------------
# Values 0..15 of a block sit in the low nibbles of the packed bytes, 16..31 in the
# high nibbles; Q5's fifth bit of value j is bit j of the 32-bit little-endian qh.

def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    return _unpack(qs, 4).reshape(-1, 32)  # [n, 16] -> [n, 32]


def _fifth_bits32(qh: torch.Tensor) -> torch.Tensor:
    # _unpack gives [n, bit, byte]; value j is byte j // 8, bit j % 8
    return _unpack(qh, 1).transpose(1, 2).reshape(-1, 32)  # [n, 4] -> [n, 32]


class Q8_0(QuantType, qtype=T.Q8_0):
    f16_fields = (0,)
    max_q = 128.0

    @staticmethod
    def dequantize_blocks(blocks):
        d = _f16(blocks, 0)  # [n, 1]
        q = blocks[:, 2:].view(torch.int8).float()  # [n, 32]
        return q * d


class Q4_0(QuantType, qtype=T.Q4_0):
    f16_fields = (0,)
    max_q = 8.0

    @staticmethod
    def dequantize_blocks(blocks):
        d = _f16(blocks, 0)  # [n, 1]
        q = _nibbles32(blocks[:, 2:]).float() - 8  # [n, 32], exact in fp32
        return d * q


class Q4_1(QuantType, qtype=T.Q4_1):
    f16_fields = (0, 2)
    max_q = 7.5

    @staticmethod
    def dequantize_blocks(blocks):
        d, m = _f16(blocks, 0), _f16(blocks, 2)  # [n, 1] each
        q = _nibbles32(blocks[:, 4:]).float()  # [n, 32]
        return d * q + m

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        # m = -7.5 d centres the block on zero, as weights are
        blocks = super().random_blocks(n_blocks, generator)
        _put_f16(blocks, 2, _f16(blocks, 0).squeeze(1) * -7.5)
        return blocks


class Q5_0(QuantType, qtype=T.Q5_0):
    f16_fields = (0,)
    max_q = 16.0

    @staticmethod
    def dequantize_blocks(blocks):
        d = _f16(blocks, 0)  # [n, 1]
        q = _nibbles32(blocks[:, 6:]) | (_fifth_bits32(blocks[:, 2:6]) << 4)  # [n, 32] in 0..31
        return d * (q.float() - 16)


class Q5_1(QuantType, qtype=T.Q5_1):
    f16_fields = (0, 2)
    max_q = 15.5

    @staticmethod
    def dequantize_blocks(blocks):
        d, m = _f16(blocks, 0), _f16(blocks, 2)  # [n, 1] each
        q = _nibbles32(blocks[:, 8:]) | (_fifth_bits32(blocks[:, 4:8]) << 4)  # [n, 32] in 0..31
        return d * q.float() + m

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        blocks = super().random_blocks(n_blocks, generator)
        _put_f16(blocks, 2, _f16(blocks, 0).squeeze(1) * -15.5)
        return blocks


# --- k-quants: 256-value super-blocks of sub-blocks with their own scales ---------

class _KWithMin(QuantType):
    """Q4_K/Q5_K: 8 sub-blocks of 32, value = (d * sc) * q - (dmin * m), 6-bit sc and m."""
    f16_fields = (0, 2)
    q_mid: ClassVar[float]   # middle of q's range

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        # Every min equal to its scale and dmin = q_mid * d make each sub-block
        # d * sc * (q - q_mid): centred on zero like real weights, |value| <= 63 q_mid d.
        blocks = super().random_blocks(n_blocks, generator)  # [n, type_size]
        _put_f16(blocks, 2, _f16(blocks, 0).squeeze(1) * cls.q_mid)
        blocks[:, 8:12] = blocks[:, 4:8]  # mins 0-3 and top bits of mins 4-7 = the scales'
        blocks[:, 12:16] = (blocks[:, 12:16] & 0x0F) * 0x11  # low 4 bits of min 4-7 = scale's
        return blocks


class Q4_K(_KWithMin, qtype=T.Q4_K):
    q_mid = 7.5
    max_q = 63 * 7.5
    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)  # [n, 1] each
        sc, m = _k_scales(blocks[:, 4:16])  # [n, 8] each
        q = _unpack(blocks[:, 16:].reshape(n, 4, 32), 4).reshape(n, 8, 32)  # sub-block 2i+1 = high nibbles
        d = (d * sc.float()).unsqueeze(-1)  # [n, 8, 1]
        dm = (dmin * m.float()).unsqueeze(-1)  # [n, 8, 1]
        return (d * q.float() - dm).reshape(n, QK_K)


class Q5_K(_KWithMin, qtype=T.Q5_K):
    q_mid = 15.5
    max_q = 63 * 15.5

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)  # [n, 1] each
        sc, m = _k_scales(blocks[:, 4:16])  # [n, 8] each
        qh = _unpack(blocks[:, 16:48], 1)  # [n, 8, 32]: sub-block k's fifth bits are bit k
        ql = _unpack(blocks[:, 48:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
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
        ql = _unpack(blocks[:, :128].reshape(n, 2, 64), 4).reshape(n, 8, 32)
        qh = _unpack(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
        q = ((ql | (qh << 4)).float() - 32).reshape(n, 16, 16)  # [n, 16, 16] in -32..31
        sc = blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
        d = (_f16(blocks, 208) * sc).unsqueeze(-1)  # [n, 16, 1]
        return (d * q).reshape(n, QK_K)


QUANTS: dict[T, type[QuantType]] = {
    q.qtype: q for q in (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
}


# --- public functions ---------------------------------------------------------

def quant_type(qtype: T | int) -> type[QuantType]:
    """The registry entry for `qtype`; ValueError naming the type if unsupported."""
    q = QUANTS.get(qtype)
    if q is None:
        try:
            name = T(qtype).name
        except ValueError:
            name = f"#{int(qtype)}"
        raise ValueError(f"quant type {name} is not supported for dequantization "
                         f"(supported: {', '.join(t.name for t in QUANTS)})")
    return q


def as_bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Any array or tensor, reinterpreted as its flat bytes (uint8 [n_bytes])."""
    if isinstance(raw, np.ndarray):
        # torch cannot wrap a read-only array (an mmap'd file) without a warning and
        # the risk of a write through it; copying the raw bytes costs less than the
        # float32 result does
        raw = np.ascontiguousarray(raw) if raw.flags.writeable else np.array(raw, order="C")
        raw = torch.from_numpy(raw.reshape(-1).view(np.uint8))
    return raw.contiguous().reshape(-1).view(torch.uint8)  # [n_bytes]


def dequantize(raw: torch.Tensor | np.ndarray, qtype: T | int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's stored bytes -> float32 tensor of `shape` (torch order, last dim = row).

    `raw` may have any shape and dtype; only its bytes count (so typed F32/F16/BF16
    arrays work too). The result is on raw's device and never aliases raw."""
    q = quant_type(qtype)
    shape = tuple(int(s) for s in shape)
    n_values = int(np.prod(shape, dtype=np.int64))
    if not shape or shape[-1] % q.block_size:
        raise ValueError(f"{q.qtype.name}: row length of shape {shape} is not a multiple "
                         f"of the block size {q.block_size}")
    data = as_bytes(raw)  # [n_bytes]
    n_bytes = n_values // q.block_size * q.type_size
    if data.numel() != n_bytes:
        raise ValueError(f"{q.qtype.name} tensor of shape {shape} needs {n_bytes} bytes, got {data.numel()}")
    blocks = data.reshape(-1, q.type_size)  # [n_blocks, type_size]
    return q.dequantize_blocks(blocks).reshape(shape)


def random_blocks(qtype: T | int, n_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [n_blocks, type_size] of valid random blocks with finite values of at most
    about RANDOM_WEIGHT_MAX, on the generator's device."""
    return quant_type(qtype).random_blocks(n_blocks, generator)
