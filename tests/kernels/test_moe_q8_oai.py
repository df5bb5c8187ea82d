"""The expert contract with gpt-oss's experts: MXFP4 weights (codes = the doubled E2M1 levels,
A = 2^(e - 128)), a bias per expert on gate|up [E, 2F] and down [E, D], the clamped swiglu_oai.

  reference  expert_q8's MXFP4 slot terms against float64 of gguf's dequantized weights, and
             swiglu_oai_c against float64 of model/layers.swiglu_oai, within float32 rounding
  kernels    expert_q8_gpu (through moe_q8) bit for bit against the reference, experts in the
             bank and in the host tier, the biases indexed by expert (not by slot), both clamps
             crossed; a row alone gives its bits in the round
CPU: the Triton interpreter (the contract's kernels use no fma, so its double-rounding fma
does not enter); on a GPU the same tests run compiled. Sizes: D = 96 is 3 slots (a padded
chunk), F = 64 two gate blocks."""
from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels import QuantWeight
from alphallama.kernels.activations.act_ids import ACT_IDS
from alphallama.kernels.moe.expert_q8 import (ExpertOps, QBLOCK, matvec_q8, moe_q8 as moe_q8_ref, quantize_q8,
                                              swiglu_oai_c)
from alphallama.kernels.moe.moe_q8 import contract_ok, moe_q8
from alphallama.model.layers import swiglu_oai
from tests.kernels.test_gpu_quant_types_iq import valid_raw
from tests.kernels.test_moe_q8 import _bank
from tests.kernels.test_qmatmul import gguf_dequant

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OAI = ACT_IDS["swiglu_oai"]
E, D, F, K_TOP, W = 4, 96, 64, 2, 3


def mx_raw(n: int, k: int, seed: int, e_range: tuple[int, int] = (118, 124)) -> np.ndarray:
    """Random MXFP4 bytes [n, k/32 * 17]: random codes, scale bytes e drawn from e_range
    (inclusive), and in the first row the subnormal scales e = 0, 1 and e = 2."""
    raw = valid_raw(T.MXFP4, n, k, seed).copy()                       # [n, nb * 17]
    blocks = raw.reshape(n, -1, 17)
    g = np.random.default_rng(seed)
    blocks[..., 0] = g.integers(e_range[0], e_range[1] + 1, size=blocks.shape[:2])
    blocks[0, :3, 0] = (0, 1, 2)[:blocks.shape[1]]
    return raw


def mx_layer(seed: int, dev=DEV):
    """(gate|up [E, 2F, D], down [E, D, F], gguf's float64 of both, biases)."""
    gu_raw, dn_raw = mx_raw(E * 2 * F, D, seed), mx_raw(E * D, F, seed + 1)
    gu = QuantWeight.from_raw(gu_raw, T.MXFP4, (E, 2 * F, D), dev)
    dn = QuantWeight.from_raw(dn_raw, T.MXFP4, (E, D, F), dev)
    g = torch.Generator().manual_seed(seed)
    # gate|up's biases wide enough that some sums pass the clamp at 7 (and below -7 for up)
    biases = (torch.randn(E, 2 * F, generator=g) * 6, torch.randn(E, D, generator=g))
    return gu, dn, gu_raw, dn_raw, biases


def test_mxfp4_slot_terms_vs_float64():
    n, k = 24, 512
    raw = mx_raw(n, k, seed=3, e_range=(100, 140))
    w = QuantWeight.from_raw(raw, T.MXFP4, (n, k))
    w64 = gguf_dequant(raw, T.MXFP4).double().reshape(n, k)            # gguf's own dequantizer
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4))
    xq, dx, xs = quantize_q8(x)
    y = matvec_q8(xq[0], dx[0], xs[0], w)
    xd = (xq.double().reshape(-1, QBLOCK) * dx.double().reshape(-1, 1)).reshape(k)
    assert ((y.double() - w64 @ xd).abs() <= 2e-6 * (w64.abs() @ xd.abs()) + 1e-30).all()


def test_swiglu_oai_c_vs_float64():
    g = torch.cat([torch.linspace(-30, 30, 2001), torch.tensor([7.0, 7.0001, -7.0, 0.0, -0.0])])
    u = torch.cat([torch.linspace(12, -12, 2001), torch.tensor([-7.0, 7.5, 6.9, 3.0, -9.0])])
    ref = swiglu_oai(g.double(), u.double())
    got = swiglu_oai_c(g, u).double()
    assert ((got - ref).abs() <= 1e-6 * (ref.abs() + 1e-6)).all()
    assert got[-4] == swiglu_oai(torch.tensor(7.0), torch.tensor(7.0)).item()   # both clamps at the limit


def _round(seed: int):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(W, D, generator=g) * 3).to(DEV)
    h[1, :32] = 0                                                                # an all-zero block
    experts = torch.tensor([[0, 1], [3, 2], [2, 0]], dtype=torch.int32, device=DEV)
    weights = torch.rand(W, K_TOP, generator=g).to(DEV)
    return h, experts, weights


def test_contract_kernels_match_the_reference():
    """MXFP4 experts with biases and swiglu_oai: the kernels' bits are the reference's, with
    experts 0 and 2 in bank slots 1 and 0 (the biases stay the expert's), and a row alone."""
    gu, dn, _, _, biases = mx_layer(seed=11)
    ops = ExpertOps(OAI, tuple(b.to(DEV) for b in biases))
    assert contract_ok(gu, dn, OAI)
    bank_gu, bank_dn = _bank(gu, [2, 0]), _bank(dn, [2, 0])
    table = torch.tensor([1, -1, 0, -1], dtype=torch.int32, device=DEV)
    h, experts, weights = _round(12)
    out = moe_q8(h, weights, experts, gu, dn, bank_gu, bank_dn, table, layer=0, ops=ops)
    ref = moe_q8_ref(h, gu, dn, experts, weights, ops)
    assert torch.equal(out.cpu(), ref), f"max diff {(out.cpu() - ref).abs().max():.3g}"
    one = moe_q8(h[2:3], weights[2:3], experts[2:3], gu, dn, bank_gu, bank_dn, table, layer=0, ops=ops)
    assert torch.equal(one.cpu()[0], out.cpu()[2])
    # the gate|up sums cross both clamps (the activation's selects are taken)
    x = h.cpu()
    xq, dx, xs = quantize_q8(x)
    host = QuantWeight(gu.qtype, gu.shape, {n: p.cpu() for n, p in gu.planes.items()})
    sums = torch.stack([matvec_q8(xq[m], dx[m], xs[m], host.expert(int(e))) + biases[0][e]
                        for m in range(W) for e in experts[m].tolist()])       # [W k, 2F]
    assert (sums[:, :F] > 7).any() and (sums[:, F:].abs() > 7).any()
    # the pieces matter: without the biases, or with SiLU, other bits
    assert not torch.equal(moe_q8_ref(h, gu, dn, experts, weights, ExpertOps(OAI)), ref)
    assert not torch.equal(moe_q8_ref(h, gu, dn, experts, weights, ops._replace(act=ACT_IDS["silu"])), ref)


def test_contract_refuses_other_activations():
    gu, dn, *_ = mx_layer(seed=13, dev="cpu")
    assert contract_ok(gu, dn) and contract_ok(gu, dn, OAI) and not contract_ok(gu, dn, ACT_IDS["gelu"])
