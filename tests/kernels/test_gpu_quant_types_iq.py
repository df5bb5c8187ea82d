"""Issue 32's last GPU quant types: the codebook IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S /
IQ1_S / IQ1_M (fmt_grid.py), MXFP4 and the ternary TQ1_0 / TQ2_0 (fmt_misc.py), through the
format-generic kernels at small sizes (the Triton interpreter on CPU; compiled on a GPU).

  planes    the plain-torch values from the planes: gguf's, bit for bit (2-D and expert)
  dequant   the prefill scratch (fp32, bf16, a row block, pair stores) and the embedding
            gather: gguf's values, bit for bit, on random valid blocks (random codebook
            indices, signs, scales); MXFP4 over every E8M0 byte too
  f32       qmatmul at ragged sizes against float64; its exact-mode rows (column and W invariant)
  moe       the fp32 MoE GEMVs and the prefill's grouped GEMM against float64 (MXFP4 experts)
  support   qmatmul takes them, the int8 kernels refuse those without an int8 form with the
            reason (the dense int8 GEMV's: test_qgemv_i8_grid.py, test_qgemv_i8_more.py), `plan`
            runs them
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf import quants as gguf_quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from alphallama.gguf import iq_tables  # noqa: E402
from alphallama.gguf.quants import QUANTS  # noqa: E402
from alphallama.gguf.reader import TensorInfo  # noqa: E402
from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.formats.dequant import dequantize_into  # noqa: E402
from alphallama.kernels.formats.fmt_grid import grid_table  # noqa: E402
from alphallama.kernels.formats.fmt_iq4 import words_levels  # noqa: E402
from alphallama.kernels.formats.fmt_misc import E2M1_WORDS  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8_table import has_dense_i8_form  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul  # noqa: E402
from alphallama.kernels.gemv.registry import QGEMV_I8, QGEMV_MMA_K, QMATMUL, plan_linear  # noqa: E402
from alphallama.kernels.moe.moe_f32 import moe_down, moe_gate_up  # noqa: E402
from alphallama.kernels.moe.moe_gemm import moe_prefill  # noqa: E402
from alphallama.offload.support import gpu_refusal, type_uses  # noqa: E402
from tests.kernels.test_moe_gemm import _reference as moe_prefill_ref  # noqa: E402
from tests.kernels.test_gpu_quant_types import _bits, check_dequant_and_gather, check_ragged  # noqa: E402
from tests.kernels.test_qmatmul import check_close, gguf_dequant, random_raw, rotation_check  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GRID = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
NEW = GRID + [T.MXFP4, T.TQ1_0, T.TQ2_0]
IDS = [t.name for t in NEW]
# K whose slot count is not a multiple of the step (a masked last step): 96 groups of 8,
# 48 ternary slots of 16, 9 MXFP4 blocks
RAGGED_K = {**{t: 768 for t in GRID}, T.TQ1_0: 768, T.TQ2_0: 768, T.MXFP4: 288}
# planes' bytes over the file's (fmt_grid.py's table; TQ1_0 in TQ2_0's planes)
PLANE_BYTES = {T.IQ2_XXS: 1.13, T.IQ2_XS: 1.11, T.IQ2_S: 1.2, T.IQ3_XXS: 1.07, T.IQ3_S: 1.02,
               T.IQ1_S: 1.32, T.IQ1_M: 1.18, T.TQ1_0: 1.23, T.TQ2_0: 1.0, T.MXFP4: 1.0}


def valid_raw(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """Random valid GGUF bytes for an [n, k] tensor (the CPU side's random_blocks: random
    indices, signs and scales, sane d)."""
    q = QUANTS[qtype]
    blocks = q.random_blocks(n * k // q.block_size, torch.Generator().manual_seed(seed))
    return blocks.numpy().reshape(n, -1)


def _weight(qtype: T, n: int, k: int, seed: int) -> tuple[np.ndarray, QuantWeight]:
    raw = valid_raw(qtype, n, k, seed)
    return raw, QuantWeight.from_raw(raw, qtype, (n, k), DEV)


def test_tables_are_the_format_tables():
    """The device codebooks read back as iq_tables' (IQ1: biased by 1); MXFP4's level
    constants as the doubled E2M1 values of gguf's table."""
    for grid, bias in ((iq_tables.GRID_IQ2_XXS, 0), (iq_tables.GRID_IQ3_S, 0), (iq_tables.GRID_IQ1_S, 1)):
        back = grid_table(grid, bias).view(torch.uint8).reshape(grid.shape).float() - bias
        assert torch.equal(back, grid)
    assert words_levels(E2M1_WORDS).tolist() == list(gguf_quants.MXFP4.kvalues)


