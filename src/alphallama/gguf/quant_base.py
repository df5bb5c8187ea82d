"""The element type of the quant registry and the byte-level helpers every format uses.

A format's dequantizer does each float op in the same order and precision as the `gguf`
package's numpy reference (fp16 -> fp32 first, then the products left to right), so the
results are identical to the bit. Everything is plain torch on the input's device.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

# random_blocks picks each block's scale so that the largest value the block can hold
# is about this: the size of real LLM weights (std ~0.02, tails ~0.1).
RANDOM_WEIGHT_MAX = 0.1


def f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of every block, widened to fp32: [n, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()  # [n, 1]


def f16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns held as integers 0..65535 [...] -> their values as float32 [...]."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return signed.to(torch.int16).view(torch.float16).float()


def put_f16(blocks: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """Write fp32 `values` [n] as the fp16 field at byte `offset` of every block."""
    blocks[:, offset:offset + 2] = values.to(torch.float16).reshape(-1, 1).view(torch.uint8)  # [n, 2]


def unpack(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Split each byte into its 8 // bits fields, lowest bits first: [..., k] -> [..., 8 // bits, k].

    ggml packs sub-blocks in planes: field i of bytes 0..k-1 is one run of k values,
    so the new axis goes before the byte axis."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)  # [8 // bits]
    return (x.unsqueeze(-2) >> shifts.unsqueeze(-1)) & ((1 << bits) - 1)  # [..., 8 // bits, k]


def unpack_bytewise(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Each byte's fields next to each other, lowest first: uint8 [n, k] -> [n, k * 8 // bits]
    (field j of byte b at b * 8 // bits + j: how the IQ formats pack scales and high bits)."""
    return unpack(x, bits).transpose(-1, -2).reshape(x.shape[0], -1)


def le_words(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Little-endian unsigned words of `nbytes` bytes: uint8 [n, k] -> int64 [n, k // nbytes]."""
    b = x.reshape(x.shape[0], -1, nbytes).to(torch.int64)  # [n, words, nbytes]
    shifts = torch.arange(0, 8 * nbytes, 8, dtype=torch.int64, device=x.device)  # [nbytes]
    return (b << shifts).sum(-1)  # [n, words]


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    """Bits as float signs, bit 0 first, set = -1: [..., k] (any integer) -> float32 [..., k, 8]."""
    shifts = torch.arange(8, dtype=x.dtype, device=x.device)  # [8]
    bit = (x.unsqueeze(-1) >> shifts) & 1  # [..., k, 8]
    return 1.0 - 2.0 * bit.float()


def uniform(n: int, lo: float, hi: float, generator: torch.Generator) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=generator, device=generator.device)  # [n]


def random_bytes(n: int, type_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n, type_size), dtype=torch.uint8,
                         generator=generator, device=generator.device)  # [n, type_size]


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
        blocks = random_bytes(n_blocks, cls.type_size, generator)  # [n, type_size]
        d = uniform(n_blocks, 0.5, 1.0, generator) * (RANDOM_WEIGHT_MAX / cls.max_q)  # [n]
        put_f16(blocks, cls.f16_fields[0], d)
        return blocks
