"""qmatmul against float64 references, and its exact-mode property (a row's bits do not
depend on its column or on W). On CPU the Triton interpreter runs the kernels at small
sizes; on a GPU the same tests run compiled, plus the heavier cases."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf import quants as gguf_quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from alphallama.gguf.quants import QUANTS  # noqa: E402
from alphallama.kernels import FORMATS, QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul, qmatmul_ref, tile  # noqa: E402
from alphallama.kernels.formats.fmt_grid import GRID_FORMATS  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"
gpu_only = pytest.mark.skipif(not GPU, reason="too slow for the CPU interpreter; runs on a GPU")
QTYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q4_0, T.F16, T.BF16, T.F32, T.Q4_1, T.Q5_1, T.Q2_K, T.Q3_K,
          T.IQ4_NL, T.IQ4_XS]
IDS = [t.name for t in QTYPES]
# planes' bytes over the file's: 1.03 for every type but Q3_K, whose 12 scale bytes per
# 110-byte block are 16 on the GPU (one int8 per 16-value slot): 114 / 110
PLANE_BYTES = {T.Q3_K: 1.04}
CODEBOOK_AND_MORE = [f.qtype for f in GRID_FORMATS] + [T.MXFP4, T.TQ1_0, T.TQ2_0]


def random_raw(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF bytes for an [n, k] tensor: random quant bits, every fp16 scale field
    replaced by a small finite value of random sign (float types: random small values)."""
    g = torch.Generator().manual_seed(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    nb = n * k // block
    if qtype in (T.F32, T.F16, T.BF16):
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        vals = torch.randn(nb, generator=g) * 0.05  # [nb]
        return vals.to(dtype).view(torch.uint8).numpy().reshape(n, -1)
    blocks = torch.randint(0, 256, (nb, size), dtype=torch.uint8, generator=g)  # [nb, size]
    for off in QUANTS[qtype].f16_fields:
        scale = (torch.rand(nb, generator=g) * 2 - 1) * 2e-3  # [nb]
        blocks[:, off:off + 2] = scale.to(torch.float16).reshape(nb, 1).view(torch.uint8)
    return blocks.numpy().reshape(n, -1)


def gguf_dequant(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw, qtype), dtype=np.float32))


def check_close(out: torch.Tensor, x: torch.Tensor, w_ref: torch.Tensor) -> None:
    """fp32 accumulation: every element within 1e-5 of sum |x * w| of the float64 result."""
    ref = x.double() @ w_ref.double().T  # [W, N]
    scale = x.double().abs() @ w_ref.double().abs().T  # [W, N]
    err = (out.double().cpu() - ref).abs()
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert (err <= 1e-5 * scale + 1e-30).all(), f"max err/scale {(err / scale).max():.3g}"


