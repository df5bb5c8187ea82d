"""qgemv_i8's int8 form of MXFP4 (the IQ4 lookup on the doubled E2M1 levels), Q2_K (2-bit
codes spread into Q8_0's 8-bit lanes, an affine slot) and TQ2_0 / TQ1_0 (the same lanes, BIAS
1) (kernels/gemv/qgemv_i8_table.py):

  lanes     MXFP4's lookup lanes (biased doubled E2M1 levels of fields 0, 2, 4, 6 and 1, 3, 5,
            7 of a qs word) from the kernel's path and from its asm text run by
            test_qgemv_i8_table's PTX model, against gguf's 16 levels; crumb_lanes's bytes
            (Q2_K's and TQ's codes) against numpy
  float64   the GEMV against a float64 product of the same int8 activations with gguf's
            dequantized weights (random valid blocks, and random bytes with sane scales;
            ragged rows: a masked last step)
  rows      every row of W = 1 / 3 / 8 bit-identical to that row alone, whatever its column
  epilogue  the residual add and the split runs, as the plan uses them
  plan      the registry's plan puts them on qgemv_i8 at W = 1..16 in the lane order of the
            format they share it with, exact
CPU: the Triton interpreter; on a GPU the same tests run compiled (the asm)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels.formats.fmt_misc import E2M1_WORDS
from alphallama.kernels.formats.qweight import QuantWeight
from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8
from alphallama.kernels.gemv.qgemv_i8_table import (ACT_ORDER, MX_ASM, TABLE_MX, i8_codes,
                                                    table_lanes)
from alphallama.kernels.gemv.qmatvec_i8 import lane_order
from tests.kernels.i8checks import EPILOGUE_NK, ROWS_NK, epilogues_add_up, plan_shares_the_order, rows_keep_their_bits
from tests.kernels.sm90 import run_in_child
from tests.kernels.test_gpu_quant_types_iq import valid_raw
from tests.kernels.test_qgemv_i8 import reference64
from tests.kernels.test_qgemv_i8_table import _words, run_ptx
from tests.kernels.test_qmatmul import random_raw
from tests.kernels.test_qmatvec_i8 import _x

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = [T.MXFP4, T.Q2_K, T.TQ2_0, T.TQ1_0]
IDS = [t.name for t in TYPES]
# the row and epilogue tests take MXFP4 (a lookup) and Q2_K (crumbs; TQ2_0 / TQ1_0 share its lanes)
FAMILIES = [T.MXFP4, T.Q2_K]
RAGGED_K = {T.MXFP4: 288, T.Q2_K: 768, T.TQ2_0: 768, T.TQ1_0: 768}     # 9, 48 slots: a masked last step
SAME_ORDER = {T.MXFP4: T.Q4_K, T.Q2_K: T.Q8_0, T.TQ2_0: T.Q8_0, T.TQ1_0: T.Q8_0}     # whose activations they read
MX_LEVELS = np.array(gguf_quants.MXFP4.kvalues, dtype=np.int64)
E_RANGE = (112, 141)                       # E8M0 bytes of the any-bytes weights: d = 2^-16 .. 2^12


def _raw(qtype: T, n: int, k: int, seed: int, valid: bool = True) -> np.ndarray:
    """Random valid blocks (the CPU side's random_blocks), or random bytes with sane scales
    (fp16 fields small: random_raw; MXFP4's E8M0 byte in E_RANGE)."""
    if valid:
        return valid_raw(qtype, n, k, seed)
    raw = random_raw(qtype, n, k, seed)
    if qtype == T.MXFP4:
        e = np.random.default_rng(seed).integers(*E_RANGE, size=n * k // 32)
        raw.reshape(-1, 17)[:, 0] = e.astype(np.uint8)
    return raw


def _weight(qtype: T, n: int, k: int, seed: int, valid: bool = True):
    raw = _raw(qtype, n, k, seed, valid)
    return raw, QuantWeight.from_raw(raw, qtype, (n, k), DEV)


@triton.jit
def _mx_lanes_kernel(words, lo_out, hi_out, one, DP4A: tl.constexpr):
    i = tl.arange(0, 256)
    w = tl.reshape(tl.load(words + i), (256, 1, 1))
    lo, hi = table_lanes(w, w, one, 4, DP4A)
    tl.store(lo_out + i, tl.reshape(lo, (256,)))
    tl.store(hi_out + i, tl.reshape(hi, (256,)))


def mx_lanes(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """byte j of lo the doubled E2M1 level + 128 of field 2j, of hi of field 2j + 1."""
    f = (words[:, None] >> (4 * np.arange(8))) & 0xF                    # [n, 8]
    b = MX_LEVELS[f] + 128
    return (sum(b[:, 2 * j] << (8 * j) for j in range(4)), sum(b[:, 2 * j + 1] << (8 * j) for j in range(4)))


def test_mxfp4_lanes_are_the_levels():
    """The kernel's lanes (the asm compiled on a GPU, the integer selects in the interpreter)
    and the asm text run by the PTX model: gguf's doubled E2M1 levels + 128 in unpack_lanes's
    byte order, every code in every field and random words."""
    assert TABLE_MX == 4 and i8_codes(T.MXFP4) == (4, 0, 128, False, TABLE_MX)
    words = _words(256, seed=1)
    lo_ref, hi_ref = mx_lanes(words)
    w = torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(DEV)
    lo, hi = torch.empty_like(w), torch.empty_like(w)
    _mx_lanes_kernel[(1,)](w, lo, hi, 1, DP4A=w.is_cuda)
    assert (lo.cpu().numpy().view(np.uint32) == lo_ref).all()
    assert (hi.cpu().numpy().view(np.uint32) == hi_ref).all()
    got = np.array([run_ptx(MX_ASM, int(x), E2M1_WORDS) for x in words], dtype=np.int64)   # [n, 2]
    assert (got[:, 0] == lo_ref).all() and (got[:, 1] == hi_ref).all()


@triton.jit
def _crumb_lanes_kernel(words, out, one, DP4A: tl.constexpr):
    i = tl.arange(0, 256)
    w = tl.reshape(tl.load(words + i), (256, 1, 1))
    lo, hi = table_lanes(w, w, one, 2, DP4A, 0)
    tl.store(out + 4 * i[:, None] + tl.arange(0, 4)[None, :], tl.reshape(lo, (256, 4)))


def test_crumb_lanes_are_the_codes_in_q8_0_order():
    """2-bit codes (Q2_K's and TQ's, TABLE 2 without hmask bits): byte j of word v is code
    k = (j // 2) 8 + 2 v + j % 2 of the qs word (field k at bits 2k), Q8_0's lane order."""
    assert i8_codes(T.Q2_K) == (8, 0, 0, True, 2) and ACT_ORDER[T.Q2_K] == (16, 4, 8)
    for tq in (T.TQ2_0, T.TQ1_0):
        assert i8_codes(tq) == (8, 0, 1, False, 2) and ACT_ORDER[tq] == (16, 4, 8)
    words = np.random.default_rng(3).integers(0, 1 << 32, 256, dtype=np.int64)
    out = torch.empty(256, 4, dtype=torch.int32, device=DEV)
    w = torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(DEV)
    _crumb_lanes_kernel[(1,)](w, out, 1, DP4A=w.is_cuda)
    got = (out.cpu().numpy().view(np.uint32).astype(np.int64)[:, :, None] >> (8 * np.arange(4))) & 0xFF  # [256, 4, 4]
    v, j = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
    k = (j // 2) * 8 + 2 * v + j % 2                                                   # [4, 4]
    assert (got == (words[:, None, None] >> (2 * k)) & 3).all()


@pytest.mark.parametrize("valid", [True, False], ids=["valid", "any_bytes"])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_matches_float64_of_the_quantized_activations(qtype, valid):
    n, k = 48, RAGGED_K[qtype]
    raw, w = _weight(qtype, n, k, seed=3, valid=valid)
    x = _x(3, k, seed=4)
    out = torch.full((3, n), float("nan"), device=DEV)
    qgemv_i8(x, w, out=out)
    ref, scale = reference64(x, raw, qtype, n, k)
    err = ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert torch.isfinite(out).all() and err < 2e-6, err


@pytest.mark.parametrize("qtype", FAMILIES, ids=lambda t: t.name)
def test_rows_are_invariant_to_width_and_column(qtype):
    raw, w = _weight(qtype, *ROWS_NK, seed=5, valid=False)
    rows_keep_their_bits(qtype, raw, w)


@pytest.mark.parametrize("qtype", FAMILIES, ids=lambda t: t.name)
def test_epilogue_add_and_split_runs(qtype):
    raw, w = _weight(qtype, *EPILOGUE_NK, seed=7, valid=False)
    epilogues_add_up(qtype, raw, w)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_plan_picks_the_int8_gemv(qtype):
    """Each reads the lane order of SAME_ORDER's format."""
    plan_shares_the_order(qtype, _weight(qtype, 32, 256, seed=0)[1], _weight(SAME_ORDER[qtype], 32, 256, seed=0)[1])


def compile_sm90() -> None:
    """The GEMV for sm_90 (child process): each type at the 8B's K (W = 1, one step ahead)
    and at K = 12288 (W = 4, split runs, PDL, two steps ahead); the lanes kernels."""
    from alphallama.kernels.gemv import qgemv_i8 as mod
    from alphallama.kernels.formats.format import PLANES
    from alphallama.kernels.formats.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as build

    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8", torch.uint8: "*u8"}
    build(_mx_lanes_kernel, ["*i32", "*i32", "*i32", "i32"], dict(DP4A=True))
    build(_crumb_lanes_kernel, ["*i32", "*i32", "i32"], dict(DP4A=True))
    for qtype in TYPES:
        for K, BW, pre, split in ((4096, 1, 1, 1), (12288, 4, 2, 2)):
            f = FORMATS[qtype]
            packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
            named = {n: packed.get(n, packed["qs"]) for n in PLANES}          # absent planes: qs (plane_args)
            bits, hbits, bias, has_min, table = i8_codes(qtype)
            _, xv, xbits = lane_order(QuantWeight.from_raw(valid_raw(qtype, 1, K, 0), qtype, (1, K), "cpu"))
            types = ["*i32", "*i32", "*fp32", *[ptr[p.dtype] for p in named.values()], "i32", "i32", "i32", "i32"]
            const = dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias,
                         HAS_MIN=has_min, BN=16, NT=32, BW=BW, PREFETCH=pre, DP4A=True, TABLE=table,
                         XV=2 * xv if xbits == 4 else xv)
            if split > 1:
                types.append("i32")
                const.update(PDL=True, SPLIT=split, **{f"RUN_{n.upper()}": p.shape[-1] // split
                                                       for n, p in named.items()})
            build(mod._qgemv_i8_kernel, types, const, num_warps=8)


def test_compiles_for_sm90():
    run_in_child("test_qgemv_i8_more")
