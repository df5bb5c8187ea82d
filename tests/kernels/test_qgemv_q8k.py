"""qgemv_q8k (dp4a on q8_K activations) against qgemv_mma_k bit for bit, and against float64
of the same activations: the narrow-W and wide-W kernels of one float order."""
from __future__ import annotations


import pytest
import torch


from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.gemv.qgemv_mma import mma_tile, prepare_q8k, qgemv_mma_k  # noqa: E402
from alphallama.kernels.gemv.qgemv_q8k import qgemv_q8k  # noqa: E402
from tests.kernels.test_qgemv_mma import _rel_err, q8k_reference64  # noqa: E402
from tests.kernels.test_qmatvec_i8 import _weight, _x  # noqa: E402


@pytest.mark.parametrize("n,k,W,rows,cols", [(48, 1024, 3, 16, 1), (32, 2048, 10, 16, 4), (4112, 512, 2, 32, 2)])
def test_equals_the_tensor_core_kernel_bit_for_bit(n, k, W, rows, cols):
    """Runs 4 (48 and 32 rows: mma_tile's runs below 4096 rows at 4 / 8 super-blocks), 1 and
    2 (4112 rows: 4 runs do not divide 2 super-blocks): the same runs, the same tree."""
    raw, w = _weight(T.Q4_K, n, k, seed=11)
    x = _x(W, k, seed=12)
    prep = prepare_q8k(x, w.n_slots)
    want = qgemv_mma_k(x, w, prepared=prep)
    got = qgemv_q8k(x, w, prepared=prep, rows=rows, cols=cols)
    assert mma_tile(w)[1] > 1 or n > 4096
    assert torch.equal(got, want)
    assert _rel_err(got, *q8k_reference64(x, raw, T.Q4_K, n, k)) < 2e-6


def test_rows_do_not_depend_on_width_or_column():
    _, w = _weight(T.Q4_K, 32, 1024, seed=13)
    x = _x(7, 1024, seed=14)
    full = qgemv_q8k(x, w, cols=4)
    alone = torch.cat([qgemv_q8k(x[m:m + 1], w, cols=1) for m in range(7)])
    assert torch.equal(full, alone)
    assert torch.equal(torch.roll(full, 2, dims=0), qgemv_q8k(torch.roll(x, 2, dims=0), w, cols=2))


def test_refuses_what_it_does_not_cover():
    _, w6 = _weight(T.Q6_K, 32, 256, seed=1)
    with pytest.raises(ValueError, match="Q4_K"):
        qgemv_q8k(_x(1, 256, seed=1), w6)


def compile_sm90() -> None:
    """The kernel for sm_90 (child process): dp4a in the PTX, at the tiles the bench times."""
    from alphallama.kernels.gemv.qgemv_q8k import _q8k_dp4a_kernel
    from tests.kernels.sm90 import compile_sm90 as build

    args = ["*i32", "*i32", "*fp32", "*fp32", "*i32", "*i16", "*fp16", "i32", "i32", "i32", "i32"]
    for bn, r, bw in ((16, 4, 1), (8, 8, 1), (16, 4, 4)):
        k = build(_q8k_dp4a_kernel, args, {"n_slots": 128, "BN": bn, "R": r, "BW": bw, "DP4A": True, "PDL": True})
        assert "dp4a.u32.s32" in k.asm["ptx"]


def test_compiles_for_sm90():
    from tests.kernels.sm90 import run_in_child
    run_in_child("test_qgemv_q8k")
