"""Q4_K, Q5_K, Q6_K: 256-value super-blocks with per-slot scales.

Q4_K/Q5_K: 8 slots of 32, value = (d * sc) * q - (dmin * m) with 6-bit sc, m (packed
12 bytes in the file, one byte each here) and fp16 d, dmin per super-block.
Q6_K: 16 slots of 16, value = (d * sc) * (q - 32) with int8 sc and 6-bit q.
d * sc and the products with q are exact in fp32, so the only rounding is the last
subtraction (or the one product for Q6_K): the same as gguf's numpy dequantizers,
and the kernel's explicit fused multiply-add rounds it the same way.
"""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T

from .format import Format, f16_field, pack_high, pack_slots, torch_fields, torch_high, unpack_fields


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte scale field -> 8 six-bit scales and 8 mins, uint8 [..., 8] each.

    Bytes 0-3: scales 0-3 (low 6 bits) + top 2 bits of scales 4-7; bytes 4-7 the same
    for mins; bytes 8-11: low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high)."""
    s, m, sm = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]  # [..., 4] each
    sc = torch.cat([s & 0x3F, (sm & 0x0F) | ((s >> 2) & 0x30)], dim=-1)  # [..., 8]
    mn = torch.cat([m & 0x3F, (sm >> 4) | ((m >> 2) & 0x30)], dim=-1)  # [..., 8]
    return sc, mn


def _sub_block_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 code bytes -> 256 low nibbles in k order: [R, nb, 256].
    Bytes come in 4 runs of 32; a run's low nibbles are sub-block 2c, high 2c+1."""
    return unpack_fields(qs.reshape(*qs.shape[:-1], 4, 32), 4).flatten(-3)  # [R, nb, 4, 2, 32] -> 256


def _pack_k_with_min(blocks: torch.Tensor, high: torch.Tensor | None) -> dict[str, torch.Tensor]:
    R, nb = blocks.shape[:2]
    low = _sub_block_nibbles(blocks[..., -128:]).reshape(R, nb * 8, 32)  # [R, ns, 32]
    sc, mn = _k_scales(blocks[..., 4:16])  # [R, nb, 8] each
    planes = {
        "qs": pack_slots(low, 4, 4),  # [R, ns * 4]
        "sc": torch.stack([sc, mn], dim=-1).reshape(R, nb * 8, 2).contiguous().view(torch.int16)[..., 0],  # [R, ns]
        "sd": torch.stack([f16_field(blocks, 0), f16_field(blocks, 2)], dim=-1).flatten(1),  # [R, nb * 2]
    }
    if high is not None:
        planes["qh"] = pack_high(high.reshape(R, nb * 8, 32), 1, 4)  # [R, ns]
    return planes


def _torch_k_with_min(p: dict[str, torch.Tensor], K: int, has_high: bool) -> torch.Tensor:
    R = p["qs"].shape[0]
    q = torch_fields(p["qs"], 4, 4)  # [R, ns, 32]
    if has_high:
        q = q | (torch_high(p["qh"], 1, 4, 8) << 4)
    s = p["sc"].to(torch.int32)  # [R, ns]
    sd = p["sd"].float().reshape(R, -1, 2).repeat_interleave(8, dim=1)  # [R, ns, (d, dmin)]
    d, dmin = sd.unbind(-1)  # [R, ns] each
    ds = (d * (s & 0xFF).float())[..., None]  # [R, ns, 1]
    dm = (dmin * ((s >> 8) & 0xFF).float())[..., None]
    return (ds * q.float() - dm).reshape(R, K)


# --- Q4_K ----------------------------------------------------------------------------

def _pack_q4_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 144]
    return _pack_k_with_min(blocks, None)


def _torch_q4_k(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    return _torch_k_with_min(p, K, has_high=False)


Q4_K = Format(T.Q4_K, slot=32, V=4, P=8, pack=_pack_q4_k, dequantize=_torch_q4_k)


# --- Q5_K: Q4_K plus a fifth bit; bit s of qh byte l belongs to value l of sub-block s --

def _pack_q5_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 176]
    high = unpack_fields(blocks[..., 16:48], 1).flatten(-2)  # [R, nb, 8, 32] -> [R, nb, 256]
    return _pack_k_with_min(blocks, high)


def _torch_q5_k(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    return _torch_k_with_min(p, K, has_high=True)


Q5_K = Format(T.Q5_K, slot=32, V=4, P=8, pack=_pack_q5_k, dequantize=_torch_q5_k)


# --- Q6_K ----------------------------------------------------------------------------
# File: ql[128] qh[64] sc[16] d. Each half of the super-block (128 values) uses 64 ql
# bytes (low nibbles: values 0..63 of the half, high: 64..127) and 32 qh bytes (2-bit
# fields 0..3: values 0..31, 32..63, 64..95, 96..127 of the half).

def _pack_q6_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:  # blocks [R, nb, 210]
    R, nb = blocks.shape[:2]
    low = unpack_fields(blocks[..., :128].reshape(R, nb, 2, 64), 4).reshape(R, nb * 16, 16)  # [R, ns, 16]
    high = unpack_fields(blocks[..., 128:192].reshape(R, nb, 2, 32), 2).reshape(R, nb * 16, 16)
    return {"qs": pack_slots(low, 4, 2),  # [R, ns * 2]
            "qh": pack_high(high, 2, 2),  # [R, ns]
            "sc": blocks[..., 192:208].contiguous().view(torch.int8).reshape(R, nb * 16),  # [R, ns]
            "sd": f16_field(blocks, 208)}  # [R, nb]


def _torch_q6_k(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    R = p["qs"].shape[0]
    q = torch_fields(p["qs"], 4, 2) | (torch_high(p["qh"], 2, 2, 8) << 4)  # [R, ns, 16]
    d = p["sd"].float().repeat_interleave(16, dim=1)  # [R, ns]
    ds = (d * p["sc"].float())[..., None]  # [R, ns, 1]
    return (ds * (q.float() - 32)).reshape(R, K)


Q6_K = Format(T.Q6_K, slot=16, V=2, P=8, pack=_pack_q6_k, dequantize=_torch_q6_k)
