"""The expert contract: one routed expert's arithmetic defined to the bit.

An expert that is not in the VRAM bank may be computed by the GPU (its weights read in
place over PCIe) or by a CPU worker where its weights sit (offload/native). Exact mode
needs the same bits either way: residency changes between rounds (admissions), and a
speculative run sees other residencies than the plain run it must equal. Float sums in
an order that each implementation picks for itself (warp shuffles, SIMD lanes) cannot
give that, so the expert is defined here as integer dot products plus a short, fixed
sequence of IEEE-754 float32 operations that the Triton kernels (expert_q8_gpu.py), the
C workers and this plain-torch reference all carry out in the same order. There is no
fused multiply-add (Triton compiles with enable_fp_fusion=False, C with
-ffp-contract=off) and no division except the correctly rounded one.

Activations (quantize_q8): per 32-value block of a row,
    amax = max |x|;  dx = amax / 127;  inv = 127 / amax  (0 if amax == 0)
    q    = rne(x * inv)        rne(v) = (v + 1.5 * 2**23) - 1.5 * 2**23, |q| <= 127
    xs   = sum of q per 16 values (for the formats with a min term)
Weights: per slot s of the format (formats.py: 32 values, 16 for Q6_K and Q8_0) integer
codes c_k, a scale A_s and for Q4_K/Q5_K/Q4_1/Q5_1 a min term B_s, such that value = A_s c_k - B_s:
    Q4_K/Q5_K  c = q            A = d * sc   B = dmin * m
    Q6_K       c = q - 32       A = d * sc
    Q4_0/Q5_0  c = q - 8 / 16   A = d
    Q8_0       c = q (int8)     A = d
    Q4_1/Q5_1  c = q            A = d        B = -m   (value = d q + m)
    MXFP4      c = E2M1[q]      A = 2^(e-128)         (the doubled E2M1 level: 0, +-1, 2, 3, 4, 6, 8, 12)
(A and B are exact in float32: an fp16 times a small integer; MXFP4's A is built from e's
bits as ggml does, e < 2 the subnormals 2^-128 and 2^-127.) Then
    isum = sum_k c_k xq_k,  xsum = sum_k xq_k                (exact integers)
    t    = A * isum                  or (A * isum) - (B * xsum)
    term = t * dx[block of the slot]
A row's terms go to nl lanes (contract_lanes: 32, 64 for Q6_K rows of >= 512 slots, fewer
for shorter rows), slot s to lane s mod nl: lane = lane + term, slot after slot, from +0;
then the lanes' pairwise tree, adjacent pairs first: ((l0 + l1) + (l2 + l3)) + ... (the
order of moe_i8, the resident experts' kernel, so that kernel serves the store's VRAM and
PCIe tiers with the CPU workers on: docs/decisions/offload-v2.md part 3).
Expert FFN of a row x:  g | u = gate_up @ quantize_q8(x)   (rows [0, F) and [F, 2F))
                        g | u = (g | u) + b_gu[e]   (with the experts' biases: one add a row)
                        a = act(g, u)                (CONTRACT_ACTS, below)
                        y = down @ quantize_q8(a)   (+ b_dn[e], one add a row, with biases)
    act silu:       a = (g * (1 / (1 + exp_c(-g)))) * u
    act swiglu_oai: g = g > 7 ? 7 : g;  u = (u > 7 ? 7 : (u < -7 ? -7 : u)) + 1   (selects)
                    a = (g * (1 / (1 + exp_c(-(g * 1.702))))) * u                   (gpt-oss's)
Combine of a row's ranks: acc = +0; acc = acc + (w_r * y_r) for r = 0 .. k-1.
exp_c is a range-reduced degree-7 polynomial (below), not the platform's expf; 1.702 and
7 are float32 constants (act_ids.OAI_ALPHA, OAI_LIMIT rounded once).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from gguf.constants import GGMLQuantizationType as T

from ...gguf.quants_misc import e2m1_doubled, e8m0_half
from ..activations.act_ids import ACT_IDS, OAI_ALPHA, OAI_LIMIT
from ..formats.format import torch_fields, torch_high
from ..formats.qweight import QuantWeight

LANES = 32              # a row's lanes (contract_lanes), 64 for the long Q6_K rows
QBLOCK = 32             # activation values per scale
XS_GROUP = 16           # activation values per integer sum
RNE_MAGIC = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds to an integer, ties to even
EXP_CLAMP = 87.0        # exp_c's argument is clamped to [-87, 87]: 2**n stays a normal float
LOG2E = 1.4426950408889634
LN2_HI = 0.693359375    # 355 / 512: n * LN2_HI is exact for |n| <= 128
LN2_LO = -2.1219444005469057e-4
EXP_POLY = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)   # Horner, highest first


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def rne(v: torch.Tensor) -> torch.Tensor:
    m = _f32(RNE_MAGIC)
    return (v + m) - m


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] -> (xq int8 [R, K], dx float32 [R, K/32], xs int32 [R, K/16])."""
    R, K = x.shape
    if K % QBLOCK:
        raise ValueError(f"the expert contract needs K % {QBLOCK} == 0, got K={K}")
    xb = x.float().reshape(R, K // QBLOCK, QBLOCK)                     # [R, nb, 32]
    amax = xb.abs().amax(-1)                                           # [R, nb]
    dx = amax / _f32(127.0)
    inv = torch.where(amax > 0, _f32(127.0) / torch.where(amax > 0, amax, _f32(1.0)), _f32(0.0))
    q = rne(xb * inv[..., None]).to(torch.int32)                       # [R, nb, 32]
    xs = q.reshape(R, K // XS_GROUP, XS_GROUP).sum(-1, dtype=torch.int32)   # [R, K/16]
    return q.reshape(R, K).to(torch.int8), dx, xs


def exp_c(v: torch.Tensor) -> torch.Tensor:
    """exp(v) for float32 v, the contract's own: n = rne(v log2 e), r = v - n ln2 in two
    steps, a degree-7 Horner polynomial, times 2**n built from its bits."""
    v = v.clamp(-EXP_CLAMP, EXP_CLAMP)
    n = rne(v * _f32(LOG2E))
    r = (v - n * _f32(LN2_HI)) - n * _f32(LN2_LO)
    p = _f32(EXP_POLY[0]).expand_as(r)
    for c in EXP_POLY[1:]:
        p = p * r + _f32(c)
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return p * scale


def silu_mul_c(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    one = _f32(1.0)
    return (g * (one / (one + exp_c(-g)))) * u


def swiglu_oai_c(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU in the contract's float32 steps (clamps as compare-selects)."""
    one, lim = _f32(1.0), _f32(OAI_LIMIT)
    g = torch.where(g > lim, lim, g)
    u = torch.where(u > lim, lim, torch.where(u < -lim, -lim, u)) + one
    return (g * (one / (one + exp_c(-(g * _f32(OAI_ALPHA)))))) * u


# the contract's activations by id (act_ids.ACT_IDS: the kernels' ACT, the CPU workers' act)
CONTRACT_ACTS: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    ACT_IDS["silu"]: silu_mul_c, ACT_IDS["swiglu_oai"]: swiglu_oai_c}


class ExpertOps(NamedTuple):
    """What a layer's experts do beside their weights: the activation (an id of
    CONTRACT_ACTS) and the biases, (gate|up [E, 2F], down [E, D]) float32 or None."""
    act: int = ACT_IDS["silu"]
    biases: tuple[torch.Tensor, torch.Tensor] | None = None

    def to(self, device) -> "ExpertOps":
        return self if self.biases is None else self._replace(biases=tuple(b.to(device) for b in self.biases))

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert e's (gate|up [2F], down [D]) biases, or None."""
        return None if self.biases is None else (self.biases[0][e], self.biases[1][e])


# -- weights as integer codes and slot scales -------------------------------------------
SlotTerms = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def _nibble_codes(p: dict[str, torch.Tensor], high: bool) -> torch.Tensor:
    """The 4-bit codes of 32-value slots, with the fifth bit from qh if `high`: int32 [R, ns, 32]."""
    c = torch_fields(p["qs"], 4, 4)                                    # [R, ns, 32]
    return c | (torch_high(p["qh"], 1, 4, 8) << 4) if high else c


def _k_min(p: dict[str, torch.Tensor], high: bool):
    R = p["qs"].shape[0]
    c = _nibble_codes(p, high)                                         # [R, ns, 32]
    s = p["sc"].to(torch.int32)                                        # [R, ns]: sc | m << 8
    d, dmin = p["sd"].float().reshape(R, -1, 2).repeat_interleave(8, dim=1).unbind(-1)  # [R, ns] each
    return c, d * (s & 0xFF).float(), dmin * ((s >> 8) & 0xFF).float()


def _q6_k(p):
    c = (torch_fields(p["qs"], 4, 2) | (torch_high(p["qh"], 2, 2, 8) << 4)) - 32   # [R, ns, 16]
    return c, p["sd"].float().repeat_interleave(16, dim=1) * p["sc"].float(), None


def _legacy(mid: int, high: bool):
    def terms(p):
        return _nibble_codes(p, high) - mid, p["sc"].float(), None
    return terms


def _legacy_min(high: bool):
    def terms(p):
        d, m = p["sc"].float().reshape(p["sc"].shape[0], -1, 2).unbind(-1)   # [R, ns] each: the (d, m) plane
        return _nibble_codes(p, high), d, -m
    return terms


def _q8_0(p):
    c = (torch_fields(p["qs"], 8, 4) ^ 0x80) - 128                     # [R, ns, 16]: bytes as int8
    return c, p["sc"].float().repeat_interleave(2, dim=1), None


_E2M1 = e2m1_doubled().to(torch.int32)                                 # [16] the doubled E2M1 levels


def _mxfp4(p):
    c = _E2M1.to(p["qs"].device)[torch_fields(p["qs"], 4, 4).long()]   # [R, ns, 32]: the codes' levels
    return c, e8m0_half(p["sc"]), None                                 # A [R, ns] = 2^(e - 128)


SLOT_TERMS: dict[T, SlotTerms] = {
    T.Q4_K: lambda p: _k_min(p, False), T.Q5_K: lambda p: _k_min(p, True), T.Q6_K: _q6_k,
    T.Q4_0: _legacy(8, False), T.Q5_0: _legacy(16, True), T.Q8_0: _q8_0,
    T.Q4_1: _legacy_min(False), T.Q5_1: _legacy_min(True), T.MXFP4: _mxfp4}


def supports(w: QuantWeight) -> bool:
    return supports_qtype(w.qtype)


def supports_act(act: int) -> bool:
    """Has the contract this activation (an id of act_ids.ACT_IDS)?"""
    return act in CONTRACT_ACTS


def supports_qtype(qtype: int) -> bool:
    """Has the contract an integer form of this GGUF type?"""
    return qtype in SLOT_TERMS


def slot_terms(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A 2-D weight's (codes int32 [N, ns, slot] in k order, A [N, ns], B [N, ns] or None)."""
    if not supports(w):
        raise ValueError(f"the expert contract has no integer form of {w.qtype.name}")
    if len(w.shape) != 2:
        raise ValueError(f"slot_terms takes a 2-D weight, got {w.shape}")
    return SLOT_TERMS[w.qtype](w.planes)


# -- the contract's matrix-vector product and expert --------------------------------------
def contract_lanes(qtype: int, n_slots: int) -> int:
    """A row's lanes: 32 (64 for Q6_K rows of >= 512 slots, K >= 8192), or the row's slots
    rounded up to a power of two where there are fewer. A function of the weight only
    (gemv/qgemv_i8.step_slots: the experts' kernels step this many slots at a time)."""
    wide = qtype == T.Q6_K and n_slots >= 512
    return min(2 * LANES if wide else LANES, 1 << max(0, (n_slots - 1).bit_length()))


def lane_sum(terms: torch.Tensor, nl: int) -> torch.Tensor:
    """terms [R, ns] float32 -> [R]: slot s into lane s mod nl, in order from +0, then the
    lanes' pairwise tree (a lane is never -0, so the +0 padding is an identity)."""
    R, ns = terms.shape
    pad = (-ns) % nl
    t = torch.cat([terms, terms.new_zeros(R, pad)], 1).reshape(R, -1, nl)     # [R, steps, nl]
    acc = torch.zeros(R, nl, dtype=torch.float32)
    for j in range(t.shape[1]):
        acc = acc + t[:, j]
    while acc.shape[1] > 1:
        acc = acc[:, 0::2] + acc[:, 1::2]
    return acc[:, 0]


def matvec_q8(xq: torch.Tensor, dx: torch.Tensor, xs: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """One quantized row (xq [K] int8, dx [K/32], xs [K/16]) times a 2-D weight [N, K]: [N] float32."""
    codes, A, B = slot_terms(w)
    N, ns, slot = codes.shape
    xqs = xq.to(torch.int64).reshape(ns, slot)                         # [ns, slot]
    isum = (codes.to(torch.int64) * xqs).sum(-1).float()               # [N, ns], exact below 2**24
    t = A * isum
    if B is not None:
        xsum = xs.to(torch.int64).reshape(ns, slot // XS_GROUP).sum(-1).float()   # [ns]
        t = t - B * xsum
    blk = torch.arange(ns) * slot // QBLOCK                            # [ns] activation block of each slot
    return lane_sum(t * dx.float()[blk], contract_lanes(w.qtype, ns))


def expert_ffn(x: torch.Tensor, gate_up: QuantWeight, down: QuantWeight, act: int = ACT_IDS["silu"],
               bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One row x [D] through one expert (gate_up [2F, D], down [D, F]; act an id of
    CONTRACT_ACTS; bias: its (gate|up [2F], down [D]) or None): y [D] float32."""
    xq, dx, xs = quantize_q8(x.reshape(1, -1))
    return expert_ffn_q8(xq[0], dx[0], xs[0], gate_up, down, act, bias)


def expert_ffn_q8(xq: torch.Tensor, dx: torch.Tensor, xs: torch.Tensor, gate_up: QuantWeight,
                  down: QuantWeight, act: int = ACT_IDS["silu"],
                  bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """expert_ffn from the row already quantized (what the mailbox carries): y [D] float32."""
    gu = matvec_q8(xq, dx, xs, gate_up)                                # [2F]
    if bias is not None:
        gu = gu + bias[0].float()
    F = gu.shape[0] // 2
    a = CONTRACT_ACTS[act](gu[:F], gu[F:])                             # [F]
    aq, adx, axs = quantize_q8(a.reshape(1, -1))
    y = matvec_q8(aq[0], adx[0], axs[0], down)                         # [D]
    return y if bias is None else y + bias[1].float()


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [W, k, D] per-rank expert outputs, weights [W, k] -> [W, D]: ranks added in order."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32)
    for r in range(y.shape[1]):
        acc = acc + weights[:, r:r + 1].float() * y[:, r].float()
    return acc


def moe_q8(x: torch.Tensor, gate_up: QuantWeight, down: QuantWeight, experts: torch.Tensor,
           weights: torch.Tensor, ops: ExpertOps = ExpertOps()) -> torch.Tensor:
    """The routed experts of rows x [W, D] (gate_up [E, 2F, D], down [E, D, F], experts
    and weights [W, k]; ops: their activation and biases) under the contract: [W, D]
    float32. The reference the GPU kernels and the CPU workers are held to, bit for bit."""
    x, gate_up, down, ops = x.cpu(), _cpu(gate_up), _cpu(down), ops.to("cpu")
    W, k = experts.shape
    y = torch.stack([torch.stack([expert_ffn(x[m], gate_up.expert(int(e)), down.expert(int(e)), ops.act,
                                             ops.expert(int(e)))
                                  for e in experts[m].tolist()]) for m in range(W)])   # [W, k, D]
    return combine(y, weights.cpu())


def _cpu(w: QuantWeight) -> QuantWeight:
    return QuantWeight(w.qtype, w.shape, {n: p.cpu() for n, p in w.planes.items()})
