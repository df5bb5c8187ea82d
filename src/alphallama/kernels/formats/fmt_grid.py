"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: codebook (grid) formats.

Each of them cuts a 256-value super-block into 32 groups of 8 values; a group is one
codebook point of 8 (IQ2, IQ1) or two points of 4 (IQ3), 8 sign bits (IQ2, IQ3) or a
delta sign (IQ1), and a small scale s shared by 16 or 32 values. A slot is a group (8
values, V = 2 words of P = 4 byte fields, format.slot_positions). The kernels' loads
(fmt_triton_grid.py) widen each group's stored fields to one int32 *group word*:

    bits  0..10  point index a (IQ3: the first point of 4)
    bits 11..19  IQ3's second point index b
    bits 20..27  the 8 signs, bit j = value j; IQ1: bit 20 = delta negative
    bits 28..31  s

then gather the group's point bytes from the format's codebook, held on the device as an
int16 table of the points' bytes (`Format.table`; IQ1: point + 1, so 0..2), word v being the
half-words v and v + 2 of the group's 8 bytes. The table is passed in qh's place
(QuantWeight.plane_args): these formats have no qh plane.

What the planes store (qs: a 16-bit short word a group; sd: fp16 d a super-block unless said):
    IQ1_S, IQ1_M   index | delta sign << 11 | s << 12 (IQ1_M's split d joined)
    IQ2_XXS/XS     index | the 7 stored sign bits << 9 (the 8th: their parity, the ksigns
                   rule); sc: uint8 s, one a scale (4 groups / 2 groups)
    IQ2_S          index | s << 10; sc: the 8 signs a byte
    IQ3_XXS/S      the two indices' low bytes; sc: the 8 signs a byte; sd: a record of int32
                   a super-block: d's bits, the 8 s nibbles, (IQ3_S) the indices' top bits,
                   two a group
Planes over the file: IQ1_S 1.32, IQ1_M 1.18, IQ2_XXS 1.12, IQ2_XS 1.11, IQ2_S 1.20,
IQ3_XXS 1.06, IQ3_S 1.02 (the file packs fields across groups; these keep one load a group).
The plain-torch side packs the group words first and shortens them (`_*_short`), and widens
them back before its dequantizer (`_*_long`).

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


def _i32(v: torch.Tensor) -> torch.Tensor:
    """Values 0..2^32 - 1 (int64) as int32 bit patterns."""
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def _word(a, s, signs=None, b=None, neg=None) -> torch.Tensor:
    """Group fields (int64 [..]) -> the group word, int32 [..]."""
    w = a | (s << 28)
    if b is not None:
        w = w | (b << 11)
    if signs is not None:
        w = w | (signs << 20)
    if neg is not None:
        w = w | (neg << 20)
    return _i32(w)


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


# --- what the planes store (the module's table): group words shortened, and widened back ---

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


def _iq2_s_short(pack):
    def short(blocks):
        p = pack(blocks)
        w = p["qs"].to(torch.int64) & 0xFFFFFFFF
        return {"qs": _short((w & 0x3FF) | ((w >> 28) << 10)), "sc": ((w >> 20) & 0xFF).to(torch.uint8),
                "sd": p["sd"]}
    return short


def _iq2_s_long(p):
    h = _long(p)
    return {"qs": _word(h & 0x3FF, h >> 10, p["sc"].to(torch.int64)), "sd": p["sd"]}


def _iq3_short(pack, W: int):
    """IQ3: the indices' low bytes a short word, the 8 signs a byte (sc), and a record of W
    int32 a super-block (sd): d's bits, the 8 s nibbles, (IQ3_S) the indices' top bits."""
    def short(blocks):
        p = pack(blocks)
        w = p["qs"].to(torch.int64) & 0xFFFFFFFF
        R = w.shape[0]
        s8 = (w >> 28).reshape(R, -1, 8, 4)[..., 0]                                   # [R, nb, 8]
        rec = [p["sd"].view(torch.int16).to(torch.int64) & 0xFFFF,                    # [R, nb]
               (s8 << (4 * torch.arange(8, device=w.device))).sum(-1)]
        if W == 4:
            top = (((w >> 8) & 1) | (((w >> 19) & 1) << 1)).reshape(R, -1, 2, 16)     # [R, nb, 2, 16]
            rec += list((top << (2 * torch.arange(16, device=w.device))).sum(-1).unbind(-1))
        return {"qs": _short((w & 0xFF) | (((w >> 11) & 0xFF) << 8)), "sc": ((w >> 20) & 0xFF).to(torch.uint8),
                "sd": _i32(torch.stack(rec, dim=-1)).reshape(R, -1)}                  # [R, nb * W]
    return short


def _iq3_long(W: int):
    def long(p):
        h = _long(p)
        R = h.shape[0]
        rec = p["sd"].to(torch.int64).reshape(R, -1, W) & 0xFFFFFFFF                  # [R, nb, W]
        d = _short(rec[..., 0]).view(torch.float16)                                   # [R, nb]
        s = ((rec[..., 1:2] >> (4 * torch.arange(8, device=h.device))) & 0xF).repeat_interleave(4, dim=-1)
        a, b = h & 0xFF, h >> 8
        if W == 4:
            top = ((rec[..., 2:4, None] >> (2 * torch.arange(16, device=h.device))) & 3).reshape(R, -1)
            a, b = a | ((top & 1) << 8), b | ((top >> 1) << 8)
        return {"qs": _word(a, s.reshape(R, -1), p["sc"].to(torch.int64), b), "sd": d}
    return long


def _fmt(qtype, pack, dequantize, grid, bias=0, widen=None) -> Format:
    deq = dequantize if widen is None else (lambda p, K: dequantize(widen(p), K))
    return Format(qtype, slot=8, V=2, P=4, pack=pack, dequantize=deq, table=lambda: grid_table(grid, bias))


IQ2_XXS = _fmt(T.IQ2_XXS, _iq2_short(_pack_iq2_xxs, 4), _signed(tab.GRID_IQ2_XXS, 8, 0.125), tab.GRID_IQ2_XXS,
               widen=_iq2_long(4))
IQ2_XS = _fmt(T.IQ2_XS, _iq2_short(_pack_iq2_xs, 2), _signed(tab.GRID_IQ2_XS, 8, 0.125), tab.GRID_IQ2_XS,
              widen=_iq2_long(2))
IQ2_S = _fmt(T.IQ2_S, _iq2_s_short(_pack_iq2_s), _signed(tab.GRID_IQ2_S, 8, 0.125), tab.GRID_IQ2_S,
             widen=_iq2_s_long)
IQ3_XXS = _fmt(T.IQ3_XXS, _iq3_short(_pack_iq3_xxs, 2), _signed(tab.GRID_IQ3_XXS, 4, 0.25), tab.GRID_IQ3_XXS,
               widen=_iq3_long(2))
IQ3_S = _fmt(T.IQ3_S, _iq3_short(_pack_iq3_s, 4), _signed(tab.GRID_IQ3_S, 4, 1.0), tab.GRID_IQ3_S,
             widen=_iq3_long(4))
IQ1_S = _fmt(T.IQ1_S, _iq1_short(_pack_iq1_s), _torch_iq1, tab.GRID_IQ1_S, bias=1, widen=_iq1_long)
IQ1_M = _fmt(T.IQ1_M, _iq1_short(_pack_iq1_m), _torch_iq1, tab.GRID_IQ1_S, bias=1, widen=_iq1_long)
GRID_FORMATS = (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
