"""qgemv_i8's int8 form of IQ4_NL, IQ4_XS (a level lookup) and Q3_K (3-bit codes spread into
8-bit lanes) (kernels/gemv/qgemv_i8_table.py):

  lanes     the lookup's lanes (biased levels of fields 0, 2, 4, 6 and 1, 3, 5, 7 of a qs
            word) from the kernel's path (interpreter: integer selects; GPU: the prmt asm)
            and from the asm text run by a small PTX model, against gguf's 16 levels
  float64   the GEMV against a float64 product of the same int8 activations with gguf's
            dequantized weights (random valid blocks; ragged rows: a masked last step)
  rows      every row of W = 1 / 3 / 8 bit-identical to that row alone, whatever its column
  epilogue  the residual add and the split runs, as the plan uses them
  plan      the registry's plan puts them on qgemv_i8 at W = 1..16, in Q4_K's (IQ4) or Q8_0's
            (Q3_K) lane order, exact
CPU: the Triton interpreter; on a GPU the same tests run compiled (the asm)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels.formats.fmt_iq4 import LEVEL_WORDS
from alphallama.kernels.formats.qweight import QuantWeight
from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8
from alphallama.kernels.gemv.qgemv_i8_table import ACT_ORDER, IQ4_ASM, i8_codes, table_lanes
from tests.kernels.i8checks import EPILOGUE_NK, ROWS_NK, epilogues_add_up, plan_shares_the_order, rows_keep_their_bits
from tests.kernels.sm90 import run_in_child
from tests.kernels.test_qgemv_i8 import reference64
from tests.kernels.test_qmatmul import random_raw
from tests.kernels.test_qmatvec_i8 import _x

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TABLE = [T.IQ4_NL, T.IQ4_XS, T.Q3_K]
IDS = [t.name for t in TABLE]
RAGGED_K = {T.IQ4_NL: 288, T.IQ4_XS: 768, T.Q3_K: 768}    # 9, 24 and 48 slots: a masked last step
SAME_ORDER = {T.IQ4_NL: T.Q4_K, T.IQ4_XS: T.Q4_K, T.Q3_K: T.Q8_0}   # whose activations they read
LEVELS = np.array(gguf_quants.IQ4_NL.kvalues, dtype=np.int64)


def _weight(qtype: T, n: int, k: int, seed: int):
    raw = random_raw(qtype, n, k, seed)
    return raw, QuantWeight.from_raw(raw, qtype, (n, k), DEV)


def expected_lanes(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lanes the kernel must make of qs words (int64 [n]): byte j of lo the level + 128
    of field 2j, of hi of field 2j + 1."""
    f = (words[:, None] >> (4 * np.arange(8))) & 0xF                    # [n, 8]
    b = LEVELS[f] + 128
    lo = sum(b[:, 2 * j] << (8 * j) for j in range(4))
    hi = sum(b[:, 2 * j + 1] << (8 * j) for j in range(4))
    return lo, hi


def _prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 (default mode): byte n of the result is byte (c >> 4n) & 7 of the pool
    b:a, or that byte's sign replicated where bit 3 of the selector is set."""
    pool = (b << 32) | a
    out = 0
    for n in range(4):
        sel = (c >> (4 * n)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * n)
    return out


def run_ptx(asm: str, x: int, table: tuple[int, ...] = LEVEL_WORDS) -> tuple[int, int]:
    """The lookup asm's instructions (and, shr, or, prmt on .b32) run on word x, with the
    table words table_lanes passes in registers (words 0 and 2 of `table`): ($0, $1)."""
    regs = {"$2": x & 0xFFFFFFFF, "$3": table[0] & 0xFFFFFFFF, "$4": table[2] & 0xFFFFFFFF}

    def val(tok: str) -> int:
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    for line in asm.splitlines():
        m = re.match(r"(\w+)\.(\w+) (.+);", line.strip())
        if m is None or m.group(1) == "reg":
            continue
        op, args = m.group(1), [t.strip() for t in m.group(3).split(",")]
        v = [val(t) for t in args[1:]]
        regs[args[0]] = {"and": lambda: v[0] & v[1], "or": lambda: v[0] | v[1], "shr": lambda: v[0] >> v[1],
                         "prmt": lambda: _prmt(*v)}[op]() & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


@triton.jit
def _lanes_kernel(words, lo_out, hi_out, one, DP4A: tl.constexpr):
    i = tl.arange(0, 256)
    w = tl.reshape(tl.load(words + i), (256, 1, 1))
    lo, hi = table_lanes(w, w, one, 1, DP4A)
    tl.store(lo_out + i, tl.reshape(lo, (256,)))
    tl.store(hi_out + i, tl.reshape(hi, (256,)))


def _words(n: int, seed: int) -> np.ndarray:
    """n qs words: every code in every field (the first 16), then random ones: int64 in 0..2**32-1."""
    rng = np.random.default_rng(seed)
    every = sum(((np.arange(16) + f) % 16) << (4 * f) for f in range(8))     # [16]
    return np.concatenate([every, rng.integers(0, 1 << 32, n - 16, dtype=np.int64)])


