"""gpt-oss's MoE pieces on the device kernels, against float64 references: the router's bias
and the softmax over the k chosen logits (kernels/moe/route.py), the experts' biases and the
clamped swiglu_oai in the decode GEMVs (moe_f32: MXFP4 experts, rows alone and in a round the
same bits) and in the prefill's grouped GEMMs (moe_gemm), and swiglu_oai's dense launches
(activations/silu.py: plain and with the down's int8 activations, the same values)."""
from __future__ import annotations


import torch


from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.activations.silu import ACT_IDS, swiglu_oai_mul, swiglu_oai_mul_q8  # noqa: E402
from alphallama.kernels.formats.qweight import QuantWeight  # noqa: E402
from alphallama.kernels.moe.moe_f32 import moe_down, moe_down_ref, moe_gate_up, moe_gate_up_ref  # noqa: E402
from alphallama.kernels.moe.moe_gemm import moe_prefill  # noqa: E402
from alphallama.kernels.moe.route import moe_route  # noqa: E402
from alphallama.model.layers import swiglu_oai  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from alphallama.gguf.quants import QUANTS  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OAI = ACT_IDS["swiglu_oai"]
E, K, F, D, TOP_K = 4, 64, 32, 64, 2


def _mxfp4(shape: tuple[int, int, int], seed: int) -> QuantWeight:
    """Random valid MXFP4 experts (gguf/quants.py's random blocks: sane exponents)."""
    q = QUANTS[T.MXFP4]
    raw = q.random_blocks(shape[0] * shape[1] * shape[2] // q.block_size, torch.Generator().manual_seed(seed))
    return QuantWeight.from_raw(raw.numpy().reshape(shape[0] * shape[1], -1), T.MXFP4, shape, DEV)


def _experts(seed: int):
    gu, dn = _mxfp4((E, 2 * F, K), seed), _mxfp4((E, D, F), seed + 1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, K, generator=g)
    # gate|up's biases wide enough that some sums pass the clamp at 7 (and below -7 for up)
    biases = (torch.randn(E, 2 * F, generator=g) * 6, torch.randn(E, D, generator=g))
    return gu, dn, x, biases


def test_route_bias_and_softmax_after_top_k():
    """Each row's k largest biased logits (by rank), their softmax as the weights."""
    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(5, 8, generator=g), torch.randn(8, generator=g)
    w, ids = moe_route(logits.to(DEV), 3, False, bias=bias.to(DEV), after=True)
    top, ref_ids = (logits + bias).double().topk(3, -1)
    assert torch.equal(ids.cpu().long(), ref_ids)
    torch.testing.assert_close(w.cpu().double(), torch.softmax(top, -1), atol=1e-6, rtol=1e-6)


def test_experts_with_biases_and_swiglu_oai_against_float64():
    """gate|up (+ bias, swiglu_oai) and down (+ bias, weighted sum) of MXFP4 experts within 1e-4
    of float64; the reference without the biases, or with SiLU, far away; a row's bits the same
    in a round of 3 and alone."""
    gu, dn, x, (gb, db) = _experts(1)
    experts = torch.tensor([[0, 3], [2, 1], [3, 2]], dtype=torch.int32)
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    bias_d = (gb.to(DEV), db.to(DEV))
    act = moe_gate_up(x.to(DEV), gu, experts.to(DEV), torch.float32, bias=bias_d[0], act=OAI)   # [3, 2, F]
    out = moe_down(act, dn, experts.to(DEV), weights.to(DEV), bias=bias_d[1]).cpu()            # [3, D]
    act_ref = moe_gate_up_ref(x.double(), gu, experts, gb, OAI)
    ref = moe_down_ref(act_ref, dn, experts, weights, db)
    torch.testing.assert_close(act.cpu().double(), act_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    sums = torch.einsum("wk,wjnk->wjn", x.double(), gu.dequantize().double().cpu()[experts.long()]) \
        + gb.double()[experts.long()]                                        # [3, 2, 2F] before the activation
    assert (sums[..., :F] > 7).any() and (sums[..., F:].abs() > 7).any()     # the clamps are crossed
    assert (moe_gate_up_ref(x.double(), gu, experts, gb, ACT_IDS["silu"]) - act_ref).abs().max() > 1
    assert (moe_gate_up_ref(x.double(), gu, experts, None, OAI) - act_ref).abs().max() > 1
    assert (moe_down_ref(act_ref, dn, experts, weights) - ref).abs().max() > 0.5
    one = moe_gate_up(x[1:2].to(DEV), gu, experts[1:2].to(DEV), torch.float32, bias=bias_d[0], act=OAI)
    assert torch.equal(one, act[1:2])
    assert torch.equal(moe_down(one, dn, experts[1:2].to(DEV), weights[1:2].to(DEV), bias=bias_d[1]).cpu(), out[1:2])


def test_prefill_grouped_gemms_with_biases_and_swiglu_oai():
    """moe_prefill with the experts' biases and swiglu_oai against the float64 reference."""
    gu, dn, _, (gb, db) = _experts(5)
    g = torch.Generator().manual_seed(6)
    h = torch.randn(9, K, generator=g)
    experts = torch.randint(0, E, (9, TOP_K), generator=g, dtype=torch.int32)
    experts[:, 1] = (experts[:, 0] + 1) % E                                   # two different experts a row
    weights = torch.softmax(torch.randn(9, TOP_K, generator=g), -1)
    out = moe_prefill(h.to(DEV), weights.to(DEV), experts.to(DEV), gu, dn, biases=(gb.to(DEV), db.to(DEV)),
                      act=OAI).cpu()
    ref = moe_down_ref(moe_gate_up_ref(h.double(), gu, experts, gb, OAI), dn, experts, weights, db)
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-3)


def test_dense_swiglu_oai_launches():
    """swiglu_oai_mul against model/layers.swiglu_oai (gate and up across the clamp), and its
    launch with the down's int8 activations gives the same values."""
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(3, 2 * 64, generator=g) * 6                              # [3, 2F]: past +-7 often
    out = swiglu_oai_mul(gu.to(DEV)).cpu()
    ref = swiglu_oai(gu[:, :64].double(), gu[:, 64:].double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    q8_out, q8 = swiglu_oai_mul_q8(gu.to(DEV), torch.float32, ((32, 4, 4),))
    assert torch.equal(q8_out.cpu(), out) and len(q8) == 1


def compile_oai() -> None:
    """gpt-oss's kernel variants for sm_90 (MXFP4 experts of gpt-oss-120b's sizes: D 2880, F 2880,
    128 experts, top 4): the route with the bias and the softmax after top-k, the decode GEMVs
    and the prefill's grouped GEMM with biases and swiglu_oai, the dense swiglu_oai launch."""
    from alphallama.kernels.activations import silu
    from alphallama.kernels.formats.qweight import format_of
    from alphallama.kernels.moe import moe_f32, moe_gemm, route
    from tests.kernels.sm90 import compile_sm90 as build

    f, K = format_of(T.MXFP4), 2880
    dt = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8", torch.uint8: "*u8"}
    planes = {n: dt[p.dtype] for n, p in f.pack(torch.zeros((1, K // f.block_size, f.type_size),
                                                            dtype=torch.uint8)).items()}
    args = [planes.get(n, planes["qs"]) for n in ("qs", "qh", "sc", "sd")]   # absent planes: qs
    fmt = dict(n_slots=K // f.slot, LOAD=f.triton_load, FIELD=f.triton_field, V=f.V, P=f.P)
    build(route._route_kernel, ["*fp32", "*fp32", "*i32", "i32", "*fp32"],
          dict(TOP_K=4, BLOCK_E=128, BLOCK_K=4, NORM=False, PDL=False, HAS_BIAS=True, AFTER=True), num_warps=route.ROUTE_WARPS)
    build(moe_f32._gate_up_kernel, ["*bf16", "*bf16", "*i32", "*i32", *args, *args, "i32", "i32", "i32", "*fp32"],
          dict(TOP_K=4, TABLE=True, BN=8, NT=32, HAS_BIAS=True, ACT=silu.ACT_IDS["swiglu_oai"], **fmt))
    build(moe_f32._down_part_kernel, ["*bf16", "*fp32", "*i32", "*i32", *args, *args, "i32", "i32", "*fp32"],
          dict(TABLE=True, BN=8, NT=32, HAS_BIAS=True, **fmt))
    build(moe_gemm._moe_gemm_kernel, ["*bf16", "*bf16", "*i32", "*i32", "*i32", *args,
                                      "i32", "i32", "i32", "i32", "i32", "i32", "*fp32"],
          dict(TOP_K=4, GATHER=True, GATED=True, PREC="tf32", BM=32, BN=64, NT=64 // f.slot, HAS_BIAS=True,
               ACT=silu.ACT_IDS["swiglu_oai"], **fmt))
    build(silu._silu_mul_kernel, ["*fp32", "*bf16", "*i8", "*i32"],
          {"F": 2880, "BLOCK": 1024, "NQ": 1, "SLOT1": 32, "V1": 4, "BITS1": 4, "ACT": silu.ACT_IDS["swiglu_oai"]})


def test_oai_kernels_compile_for_sm90():
    run_in_child("test_moe_oai", "compile_oai", timeout=600)
