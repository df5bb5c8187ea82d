"""qgemv_i8 (the decode GEMV on int8 activations) against a float64 product of the same
quantized activations with gguf's dequantized weights, and row invariance: every row of
a W-row call bit-identical to that row alone, whatever its column. CPU: the Triton interpreter (dp4a's integer
fallback); on a GPU the same tests run compiled."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.moe.expert_q8 import quantize_q8  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8 import GemvTile, gemv_tile, one_step_row, qgemv_i8, split_runs  # noqa: E402
from alphallama.kernels.formats.qweight import QuantWeight  # noqa: E402
from tests.kernels.test_qmatvec_i8 import QTYPES, IDS, _weight, _x, assert_same_bits  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_qmatmul import gguf_dequant  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference64(x: torch.Tensor, raw, qtype, n, k) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [W, N] of q8(x) @ w^T, the bound scale |q8(x)| @ |w|^T)."""
    xq, dx, _ = quantize_q8(x.cpu().float())
    xd = (xq.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape[0], k)
    wd = gguf_dequant(raw, qtype).double().reshape(n, k)
    return xd @ wd.T, xd.abs() @ wd.abs().T


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_matches_float64_of_the_quantized_activations(qtype):
    n, k = 48, 768                                   # 768: n_slots not a multiple of NT (masked step)
    raw, w = _weight(qtype, n, k, seed=3)
    x = _x(3, k, seed=4)
    out = torch.full((3, n), float("nan"), device=DEV)
    qgemv_i8(x, w, out=out)
    ref, scale = reference64(x, raw, qtype, n, k)
    err = ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert torch.isfinite(out).all() and err < 2e-6, err


def test_wide_q6_k_tile():
    """Q6_K rows of >= 512 slots take 64 slots a step (the measured faster tile); it is
    still checked against float64 here."""
    n, k = 8, 8192
    raw, w = _weight(T.Q6_K, n, k, seed=7)
    assert gemv_tile(w).NT == 64 and gemv_tile(_weight(T.Q6_K, n, 4096, seed=7)[1]).NT == 32
    x = _x(2, k, seed=8)
    ref, scale = reference64(x, raw, T.Q6_K, n, k)
    out = qgemv_i8(x, w, tile=gemv_tile(w))
    assert ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item() < 2e-6


@pytest.mark.parametrize("tile", [GemvTile(32, 32, 8), GemvTile(16, 32, 8), GemvTile(32, 64, 8)], ids=str)
def test_many_row_tiles(tile):
    """The GPU's tiles of 16 and 32 weight rows (8 warps), against float64, with rows past N
    (40 rows: the last program is partly masked) and slots past the row (Q6_K 768)."""
    n, k = 40, 768
    raw, w = _weight(T.Q6_K, n, k, seed=12)
    x = _x(3, k, seed=13)
    ref, scale = reference64(x, raw, T.Q6_K, n, k)
    out = qgemv_i8(x, w, tile=tile)
    assert ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item() < 2e-6


@pytest.mark.parametrize("k", [256, 768])                 # one step; three steps of 8 slots, the last masked
def test_prefetch_depth_keeps_the_bits(k):
    """Loading 0, 1 or 2 steps ahead changes when the weights are asked for, never the sums:
    every depth gives the bits of depth 1, at W=1 and W=3."""
    _, w = _weight(T.Q4_K, 24, k, seed=14)
    x = _x(3, k, seed=15)
    for W in (1, 3):
        base = qgemv_i8(x[:W], w, tile=GemvTile(8, 8, 4, prefetch=1))
        for depth in (0, 2):
            assert_same_bits(qgemv_i8(x[:W], w, tile=GemvTile(8, 8, 4, prefetch=depth)), base, f"depth {depth} W={W}")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=["Q4_K", "Q6_K"])
