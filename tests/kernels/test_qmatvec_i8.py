"""qmatvec_i8 (int8 activations + dp4a) against the expert contract's plain-torch
reference expert_q8.matvec_q8, bit for bit, and against float64 (gguf's dequantizer)
within the int8 quantization bound. On CPU the Triton interpreter runs the kernels (the
integer fallback of dp4a); on a GPU the same tests run compiled with dp4a."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.moe.expert_q8 import QBLOCK, matvec_q8, quantize_q8  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import lane_perm, qmatvec_i8  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_qmatmul import gguf_dequant, random_raw  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QTYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K, T.Q4_0, T.Q5_0]
IDS = [t.name for t in QTYPES]


def _weight(qtype, n, k, seed):
    raw = random_raw(qtype, n, k, seed)
    return raw, QuantWeight.from_raw(raw, qtype, (n, k), DEV)


def _x(W, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(W, k, generator=g) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=g)]
    return x.to(dtype).to(DEV)


def reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The contract, row by row, on the CPU: [W, N] float32."""
    wc = QuantWeight(w.qtype, w.shape, {n: p.cpu() for n, p in w.planes.items()})
    xq, dx, xs = quantize_q8(x.cpu())
    return torch.stack([matvec_q8(xq[m], dx[m], xs[m], wc) for m in range(x.shape[0])])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    same = a.cpu().view(torch.int32) == b.cpu().view(torch.int32)
    rows = (~same).any(1).nonzero()[:, 0].tolist()
    assert same.all(), f"{what}: {int((~same).sum())} of {same.numel()} differ, rows {rows}"


def test_lane_perm_is_a_permutation_of_the_slot():
    for slot, V, bits in ((32, 4, 4), (16, 2, 4), (16, 4, 8)):
        p = lane_perm(slot, V, bits)
        assert sorted(p.tolist()) == list(range(slot))


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_bit_exact_vs_matvec_q8(qtype):
    """Every row of W=9 (a 16-row program, 7 rows masked) and W=1, N 64, K 512."""
    _, w = _weight(qtype, 64, 512, seed=1)
    x = _x(9, 512, seed=2, dtype=torch.bfloat16 if qtype == T.Q6_K else torch.float32)
    out = torch.full((9, 64), float("nan"), device=DEV)      # poisoned: every element must be written
    qmatvec_i8(x, w, out=out)
    assert_same_bits(out, reference(x, w), f"{qtype.name} W=9")
    assert_same_bits(qmatvec_i8(x[4:5], w), reference(x[4:5], w), f"{qtype.name} W=1")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=["Q4_K", "Q6_K"])
def test_rotation_same_bits(qtype):
    """Row r alone equals row r inside W rows at another position, W = 1..9."""
    pool = 9
    _, w = _weight(qtype, 16, 256, seed=3)
    xs = _x(pool, 256, seed=4)
    alone = torch.cat([qmatvec_i8(xs[i:i + 1], w) for i in range(pool)])   # [pool, N]
    widths = range(1, pool + 1) if qtype == T.Q4_K else (2, 5, 9)
    for W in widths:
        idx = [(W // 2 + 1 + j) % pool for j in range(W)]
        assert_same_bits(qmatvec_i8(xs[idx], w), alone[idx], f"W={W}")


def test_any_tile_same_bits():
    """The rows a program takes are speed only: the lanes are the contract's."""
    _, w = _weight(T.Q5_K, 24, 512, seed=5)
    x = _x(3, 512, seed=6)
    ref = qmatvec_i8(x, w)
    for BN in (1, 8, 32):
        assert_same_bits(qmatvec_i8(x, w, BN=BN), ref, f"BN={BN}")


@pytest.mark.parametrize("qtype,k", [(T.Q6_K, 768), (T.Q4_0, 896), (T.Q8_0, 96), (T.Q6_K, 8448), (T.Q4_0, 64)],
                         ids=["Q6_K-768", "Q4_0-896", "Q8_0-96", "Q6_K-8448-64-lanes", "Q4_0-2-slots"])
def test_ragged_shapes(qtype, k):
    """Slot counts that are not a multiple of the lanes (masked, padded steps), 64 lanes
    (Q6_K rows of >= 512 slots), fewer than 8, N not a multiple of BN, x with a row stride
    larger than K."""
    n = 37
    _, w = _weight(qtype, n, k, seed=7)
    xbig = _x(3, k + 32, seed=8)
    x = xbig[:, 16:16 + k]                                              # [3, K], stride K + 32
    assert_same_bits(qmatvec_i8(x, w), reference(x, w), f"{qtype.name} K={k}")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0], ids=["Q4_K", "Q8_0"])
def test_vs_float64_within_int8_bound(qtype):
    n, k = 64, 512
    raw, w = _weight(qtype, n, k, seed=9)
    w64 = gguf_dequant(raw, qtype).double().reshape(n, k)              # gguf's own dequantizer
    x = _x(2, k, seed=10)
    out = qmatvec_i8(x, w).cpu().double()
    xq, dx, _ = quantize_q8(x.cpu())
    xd = (xq.double().reshape(2, -1, QBLOCK) * dx.double()[..., None]).reshape(2, k)
    scale = xd.abs() @ w64.abs().T
    assert ((out - xd @ w64.T).abs() <= 2e-6 * scale + 1e-30).all()    # float32 rounding of the exact sums
    bound = (dx.double().repeat_interleave(QBLOCK, 1) * 0.5) @ w64.abs().T + 2e-6 * scale
    assert ((out - x.cpu().double() @ w64.T).abs() <= bound + 1e-12).all()   # int8 rounding of x


def test_errors():
    _, w = _weight(T.F16, 8, 64, seed=11)
    with pytest.raises(ValueError, match="no integer form"):
        qmatvec_i8(_x(1, 64, 0), w)
    _, w = _weight(T.Q8_0, 8, 64, seed=11)
    with pytest.raises(ValueError, match="does not match"):
        qmatvec_i8(_x(1, 96, 0), w)
    with pytest.raises(ValueError, match="power of two"):
        qmatvec_i8(_x(1, 64, 0), w, BN=3)


def test_compiles_for_sm90():
    """The interpreter runs what the compiler may reject: compile the GEMV (dp4a) and
    the prepare kernel for sm_90 with the ptxas that ships with Triton (no GPU needed)."""
    run_in_child("test_qmatvec_i8")


def compile_sm90() -> None:
    from alphallama.kernels.gemv import qmatvec_i8 as mod
    from alphallama.kernels.moe.expert_q8 import contract_lanes
    from alphallama.kernels.moe.expert_q8_gpu import CODES
    from alphallama.kernels.formats.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as build

    for qtype, K in ((T.Q4_K, 4096), (T.Q6_K, 8192)):
        f = FORMATS[qtype]
        planes = [{torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8"}[p.dtype]
                  for p in f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8)).values()]
        if qtype == T.Q4_K:                                             # no qh plane: qs stands in
            planes = [planes[0], planes[0], planes[1], planes[2]]
        bits, hbits, bias, has_min = CODES[qtype]
        build(mod._qmatvec_i8_kernel, ["*i32", "*i32", "*fp32", *planes, "i32", "i32", "i32"],
              dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias, HAS_MIN=has_min,
                   BN=16, NT=contract_lanes(qtype, K // f.slot), DP4A=True))
        build(mod._prepare_kernel, ["*bf16", "*i8", "*i32", "i32"], dict(K=K, BQ=256, SLOT=f.slot, V=f.V, BITS=bits, PDL=False))