def test_the_codebook_rides_in_qh_place():
    """A codebook weight's table is its kernels' qh argument; an expert's view and the expert
    store's host / bank / sub-range weights share the device weight's table (no copy)."""
    from alphallama.offload.planes import bank_like, host_like, sub_experts
    _, w = _weight(T.IQ2_XXS, 8, 256, seed=2)
    assert w.plane_args()[1] is w.table and w.table.dtype == torch.int16 and "qh" not in w.planes
    w3 = QuantWeight.from_raw(valid_raw(T.IQ3_S, 6, 256, 2), T.IQ3_S, (3, 2, 256), DEV)
    host = host_like(w3, 3)
    assert w3.expert(1).table is w3.table and host.table is w3.table
    assert bank_like(host, 2, DEV).table is w3.table and sub_experts(host, 1, 2).table is w3.table
    _, q = _weight(T.MXFP4, 8, 256, seed=2)
    assert q.table is None and q.plane_args()[1] is q.planes["qs"]      # no qh, no table: qs stands in


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_planes_are_gguf_values(qtype):
    raw, w = _weight(qtype, 12, 512, seed=1)
    ref = gguf_dequant(raw, qtype)
    assert torch.equal(_bits(w.dequantize()), _bits(ref))
    w3 = QuantWeight.from_raw(raw, qtype, (3, 4, 512), DEV)
    assert torch.equal(_bits(w3.expert(2).dequantize()), _bits(ref[8:]))
    assert w.nbytes <= PLANE_BYTES[qtype] * w.gguf_nbytes


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_dequant_and_gather_bit_exact(qtype):
    check_dequant_and_gather(*_weight(qtype, 13, 512, seed=3), qtype, [12, 0, 5, 5, 7])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # MXFP4's 2^127 * 12: inf
@pytest.mark.parametrize("qtype", [T.MXFP4, T.TQ2_0, T.IQ2_S, T.IQ3_S, T.IQ1_S],
                         ids=["MXFP4", "TQ2_0", "IQ2_S", "IQ3_S", "IQ1_S"])
def test_dequant_any_bytes(qtype):
    """Random bytes (fp16 d of random sign): every E8M0 byte (its subnormal and 2^127
    ends: infinities as gguf's), TQ2_0's unused code 3, every index and sign."""
    n, k = 8, 1024
    raw = random_raw(qtype, n, k, seed=9)
    if qtype == T.MXFP4:
        raw.reshape(-1, 17)[:256, 0] = np.arange(256, dtype=np.uint8)   # every scale byte
    w = QuantWeight.from_raw(raw, qtype, (n, k), DEV)
    ref = gguf_dequant(raw, qtype)
    assert torch.equal(_bits(dequantize_into(w, torch.empty(n, k, device=DEV))), _bits(ref))


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_qmatmul_ragged_against_float64(qtype):
    """N = 37 and K whose slots are not a multiple of the step, x with a row stride past K."""
    check_ragged(*_weight(qtype, 37, RAGGED_K[qtype], seed=5), qtype)


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_qmatmul_rows_do_not_depend_on_column_or_width(qtype):
    _, w = _weight(qtype, 16, 256, seed=7)
    rotation_check(w, (1, 3, 9), pool=9)


