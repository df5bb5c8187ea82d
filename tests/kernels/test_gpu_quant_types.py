"""Issue 32's GPU quant types (Q4_1, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS): each new format
through every kernel family that takes it, at small sizes (the Triton interpreter on CPU;
compiled on a GPU).

  f32       qmatmul at ragged sizes against float64, and its exact-mode rows (column and W
            invariant); test_qmatmul.py's types include them (gguf's values, float64, GPU sizes)
  dequant   the prefill scratch and the embedding gather: gguf's values, bit for bit
  int8      (Q4_1, Q5_1) qmatvec_i8 against the expert contract's plain-torch matvec, bit for
            bit; qgemv_i8 against float64. Q2_K, Q3_K, IQ4_NL and IQ4_XS have the dense GEMV's
            int8 form only (test_qgemv_i8_table.py, Q2_K: test_qgemv_i8_more.py)
  moe       the contract's MoE kernels against its reference, bit for bit; the fp32 MoE
            GEMVs and the prefill's grouped GEMM against float64
  support   the registry and offload/support.py name the GPU for them; others are refused
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

from alphallama.gguf.reader import TensorInfo  # noqa: E402
from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.formats.dequant import dequantize_into, gather_rows  # noqa: E402
from alphallama.kernels.formats.fmt_iq4 import LEVEL_WORDS, words_levels  # noqa: E402
from alphallama.kernels.formats.qweight import format_of  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import qmatvec_i8  # noqa: E402
from alphallama.kernels.gemv.registry import QGEMV_I8, QGEMV_MMA_K, QMATMUL, plan_linear  # noqa: E402
from alphallama.kernels.moe.expert_q8 import moe_q8 as moe_q8_ref  # noqa: E402
from alphallama.kernels.moe.moe_f32 import moe_down, moe_gate_up  # noqa: E402
from alphallama.kernels.moe.moe_gemm import moe_prefill  # noqa: E402
from alphallama.kernels.moe.moe_q8 import moe_q8  # noqa: E402
from alphallama.offload.support import gpu_refusal, type_uses  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_moe_gemm import _reference as moe_prefill_ref  # noqa: E402
from tests.kernels.test_moe_q8 import _bank, _layer  # noqa: E402
from tests.kernels.test_qmatmul import check_close, gguf_dequant, random_raw, rotation_check  # noqa: E402
from tests.kernels.test_qgemv_i8 import reference64  # noqa: E402
from tests.kernels.test_qmatvec_i8 import _x, assert_same_bits, reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(DEV != "cuda", reason="too slow for the CPU interpreter; runs on a GPU")
NEW = [T.Q4_1, T.Q5_1, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS]
IDS = [t.name for t in NEW]
INT8 = [T.Q4_1, T.Q5_1]                    # the expert contract's integer form (expert_q8.SLOT_TERMS)
DENSE_INT8 = INT8 + [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS]    # qgemv_i8's (and qgemv_i8_table.TABLE_CODES)
STILL_CPU_ONLY = [T.Q8_K]                   # no GPU format (nor a CPU one: the file type of none)
# K whose slot count is not a multiple of the step (a masked last step)
RAGGED_K = {T.Q4_1: 288, T.Q5_1: 288, T.Q2_K: 768, T.Q3_K: 768, T.IQ4_NL: 288, T.IQ4_XS: 768}


def _weight(qtype: T, n: int, k: int, seed: int) -> tuple[np.ndarray, QuantWeight]:
    raw = random_raw(qtype, n, k, seed)
    return raw, QuantWeight.from_raw(raw, qtype, (n, k), DEV)


def _info(qtype: T, n: int, k: int) -> TensorInfo:
    """A [n, k] matrix of a file, as the reader describes it (zero bytes)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return TensorInfo("blk.0.ffn_up.weight", qtype, (n, k), np.zeros((n, k // block * size), np.uint8), 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.int32)


def test_iq4_level_words_are_gguf_levels():
    """The kernels' packed IQ4 levels read back as the gguf package's 16 levels."""
    assert words_levels(LEVEL_WORDS).tolist() == list(gguf_quants.IQ4_NL.kvalues)
    assert all(-(1 << 31) <= w < 1 << 31 for w in LEVEL_WORDS)


def check_ragged(raw: np.ndarray, w: QuantWeight, qtype: T) -> None:
    """qmatmul of x with a row stride past K against float64 of gguf's values."""
    k = w.shape[-1]
    xbig = torch.randn(3, k + 16, generator=torch.Generator().manual_seed(2)).to(DEV, torch.bfloat16)
    x = xbig[:, 8:8 + k]                                              # [3, K], stride K + 16
    check_close(qmatmul(x, w), x.cpu(), gguf_dequant(raw, qtype))


def check_dequant_and_gather(raw: np.ndarray, w: QuantWeight, qtype: T, idx: list[int]) -> None:
    """The prefill scratch (fp32, and bf16 rounded once; whole-slot and pair stores), rows
    5..7 as a block, and the embedding lookup of rows idx (any order, repeats): gguf's values."""
    n, k = w.shape
    ref = gguf_dequant(raw, qtype)                                     # [n, k]
    assert torch.equal(_bits(dequantize_into(w, torch.empty(n, k, device=DEV))), _bits(ref))
    out16 = dequantize_into(w, torch.empty(n, k, dtype=torch.bfloat16, device=DEV))
    assert torch.equal(out16.cpu(), ref.to(torch.bfloat16))
    assert torch.equal(_bits(dequantize_into(w, torch.empty(3, k, device=DEV), 5, 8)), _bits(ref[5:8]))
    # pairs of fields stored as they come (no whole-slot store): the same values
    pairs = dequantize_into(w, torch.empty(n, k, device=DEV), tile=(2, 128, 4, False, False))
    assert torch.equal(_bits(pairs), _bits(ref))
    rows = torch.tensor(idx, device=DEV)
    assert torch.equal(_bits(gather_rows(w, rows)), _bits(ref[rows.cpu()]))


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_qmatmul_ragged_against_float64(qtype):
    """N = 37 and K whose slots are not a multiple of the step, x with a row stride past K
    (test_qmatmul.py holds the new types to float64 and gguf's values at the regular sizes)."""
    check_ragged(*_weight(qtype, 37, RAGGED_K[qtype], seed=5), qtype)


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_qmatmul_rows_do_not_depend_on_column_or_width(qtype):
    _, w = _weight(qtype, 16, 256, seed=7)
    rotation_check(w, (1, 3, 9), pool=9)


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_dequant_and_gather_bit_exact(qtype):
    check_dequant_and_gather(*_weight(qtype, 37, 512, seed=3), qtype, [36, 0, 5, 5, 17])


@pytest.mark.parametrize("qtype", INT8, ids=[t.name for t in INT8])
def test_qmatvec_i8_is_the_contract(qtype):
    """qmatvec_i8 (the round's fused GEMV) gives the contract's bits: W = 9 (a partly masked
    row program) and W = 1; K = 288 (a padded chunk), N = 20 (a partly masked row block)."""
    n, k = 20, 288
    _, w = _weight(qtype, n, k, seed=n)
    x = _x(9, k, seed=2)
    ref = reference(x, w)
    out = torch.full((9, n), float("nan"), device=DEV)             # poisoned: every element must be written
    qmatvec_i8(x, w, out=out)
    assert_same_bits(out, ref, f"qmatvec_i8 {qtype.name} W=9")
    assert_same_bits(qmatvec_i8(x[4:5], w), ref[4:5], f"qmatvec_i8 {qtype.name} W=1")


@pytest.mark.parametrize("qtype", INT8, ids=[t.name for t in INT8])
def test_qgemv_i8_against_float64_and_row_invariant(qtype):
    """qgemv_i8 against float64 of the same int8 activations; each row of W = 3 equals
    that row alone (K = 288: a masked step)."""
    n, k = 37, 288
    raw, w = _weight(qtype, n, k, seed=3)
    x = _x(3, k, seed=4)
    out = qgemv_i8(x, w)
    ref, scale = reference64(x, raw, qtype, n, k)
    err = ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert torch.isfinite(out).all() and err < 2e-6, err
    for m in (0, 2):
        assert_same_bits(qgemv_i8(x[m:m + 1], w), out[m:m + 1], f"qgemv_i8 {qtype.name} row {m} alone")


@gpu_only
@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_gpu_sizes(qtype):
    """A 4096 x 4096 weight: the dequantize kernel gives gguf's values; with a dense int8 form,
    qgemv_i8 at W = 8 against float64 and each row alone; with the contract's, qmatvec_i8 its bits
    (test_qmatmul.py runs qmatmul at these sizes)."""
    n = k = 4096
    raw, w = _weight(qtype, n, k, seed=3)
    ref = gguf_dequant(raw, qtype)
    assert torch.equal(_bits(dequantize_into(w, torch.empty(n, k, device=DEV))), _bits(ref))
    if qtype not in DENSE_INT8:
        return
    x = _x(8, k, seed=4)
    out = qgemv_i8(x, w)
    ref64, scale = reference64(x, raw, qtype, n, k)
    assert ((out.cpu().double() - ref64).abs() / scale.clamp_min(1e-30)).max().item() < 2e-6
    for m in (0, 5):
        assert_same_bits(qgemv_i8(x[m:m + 1], w), out[m:m + 1], f"qgemv_i8 row {m} alone")
    if qtype in INT8:
        assert_same_bits(qmatvec_i8(x, w), reference(x, w), f"qmatvec_i8 {qtype.name}")


def test_moe_contract_kernels():
    """The expert contract's kernels (bank and host tiers; Q5_1 gate|up, Q4_1 down) against
    its reference; a row alone gives the same bits."""
    E, D, F, W = 3, 128, 128, 2
    gu, dn = _layer(T.Q5_1, T.Q4_1, E, D, F, seed=11)
    bank_gu, bank_dn = _bank(gu, [2, 0]), _bank(dn, [2, 0])
    table = torch.tensor([1, -1, 0], dtype=torch.int32, device=DEV)            # experts 2, 0 in the bank
    g = torch.Generator().manual_seed(12)
    h = (torch.randn(W, D, generator=g) * 3).to(DEV)
    experts = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32, device=DEV)
    weights = torch.rand(W, 2, generator=g).to(DEV)
    out = moe_q8(h, weights, experts, gu, dn, bank_gu, bank_dn, table, layer=0)
    assert torch.equal(_bits(out), _bits(moe_q8_ref(h, gu, dn, experts, weights)))
    one = moe_q8(h[1:2], weights[1:2], experts[1:2], gu, dn, bank_gu, bank_dn, table, layer=0)
    assert torch.equal(_bits(one[0]), _bits(out[1]))


# the K-quant sizes (K a multiple of 256) cost the interpreter ~30 s here: GPU runs only (their
# LOAD / FIELD and slot_values are the ones qmatmul and the dequantize tests above run)
@pytest.mark.parametrize("gt,dt,size", [(T.Q4_1, T.Q5_1, 128),
                                        pytest.param(T.Q2_K, T.Q3_K, 256, marks=gpu_only),
                                        pytest.param(T.IQ4_XS, T.IQ4_NL, 256, marks=gpu_only)],
                         ids=["Q4_1-Q5_1", "Q2_K-Q3_K", "IQ4_XS-IQ4_NL"])
def test_moe_f32_and_prefill_gemm_against_float64(gt, dt, size):
    """The format-generic MoE kernels (fp32 decode GEMVs, the prefill's grouped GEMM) with
    one new type as gate|up and another as down, against float64 of gguf's values."""
    E, F, D, k = 4, size, size, 2
    gu = QuantWeight.from_raw(random_raw(gt, E * 2 * F, D, 1), gt, (E, 2 * F, D), DEV)
    dn = QuantWeight.from_raw(random_raw(dt, E * D, F, 2), dt, (E, D, F), DEV)
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


@pytest.mark.parametrize("qtype", NEW, ids=IDS)
def test_registry_and_support_name_the_gpu(qtype):
    """Every new type runs on qmatmul; those with a dense int8 form on qgemv_i8 in an "i8"
    plan, the others are refused by it with the reason and planned on qmatmul at every width."""
    _, w = _weight(qtype, 32, 256, seed=0)
    assert QMATMUL.supports(w) is None
    assert "Q4_K only" in QGEMV_MMA_K.supports(w)
    plan = plan_linear([w], "i8")
    if qtype in DENSE_INT8:
        assert QGEMV_I8.supports(w) is None
        assert plan.i8 == (True,) and plan.at(1).kernels == (QGEMV_I8,)
    else:
        assert f"{qtype.name} has no int8 form" in QGEMV_I8.supports(w)
        assert plan.i8 == (False,) and all(st.kernels == (QMATMUL,) for st in plan.steps)
    assert plan_linear([w], "f32").at(1).kernels == (QMATMUL,)
    t = _info(qtype, 64, 256)
    tensors = {t.name: t}
    assert gpu_refusal(t.name, t, tensors) is None
    assert type_uses(tensors)[qtype.name].runs_on == "cpu+gpu"


@pytest.mark.parametrize("qtype", STILL_CPU_ONLY, ids=[t.name for t in STILL_CPU_ONLY])
def test_types_without_a_gpu_format_are_refused(qtype):
    with pytest.raises(ValueError, match=f"no GPU kernel for {qtype.name}"):
        format_of(qtype)
    t = _info(qtype, 64, 256)
    why = gpu_refusal(t.name, t, {t.name: t})
    assert why is not None and qtype.name in why
    assert type_uses({t.name: t})[qtype.name].runs_on == "none"


# each new load / field once (Q4_1 and IQ4_NL share theirs with Q5_1 and Q4_0 / IQ4_XS)
COMPILED = {T.Q5_1: ("i8", "f32", "dequant"), T.Q3_K: ("f32", "dequant"), T.Q2_K: ("f32",),
            T.IQ4_XS: ("f32", "dequant")}


def test_compiles_for_sm90():
    """The interpreter runs what the compiler may reject: compile for sm_90 (no GPU needed)
    each new load / field: the int8 GEMV, the fp32 GEMV and the dequantize kernel (the
    2-bit types' 16-field slot_values) as COMPILED lists them."""
    run_in_child("test_gpu_quant_types")


def compile_sm90() -> None:
    from alphallama.kernels.formats import dequant
    from alphallama.kernels.gemv import qmatmul as qm
    from alphallama.kernels.gemv import qmatvec_i8 as mod
    from alphallama.kernels.moe.expert_q8_gpu import CODES
    from tests.kernels.sm90 import compile_sm90 as build

    dt = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8", torch.uint8: "*u8"}
    for qtype, kernels in COMPILED.items():
        f, K = format_of(qtype), 4096
        planes = {n: dt[p.dtype] for n, p in f.pack(torch.zeros((1, K // f.block_size, f.type_size),
                                                                dtype=torch.uint8)).items()}
        args = [planes.get(n, planes["qs"]) for n in ("qs", "qh", "sc", "sd")]   # absent planes: qs
        if "i8" in kernels:
            bits, hbits, bias, has_min = CODES[qtype]
            build(mod._qmatvec_i8_kernel, ["*i32", "*i32", "*fp32", *args, "i32", "i32", "i32"],
                  dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias,
                       HAS_MIN=has_min, BN=16, NT=32, DP4A=True))
        if "f32" in kernels:
            build(qm._qmatmul_kernel, ["*bf16", "*fp32", *args, "i32", "i32", "i32", "i32"],
                  dict(n_slots=K // f.slot, LOAD=f.triton_load, FIELD=f.triton_field, V=f.V, P=f.P, BN=2, NT=128,
                       BW=4))
        if "dequant" in kernels:
            build(dequant._dequant_kernel, ["*bf16", *args, "i32", "i32"],
                  dict(n_slots=K // f.slot, LOAD=f.triton_load, FIELD=f.triton_field, V=f.V, P=f.P, SLOT=f.slot,
                       BN=1, NT=128, WHOLE=True, HW=True))
