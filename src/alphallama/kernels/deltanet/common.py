"""Pieces the Gated DeltaNet kernels share, so that decode, verify, commit and prefill do
the same arithmetic for the same row: the conv taps (from the round's rows or the conv
ring), the conv + SiLU, the L2 norm, the gates, and the layer's shape.

The conv ring. A layer's conv state is the d_conv - 1 conv inputs (mix rows) before the
next position. The kernels keep every mix row p in slot p mod R of a ring [R, C] instead
of a [d_conv - 1, C] window: a round at positions pos..pos+W-1 reads the slots of
pos-d_conv+1..pos-1 and writes those of pos..pos+W-1, which are different slots while
R >= W + d_conv - 1, so the programs of one launch never race on a slot, and the window of
any accepted prefix (pos + n) is already in place after a verify round: the conv state needs
no commit. Positions below 0 are zero rows (a fresh ring is zeros).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...model.deltanet import key_heads
from .layout import RING_ROWS, W_MAX  # noqa: F401 (W_MAX: imported from here by the kernels and the cache)



@dataclass(frozen=True)
class DeltaNetShape:
    """One recurrent layer's dimensions. Value head j reads key head j % hk (tiled, qwen35)
    or j // (hv / hk) (grouped, qwen3next). The mix's channels are [q (hk*dk) | k (hk*dk) |
    v (hv*dv)], as the reference's attn_qkv output."""
    hk: int
    hv: int
    dk: int
    dv: int
    d_conv: int = 4
    tiled: bool = True
    eps: float = 1e-6

    @property
    def channels(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    def check(self) -> None:
        for name in ("dk", "dv"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {n}")
        if self.hv % self.hk:
            raise ValueError(f"value heads {self.hv} must be a multiple of key heads {self.hk}")
        if self.d_conv < 2:
            raise ValueError(f"d_conv must be >= 2, got {self.d_conv}")

    def key_head(self) -> torch.Tensor:
        """[hv] the key head of each value head (model.deltanet.key_heads)."""
        return key_heads(self.hv, self.hk, self.tiled)


def ring_from_state(conv_state: torch.Tensor, pos: int, rows: int = RING_ROWS) -> torch.Tensor:
    """A ring [rows, C] holding a [d_conv-1, C] conv state as the rows before `pos` (the
    other slots zero): how a checkpoint or a CPU cache's state enters the kernels. The
    kernels read zeros below position 0, so the state's rows there must be zero."""
    d1, C = conv_state.shape
    if pos < d1 and conv_state[:d1 - pos].any():
        raise ValueError(f"a conv state before position {pos} has non-zero rows below position 0")
    ring = torch.zeros(rows, C, dtype=conv_state.dtype, device=conv_state.device)
    ring[(torch.arange(pos - d1, pos) % rows).to(conv_state.device)] = conv_state
    return ring


def state_from_ring(ring: torch.Tensor, pos: int, d_conv: int) -> torch.Tensor:
    """The [d_conv-1, C] conv state before position `pos` (zero rows below position 0)."""
    p = torch.arange(pos - d_conv + 1, pos)
    out = ring[(p % ring.shape[0]).to(ring.device)].clone()                 # [d-1, C]
    out[(p < 0).to(ring.device)] = 0
    return out


@triton.jit
def mix_row(MIX, RING, p, pos, R, C, ch, mask, FROM_RING: tl.constexpr):
    """Channels `ch` of mix row(s) p (a scalar, or rows [BR, 1] against ch [1, BLOCK]): from
    the round's rows MIX [*, C] (row p - pos) when p >= pos and not FROM_RING, else from
    the ring slot p mod R (zeros below position 0). A select, not an add: the value's bits."""
    old = tl.load(RING + ((p + R) % R) * C + ch, mask=mask & (p >= 0), other=0.0)
    if FROM_RING:
        x = old
    else:
        new = tl.load(MIX + (p - pos) * C + ch, mask=mask & (p >= pos), other=0.0)
        x = tl.where(p >= pos, new, old)
    return x


@triton.jit
def conv_silu(MIX, RING, CONVW, p, pos, R, C, ch, mask, D_CONV: tl.constexpr, FROM_RING: tl.constexpr):
    """silu(sum_i w[ch, i] * x[p - D_CONV + 1 + i]) for channels ch of row(s) p, the taps in
    a fixed order (i = 0 first): a row's bits do not depend on where its taps come from."""
    acc = mix_row(MIX, RING, p - D_CONV + 1, pos, R, C, ch, mask, FROM_RING) * \
        tl.load(CONVW + ch * D_CONV, mask=mask, other=0.0)
    for i in tl.static_range(1, D_CONV):
        x = mix_row(MIX, RING, p - D_CONV + 1 + i, pos, R, C, ch, mask, FROM_RING)
        acc = acc + x * tl.load(CONVW + ch * D_CONV + i, mask=mask, other=0.0)
    return acc * tl.sigmoid(acc)


@triton.jit
def l2_normalize(x, eps, AXIS: tl.constexpr):
    """x / sqrt(sum(x^2) + eps) over a head along AXIS (model.deltanet.l2_normalize)."""
    return x * tl.expand_dims(tl.rsqrt(tl.sum(x * x, AXIS) + eps), AXIS)


@triton.jit
def gates(ALPHA, BETA, DTB, SSMA, t, j, stride_ab, mask):
    """(g, beta) of value head j, row(s) t: softplus(alpha + dt_bias) * ssm_a, sigmoid(beta)
    (model.deltanet.gates; softplus with torch's threshold of 20). Rows outside `mask`
    get g = 0 and beta = 0: they leave a state unchanged."""
    a = tl.load(ALPHA + t * stride_ab + j, mask=mask, other=0.0) + tl.load(DTB + j)
    sp = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    b = tl.sigmoid(tl.load(BETA + t * stride_ab + j, mask=mask, other=0.0))
    return tl.where(mask, sp * tl.load(SSMA + j), 0.0), tl.where(mask, b, 0.0)


@triton.jit
def key_head(j, HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr):
    """The key head value head j reads (DeltaNetShape.key_head)."""
    if TILED:
        kh = j % HK
    else:
        kh = j // (HV // HK)
    return kh


def check_ring(ring: torch.Tensor, shape: DeltaNetShape, width: int) -> None:
    R = ring.shape[-2]
    if R < width + shape.d_conv - 1:
        raise ValueError(f"a ring of {R} rows cannot hold a round of {width} rows and its "
                         f"{shape.d_conv - 1} rows of conv state")
    if ring.shape[-1] != shape.channels:
        raise ValueError(f"ring has {ring.shape[-1]} channels, the layer {shape.channels}")
