"""qgemv_i8's int8 form of the codebook (grid) formats (kernels/gemv/qgemv_i8_grid.py):

  lanes     grid_lanes's biased signed bytes (128 + sign * point) against numpy, on every
            point byte 0..127 and random sign bits
  float64   the GEMV against a float64 product of the same int8 activations with gguf's
            dequantized weights (random valid blocks; and random bytes with sane d)
  rows      every row of W = 1 / 3 / 8 bit-identical to that row alone, whatever its column
  epilogue  the residual add and the split runs (the codebook, in qh's place, is not a plane
            the runs cut)
  emit      the producers (norm, SiLU) emit the (8, 2, 8) lane order as prepare_i8 does
  plan      the registry's plan puts them on qgemv_i8 at W = 1..16, exact
CPU: the Triton interpreter; on a GPU the same tests run compiled."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.activations.silu import silu_mul_q8  # noqa: E402
from alphallama.kernels.formats.qweight import FORMATS, QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8_grid import GRID_CODES, grid_lanes  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8_table import has_dense_i8_form, i8_codes  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import lane_order, prepare_i8  # noqa: E402
from alphallama.kernels.gemv.registry import QGEMV_I8, QMATMUL, plan_linear  # noqa: E402
from alphallama.kernels.norm.rmsnorm import add_rmsnorm_q8  # noqa: E402
from tests.kernels.i8checks import EPILOGUE_NK, ROWS_NK, epilogues_add_up, rows_keep_their_bits  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_gpu_quant_types_iq import valid_raw  # noqa: E402
from tests.kernels.test_qgemv_i8 import reference64  # noqa: E402
from tests.kernels.test_qmatmul import random_raw  # noqa: E402
from tests.kernels.test_qmatvec_i8 import _x  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GRID = list(GRID_CODES)
IDS = [t.name for t in GRID]
# the row and epilogue tests take one type of each point width (4-value IQ3 and 8-value IQ2 points):
# a row's loop and the epilogues do not depend on the load; every type is checked against float64
FAMILIES = [T.IQ3_XXS, T.IQ2_XS]
ORDER = (8, 2, 8)          # their activations: a record a group of 8, 2 words of 8-bit lanes


def _weight(qtype: T, n: int, k: int, seed: int, valid: bool = True):
    raw = valid_raw(qtype, n, k, seed) if valid else random_raw(qtype, n, k, seed)
    return raw, QuantWeight.from_raw(raw, qtype, (n, k), DEV)


@triton.jit
def _lanes_kernel(words, groups, out):
    i = tl.arange(0, 256)
    w = tl.reshape(tl.load(words + 2 * i[:, None] + tl.arange(0, 2)[None, :]), (256, 1, 2))
    g = tl.reshape(tl.load(groups + i), (256, 1))
    lanes = tl.reshape(grid_lanes(w, g), (256, 2))
    tl.store(out + 2 * i[:, None] + tl.arange(0, 2)[None, :], lanes)


def test_lanes_are_the_signed_points():
    """Byte j of word v is 128 + sign * point for the group's value 2v + j (j < 2) or
    4 + 2v + j - 2 (j >= 2), its sign bit 20 + that value of the group word; every point
    byte 0..127 in every lane, random signs and high bits (s)."""
    rng = np.random.default_rng(1)
    pts = np.stack([(np.arange(256) + 37 * b) % 128 for b in range(8)], axis=1)      # [256, 8]: bytes of words
    g = rng.integers(0, 1 << 32, 256, dtype=np.int64)
    words = (pts.reshape(256, 2, 4) << (8 * np.arange(4))).sum(-1)                    # [256, 2]
    out = torch.empty(256, 2, dtype=torch.int32, device=DEV)
    _lanes_kernel[(1,)](torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(DEV),
                        torch.from_numpy(g.astype(np.uint32).view(np.int32)).to(DEV), out)
    got = (out.cpu().numpy().view(np.uint32).astype(np.int64)[:, :, None] >> (8 * np.arange(4))) & 0xFF  # [256, 2, 4]
    val = np.array([[2 * v, 2 * v + 1, 4 + 2 * v, 5 + 2 * v] for v in range(2)])                          # [2, 4]
    sign = 1 - 2 * ((g[:, None, None] >> (20 + val)) & 1)
    assert (got == 128 + sign * pts.reshape(256, 2, 4)).all()


@pytest.mark.parametrize("qtype", GRID, ids=IDS)
def test_points_fit_the_lanes(qtype):
    """grid_lanes needs every point byte < 128 (128 +- point in 1..255, no carry)."""
    table = FORMATS[qtype].table().view(torch.uint8)
    assert int(table.max()) < 128 and int(table.min()) > 0


@pytest.mark.parametrize("valid", [True, False], ids=["valid", "any_bytes"])
@pytest.mark.parametrize("qtype", GRID, ids=IDS)
def test_matches_float64_of_the_quantized_activations(qtype, valid):
    n, k = 48, 768                                     # 96 groups: 3 steps
    raw, w = _weight(qtype, n, k, seed=3, valid=valid)
    x = _x(3, k, seed=4)
    out = torch.full((3, n), float("nan"), device=DEV)
    qgemv_i8(x, w, out=out)
    ref, scale = reference64(x, raw, qtype, n, k)
    err = ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert torch.isfinite(out).all() and err < 2e-6, err


@pytest.mark.parametrize("qtype", FAMILIES, ids=lambda t: t.name)
def test_rows_are_invariant_to_width_and_column(qtype):
    raw, w = _weight(qtype, *ROWS_NK, seed=5)
    rows_keep_their_bits(qtype, raw, w)


@pytest.mark.parametrize("qtype", FAMILIES, ids=lambda t: t.name)
def test_epilogue_add_and_split_runs(qtype):
    raw, w = _weight(qtype, *EPILOGUE_NK, seed=7)
    epilogues_add_up(qtype, raw, w)


def test_producers_emit_the_grid_order():
    """The norm and the SiLU emit the (8, 2, 8) activations (four records a 32-block) as
    prepare_i8 makes them, beside Q4_K's order; the SiLU with a ragged last block."""
    grid = _weight(GRID[0], 8, 768, seed=1)[1]
    q4k = _weight(T.Q4_K, 8, 768, seed=1)[1]
    assert lane_order(grid) == ORDER
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(3, 768, generator=g).to(DEV), torch.randn(3, 768, generator=g).to(DEV)
    nw = (torch.rand(768, generator=g) + 0.5).to(DEV)
    h, q8 = add_rmsnorm_q8(x, y, nw, 1e-6, torch.float32, (lane_order(q4k), ORDER))
    for o, w in ((ORDER, grid), (lane_order(q4k), q4k)):
        for a, b in zip(q8[o], prepare_i8(h, w)):
            assert torch.equal(a, b), o
    F = 1024 + 256
    gu = (torch.randn(2, 2 * F, generator=g) * 3).to(DEV)
    a, q8 = silu_mul_q8(gu, torch.float32, (ORDER,))
    for p, r in zip(q8[ORDER], prepare_i8(a, _weight(GRID[0], 8, F, seed=2)[1])):
        assert torch.equal(p, r)


