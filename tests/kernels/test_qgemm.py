"""The prefill GEMM path: its dequantize kernel bit for bit against the gguf-checked
numpy dequantizers (alphallama.gguf.quants), and qgemm against a float64 product."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.gguf.quants import dequantize  # noqa: E402
from alphallama.runtime.scratch import Scratch  # noqa: E402
from alphallama.kernels.formats.dequant import dequantize_into, gather_rows  # noqa: E402
from alphallama.kernels.prefill.qgemm import qgemm, qgemm_ref, units_of  # noqa: E402
from alphallama.kernels.formats.qweight import QuantWeight  # noqa: E402

try:                                                           # pytest puts tests/kernels on the path
    from test_qmatmul import random_raw  # noqa: E402  (random GGUF bytes, finite scales)
except ImportError:                                            # sm90.run_in_child imports from the root
    from tests.kernels.test_qmatmul import random_raw  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QTYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q4_0, T.F16, T.BF16, T.F32]


def _ref(raw: np.ndarray, qtype: T, n: int, k: int) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(dequantize(raw, qtype, (n, k)), dtype=np.float32))


# (rows, slots, warps, whole-slot stores, the GPU's own bf16 convert): every variant, the same bits
TILES = [(2, 128, 4, False, False), (4, 64, 4, True, False), (2, 128, 4, False, True), (2, 128, 4, True, True)]


@pytest.mark.parametrize("tile", TILES if DEV == "cuda" else TILES[:2], ids=lambda t: "-".join(map(str, t)))
@pytest.mark.parametrize("qtype", QTYPES, ids=[t.name for t in QTYPES])
def test_dequant_bit_exact(qtype, tile):
    n, k = 5, 512                      # 5 rows: a partial row block; K: 2 super-blocks
    raw = random_raw(qtype, n, k, seed=1)
    w = QuantWeight.from_raw(raw, qtype, (n, k), DEV)
    ref = _ref(raw, qtype, n, k)       # [n, k] fp32
    out = dequantize_into(w, torch.empty(n, k, device=DEV), tile=tile)
    assert torch.equal(out.cpu(), ref)
    # the bf16 scratch holds the fp32 values rounded once (round to nearest even)
    out16 = dequantize_into(w, torch.empty(n, k, dtype=torch.bfloat16, device=DEV), tile=tile)
    assert torch.equal(out16.cpu(), ref.to(torch.bfloat16))
    # a row block (what qgemm does with a small scratch)
    part = dequantize_into(w, torch.empty(2, k, device=DEV), 2, 4, tile=tile)
    assert torch.equal(part.cpu(), ref[2:4])


@pytest.mark.parametrize("qtype", QTYPES, ids=[t.name for t in QTYPES])
def test_gather_rows_is_the_embedding_lookup(qtype):
    """The embedding lookup kernel: rows in any order, repeated, the first and the last,
    bit for bit the gguf dequantizers' rows; no rows gives an empty result."""
    n, k = 37, 512
    raw = random_raw(qtype, n, k, seed=3)
    w = QuantWeight.from_raw(raw, qtype, (n, k), DEV)
    ref = _ref(raw, qtype, n, k)                                       # [n, k] fp32
    idx = torch.tensor([36, 0, 5, 5, 17, 36, 1], device=DEV)
    out = gather_rows(w, idx)
    assert out.dtype == torch.float32 and torch.equal(out.cpu(), ref[idx.cpu()])
    assert gather_rows(w, idx[:0]).shape == (0, k)
    # ids past either end read the nearest row, never past the planes
    assert torch.equal(gather_rows(w, torch.tensor([-3, 40, 2**40], device=DEV)).cpu(), ref[[0, 36, 36]])
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows(w, idx, torch.empty(len(idx), k + 1, device=DEV))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("scratch_rows,overlap", [(40, False), (7, False), (80, True), (14, True)],
                         ids=["whole", "blocks-of-7", "whole-2-buffers", "blocks-of-7-2-buffers"])
def test_qgemm_matches_float64(qtype, scratch_rows, overlap):
    n, k, t = 40, 256, 9
    raw = random_raw(qtype, n, k, seed=2)
    w = QuantWeight.from_raw(raw, qtype, (n, k), DEV)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(0)).to(DEV)
    y = qgemm(x, w, Scratch(scratch_rows * k, torch.float32, torch.device(DEV), overlap=overlap))
    ref = qgemm_ref(x.cpu(), QuantWeight.from_raw(raw, qtype, (n, k)))
    scale = x.cpu().double().abs() @ _ref(raw, qtype, n, k).double().abs().T   # sum |x w|
    assert y.dtype == torch.float32 and y.shape == (t, n)
    assert ((y.cpu().double() - ref).abs() <= 1e-5 * scale + 1e-30).all()