@pytest.mark.skipif(DEV != "cuda", reason="too slow for the CPU interpreter; runs on a GPU")
@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_gpu_sizes(qtype):
    """A 4096 x 4096 weight on the compiled kernels: the dequantize kernel gives gguf's
    values, qmatmul at W = 8 follows float64 and each row alone gives the same bits."""
    n = k = 4096
    raw, w = _weight(qtype, n, k, seed=3)
    ref = gguf_dequant(raw, qtype)
    assert torch.equal(_bits(dequantize_into(w, torch.empty(n, k, device=DEV))), _bits(ref))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(4)).to(DEV, torch.bfloat16)
    out = qmatmul(x, w)
    check_close(out, x.cpu(), ref)
    for m in (0, 5):
        assert torch.equal(_bits(qmatmul(x[m:m + 1], w)), _bits(out[m:m + 1]))


def test_moe_f32_and_prefill_gemm_against_float64():
    """gpt-oss's expert type: MXFP4 gate|up and down through the fp32 MoE GEMVs and the
    prefill's grouped GEMM, against float64 of gguf's values."""
    E, F, D, k = 4, 64, 64, 2
    gu = QuantWeight.from_raw(valid_raw(T.MXFP4, E * 2 * F, D, 1), T.MXFP4, (E, 2 * F, D), DEV)
    dn = QuantWeight.from_raw(valid_raw(T.MXFP4, E * D, F, 2), T.MXFP4, (E, D, F), DEV)
    g = torch.Generator().manual_seed(3)
    experts = torch.tensor([[0, 3], [2, 0], [1, 2]], dtype=torch.int32)
    weights, h = torch.rand(3, k, generator=g), torch.randn(3, D, generator=g)
    ref = moe_prefill_ref(h, weights, experts, gu, dn)                # float64 [3, D]
    tol = 1e-4 * ref.abs().max().item()
    act = moe_gate_up(h.to(DEV), gu, experts.to(DEV))                 # [3, k, F]
    out = moe_down(act, dn, experts.to(DEV), weights.to(DEV))
    assert (out.cpu().double() - ref).abs().max().item() <= tol
    out = moe_prefill(h.to(DEV), weights.to(DEV), experts.to(DEV), gu, dn, tile=(32, 4, 2))
    assert (out.cpu().double() - ref).abs().max().item() <= tol