def test_lookup_lanes_are_the_levels():
    """The kernel's lanes (the asm compiled on a GPU, the integer selects in the
    interpreter) are gguf's levels + 128 in unpack_lanes's byte order."""
    words = _words(256, seed=1)
    lo_ref, hi_ref = expected_lanes(words)
    w = torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(DEV)
    lo, hi = torch.empty_like(w), torch.empty_like(w)
    _lanes_kernel[(1,)](w, lo, hi, 1, DP4A=w.is_cuda)
    assert (lo.cpu().numpy().view(np.uint32) == lo_ref).all()
    assert (hi.cpu().numpy().view(np.uint32) == hi_ref).all()


def test_asm_text_gives_the_same_lanes():
    """The asm itself (on a machine without a GPU too): each instruction run by a model of
    PTX's and / shr / or / prmt on every code in every field and random words."""
    words = _words(400, seed=2)
    lo_ref, hi_ref = expected_lanes(words)
    got = np.array([run_ptx(IQ4_ASM, int(x)) for x in words], dtype=np.int64)     # [n, 2]
    assert (got[:, 0] == lo_ref).all() and (got[:, 1] == hi_ref).all()
    assert len(re.findall(r"^prmt", IQ4_ASM, re.M)) == 8


@pytest.mark.parametrize("qtype", TABLE, ids=IDS)
def test_matches_float64_of_the_quantized_activations(qtype):
    n, k = 48, RAGGED_K[qtype]
    raw, w = _weight(qtype, n, k, seed=3)
    x = _x(3, k, seed=4)
    out = torch.full((3, n), float("nan"), device=DEV)
    qgemv_i8(x, w, out=out)
    ref, scale = reference64(x, raw, qtype, n, k)
    err = ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert torch.isfinite(out).all() and err < 2e-6, err


@pytest.mark.parametrize("qtype", [T.IQ4_XS, T.Q3_K], ids=["IQ4_XS", "Q3_K"])   # a lookup and a crumb family
def test_rows_are_invariant_to_width_and_column(qtype):
    raw, w = _weight(qtype, *ROWS_NK, seed=5)
    rows_keep_their_bits(qtype, raw, w)


@pytest.mark.parametrize("qtype", [T.IQ4_XS, T.Q3_K], ids=["IQ4_XS", "Q3_K"])
def test_epilogue_add_and_split_runs(qtype):
    raw, w = _weight(qtype, *EPILOGUE_NK, seed=7)
    epilogues_add_up(qtype, raw, w)


@pytest.mark.parametrize("qtype", TABLE, ids=IDS)
def test_plan_picks_the_int8_gemv(qtype):
    """IQ4 reads Q4_K's lane order, Q3_K Q8_0's."""
    plan_shares_the_order(qtype, _weight(qtype, 32, 256, seed=0)[1], _weight(SAME_ORDER[qtype], 32, 256, seed=0)[1])


def compile_sm90() -> None:
    """The GEMV with the lookup asm for sm_90 (child process): IQ4_XS at the 8B's K (W = 1
    and 4, two steps in flight), IQ4_NL (split runs, PDL), Q3_K and the lanes kernel."""
    from alphallama.kernels.gemv import qgemv_i8 as mod
    from alphallama.kernels.formats.format import PLANES
    from alphallama.kernels.formats.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as build

    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8"}
    build(_lanes_kernel, ["*i32", "*i32", "*i32", "i32"], dict(DP4A=True))
    for qtype, K, BN, BW, NT, pre, split, warps in ((T.IQ4_XS, 4096, 16, 1, 32, 1, 1, 8),
                                                    (T.IQ4_XS, 12288, 16, 4, 32, 2, 1, 8),
                                                    (T.IQ4_NL, 12288, 16, 4, 32, 1, 2, 8),
                                                    (T.Q3_K, 4096, 16, 1, 32, 1, 1, 8),
                                                    (T.Q3_K, 12288, 16, 4, 32, 1, 2, 8)):
        f = FORMATS[qtype]
        packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
        named = {n: packed.get(n, packed["qs"]) for n in PLANES}          # absent planes: qs (plane_args)
        bits, hbits, bias, has_min, table = i8_codes(qtype)
        types = ["*i32", "*i32", "*fp32", *[ptr[p.dtype] for p in named.values()], "i32", "i32", "i32", "i32"]
        _, xv, xbits = ACT_ORDER.get(qtype, (f.slot, f.V, bits))
        const = dict(n_slots=K // f.slot, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias,
                     HAS_MIN=has_min, BN=BN, NT=NT, BW=BW, PREFETCH=pre, DP4A=True, TABLE=table,
                     XV=2 * xv if xbits == 4 else xv)
        if split > 1:
            types.append("i32")
            const.update(PDL=True, SPLIT=split, **{f"RUN_{n.upper()}": p.shape[-1] // split for n, p in named.items()})
        build(mod._qgemv_i8_kernel, types, const, num_warps=warps)


def test_compiles_for_sm90():
    run_in_child("test_qgemv_i8_table")