def test_qgemm_rejects_bad_shapes():
    raw = random_raw(T.Q8_0, 4, 64, seed=3)
    w = QuantWeight.from_raw(raw, T.Q8_0, (4, 64), DEV)
    with pytest.raises(ValueError):
        qgemm(torch.zeros(2, 32, device=DEV), w, Scratch(1024, torch.float32, torch.device(DEV)))
    with pytest.raises(ValueError):
        dequantize_into(w, torch.empty(3, 64, device=DEV))


def test_units_stack_small_weights_and_split_large_ones():
    """A Linear's matrices (of different types) share a buffer where they fit: one GEMM."""
    k = 256
    ws = [QuantWeight.from_raw(random_raw(q, n, k, seed=5 + n), q, (n, k), DEV)
          for q, n in ((T.Q4_K, 6), (T.Q6_K, 3), (T.Q8_0, 5))]
    assert [u.n for u in units_of(ws, 16)] == [14]
    assert [[(p[0].N, p[1], p[2]) for p in u.pieces] for u in units_of(ws, 4)] == [
        [(6, 0, 4)], [(6, 4, 6), (3, 0, 2)], [(3, 2, 3), (5, 0, 3)], [(5, 3, 5)]]


@pytest.mark.parametrize("overlap", [False, True])
def test_planned_gemms_in_any_order_match(overlap):
    """A plan of several weights, followed, departed from (a GEMM outside the plan) and
    extended with expect(): every product equals the weight's own float64 reference,
    so no buffer is read while it holds another weight (the ordering the events keep on
    the GPU, checked here with its bookkeeping)."""
    k, t = 256, 5
    qs = (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0)
    raws = [random_raw(q, 8 + i, k, seed=20 + i) for i, q in enumerate(qs)]
    ws = [[QuantWeight.from_raw(r, q, (8 + i, k), DEV)] for i, (q, r) in enumerate(zip(qs, raws))]
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(1)).to(DEV)
    refs = [qgemm_ref(x.cpu(), QuantWeight.from_raw(r, q, (8 + i, k))) for i, (q, r) in enumerate(zip(qs, raws))]
    s = Scratch(2 * 12 * k, torch.float32, torch.device(DEV), overlap=overlap)
    s.plan([u for w in ws[:3] for u in s.units(w)])
    order = [0, 3, 1, 2, 0]                     # 3 is outside the plan; 0 comes back after the plan ran out
    for i in order:
        y = s.gemm(x, s.units(ws[i]))
        assert torch.allclose(y.cpu().double(), refs[i], atol=1e-4, rtol=1e-5), i
    extra = s.units(ws[2], cache=False)
    s.expect(extra)
    y = s.gemm(x, extra)
    assert torch.allclose(y.cpu().double(), refs[2], atol=1e-4, rtol=1e-5)


def compile_sm90() -> None:
    """The dequantize kernel as the embedding lookup (GATHER: int64 ids, the row clamp) for
    sm_90, for the formats of Q4_K_M files and Qwen2.5-Coder (child process)."""
    from alphallama.kernels.formats import dequant
    from alphallama.kernels.formats.format import PLANES
    from alphallama.kernels.formats.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as build

    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8", torch.uint8: "*u8"}
    for qt in (T.Q4_K, T.Q6_K, T.Q8_0, T.F16):
        f = FORMATS[qt]
        packed = f.pack(torch.zeros((1, 4096 // f.block_size, f.type_size), dtype=torch.uint8))
        planes = [ptr[packed.get(n, packed["qs"]).dtype] for n in PLANES]
        build(dequant._dequant_kernel, ["*fp32", *planes, "i32", "i32", "*i64", "i32"],
              dict(n_slots=4096 // f.slot, LOAD=f.triton_load, FIELD=f.triton_field, V=f.V, P=f.P, SLOT=f.slot,
                   BN=1, NT=128, WHOLE=True, HW=True, GATHER=True))


def test_gather_compiles_for_sm90():
    from tests.kernels.sm90 import run_in_child
    run_in_child("test_qgemm")