def test_split_runs_sum_to_the_product(qtype):
    """A split tile's partials [W, split, N]: run s is the plain tile's sum over run s's
    slots alone (the same steps; here checked against a weight cut to those columns),
    their sum in run order matches float64, and every row's partials are those of the
    row alone (W=1) whatever its column."""
    n, k, S = 40, 1024, 4
    raw, w = _weight(qtype, n, k, seed=31)
    x = _x(5, k, seed=32)
    t = GemvTile(16, 8, 4, split=S)
    part = qgemv_i8(x, w, tile=t)                                        # [W, S, N]
    assert part.shape == (5, S, n)
    ref, scale = reference64(x, raw, qtype, n, k)
    total = part[:, 0].clone()
    for s in range(1, S):
        total += part[:, s]
    assert ((total.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item() < 2e-6
    rb = raw.reshape(n, -1)
    cols = rb.shape[1] // S                                               # bytes of a run's k range
    for s in range(S):                                                    # run s alone: x's and w's k range
        ks = slice(s * k // S, (s + 1) * k // S)
        ws = QuantWeight.from_raw(rb[:, s * cols:(s + 1) * cols].copy(), qtype, (n, k // S), DEV)
        xs = x[:, ks].contiguous()
        assert_same_bits(part[:, s], qgemv_i8(xs, ws, tile=GemvTile(16, 8, 4)), f"run {s}")
    for m in (0, 4):
        assert_same_bits(qgemv_i8(x[m:m + 1], w, tile=t)[0], part[m], f"row {m}")
    with pytest.raises(ValueError, match="whole"):
        qgemv_i8(x, w, tile=GemvTile(16, 8, 4, split=3))
    with pytest.raises(ValueError, match="cannot add"):
        qgemv_i8(x, w, out=torch.zeros(5, n, device=DEV), tile=t, accumulate=True)


def test_split_runs_rule():
    """The runs where the measured sweep gained (gpu_qgemv_split-20261201-131530.json): the
    8B shape's down (Q6_K or Q4_K) and o, the 30B-A3B's o; not its qkv (K = 2048), nor the
    8B qkv (6144 rows) or gate|up (24576 rows); and never where a run is not whole steps."""
    def w(qt, n, k):
        return QuantWeight(qt, (n, k), {"qs": torch.zeros(1, dtype=torch.int32)})   # shape only
    for qt, n, k, runs in ((T.Q6_K, 4096, 12288, 2), (T.Q4_K, 4096, 12288, 2), (T.Q4_K, 4096, 4096, 2),
                           (T.Q4_K, 2048, 4096, 1),      # a one-step row (gemv_tile): not split
                           (T.Q4_K, 5120, 2048, 1), (T.Q4_K, 6144, 4096, 1),
                           (T.Q4_K, 24576, 4096, 1), (T.Q6_K, 151936, 4096, 1),
                           (T.Q8_0, 896, 4864, 1)):      # Qwen2.5-0.5B's down: 152 slots, not 2 runs of 32-slot steps
        assert split_runs(w(qt, n, k)) == runs, (qt.name, n, k)


def test_tile_is_a_function_of_the_weight():
    """Many-row programs only where there are rows enough for every SM; the head keeps 16."""
    assert gemv_tile(_weight(T.Q4_K, 8, 256, seed=1)[1]) == GemvTile(4, 8)
    assert gemv_tile(_weight(T.Q4_K, 4096, 256, seed=1)[1]) == GemvTile(16, 8, 8)


def test_one_step_rows():
    """Q4_K rows of 4096 in a qkv-sized matrix, or in one of <= 2048 rows, take one step
    (all their bytes loaded before the PDL wait); the 8B's o and gate|up and every other
    type keep their looped tiles. The one-step tile checked against float64 and for rows
    invariant to the width and their column, as the GPU runs it."""
    def shape(qt, n, k):
        return QuantWeight(qt, (n, k), {"qs": torch.zeros(1, dtype=torch.int32)})   # shape only
    assert gemv_tile(shape(T.Q4_K, 6144, 4096)) == GemvTile(16, 128, 4)
    assert gemv_tile(shape(T.Q4_K, 2048, 4096)) == GemvTile(8, 128, 4)
    assert gemv_tile(shape(T.Q4_K, 4096, 4096)) == GemvTile(16, 32, 8)
    assert gemv_tile(shape(T.Q4_K, 24576, 4096)) == GemvTile(32, 32, 8)
    assert gemv_tile(shape(T.Q6_K, 6144, 4096)).NT == 32 and gemv_tile(shape(T.Q4_K, 6144, 2048)).NT == 32
    n, k = 16, 4096
    raw, w = _weight(T.Q4_K, n, k, seed=9)
    assert one_step_row(w)
    t = GemvTile(8, 128, 4)                          # the 2048-row form's tile on a small matrix
    x = _x(5, k, seed=10)
    ref, scale = reference64(x, raw, T.Q4_K, n, k)
    out = qgemv_i8(x, w, tile=t)
    assert ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item() < 2e-6
    alone = torch.stack([qgemv_i8(x[m:m + 1], w, tile=t)[0] for m in range(5)])
    assert_same_bits(out, alone, "one-step tile, W=5 against its rows alone")
    assert_same_bits(qgemv_i8(x[[3, 1]], w, tile=t), alone[[3, 1]], "one-step tile, rows in another column")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_rows_are_invariant_to_width_and_column(qtype):
    n, k = 40, 512
    _, w = _weight(qtype, n, k, seed=5)
    x = _x(11, k, seed=6)
    alone = torch.stack([qgemv_i8(x[m:m + 1], w)[0] for m in range(11)])
    for W in (2, 5, 11):
        for shift in (0, 3):
            rows = torch.roll(torch.arange(11), shift)[:W]
            assert_same_bits(qgemv_i8(x[rows], w), alone[rows], f"{qtype.name} W={W} shift={shift}")
    for W in (3, 8):                                  # also with the GPU's tile (the interpreter's differs)
        t = gemv_tile(w)
        one = torch.stack([qgemv_i8(x[m:m + 1], w, tile=t)[0] for m in range(W)])
        assert_same_bits(qgemv_i8(x[:W], w, tile=t), one, f"{qtype.name} W={W} {t}")


def compile_sm90() -> None:
    """The GEMV for sm_90 at the 8B shape's K, W=1, 2 and 8 (child process)."""
    from alphallama.kernels.gemv import qgemv_i8 as mod
    from alphallama.kernels.moe.expert_q8_gpu import CODES
    from alphallama.kernels.formats.format import PLANES
    from alphallama.kernels.formats.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as build

    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8"}
    for qtype, K, BW, NT in ((T.Q4_K, 4096, 1, 32), (T.Q6_K, 12288, 8, 64), (T.Q6_K, 12288, 1, 64),
                             (T.Q8_0, 4096, 2, 32)):
        f = FORMATS[qtype]
        packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
        planes = [ptr[packed.get(n, packed["qs"]).dtype] for n in PLANES]   # absent planes: qs (plane_args)
        bits, hbits, bias, has_min = CODES[qtype]
        build(mod._qgemv_i8_kernel, ["*i32", "*i32", "*fp32", *planes, "i32", "i32", "i32", "i32"],
              dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias,
                   HAS_MIN=has_min, BN=4, NT=NT, BW=BW, PREFETCH=True, DP4A=True))
    # split runs (the 8B down), each run's planes and x a run further on
    for qtype, K, BN, NT in ((T.Q6_K, 12288, 32, 64), (T.Q4_K, 12288, 16, 32)):
        f = FORMATS[qtype]
        packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
        named = {n: packed.get(n, packed["qs"]) for n in PLANES}
        bits, hbits, bias, has_min = CODES[qtype]
        build(mod._qgemv_i8_kernel, ["*i32", "*i32", "*fp32", *[ptr[p.dtype] for p in named.values()],
                                     "i32", "i32", "i32", "i32", "i32"],
              dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias,
                   HAS_MIN=has_min, BN=BN, NT=NT, BW=4, PREFETCH=1, DP4A=True, PDL=True, SPLIT=2,
                   **{f"RUN_{n.upper()}": p.shape[-1] // 2 for n, p in named.items()}), num_warps=8)
    # one step a row (one_step_row: every byte of the program's rows asked for before the PDL wait)
    f = FORMATS[T.Q4_K]
    packed = f.pack(torch.zeros((1, 4096 // f.block_size, f.type_size), dtype=torch.uint8))
    planes = [ptr[packed.get(n, packed["qs"]).dtype] for n in PLANES]
    bits, hbits, bias, has_min = CODES[T.Q4_K]
    for BN, BW in ((16, 1), (16, 4), (8, 4)):
        build(mod._qgemv_i8_kernel, ["*i32", "*i32", "*fp32", *planes, "i32", "i32", "i32", "i32"],
              dict(n_slots=128, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias, HAS_MIN=has_min,
                   BN=BN, NT=128, BW=BW, PREFETCH=1, DP4A=True, PDL=True))
    # two steps in flight, with the GPU's 16- and 32-row tiles
    for qtype, K, BN, NT in ((T.Q4_K, 4096, 32, 32), (T.Q6_K, 12288, 32, 64), (T.Q4_K, 4096, 16, 32)):
        f = FORMATS[qtype]
        packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
        planes = [ptr[packed.get(n, packed["qs"]).dtype] for n in PLANES]
        bits, hbits, bias, has_min = CODES[qtype]
        build(mod._qgemv_i8_kernel, ["*i32", "*i32", "*fp32", *planes, "i32", "i32", "i32", "i32"],
              dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias,
                   HAS_MIN=has_min, BN=BN, NT=NT, BW=1, PREFETCH=2, DP4A=True), num_warps=8)


def test_compiles_for_sm90():
    run_in_child("test_qgemv_i8")
