"""moe_i8 with gpt-oss's experts (kernels/moe/moe_i8.py): MXFP4 gate|up and down (qgemv_i8_table's
level lookup), a bias per expert on gate|up [E, 2F] and down [E, D], the clamped swiglu_oai.

  float64   gate|up (+ bias, swiglu_oai) against float64 of the same int8 input and gguf's
            dequantized MXFP4 weights, down (+ bias, the weighted rank sum) against float64 of
            the kernel's own int8 activations; the sums cross both clamps, and the reference
            without the biases or with SiLU is far away
  rows      every row of W = 1 / 3 / 8 bit-identical to that row alone, whatever its column
  tiers     experts read from bank slots give the host planes' bits (the biases are the
            expert's, not the slot's); gate and up rows walked apart give the paired walk's bits
  sm_90     the kernels with the lookup's `prmt` asm, the biases and swiglu_oai compile (child)
CPU: the Triton interpreter (no asm: the lookup's selects); on a GPU the same tests run compiled.
Sizes: K = 288 and F = 96 are 9 and 3 slots (a masked last step), F = 96 rows a masked row tile."""
from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels.activations.silu import ACT_IDS
from alphallama.kernels.formats.qweight import QuantWeight
from alphallama.kernels.gemv.qmatvec_i8 import lane_order, prepare_i8
from alphallama.kernels.moe.expert_q8 import quantize_q8
from alphallama.kernels.moe.moe_i8 import moe_down_i8, moe_gate_up_i8, moe_i8_ok, moe_i8_order
from alphallama.model.layers import swiglu_oai
from tests.kernels.sm90 import run_in_child
from tests.kernels.test_gpu_quant_types_iq import valid_raw
from tests.kernels.test_moe_i8 import _split
from tests.kernels.test_qmatmul import gguf_dequant
from tests.kernels.test_qmatvec_i8 import DEV, _x, assert_same_bits

OAI = ACT_IDS["swiglu_oai"]
E, K, F, D, TOP_K = 4, 288, 96, 64, 2


def _mxfp4(n: int, k: int, seed: int) -> tuple[QuantWeight, torch.Tensor]:
    """Random valid MXFP4 experts [E, n, k] and gguf's dequantization of them, float64."""
    raw = valid_raw(T.MXFP4, E * n, k, seed)
    return QuantWeight.from_raw(raw, T.MXFP4, (E, n, k), DEV), gguf_dequant(raw, T.MXFP4).double().reshape(E, n, k)


def _layer(W: int = 3, seed: int = 1):
    """(gate|up, down, their float64 weights, biases, x [W, K], experts [W, k], weights [W, k])."""
    (gu, gu64), (dn, dn64) = _mxfp4(2 * F, K, seed), _mxfp4(D, F, seed + 1)
    g = torch.Generator().manual_seed(seed)
    # gate|up's biases wide enough that some sums pass the clamp at 7 (and below -7 for up)
    gb, db = torch.randn(E, 2 * F, generator=g) * 6, torch.randn(E, D, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(W)]).int()     # [W, k]
    weights = torch.softmax(torch.randn(W, TOP_K, generator=g), -1)                             # [W, k]
    return gu, dn, gu64, dn64, gb, db, _x(W, K, seed=seed + 2), experts, weights


def _q8_float64(x: torch.Tensor) -> torch.Tensor:
    """x [R, n] as its int8 activations, float64."""
    xq, dx, _ = quantize_q8(x.cpu().float())
    return (xq.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape)


def _run(gu, dn, gb, db, x, experts, weights, table=None, bank_gu=None, bank_dn=None, paired=True):
    """The layer's two kernels on x [W, K]: (act [W, k, F], out [W, D])."""
    ex, dev_b = experts.to(DEV), (gb.to(DEV), db.to(DEV))
    act = moe_gate_up_i8(prepare_i8(x, gu.expert(0)), gu, ex, torch.float32, table, bank_gu, paired=paired,
                         bias=dev_b[0], act=OAI)                                            # [W, k, F]
    return act, moe_down_i8(act, dn, ex, weights.to(DEV), table, bank_dn, bias=dev_b[1])   # [W, D]


