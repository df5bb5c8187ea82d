"""ctypes views of the C side: plane descriptors, and the contract's functions one call
at a time (what the tests hold bit-equal to kernels/moe/expert_q8.py; the pool runs the same
C functions)."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from ...kernels.moe.expert_q8 import supports, supports_qtype
from ...kernels.formats.qweight import QuantWeight, format_of
from .build import lib

_P = ctypes.c_void_p


class QMat(ctypes.Structure):
    """experts.c's qmat: one [E, N, K] expert tensor's planes, byte strides per expert and row."""
    _fields_ = [("qs", _P), ("qh", _P), ("sc", _P), ("sd", _P),
                ("qs_e", ctypes.c_int64), ("qs_r", ctypes.c_int64), ("qh_e", ctypes.c_int64),
                ("qh_r", ctypes.c_int64), ("sc_e", ctypes.c_int64), ("sc_r", ctypes.c_int64),
                ("sd_e", ctypes.c_int64), ("sd_r", ctypes.c_int64),
                ("qtype", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32), ("E", ctypes.c_int32),
                ("raw", _P), ("raw2", _P), ("raw_e", ctypes.c_int64), ("raw_r", ctypes.c_int64),
                ("split", ctypes.c_int32), ("bias", _P)]   # bias: [E, N] float32 added to the rows, or NULL


class LayerDesc(ctypes.Structure):
    """pool.c's layer_desc; gate_up.N == 0 marks a layer without experts. act: the
    activation's id (expert_q8.CONTRACT_ACTS, experts.c's ACTS)."""
    _fields_ = [("gate_up", QMat), ("down", QMat), ("act", ctypes.c_int32)]


class XPrep(ctypes.Structure):
    _fields_ = [("xp", _P), ("ssum", _P), ("xsum", _P), ("dxs", _P), ("xi", _P)]   # xi: aq_prep_group's, or NULL


class RowBuf(ctypes.Structure):
    _fields_ = [("isum", _P), ("pl", _P)]   # pl: a mapped row's planes, 2 K + 64 bytes


MAXLANES = 64   # experts.c's: the most lanes a row's sum has


class GrpBuf(ctypes.Structure):
    """group.c's grpbuf: a row's scratch, its decoded codes [K], scales A, B [K / 16 + 8], sums [G],
    lanes [G, MAXLANES]."""
    _fields_ = [("rb", RowBuf), ("codes", _P), ("A", _P), ("B", _P), ("sum", _P), ("lanes", _P)]


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


def qmat_mapped(parts: list[np.ndarray], qtype: int, K: int) -> QMat:
    """The descriptor of a weight read straight from the GGUF file's blocks (the mapped
    tier): parts are [E, N_i, row_bytes] uint8 views of the file (gate and up: the fused
    gate|up, rows of the second after the first's; or one). The caller keeps them mapped."""
    if not supports_qtype(qtype):
        raise ValueError(f"the CPU expert workers have no integer form of type {qtype}")
    if len(parts) not in (1, 2) or any(p.ndim != 3 or p.dtype != np.uint8 for p in parts):
        raise ValueError("a mapped weight is one or two [E, N, row_bytes] uint8 views")
    a, b = parts[0], parts[-1]
    if a.shape != b.shape or any(p.strides[1:] != (p.shape[2], 1) or p.strides[0] != a.strides[0] for p in parts):
        raise ValueError(f"mapped parts must be alike and row-contiguous: {[p.shape for p in parts]}")
    E, n, _ = a.shape
    return QMat(qtype=qtype, N=n * len(parts), K=K, E=E, raw=a.ctypes.data, raw2=b.ctypes.data,
                raw_e=a.strides[0], raw_r=a.strides[1], split=n)


def repack_row(row: np.ndarray, qtype: int, K: int, so=None) -> dict[str, np.ndarray]:
    """One GGUF row (uint8 [row_bytes]) re-laid by the C code (`so`: another build of it):
    the planes' bytes {qs, qh, sc, sd}, each as long as the format's plane of one row
    (tests compare them with fmt.pack's)."""
    if not supports_qtype(qtype):
        raise ValueError(f"the CPU expert workers have no integer form of type {qtype}")
    fmt = format_of(qtype)
    row = np.ascontiguousarray(row, dtype=np.uint8)
    buf = np.zeros(2 * K + 64, dtype=np.uint8)
    ns = K // fmt.slot
    nqs = ns * 4 * fmt.V                       # V int32 words a slot
    offs = [0, nqs, nqs + 4 * ns, nqs + 8 * ns]
    base = buf.ctypes.data
    if (so or lib()).aq_repack_row(int(qtype), row.ctypes.data, K, *(base + o for o in offs)) != 0:
        raise ValueError(f"type {qtype}: a row of {K} values does not fit its blocks")
    return {n: buf[o:o + 4 * ns if n != "qs" else o + nqs] for n, o in zip(("qs", "qh", "sc", "sd"), offs)}


def willneed(view: np.ndarray) -> bool:
    """Ask the kernel to read a mapped view's pages ahead (madvise WILLNEED); False if refused."""
    return lib().aq_willneed(view.ctypes.data, view.nbytes) == 0


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def bias_plane(bias: torch.Tensor, E: int, N: int) -> torch.Tensor:
    """An experts' bias as the C side reads it (qmat.bias): contiguous float32 [E, N] on the CPU."""
    if tuple(bias.shape) not in ((E, N), (N,) if E == 1 else None):
        raise ValueError(f"a bias {tuple(bias.shape)} for a weight of {E} experts x {N} rows")
    return bias.detach().to("cpu", torch.float32).reshape(E, N).contiguous()


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


def act_c(act: int, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The C workers' activation `act` (an id of expert_q8.CONTRACT_ACTS) of g and u."""
    g, u = g.float().contiguous(), u.float().contiguous()
    out = torch.empty_like(g)
    if lib().aq_act(act, _ptr(g), _ptr(u), g.numel(), _ptr(out)) != 0:
        raise ValueError(f"the CPU expert workers have no activation {act}")
    return out


def silu_mul_c(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g, u = g.float().contiguous(), u.float().contiguous()
    out = torch.empty_like(g)
    lib().aq_silu_mul(_ptr(g), _ptr(u), g.numel(), _ptr(out))
    return out


def _prepared(so: ctypes.CDLL, qtype: int, K: int, xq: torch.Tensor, dx: torch.Tensor, xs: torch.Tensor,
              keep: list, group: bool = False) -> XPrep:
    """One quantized row prepared for a format by the C code (aq_prep; group: aq_prep_group,
    for aq_matvec_group); its buffers into keep."""
    xq, dx, xs = xq.to(torch.int8).contiguous(), dx.float().contiguous(), xs.to(torch.int32).contiguous()
    if xq.numel() != K:
        raise ValueError(f"activation of {xq.numel()} values for a weight with K={K}")
    ns = K // 16 + 8
    bufs = (torch.empty(K, dtype=torch.int8), torch.empty(ns, dtype=torch.int32), torch.empty(ns), torch.empty(ns),
            torch.empty(K, dtype=torch.int8))
    keep += [xq, dx, xs, *bufs]
    x = XPrep(*(_ptr(b) for b in bufs[:4]), _ptr(bufs[4]) if group else None)
    prep = so.aq_prep_group if group else so.aq_prep
    if prep(qtype, _ptr(xq), _ptr(dx), _ptr(xs), K, ctypes.byref(x)) != 0:
        raise ValueError(f"type {qtype}: K={K} does not fit the expert contract")
    return x


def _row_scratch(K: int, keep: list) -> RowBuf:
    ns = K // 16 + 8
    bufs = (torch.empty(ns, dtype=torch.int32), torch.empty(2 * K + 64, dtype=torch.uint8))
    keep += bufs
    return RowBuf(*(_ptr(b) for b in bufs))


def _desc(w: QuantWeight | QMat, bias: torch.Tensor | None, keep: list) -> QMat:
    q = w if isinstance(w, QMat) else qmat(w)
    if bias is not None:
        bias = bias_plane(bias, q.E, q.N)
        keep.append(bias)
        q.bias = _ptr(bias)
    return q


def _rows(q: QMat, rows: tuple[int, int] | None) -> tuple[int, int]:
    r0, r1 = rows or (0, q.N)
    if not 0 <= r0 <= r1 <= q.N:
        raise ValueError(f"rows {r0}..{r1} outside 0..{q.N}")
    return r0, r1


def matvec_group_q8(acts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], w: QuantWeight | QMat,
                    rows: tuple[int, int] | None = None, expert: int = 0, so: ctypes.CDLL | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [r0, r1) of w times several quantized rows at once, each weight row read and
    decoded once (group.c, what the pool runs for the pairs that share an expert):
    float32 [len(acts), r1 - r0]. Arguments as matvec_q8's; acts: (xq, dx, xs) per row."""
    so, keep = so or lib(), []
    q = _desc(w, bias, keep)
    r0, r1 = _rows(q, rows)
    xs_ = [_prepared(so, q.qtype, q.K, *a, keep, group=True) for a in acts]
    G = len(xs_)
    out = torch.empty(G, r1 - r0)
    xv = (ctypes.POINTER(XPrep) * G)(*(ctypes.pointer(x) for x in xs_))
    ov = (_P * G)(*(out[g].data_ptr() for g in range(G)))
    ns = q.K // 16 + 8
    bufs = (torch.empty(q.K, dtype=torch.uint8), torch.empty(ns), torch.empty(ns), torch.empty(G),
            torch.empty(G, MAXLANES))
    gb = GrpBuf(_row_scratch(q.K, keep), *(_ptr(b) for b in bufs))
    if so.aq_matvec_group(ctypes.byref(q), expert, xv, G, r0, r1, ov, ctypes.byref(gb)) != 0:
        raise RuntimeError(f"aq_matvec_group failed (type {q.qtype}, rows {r0}..{r1})")
    return out


def matvec_q8(xq: torch.Tensor, dx: torch.Tensor, xs: torch.Tensor, w: "QuantWeight | QMat",
              rows: tuple[int, int] | None = None, expert: int = 0, so: ctypes.CDLL | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [r0, r1) (all by default) of w (expert `expert` of a 3-D one) times one
    quantized row: float32 [r1 - r0]. w: a weight's planes, or a descriptor (qmat_mapped:
    rows read from the GGUF blocks). so: the library (default: built for this CPU).
    bias: [E, N] float32 added to the rows (kept alive here for the call)."""
    so, keep = so or lib(), []
    q = _desc(w, bias, keep)
    r0, r1 = _rows(q, rows)
    x = _prepared(so, q.qtype, q.K, xq, dx, xs, keep)
    out = torch.empty(r1 - r0)
    rb = _row_scratch(q.K, keep)
    if so.aq_matvec(ctypes.byref(q), expert, ctypes.byref(x), r0, r1, _ptr(out), ctypes.byref(rb)) != 0:
        raise RuntimeError(f"aq_matvec failed (type {q.qtype}, rows {r0}..{r1})")
    return out