def _weight(qtype, n, k, seed=0):
    raw = random_raw(qtype, n, k, seed)
    return raw, QuantWeight.from_raw(raw, qtype, (n, k), DEV)


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_relayout_is_bit_exact(qtype):
    """The planes' plain-torch dequantization equals gguf's, bit for bit, for 2-D and
    3-D (expert) tensors."""
    raw, w = _weight(qtype, 12, 512, seed=1)
    ref = gguf_dequant(raw, qtype)  # [12, 512]
    assert torch.equal(w.dequantize().cpu().view(torch.int32), ref.view(torch.int32))
    w3 = QuantWeight.from_raw(raw, qtype, (3, 4, 512), DEV)
    assert w3.shape == (3, 4, 512) and w3.expert(2).shape == (4, 512)
    assert torch.equal(w3.expert(2).dequantize().cpu().view(torch.int32), ref[8:].view(torch.int32))
    assert w.nbytes <= PLANE_BYTES.get(qtype, 1.03) * w.gguf_nbytes   # same bits, ~same bytes


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
@pytest.mark.parametrize("W", [1, 3, 8, 11])
def test_qmatmul_matches_reference(qtype, W):
    n, k = 64, 512
    raw, w = _weight(qtype, n, k, seed=W)
    x = torch.randn(W, k, generator=torch.Generator().manual_seed(W)).to(DEV)  # [W, K]
    if W % 2:
        x = x.to(torch.bfloat16)
    out = qmatmul(x, w)  # [W, N]
    assert out.shape == (W, n)
    w_ref = gguf_dequant(raw, qtype)
    check_close(out, x.cpu(), w_ref)
    # the plain-torch reference beside the kernel is the same function
    assert torch.allclose(qmatmul_ref(x, w).cpu(), x.cpu().double() @ w_ref.double().T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("qtype,k", [(T.Q4_0, 896), (T.Q8_0, 896), (T.Q6_K, 768), (T.F16, 72)],
                         ids=["Q4_0-896", "Q8_0-896", "Q6_K-768", "F16-72"])
def test_ragged_shapes(qtype, k):
    """K whose slot count is not a multiple of the tile (masked last step), N not a
    multiple of BN, and x with a row stride larger than K."""
    n = 37
    raw, w = _weight(qtype, n, k, seed=5)
    BN, NT, _ = tile(w)
    assert w.n_slots % NT != 0 or qtype == T.F16
    xbig = torch.randn(3, k + 16, generator=torch.Generator().manual_seed(2)).to(DEV)
    x = xbig[:, 8:8 + k]  # [3, K], stride k + 16
    check_close(qmatmul(x, w), x.cpu(), gguf_dequant(raw, qtype))


def rotation_check(w: QuantWeight, widths, pool: int, dtype=torch.bfloat16, seed=0, **knobs):
    """Exact mode: every row of every width, at every column a rotation puts it in,
    equals bit for bit that row computed alone (W=1)."""
    xs = torch.randn(pool, w.K, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)  # [pool, K]
    alone = torch.cat([qmatmul(xs[i:i + 1], w, **knobs) for i in range(pool)])  # [pool, N]
    for W in widths:
        for shift in sorted({0, W // 2, pool - 1}):
            idx = [(shift + j) % pool for j in range(W)]
            out = qmatmul(xs[idx], w, **knobs)  # [W, N]
            same = out.view(torch.int32) == alone[idx].view(torch.int32)
            assert same.all(), f"W={W} shift={shift}: rows {sorted(set(same.all(1).logical_not().nonzero()[:, 0].tolist()))} differ"


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_rotation_exact_cpu_widths(qtype):
    _, w = _weight(qtype, 16, 256, seed=7)
    widths = range(1, 17) if qtype == T.Q4_K else (1, 2, 5, 9)
    rotation_check(w, widths, pool=16)


def test_rotation_exact_four_rows_per_thread():
    """rows_per_thread=4 caps a program at 4 x rows: W=5..8 take two programs."""
    _, w = _weight(T.Q4_K, 16, 512, seed=8)
    rotation_check(w, (1, 3, 6, 8), pool=8, dtype=torch.float32, rows_per_thread=4)


@gpu_only
@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_rotation_exact_gpu(qtype):
    _, w = _weight(qtype, 1000, 4096, seed=11)
    rotation_check(w, range(1, 65), pool=64)
    rotation_check(w, (1, 7, 33), pool=40, dtype=torch.float32, seed=1)


@gpu_only
@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_qmatmul_gpu_sizes(qtype):
    raw, w = _weight(qtype, 4096, 4096, seed=3)
    x = torch.randn(17, 4096, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    check_close(qmatmul(x, w), x.cpu(), gguf_dequant(raw, qtype))


def test_expert_slices_give_the_same_bits():
    raw = random_raw(T.Q4_K, 3 * 16, 256, seed=9)
    w3 = QuantWeight.from_raw(raw, T.Q4_K, (3, 16, 256), DEV)
    w2 = QuantWeight.from_raw(raw.reshape(3, 16, -1)[1], T.Q4_K, (16, 256), DEV)
    x = torch.randn(2, 256).to(DEV)
    assert torch.equal(qmatmul(x, w3.expert(1)).view(torch.int32), qmatmul(x, w2).view(torch.int32))


def test_registry_and_errors():
    assert set(QTYPES) | set(CODEBOOK_AND_MORE) == set(FORMATS)   # those: test_gpu_quant_types_iq.py
    with pytest.raises(ValueError, match="no GPU kernel for Q8_K"):   # a type without a GPU format
        QuantWeight.from_raw(np.zeros(292, np.uint8), T.Q8_K, (1, 256))
    with pytest.raises(ValueError, match="bytes"):
        QuantWeight.from_raw(np.zeros(100, np.uint8), T.Q4_K, (1, 256))
    with pytest.raises(ValueError, match="multiple"):
        QuantWeight.from_raw(np.zeros(18, np.uint8), T.Q4_0, (1, 48))
    _, w = _weight(T.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="does not match"):
        qmatmul(torch.zeros(1, 32, device=DEV), w)


@pytest.mark.parametrize("name", ["qmatmul", "qmatvec_i8", "qgemv_i8"])
def test_gemv_wrappers_check_x_and_out(name):
    """The checks the GEMV wrappers share (qweight.check_gemv_args): a ValueError naming
    the kernel for a wrong x shape or out dtype; only qgemv_i8 takes a column slice as out."""
    from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8
    from alphallama.kernels.gemv.qmatvec_i8 import qmatvec_i8
    fn = {"qmatmul": qmatmul, "qmatvec_i8": qmatvec_i8, "qgemv_i8": qgemv_i8}[name]
    _, w = _weight(T.Q8_0, 8, 64)
    x = torch.zeros(2, 64, device=DEV)
    for bad in (torch.zeros(2, 96, device=DEV), torch.zeros(64, device=DEV)):
        with pytest.raises(ValueError, match=f"{name}: x .* does not match weight"):
            fn(bad, w)
    with pytest.raises(ValueError, match=f"{name}: out must be .*float32 \\[2, 8\\].*got torch.float16"):
        fn(x, w, out=torch.zeros(2, 8, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=f"{name}: out must be"):
        fn(x, w, out=torch.zeros(8, 2, device=DEV).T)                 # column stride 2
    wide = torch.full((2, 16), 7.0, device=DEV)
    if name == "qgemv_i8":
        assert fn(x, w, out=wide[:, 4:12]).data_ptr() == wide[:, 4:12].data_ptr()
        assert (wide[:, 4:12] == 0).all() and (wide[:, :4] == 7).all() and (wide[:, 12:] == 7).all()
    else:
        with pytest.raises(ValueError, match=f"{name}: out must be a contiguous"):
            fn(x, w, out=wide[:, 4:12])