def test_against_float64_of_the_int8_activations():
    gu, dn, gu64, dn64, gb, db, x, experts, weights = _layer()
    act, out = _run(gu, dn, gb, db, x, experts, weights)
    e = experts.long()
    xd = _q8_float64(x)                                                       # [W, K]
    sums = torch.einsum("wk,wjnk->wjn", xd, gu64[e]) + gb.double()[e]         # [W, k, 2F]
    scale = torch.einsum("wk,wjnk->wjn", xd.abs(), gu64[e].abs()) + gb.double()[e].abs()
    ref = swiglu_oai(sums[..., :F], sums[..., F:])                            # [W, k, F]
    # |d/dg| <= 1.1 * 8 (g sigmoid(1.702 g) times u + 1), |d/du| <= 7: sums' errors of 1e-5 scale
    bound = 1e-5 * (9 * scale[..., :F] + 7 * scale[..., F:] + ref.abs())
    assert ((act.cpu().double() - ref).abs() <= bound).all()
    assert (sums[..., :F] > 7).any() and (sums[..., F:].abs() > 7).any()     # both clamps are crossed
    assert (swiglu_oai(sums[..., :F] - gb.double()[e][..., :F], sums[..., F:] - gb.double()[e][..., F:])
            - ref).abs().max() > 1                                            # (without gate|up's bias)
    assert (torch.nn.functional.silu(sums[..., :F]) * sums[..., F:] - ref).abs().max() > 1
    ad = _q8_float64(act.reshape(-1, F)).reshape(act.shape)                   # the kernel's own int8 act
    w = weights.double()[..., None]
    part = torch.einsum("wjf,wjdf->wjd", ad, dn64[e])                         # [W, k, D]
    want = ((part + db.double()[e]) * w).sum(1)                               # [W, D]
    bound = ((torch.einsum("wjf,wjdf->wjd", ad.abs(), dn64[e].abs()) + db.double()[e].abs()) * w).sum(1)
    assert ((out.cpu().double() - want).abs() <= 1e-5 * bound + 1e-30).all()
    assert ((part * w).sum(1) - want).abs().max() > 0.1                       # (without down's bias)


def test_rows_keep_their_bits():
    """Each row of W = 1 / 3 / 8 (two columns each) has the bits of that row alone."""
    gu, dn, _, _, gb, db, x, experts, weights = _layer(W=8, seed=4)
    alone = torch.cat([_run(gu, dn, gb, db, x[m:m + 1], experts[m:m + 1], weights[m:m + 1])[1] for m in range(8)])
    for W in (3, 8):
        for shift in (0, 5):
            rows = torch.roll(torch.arange(8), shift)[:W]
            got = _run(gu, dn, gb, db, x[rows.to(DEV)], experts[rows], weights[rows])[1]
            assert_same_bits(got, alone[rows.to(DEV)], f"W={W} shift={shift}")


def test_bank_tiers_and_paired_walk_keep_the_bits():
    """Experts 0 and 3 in bank slots 1 and 0 (their host copies zeroed): the resident bits,
    gpt-oss's biases indexed by expert; gate and up rows walked apart: the same bits."""
    gu, dn, _, _, gb, db, x, experts, weights = _layer(seed=7)
    act, out = _run(gu, dn, gb, db, x, experts, weights)
    table = torch.tensor([1, -1, -1, 0], dtype=torch.int32, device=DEV)
    (hgu, bgu), (hdn, bdn) = _split(gu, [3, 0]), _split(dn, [3, 0])
    assert {0, 3} & set(experts.flatten().tolist()) and {1, 2} & set(experts.flatten().tolist())
    t_act, t_out = _run(hgu, hdn, gb, db, x, experts, weights, table, bgu, bdn)
    assert_same_bits(t_act.reshape(-1, F), act.reshape(-1, F), "bank/host tiers: act")
    assert_same_bits(t_out, out, "bank/host tiers")
    apart = _run(gu, dn, gb, db, x, experts, weights, paired=False)[0]
    assert_same_bits(apart.reshape(-1, F), act.reshape(-1, F), "gate and up walked apart")


def test_mxfp4_experts_take_q4_k_lanes():
    """moe_i8 takes MXFP4 experts, whose input comes in Q4_K's lane order (one prepare)."""
    gu, dn, *_ = _layer()
    assert moe_i8_ok(gu, dn) and moe_i8_order(gu) == (32, 4, 4) == lane_order(dn.expert(0))


def compile_oai_i8() -> None:
    """moe_i8's kernels on MXFP4 experts of gpt-oss-120b's sizes (K = F = 2880: 90 slots, a
    masked last step), with the lookup's asm, the biases and swiglu_oai, with and without
    the expert table, paired and not (child process)."""
    from alphallama.kernels.moe import moe_i8
    from tests.kernels.sm90 import compile_sm90 as build
    from tests.kernels.test_moe_i8 import _sm90_args

    for table in (False, True):
        types, const = _sm90_args(T.MXFP4, 2880, moe_i8._gate_up_i8_kernel, table)
        assert const["LANES"] == 4
        for paired in (False, True):
            k = build(moe_i8._gate_up_i8_kernel, [*types, "*fp32"], {**const, "PDL": False, "PAIRED": paired,
                                                                     "HAS_EBIAS": True, "ACT": OAI})
            assert "prmt.b32" in k.asm["ptx"] and "dp4a" in k.asm["ptx"]
        types, const = _sm90_args(T.MXFP4, 2880, moe_i8._down_i8_kernel, table)
        k = build(moe_i8._down_i8_kernel, [*types, "*fp32"], {**const, "PDL": False, "HAS_EBIAS": True})
        assert "prmt.b32" in k.asm["ptx"] and "dp4a" in k.asm["ptx"]


def test_compiles_for_sm90():
    run_in_child("test_moe_i8_oai", "compile_oai_i8")
