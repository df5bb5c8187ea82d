"""MXFP4 (gpt-oss's experts) and the ternary TQ1_0, TQ2_0: formats with no codebook.

MXFP4: 32-value blocks of 4-bit E2M1 codes and one E8M0 scale byte, value = 2^(e - 128) *
doubled E2M1 (gguf/quants_misc.py): Q4_0's layout (the file's nibbles, 4 words a slot), the
scale byte as it is in a uint8 sc plane. The kernels build 2^(e - 128) from e's bits as ggml
does and pick the doubled level as IQ4's kernels do (four int32 constants of biased bytes,
fmt_iq4.level_words): both exact, so the product is gguf's.

TQ2_0: 256 2-bit codes and an fp16 d, value = d * (q - 1): Q2_K's slots (16 values, one qs
word, V 1, P 16) and d per super-block in the sd plane. TQ1_0 (five trits a byte, base-3
fixed point) is decoded at load time into TQ2_0's planes: 2 bits a value (+22% over the
file's 1.69 bits), and TQ2_0's kernels. d * (q - 1) is exact: gguf's values, bit for bit.
"""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T

from ...gguf.quants_misc import e2m1_doubled, e8m0_half
from .fmt_iq4 import _codes, level_words
from .fmt_kquant_low import _crumbs
from .format import Format, f16_field, pack_slots, torch_fields

E2M1_WORDS = level_words(e2m1_doubled())


# --- MXFP4: e (E8M0), qs[16] ---------------------------------------------------------------

def _pack_mxfp4(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 17]
    return {"qs": pack_slots(_codes(blocks[..., 1:]), 4, 4),  # [R, nb * 4]
            "sc": blocks[..., 0].contiguous()}  # [R, nb] uint8


def _torch_mxfp4(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    d = e8m0_half(p["sc"])  # [R, ns]
    levels = e2m1_doubled().to(p["qs"].device)[torch_fields(p["qs"], 4, 4).long()].float()  # [R, ns, 32]
    return (d[..., None] * levels).reshape(-1, K)


MXFP4 = Format(T.MXFP4, slot=32, V=4, P=8, pack=_pack_mxfp4, dequantize=_torch_mxfp4)


# --- TQ2_0: qs[64] d; TQ1_0: qs[48] qh[4] d ------------------------------------------------

def _ternary_planes(codes: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
    """2-bit codes in k order uint8 [R, nb * 16, 16] and d fp16 [R, nb] -> the planes."""
    return {"qs": pack_slots(codes, 2, 1),  # [R, ns]
            "sd": d.contiguous()}  # [R, nb]


def _pack_tq2_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 66]
    return _ternary_planes(_crumbs(blocks[..., :64]), f16_field(blocks, 64))


def _trits(blocks: torch.Tensor) -> torch.Tensor:
    """TQ1_0's 52 code bytes -> the 256 trits in k order: uint8 [R, nb, 256] (gguf/quants_misc.py)."""
    pow3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=blocks.device)[:, None]  # [5, 1]
    parts = [(blocks[..., None, :32] * pow3).flatten(-2),        # uint8 products wrap: [R, nb, 160]
             (blocks[..., None, 32:48] * pow3).flatten(-2),      # [R, nb, 80]
             (blocks[..., None, 48:52] * pow3[:4]).flatten(-2)]  # [R, nb, 16]
    return ((torch.cat(parts, dim=-1).to(torch.int16) * 3) >> 8).to(torch.uint8)


def _pack_tq1_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 54]
    R, nb = blocks.shape[:2]
    return _ternary_planes(_trits(blocks).reshape(R, nb * 16, 16), f16_field(blocks, 52))


def _torch_ternary(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    q = torch_fields(p["qs"], 2, 1)  # [R, ns, 16]
    d = p["sd"].float().repeat_interleave(16, dim=1)  # [R, ns]
    return (d[..., None] * (q - 1).float()).reshape(-1, K)


TQ2_0 = Format(T.TQ2_0, slot=16, V=1, P=16, pack=_pack_tq2_0, dequantize=_torch_ternary)
TQ1_0 = Format(T.TQ1_0, slot=16, V=1, P=16, pack=_pack_tq1_0, dequantize=_torch_ternary)
