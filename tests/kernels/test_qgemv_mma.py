"""qgemv_mma (the int8 tensor-core GEMV) against a float64 product of the same quantized
activations with gguf's dequantized weights; its rows bit-identical whatever W (across
the fixed x tile's boundary) and the row's column. CPU: the Triton interpreter; on a
GPU the same tests run compiled (there the tile and layouts are the real ones)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.qgemv_mma import WP, qgemv_mma  # noqa: E402
from alphallama.kernels.qmatvec_i8 import prepare_i8  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_qgemv_i8 import reference64  # noqa: E402
from tests.kernels.test_qmatvec_i8 import IDS, QTYPES, _weight, _x, assert_same_bits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_matches_float64_of_the_quantized_activations(qtype):
    n, k = 40, 768                                   # 40: a masked row tile; 768: a masked slot step
    raw, w = _weight(qtype, n, k, seed=3)
    x = _x(3, k, seed=4)
    out = torch.full((3, n), float("nan"), device=DEV)
    qgemv_mma(x, w, out=out)
    ref, scale = reference64(x, raw, qtype, n, k)
    err = ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert torch.isfinite(out).all() and err < 2e-6, err


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_rows_are_invariant_to_width_and_column(qtype):
    n, k = 40, 512
    _, w = _weight(qtype, n, k, seed=5)
    M = WP + 3                                       # past one x tile
    x = _x(M, k, seed=6)
    alone = torch.stack([qgemv_mma(x[m:m + 1], w)[0] for m in range(M)])
    for W in (2, 7, WP, M):
        for shift in (0, 5):
            rows = torch.roll(torch.arange(M), shift)[:W]
            assert_same_bits(qgemv_mma(x[rows], w), alone[rows], f"{qtype.name} W={W} shift={shift}")


def test_takes_the_activations_of_qgemv_i8_and_a_column_slice():
    n, k = 24, 256
    raw, w = _weight(T.Q4_K, n, k, seed=9)
    x = _x(2, k, seed=10)
    wide = torch.full((2, n + 8), float("nan"), device=DEV)
    qgemv_mma(x, w, out=wide[:, 4:4 + n], prepared=prepare_i8(x, w))
    assert_same_bits(wide[:, 4:4 + n], qgemv_mma(x, w), "prepared + slice")
    assert torch.isnan(wide[:, :4]).all() and torch.isnan(wide[:, 4 + n:]).all()


def test_rejects_bad_arguments():
    _, w = _weight(T.Q4_K, 8, 256, seed=1)
    with pytest.raises(ValueError, match="does not match"):
        qgemv_mma(_x(1, 128, seed=1), w)
    with pytest.raises(ValueError, match="out must be"):
        qgemv_mma(_x(1, 256, seed=1), w, out=torch.empty(1, 8, dtype=torch.float16, device=DEV))


def compile_sm90() -> None:
    """The kernel for sm_90 at the 8B shape's sizes, every format (child process)."""
    from alphallama.kernels import qgemv_mma as mod
    from alphallama.kernels.expert_q8_gpu import CODES
    from alphallama.kernels.formats import PLANES
    from alphallama.kernels.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as build

    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8"}
    for qtype, K in ((T.Q4_K, 4096), (T.Q6_K, 12288), (T.Q8_0, 896), (T.Q5_K, 4096), (T.Q4_0, 4096),
                     (T.Q5_0, 4096)):
        f = FORMATS[qtype]
        packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
        planes = [ptr[packed.get(n, packed["qs"]).dtype] for n in PLANES]
        bits, hbits, bias, has_min = CODES[qtype]
        ks = build(mod._qgemv_mma_kernel, ["*i8", "*i32", "*fp32", *planes, "i32", "i32", "i32", "i32"],
                   dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias,
                        HAS_MIN=has_min, SLOT=f.slot, BN=32, NT=16 if f.slot == 16 else 8, WP=WP, PREFETCH=True))
        assert "mma.sync" in ks.asm["ptx"] and ".s8" in ks.asm["ptx"], f"{qtype.name}: no int8 MMA in the PTX"


def test_compiles_for_sm90_with_int8_mma():
    run_in_child("test_qgemv_mma")
