"""MXFP4 (OCP microscaling FP4, gpt-oss's experts) and the ternary TQ1_0 / TQ2_0, in torch."""
from __future__ import annotations

import torch
from gguf.constants import QK_K
from gguf.constants import GGMLQuantizationType as T

from .quant_base import (
    RANDOM_WEIGHT_MAX,
    QuantType,
    f16,
    put_f16,
    random_bytes,
    uniform,
    unpack,
)


def e2m1_doubled() -> torch.Tensor:
    """The 16 E2M1 (FP4) values times two, as ggml keeps them: int8 [16].

    Code bits s ee m: exponent 0 is subnormal (0, 0.5), else 2^(e-1) * (1 + m / 2);
    doubled, every value is an integer. The sign of zero is dropped (int8 -0 is 0)."""
    c = torch.arange(16)
    e, m = (c >> 1) & 3, c & 1
    mag = torch.where(e == 0, m, (2 + m) << (e - 1).clamp(min=0))  # 0 1 2 3 4 6 8 12
    return torch.where(c >= 8, -mag, mag).to(torch.int8)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """An E8M0 scale byte (2^(e - 127)) halved, for the doubled E2M1 values: uint8 [...] ->
    float32 [...] = 2^(e - 128). Its bits are built directly, as ggml does: e < 2 gives
    the subnormals 2^-128 and 2^-127, and e = 255 (NaN in the OCP spec) is 2^127."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


_E2M1 = e2m1_doubled()


class MXFP4(QuantType, qtype=T.MXFP4):
    """32 values: one E8M0 scale byte, then 16 bytes of E2M1 codes (values 0-15 in the
    low nibbles, 16-31 in the high), value = 2^(e - 128) * doubled E2M1."""

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        d = e8m0_half(blocks[:, :1])  # [n, 1]
        codes = unpack(blocks[:, 1:], 4).reshape(n, 32).long()  # [n, 32]
        return d * _E2M1.to(blocks.device)[codes].float()

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        # 2^(e - 128) * 12 <= RANDOM_WEIGHT_MAX: e = 121 at most, and one step below
        top = 128 + int(torch.tensor(RANDOM_WEIGHT_MAX / 12).log2().floor())
        blocks = random_bytes(n_blocks, cls.type_size, generator)  # [n, 17]
        blocks[:, 0] = top - (blocks[:, 0] & 1)
        return blocks


class TQ1_0(QuantType, qtype=T.TQ1_0):
    """256 ternary values, value = d * (t - 1), t in 0..2, stored as base-3 fixed point:
    a byte b holds the trits of b * 3^k (mod 256), each read as (x * 3) >> 8.

    Layout: qs[48] (bytes 0-31: five trits each, for values 32 k + byte; bytes 32-47: five
    trits for 160 + 16 k + byte), qh[4] (four trits each, 240 + 4 k + byte), d (fp16)."""
    f16_fields = (52,)
    max_q = 2.0   # random d at half the weight maximum: two thirds of the values are +-d

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        pow3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=blocks.device)[:, None]  # [5, 1]
        parts = [(blocks[:, :32].unsqueeze(1) * pow3).reshape(n, 160),       # uint8 products wrap
                 (blocks[:, 32:48].unsqueeze(1) * pow3).reshape(n, 80),
                 (blocks[:, 48:52].unsqueeze(1) * pow3[:4]).reshape(n, 16)]
        t = (torch.cat(parts, dim=1).to(torch.int16) * 3) >> 8  # [n, 256] in 0..2
        return f16(blocks, 52) * (t - 1).float()


class TQ2_0(QuantType, qtype=T.TQ2_0):
    """256 ternary values in 2-bit codes, value = d * (q - 1) (the code 3, which gives 2,
    is never written by the quantizer). Layout: qs[64] (two halves of 32 bytes, field j
    of a half's bytes one run of 32 values), d (fp16)."""
    f16_fields = (64,)
    max_q = 2.0   # as TQ1_0

    @staticmethod
    def dequantize_blocks(blocks):
        n = blocks.shape[0]
        q = unpack(blocks[:, :64].reshape(n, 2, 32), 2).reshape(n, QK_K)  # [n, 256] in 0..3
        return f16(blocks, 64) * (q.to(torch.int16) - 1).float()

    @classmethod
    def random_blocks(cls, n_blocks, generator):
        blocks = torch.zeros(n_blocks, cls.type_size, dtype=torch.uint8, device=generator.device)
        codes = torch.randint(0, 3, (n_blocks, 2, 4, 32), dtype=torch.uint8,
                              generator=generator, device=generator.device)  # ternary codes only
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=generator.device)[:, None]  # [4, 1]
        blocks[:, :64] = (codes << shifts).sum(2, dtype=torch.uint8).reshape(n_blocks, 64)
        put_f16(blocks, 64, uniform(n_blocks, 0.5, 1.0, generator) * (RANDOM_WEIGHT_MAX / cls.max_q))
        return blocks
