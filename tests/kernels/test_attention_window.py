"""Sliding-window decode attention (kernels/attention/decode.py, WINDOW > 0: gemma3's SWA
layers) and a custom q.k scale: against the float64 reference at lengths before, at and past
the window, with small tiles so the windowed span crosses split boundaries and a split-size
change; a row's bits the same alone and in rounds (its length and the window decide its
splits); the early loads the same bits, the q8 combine the same values; the sm_90 compile
of the windowed kernels."""
from __future__ import annotations

import pytest
import torch

from alphallama.kernels.attention import decode as A
from alphallama.kernels.attention.decode import (
    decode_attention,
    decode_attention_q8,
    decode_attention_ref,
)
from tests.kernels.sm90 import run_in_child

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TILES = A.Tiles(block_n=16, max_splits=4)     # the split size changes every 64 keys
WINDOW = 70                                   # past one change: spans of 1..70 keys
SCALE = 0.3


def _case(W: int, pos: int, cap: int, seed: int, H: int = 4, n_kv: int = 2, hd: int = 32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(W, H, hd, generator=g)
    kc = torch.randn(n_kv, cap, hd, generator=g).half()
    vc = torch.randn(n_kv, cap, hd, generator=g).half()
    return q, kc, vc


def _run(q, kc, vc, pos, window=WINDOW, **kw):
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    return decode_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), p, kc.shape[1], tiles=TILES, scale=SCALE,
                            window=window, **kw).cpu()


@pytest.mark.parametrize("pos", [0, 66, 130])
def test_window_against_float64(pos):
    """A round of 4 rows at pos..pos+3: rows shorter than the window (all keys), rows whose
    window starts past key 0, spans across the 64-key split-size change; the unwindowed
    reference differs (the control)."""
    q, kc, vc = _case(4, pos, pos + 9, pos)
    out = _run(q, kc, vc, pos)
    ref = decode_attention_ref(q.half().float(), kc, vc, pos, SCALE, WINDOW)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    if pos + 1 > WINDOW:
        assert (decode_attention_ref(q.half().float(), kc, vc, pos, SCALE) - ref).abs().max() > 0.05


def test_row_bits_depend_on_its_length_and_window_only():
    """The row at position 100 (its window: keys 31..100): alone, in a round of 3 at column 2
    and of 4 at column 0 with spare capacity; keys outside its window, other rows and the
    capacity change between runs: the same bits."""
    length, g = 101, torch.Generator().manual_seed(7)
    q_row = torch.randn(4, 32, generator=g)
    own = torch.randn(2, 2, length, 32, generator=g).half()
    got = []
    for W, col, spare in ((1, 0, 0), (3, 2, 5), (4, 0, 40)):
        pos = length - 1 - col
        q, kc, vc = _case(W, pos, pos + W + spare, W)
        lo = length - WINDOW
        kc[:, lo:length], vc[:, lo:length] = own[0, :, lo:], own[1, :, lo:]     # below lo: other junk each run
        q[col] = q_row
        got.append(_run(q, kc, vc, pos)[col])
    assert all(torch.equal(o, got[0]) for o in got[1:])


def test_early_and_q8_combine_keep_the_bits():
    """early=True (the old keys loaded before the PDL wait) gives the windowed rows the plain
    launch's bits. The combine that emits the o projection's int8 activations compiles
    without FP fusion (its int8 rounding is of unfused values), so where several splits are
    live its weighted sums differ from the plain combine's FMAs in the last bits (seen on
    the H100; the interpreter does not fuse); a layer's plan takes one of the two at every
    width, so no row's bits depend on W (tests/runtime/test_golden.py)."""
    pos = 90
    q, kc, vc = _case(3, pos, pos + 3, 11)
    plain = _run(q, kc, vc, pos)
    assert torch.equal(_run(q, kc, vc, pos, early=True), plain)
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    order = (32, 4, 4)                        # Q4_K's lane order (slot, V, bits)
    out, q8 = decode_attention_q8(q.to(DEV), kc.to(DEV), vc.to(DEV), p, torch.float32, (order,), tiles=TILES,
                                  scale=SCALE, window=WINDOW)
    torch.testing.assert_close(out.cpu(), plain, rtol=1e-6, atol=1e-7)
    assert order in q8


def compile_windowed() -> None:
    """The split and combine kernels with a window, for sm_90 (gemma3 27B's shape: 32 heads,
    16 kv heads, hd 128, window 1024)."""
    from tests.kernels.sm90 import compile_sm90
    blocks = {"BLOCK_N": A.BLOCK_N, "MAX_SPLITS": A.MAX_SPLITS, "WINDOW": 1024}
    ptrs = ["*fp32", "*fp16", "*fp16", "*fp32", "*fp32", "*fp32", "*i32"]
    compile_sm90(A._attn_split_kernel, [*ptrs, "fp32"] + ["i32"] * 9,
                 dict(N_HEADS=32, GROUP=2, G_PAD=16, HD=128, PDL=True, EARLY=True, **blocks),
                 num_warps=A.NUM_WARPS, fp_fusion=True, divisible_ints=True)
    compile_sm90(A._attn_combine_kernel, ["*fp32", "*fp32", "*fp32", "*bf16", "*i32"] + ["i32"] * 4,
                 dict(N_HEADS=32, HD=128, XP1=None, XS1=None, NQ=0, SLOT1=32, V1=4, BITS1=4, PDL=False, **blocks),
                 num_warps=A.COMBINE_WARPS, fp_fusion=True, divisible_ints=True)


def test_windowed_kernels_compile_for_sm90():
    run_in_child("test_attention_window", "compile_windowed", timeout=600)