@pytest.mark.parametrize("qtype", GRID, ids=IDS)
def test_plan_picks_the_int8_gemv(qtype):
    """An "i8" plan runs them on qgemv_i8 at W = 1..16 (one bits family: exact) in the
    (8, 2, 8) lane order; beside a Q4_K weight two orders; "f32" keeps qmatmul."""
    _, w = _weight(qtype, 32, 256, seed=0)
    _, q4k = _weight(T.Q4_K, 32, 256, seed=0)
    assert has_dense_i8_form(qtype) and i8_codes(qtype) == (8, 0, 128, False, 3)
    assert QGEMV_I8.supports(w) is None and lane_order(w) == ORDER
    plan = plan_linear([w], "i8", max_w=16)
    assert plan.i8 == (True,)
    for W in range(1, 17):
        assert plan.at(W).kernels == (QGEMV_I8,) and plan.at(W).orders == (ORDER,)
    plan.check_exact()
    assert plan.families(0) == {"i8"}
    mixed = plan_linear([q4k, w], "i8", max_w=16)
    assert all(s.orders == (lane_order(q4k), ORDER) for s in mixed.steps)
    mixed.check_exact()
    assert plan_linear([w], "f32", max_w=16).at(1).kernels == (QMATMUL,)


def compile_sm90() -> None:
    """The GEMV with the grid lanes for sm_90 (child process): each type at the 8B's K
    (W = 1, one step ahead) and at K = 12288 (W = 4, split runs, PDL, two steps ahead),
    and the lanes kernel."""
    from alphallama.kernels.gemv import qgemv_i8 as mod
    from alphallama.kernels.formats.format import PLANES
    from alphallama.kernels.formats.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as build

    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8", torch.uint8: "*u8"}
    build(_lanes_kernel, ["*i32", "*i32", "*i32"], {})
    for qtype in GRID:
        for K, BW, pre, split in ((4096, 1, 1, 1), (12288, 4, 2, 2)):
            f = FORMATS[qtype]
            packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
            named = {n: f.table() if n == "qh" else packed.get(n, packed["qs"]) for n in PLANES}
            bits, hbits, bias, has_min, table = i8_codes(qtype)
            types = ["*i32", "*i32", "*fp32", *[ptr[p.dtype] for p in named.values()], "i32", "i32", "i32", "i32"]
            const = dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias,
                         HAS_MIN=has_min, BN=16, NT=32, BW=BW, PREFETCH=pre, DP4A=True, TABLE=table, XV=f.V)
            if split > 1:
                types.append("i32")
                const.update(PDL=True, SPLIT=split, **{f"RUN_{n.upper()}": 0 if n == "qh" else p.shape[-1] // split
                                                       for n, p in named.items()})
            build(mod._qgemv_i8_kernel, types, const, num_warps=8)


def test_compiles_for_sm90():
    run_in_child("test_qgemv_i8_grid")
