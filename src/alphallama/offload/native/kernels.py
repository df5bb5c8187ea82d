"""ctypes views of the C side: plane descriptors, and the contract's functions one call
at a time (what the tests hold bit-equal to kernels/moe/expert_q8.py; the pool runs the same
C functions)."""
from __future__ import annotations

import ctypes

import torch

from ...kernels.moe.expert_q8 import supports
from ...kernels.formats.qweight import QuantWeight
from .build import lib

_P = ctypes.c_void_p


class QMat(ctypes.Structure):
    """experts.c's qmat: one [E, N, K] expert tensor's planes, byte strides per expert and row."""
    _fields_ = [("qs", _P), ("qh", _P), ("sc", _P), ("sd", _P),
                ("qs_e", ctypes.c_int64), ("qs_r", ctypes.c_int64), ("qh_e", ctypes.c_int64),
                ("qh_r", ctypes.c_int64), ("sc_e", ctypes.c_int64), ("sc_r", ctypes.c_int64),
                ("sd_e", ctypes.c_int64), ("sd_r", ctypes.c_int64),
                ("qtype", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32), ("E", ctypes.c_int32)]


class LayerDesc(ctypes.Structure):
    """pool.c's layer_desc; gate_up.N == 0 marks a layer without experts."""
    _fields_ = [("gate_up", QMat), ("down", QMat)]


class XPrep(ctypes.Structure):
    _fields_ = [("xp", _P), ("ssum", _P), ("xsum", _P), ("dxs", _P)]


class RowBuf(ctypes.Structure):
    _fields_ = [("isum", _P), ("t", _P)]


def qmat(w: QuantWeight) -> QMat:
    """The descriptor of a 2-D [N, K] or 3-D [E, N, K] weight on the CPU. The planes are
    read in place: the caller keeps `w` alive as long as the C side may read them."""
    if not supports(w):
        raise ValueError(f"the CPU expert workers have no integer form of {w.qtype.name}")
    if w.device.type != "cpu":
        raise ValueError(f"the CPU expert workers read host planes, these are on {w.device}")
    q = QMat(qtype=int(w.qtype), N=w.N, K=w.K, E=w.shape[0] if len(w.shape) == 3 else 1)
    for name in ("qs", "qh", "sc", "sd"):
        p = w.planes.get(name)
        if p is None:
            continue
        if p.stride(-1) != 1:
            raise ValueError(f"plane {name} must have contiguous rows, strides {p.stride()}")
        es = p.element_size()
        setattr(q, name, p.data_ptr())
        setattr(q, name + "_r", p.stride(-2) * es)
        setattr(q, name + "_e", p.stride(0) * es if p.dim() == 3 else 0)
    return q


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [K] float32 -> (xq int8 [K], dx [K/32], xs int32 [K/16]) computed by the C code."""
    x = x.float().contiguous()
    K = x.numel()
    if K % 32:
        raise ValueError(f"the expert contract needs K % 32 == 0, got K={K}")
    xq, dx, xs = torch.empty(K, dtype=torch.int8), torch.empty(K // 32), torch.empty(K // 16, dtype=torch.int32)
    lib().aq_quantize(_ptr(x), K, _ptr(xq), _ptr(dx), _ptr(xs))
    return xq, dx, xs


def exp_c(v: torch.Tensor) -> torch.Tensor:
    v = v.float().contiguous()
    out = torch.empty_like(v)
    lib().aq_exp(_ptr(v), v.numel(), _ptr(out))
    return out


def silu_mul_c(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g, u = g.float().contiguous(), u.float().contiguous()
    out = torch.empty_like(g)
    lib().aq_silu_mul(_ptr(g), _ptr(u), g.numel(), _ptr(out))
    return out


def matvec_q8(xq: torch.Tensor, dx: torch.Tensor, xs: torch.Tensor, w: QuantWeight,
              rows: tuple[int, int] | None = None, expert: int = 0, so: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows [r0, r1) (all by default) of w (expert `expert` of a 3-D one) times one
    quantized row: float32 [r1 - r0]. so: the library (default: built for this CPU)."""
    q = qmat(w)
    K = w.K
    if xq.numel() != K:
        raise ValueError(f"activation of {xq.numel()} values for a weight with K={K}")
    r0, r1 = rows or (0, w.N)
    if not 0 <= r0 <= r1 <= w.N:
        raise ValueError(f"rows {r0}..{r1} outside 0..{w.N}")
    xq, dx, xs = xq.to(torch.int8).contiguous(), dx.float().contiguous(), xs.to(torch.int32).contiguous()
    ns = K // 16 + 8
    xp, ssum, xsum, dxs = (torch.empty(K, dtype=torch.int8), torch.empty(ns, dtype=torch.int32),
                           torch.empty(ns), torch.empty(ns))
    isum, t = torch.empty(ns, dtype=torch.int32), torch.empty(ns)
    x = XPrep(_ptr(xp), _ptr(ssum), _ptr(xsum), _ptr(dxs))
    rb = RowBuf(_ptr(isum), _ptr(t))
    out = torch.empty(r1 - r0)
    so = so or lib()
    if so.aq_prep(int(w.qtype), _ptr(xq), _ptr(dx), _ptr(xs), K, ctypes.byref(x)) != 0:
        raise ValueError(f"{w.qtype.name}: K={K} does not fit the expert contract")
    so.aq_matvec(ctypes.byref(q), expert, ctypes.byref(x), r0, r1, _ptr(out), ctypes.byref(rb))
    return out
