"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: codebook (grid) formats.

Each of them cuts a 256-value super-block into 32 groups of 8 values; a group is one
codebook point of 8 (IQ2, IQ1) or two points of 4 (IQ3), 8 sign bits (IQ2, IQ3) or a
delta sign (IQ1), and a small scale s shared by 16 or 32 values. At load time each group
becomes one int32 *group word* (the qs plane, [N, K / 8]):

    bits  0..10  point index a (IQ3: the first point of 4)
    bits 11..19  IQ3's second point index b
    bits 20..27  the 8 signs, bit j = value j (IQ2_XXS / IQ2_XS / IQ3_XXS: their 7 stored
                 bits widened by the ksigns rule); IQ1: bit 20 = delta negative
    bits 28..31  s (repeated in each group it covers)

and the fp16 d of the super-block is the sd plane ([N, K / 256]; IQ1_M's split d joined).
A slot is a group (8 values, V = 2 words of P = 4 byte fields, format.slot_positions): the
kernels gather the group's point bytes from the format's codebook, held on the device as an
int16 table of the points' bytes (`Format.table`; IQ1: point + 1, so 0..2), word v being the
half-words v and v + 2 of the group's 8 bytes. That is qh's place in the kernel arguments
(QuantWeight.plane_args): these formats have no qh plane.

Where the fields fit, the plane holds a 16-bit *short word* a group that the load widens
to the group word (bottom of this file): IQ1_S / IQ1_M (index, delta sign, s) and IQ2_XXS /
IQ2_XS (index, the 7 stored sign bits; s in a uint8 sc plane, one a scale). Planes over
the file: IQ2_XXS 1.12, IQ2_XS 1.11, IQ1_S 1.32, IQ1_M 1.18; the 32-bit words of IQ2_S
1.59, IQ3_XXS 1.33, IQ3_S 1.18 (their fields take 18 to 27 bits a group).

db = d * (2 s + 1) * C (C: IQ2 1/8, IQ3_XXS 1/4, IQ3_S 1, IQ1 1) and db * point * sign
(IQ1: db * (point + delta)) are exact in fp32, as gguf's own products are: bit for bit.
"""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T

from ...gguf import iq_tables as tab
from ...gguf.quant_base import le_words, unpack_bytewise
from .format import Format, f16_field

GROUPS = 32   # groups of 8 values per super-block


def grid_table(grid: torch.Tensor, bias: int = 0) -> torch.Tensor:
    """A codebook float32 [points, dim] as the kernels read it: its bytes (+ bias) as int16 [points * dim / 2]."""
    return (grid + bias).to(torch.uint8).contiguous().view(torch.int16).flatten()


def _word(a, s, signs=None, b=None, neg=None) -> torch.Tensor:
    """Group fields (int64 [..]) -> the group word, int32 [..]."""
    w = a | (s << 28)
    if b is not None:
        w = w | (b << 11)
    if signs is not None:
        w = w | (signs << 20)
    if neg is not None:
        w = w | (neg << 20)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def _signs7(idx7: torch.Tensor) -> torch.Tensor:
    """7 stored sign bits -> the 8 (the ksigns rule: an even number of minus signs)."""
    return tab.KSIGNS.to(idx7.device)[idx7].to(torch.int64)


def _planes(blocks: torch.Tensor, words: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
    R = blocks.shape[0]
    return {"qs": words.reshape(R, -1),                       # [R, nb * 32] group words
            "sd": d.reshape(R, -1).contiguous()}              # [R, nb] fp16


def _flat(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.reshape(-1, blocks.shape[-1])               # [R * nb, type_size]


def _d(blocks: torch.Tensor) -> torch.Tensor:
    return f16_field(blocks, 0)                               # [R, nb] fp16


# --- packers: blocks [R, nb, type_size] -> planes ---------------------------------------

def _pack_iq2_xxs(blocks):
    b = _flat(blocks)
    n = b.shape[0]
    aux = le_words(b[:, 2:], 4).reshape(n, 8, 2)              # [n, 8 sub-blocks, 2]
    a = b[:, 2:].reshape(n, 8, 8)[..., :4].to(torch.int64)    # [n, 8, 4] point indices
    shifts = torch.arange(0, 28, 7, device=b.device)          # [4]
    signs = _signs7((aux[..., 1:] >> shifts) & 127)           # [n, 8, 4]
    s = (aux[..., 1:] >> 28).expand(n, 8, 4)                  # [n, 8, 4]
    return _planes(blocks, _word(a, s, signs), _d(blocks))


def _pack_iq2_xs(blocks):
    b = _flat(blocks)
    codes = le_words(b[:, 2:66], 2)                           # [n, 32]
    s = unpack_bytewise(b[:, 66:74], 4).to(torch.int64).repeat_interleave(2, dim=1)  # [n, 32]
    return _planes(blocks, _word(codes & 511, s, _signs7(codes >> 9)), _d(blocks))


def _pack_iq2_s(blocks):
    b = _flat(blocks)
    s = unpack_bytewise(b[:, 74:82], 4).to(torch.int64).repeat_interleave(2, dim=1)  # [n, 32]
    a = b[:, 2:34].to(torch.int64) | (unpack_bytewise(b[:, 66:74], 2).to(torch.int64) << 8)  # [n, 32]
    return _planes(blocks, _word(a, s, b[:, 34:66].to(torch.int64)), _d(blocks))


def _pack_iq3_xxs(blocks):
    b = _flat(blocks)
    n = b.shape[0]
    aux = le_words(b[:, 66:98], 4)                            # [n, 8]
    pts = b[:, 2:66].to(torch.int64).reshape(n, 32, 2)        # [n, 32 groups, 2 points]
    shifts = torch.arange(0, 28, 7, device=b.device)
    signs = _signs7((aux.unsqueeze(-1) >> shifts) & 127).reshape(n, 32)
    s = (aux >> 28).repeat_interleave(4, dim=1)               # [n, 32]
    return _planes(blocks, _word(pts[..., 0], s, signs, pts[..., 1]), _d(blocks))


def _pack_iq3_s(blocks):
    b = _flat(blocks)
    n = b.shape[0]
    s = unpack_bytewise(b[:, 106:110], 4).to(torch.int64).repeat_interleave(4, dim=1)  # [n, 32]
    idx = (b[:, 2:66].to(torch.int64) | (unpack_bytewise(b[:, 66:74], 1).to(torch.int64) << 8)).reshape(n, 32, 2)
    return _planes(blocks, _word(idx[..., 0], s, b[:, 74:106].to(torch.int64), idx[..., 1]), _d(blocks))


def _pack_iq1_s(blocks):
    b = _flat(blocks)
    n = b.shape[0]
    qh = le_words(b[:, 34:50], 2)                             # [n, 8]
    shifts = torch.arange(0, 12, 3, device=b.device)
    a = b[:, 2:34].to(torch.int64) | (((qh.unsqueeze(-1) >> shifts) & 7) << 8).reshape(n, 32)
    s = ((qh >> 12) & 7).repeat_interleave(4, dim=1)          # [n, 32]
    neg = (qh >> 15).repeat_interleave(4, dim=1)
    return _planes(blocks, _word(a, s, neg=neg), _d(blocks))


def _pack_iq1_m(blocks):
    b = _flat(blocks)
    n = b.shape[0]
    sc = le_words(b[:, 48:56], 2)                             # [n, 4]
    s = ((sc.unsqueeze(-1) >> torch.arange(0, 12, 3, device=b.device)) & 7).reshape(n, 16)
    qh = unpack_bytewise(b[:, 32:48], 4).to(torch.int64)      # [n, 32]
    a = b[:, :32].to(torch.int64) | ((qh & 7) << 8)
    d_bits = ((sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=b.device)).sum(-1)  # [n]
    d = torch.where(d_bits >= 0x8000, d_bits - 0x10000, d_bits).to(torch.int16).view(torch.float16)
    return _planes(blocks, _word(a, s.repeat_interleave(2, dim=1), neg=qh >> 3), d)


# --- plain-torch values from the planes (the kernels' reference) ---------------------------

def _fields(p: dict[str, torch.Tensor]):
    """The planes' group words -> (word int64 [R, ng], db's d [R, ng] float32)."""
    w = p["qs"].to(torch.int64) & 0xFFFFFFFF
    d = p["sd"].float().repeat_interleave(GROUPS, dim=1)
    return w, d


def _signed(grid: torch.Tensor, dim: int, C: float):
    def dequantize(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
        w, d = _fields(p)
        db = d * (2 * (w >> 28) + 1).float() * C                                      # [R, ng]
        g = grid.to(w.device)
        if dim == 8:
            pts = g[w & 0x7FF]                                                        # [R, ng, 8]
        else:
            pts = torch.cat([g[w & 0x7FF], g[(w >> 11) & 0x1FF]], dim=-1)
        bits = (w.unsqueeze(-1) >> (20 + torch.arange(8, device=w.device))) & 1      # [R, ng, 8]
        return (db[..., None] * pts * (1.0 - 2.0 * bits.float())).reshape(-1, K)
    return dequantize


def _torch_iq1(p: dict[str, torch.Tensor], K: int) -> torch.Tensor:
    w, d = _fields(p)
    dl = d * (2 * (w >> 28) + 1).float()                                              # [R, ng]
    delta = torch.where((w >> 20) & 1 == 0, tab.IQ1_DELTA, -tab.IQ1_DELTA)            # [R, ng]
    pts = tab.GRID_IQ1_S.to(w.device)[w & 0x7FF]                                      # [R, ng, 8]
    return (dl[..., None] * (pts + delta[..., None])).reshape(-1, K)


# --- short words: 16 bits a group where the fields fit ---------------------------------------
# IQ1_S, IQ1_M: index | neg << 11 | s << 12. IQ2_XXS, IQ2_XS: index | the 7 stored sign bits << 9
# (the 8th is their parity), s in a uint8 sc plane, one a scale (4 groups: IQ2_XXS, 2: IQ2_XS).
# The loads and the torch side widen them back to the group word.

def _short(w: torch.Tensor) -> torch.Tensor:
    """Values 0..65535 (int64) as int16 bit patterns."""
    return torch.where(w >= 1 << 15, w - (1 << 16), w).to(torch.int16)


def _long(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return p["qs"].to(torch.int64) & 0xFFFF


def _iq1_short(pack):
    def short(blocks):
        p = pack(blocks)
        w = p["qs"].to(torch.int64) & 0xFFFFFFFF
        return {"qs": _short((w & 0x7FF) | (((w >> 20) & 1) << 11) | ((w >> 28) << 12)), "sd": p["sd"]}
    return short


def _iq1_long(p):
    h = _long(p)
    return {"qs": _word(h & 0x7FF, h >> 12, neg=(h >> 11) & 1), "sd": p["sd"]}


def _iq2_short(pack, G: int):
    def short(blocks):
        p = pack(blocks)
        w = p["qs"].to(torch.int64) & 0xFFFFFFFF
        s = (w >> 28).reshape(w.shape[0], -1, G)[..., 0]                              # [R, ng / G]
        return {"qs": _short((w & 0x1FF) | (((w >> 20) & 0x7F) << 9)), "sc": s.to(torch.uint8).contiguous(),
                "sd": p["sd"]}
    return short


def _iq2_long(G: int):
    def long(p):
        h = _long(p)
        return {"qs": _word(h & 0x1FF, p["sc"].to(torch.int64).repeat_interleave(G, dim=1), _signs7(h >> 9)),
                "sd": p["sd"]}
    return long


def _fmt(qtype, pack, dequantize, grid, bias=0, widen=None) -> Format:
    deq = dequantize if widen is None else (lambda p, K: dequantize(widen(p), K))
    return Format(qtype, slot=8, V=2, P=4, pack=pack, dequantize=deq, table=lambda: grid_table(grid, bias))


IQ2_XXS = _fmt(T.IQ2_XXS, _iq2_short(_pack_iq2_xxs, 4), _signed(tab.GRID_IQ2_XXS, 8, 0.125), tab.GRID_IQ2_XXS,
               widen=_iq2_long(4))
IQ2_XS = _fmt(T.IQ2_XS, _iq2_short(_pack_iq2_xs, 2), _signed(tab.GRID_IQ2_XS, 8, 0.125), tab.GRID_IQ2_XS,
              widen=_iq2_long(2))
IQ2_S = _fmt(T.IQ2_S, _pack_iq2_s, _signed(tab.GRID_IQ2_S, 8, 0.125), tab.GRID_IQ2_S)
IQ3_XXS = _fmt(T.IQ3_XXS, _pack_iq3_xxs, _signed(tab.GRID_IQ3_XXS, 4, 0.25), tab.GRID_IQ3_XXS)
IQ3_S = _fmt(T.IQ3_S, _pack_iq3_s, _signed(tab.GRID_IQ3_S, 4, 1.0), tab.GRID_IQ3_S)
IQ1_S = _fmt(T.IQ1_S, _iq1_short(_pack_iq1_s), _torch_iq1, tab.GRID_IQ1_S, bias=1, widen=_iq1_long)
IQ1_M = _fmt(T.IQ1_M, _iq1_short(_pack_iq1_m), _torch_iq1, tab.GRID_IQ1_S, bias=1, widen=_iq1_long)
GRID_FORMATS = (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
