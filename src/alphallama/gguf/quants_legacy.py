"""Plain floats and the legacy 32-value block formats (Q8_0, Q4_0/1, Q5_0/1), in torch.

Every product here is an fp16 scale (11 significant bits) times a small integer, so it is
exact in fp32; the only rounding is Q4_1/Q5_1's final `+ m`, and a fused multiply-add
rounds that the same way (what kernels may rely on).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from gguf.constants import GGMLQuantizationType as T

from .quant_base import QuantType, f16, put_f16, unpack

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
    return unpack(qs, 4).reshape(-1, 32)  # [n, 16] -> [n, 32]


def _fifth_bits32(qh: torch.Tensor) -> torch.Tensor:
    # unpack gives [n, bit, byte]; value j is byte j // 8, bit j % 8
    return unpack(qh, 1).transpose(1, 2).reshape(-1, 32)  # [n, 4] -> [n, 32]


class Q8_0(QuantType, qtype=T.Q8_0):
    f16_fields = (0,)
    max_q = 128.0

    @staticmethod
    def dequantize_blocks(blocks):
        d = f16(blocks, 0)  # [n, 1]
        q = blocks[:, 2:].view(torch.int8).float()  # [n, 32]
        return q * d


class Q4_0(QuantType, qtype=T.Q4_0):
    f16_fields = (0,)
    max_q = 8.0

    @staticmethod
    def dequantize_blocks(blocks):
        d = f16(blocks, 0)  # [n, 1]
        q = _nibbles32(blocks[:, 2:]).float() - 8  # [n, 32], exact in fp32
        return d * q


class Q4_1(QuantType, qtype=T.Q4_1):
    f16_fields = (0, 2)
    max_q = 7.5

    @staticmethod
    def dequantize_blocks(blocks):
        d, m = f16(blocks, 0), f16(blocks, 2)  # [n, 1] each
        q = _nibbles32(blocks[:, 4:]).float()  # [n, 32]
        return d * q + m

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        # m = -7.5 d centres the block on zero, as weights are
        blocks = super().random_blocks(n_blocks, generator)
        put_f16(blocks, 2, f16(blocks, 0).squeeze(1) * -7.5)
        return blocks


class Q5_0(QuantType, qtype=T.Q5_0):
    f16_fields = (0,)
    max_q = 16.0

    @staticmethod
    def dequantize_blocks(blocks):
        d = f16(blocks, 0)  # [n, 1]
        q = _nibbles32(blocks[:, 6:]) | (_fifth_bits32(blocks[:, 2:6]) << 4)  # [n, 32] in 0..31
        return d * (q.float() - 16)


class Q5_1(QuantType, qtype=T.Q5_1):
    f16_fields = (0, 2)
    max_q = 15.5

    @staticmethod
    def dequantize_blocks(blocks):
        d, m = f16(blocks, 0), f16(blocks, 2)  # [n, 1] each
        q = _nibbles32(blocks[:, 8:]) | (_fifth_bits32(blocks[:, 4:8]) << 4)  # [n, 32] in 0..31
        return d * q.float() + m

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        blocks = super().random_blocks(n_blocks, generator)
        put_f16(blocks, 2, f16(blocks, 0).squeeze(1) * -15.5)
        return blocks