def test_codebook_experts_through_the_grouped_gemm():
    """A codebook type's table passes through the grouped GEMM's flattened planes as it is:
    IQ3_XXS gate|up, IQ2_XXS down (the smallest K of the codebook types, 256)."""
    E, F, D, k = 2, 256, 256, 1
    gu = QuantWeight.from_raw(valid_raw(T.IQ3_XXS, E * 2 * F, D, 4), T.IQ3_XXS, (E, 2 * F, D), DEV)
    dn = QuantWeight.from_raw(valid_raw(T.IQ2_XXS, E * D, F, 5), T.IQ2_XXS, (E, D, F), DEV)
    g = torch.Generator().manual_seed(6)
    experts = torch.tensor([[1], [0]], dtype=torch.int32)
    weights, h = torch.rand(2, k, generator=g), torch.randn(2, D, generator=g)
    ref = moe_prefill_ref(h, weights, experts, gu, dn)
    out = moe_prefill(h.to(DEV), weights.to(DEV), experts.to(DEV), gu, dn, tile=(32, 4, 2))
    assert (out.cpu().double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_registry_and_support_name_the_gpu(qtype):
    """qmatmul takes every new type; the int8 kernels refuse those without an int8 form
    (the dense GEMV's: qgemv_i8_grid.GRID_CODES, test_qgemv_i8_grid.py; MXFP4 and TQ,
    test_qgemv_i8_more.py) with the reason, so plans give them qmatmul at every width;
    support.py (plan, inspect) names the GPU."""
    _, w = _weight(qtype, 32, 256, seed=0)
    assert QMATMUL.supports(w) is None
    assert "Q4_K only" in QGEMV_MMA_K.supports(w)
    plan = plan_linear([w], "i8")
    if has_dense_i8_form(qtype):
        assert QGEMV_I8.supports(w) is None and plan.i8 == (True,)
        assert all(st.kernels == (QGEMV_I8,) for st in plan.steps)
    else:
        assert f"{qtype.name} has no int8 form" in QGEMV_I8.supports(w)
        assert plan.i8 == (False,) and all(st.kernels == (QMATMUL,) for st in plan.steps)
    block, size = GGML_QUANT_SIZES[qtype]
    t = TensorInfo("blk.0.ffn_up.weight", qtype, (64, 256), np.zeros((64, 256 // block * size), np.uint8), 0)
    tensors = {t.name: t}
    assert gpu_refusal(t.name, t, tensors) is None
    assert type_uses(tensors)[qtype.name].runs_on == "cpu+gpu"


# each new load / field once (IQ2_XS's load is IQ2_XXS's with another G, IQ3_XXS's IQ3_S's with
# a shorter record; IQ1_S shares IQ1_M's, TQ2_0 TQ1_0's), and the grouped GEMM with a codebook (its flattened planes
# leave the table as it is)
COMPILED = {T.IQ2_XXS: ("f32", "dequant", "moe_gemm"), T.IQ2_S: ("f32",), T.IQ3_XXS: ("f32",),
            T.IQ3_S: ("f32", "dequant"), T.IQ1_M: ("f32", "dequant"), T.MXFP4: ("f32", "dequant", "moe_gemm"),
            T.TQ1_0: ("f32", "dequant")}


def test_compiles_for_sm90():
    """The interpreter runs what the compiler may reject: compile for sm_90 (no GPU needed)
    the fp32 GEMV, the dequantize kernel and the grouped GEMM with the new loads and fields."""
    from tests.kernels.sm90 import run_in_child
    run_in_child("test_gpu_quant_types_iq")


def compile_sm90() -> None:
    from alphallama.kernels.formats import dequant
    from alphallama.kernels.formats.qweight import format_of
    from alphallama.kernels.gemv import qmatmul as qm
    from alphallama.kernels.moe import moe_gemm
    from tests.kernels.sm90 import compile_sm90 as build

    dt = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8", torch.uint8: "*u8"}
    for qtype, kernels in COMPILED.items():
        f, K = format_of(qtype), 4096
        planes = {n: dt[p.dtype] for n, p in f.pack(torch.zeros((1, K // f.block_size, f.type_size),
                                                                dtype=torch.uint8)).items()}
        if f.table is not None:
            planes["qh"] = dt[f.table().dtype]                                # the codebook in qh's place
        args = [planes.get(n, planes["qs"]) for n in ("qs", "qh", "sc", "sd")]   # absent planes: qs
        if "f32" in kernels:
            build(qm._qmatmul_kernel, ["*bf16", "*fp32", *args, "i32", "i32", "i32", "i32"],
                  dict(n_slots=K // f.slot, LOAD=f.triton_load, FIELD=f.triton_field, V=f.V, P=f.P, BN=8, NT=128,
                       BW=4))
        if "dequant" in kernels:
            build(dequant._dequant_kernel, ["*bf16", *args, "i32", "i32"],
                  dict(n_slots=K // f.slot, LOAD=f.triton_load, FIELD=f.triton_field, V=f.V, P=f.P, SLOT=f.slot,
                       BN=1, NT=128, WHOLE=True, HW=True))
        if "moe_gemm" in kernels:
            build(moe_gemm._moe_gemm_kernel, ["*bf16", "*bf16", "*i32", "*i32", "*i32", *args,
                                              "i32", "i32", "i32", "i32", "i32", "i32"],
                  dict(TOP_K=8, GATHER=True, GATED=True, PREC="tf32", n_slots=K // f.slot, LOAD=f.triton_load,
                       FIELD=f.triton_field, V=f.V, P=f.P, BM=32, BN=64, NT=64 // f.slot))
