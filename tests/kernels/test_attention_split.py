"""Split-KV decode attention (kernels/attention/decode.py): the split rule, exact-mode bits of a
row against the round's width, the row's column, the cache's capacity and what lies past
the row's keys, at lengths that straddle the split size's changes; the float64 reference;
and the sm_90 compile of both kernels (offline: tests/kernels/sm90.py)."""
from __future__ import annotations

import pytest
import torch
import triton

from alphallama.kernels.attention import decode as A
from alphallama.kernels.attention.decode import decode_attention, decode_attention_ref, live_splits, split_size
from tests.kernels.sm90 import run_in_child

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STEP = A.BLOCK_N * A.MAX_SPLITS          # the split size grows by BLOCK_N every STEP keys


def test_split_rule():
    for n in range(1, 6 * STEP + 2):
        s, live = split_size(n), live_splits(n)
        assert s % A.BLOCK_N == 0 and live <= A.MAX_SPLITS
        # the smallest multiple of BLOCK_N that needs no more than MAX_SPLITS splits
        assert s == A.BLOCK_N or triton.cdiv(n, s - A.BLOCK_N) > A.MAX_SPLITS
        # enough live splits to spread a row over the GPU: all tiles up to STEP, then > MAX_SPLITS / 2
        assert live == triton.cdiv(n, A.BLOCK_N) if n <= STEP else live > A.MAX_SPLITS // 2
    assert live_splits(512) == 512 // A.BLOCK_N


@pytest.fixture
def small_splits():
    """Small tiles (decode_attention's `tiles`): the split size then changes every 64 keys,
    so a few cheap interpreter runs cross several changes. The invariance argument does not
    depend on the constants' values."""
    return A.Tiles(block_n=16, max_splits=4)


def _row_alone_and_in_rounds(length: int, H: int, n_kv: int, hd: int, rounds, out_dtype=torch.float32, tol=2e-3,
                             tiles: A.Tiles = A.TILES):
    """The row at position length-1 with fixed query and keys, in each round (W, the row's
    column, spare capacity past the round); every other row's query, every key past the
    row's own and the capacity change from round to round. -> the row's outputs."""
    g = torch.Generator().manual_seed(length)
    q_row = torch.randn(H, hd, generator=g)
    keys = torch.randn(2, n_kv, length, hd, generator=g).half()     # the row's own K, V
    got = []
    for W, col, spare in rounds:
        pos = length - 1 - col
        if pos < 0:
            continue
        cap = pos + W + spare
        kc = torch.randn(n_kv, cap, hd, generator=g).half()           # other rows' keys and junk past them
        vc = torch.randn(n_kv, cap, hd, generator=g).half()
        kc[:, :length], vc[:, :length] = keys[0], keys[1]
        q = torch.randn(W, H, hd, generator=g)
        q[col] = q_row
        out = decode_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), torch.tensor([pos], dtype=torch.int32, device=DEV),
                               cap, out_dtype, tiles=tiles).cpu()
        ref = decode_attention_ref(q.half().float(), kc, vc, pos)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        got.append(out[col])
    assert len(got) >= 2
    return got


def _changes(limit: int, tiles: A.Tiles) -> list[int]:
    return [n for n in range(2, limit) if split_size(n, tiles) != split_size(n - 1, tiles)]


@pytest.mark.parametrize("at", ["short", "change"])
def test_row_bits_depend_on_its_length_only(small_splits, at):
    if at == "short":     # one tile, one split, a split boundary
        lengths = [1, small_splits.block_n, small_splits.block_n + 1]
    else:                 # the last length before and the first after each of the first two changes
        lengths = [n + d for n in _changes(2 * small_splits.block_n * small_splits.max_splits + 2, small_splits)
                   for d in (-1, 0)]
        assert len(lengths) == 4
    for length in lengths:
        got = _row_alone_and_in_rounds(length, 4, 2, 32, ((1, 0, 0), (3, 2, 5), (4, 0, 300)), tiles=small_splits)
        for o in got[1:]:
            assert torch.equal(o, got[0]), length


def test_row_bits_at_the_real_split_change():
    """The module's own constants, a row on each side of the first change, with 8 query
    heads per kv head (the 30B-A3B ratio) and a bf16 output."""
    for length in (STEP, STEP + 1):
        a, b = _row_alone_and_in_rounds(length, 8, 1, 32, ((1, 0, 0), (2, length - STEP, 40)), torch.bfloat16, 1e-2)
        assert torch.equal(a, b), length


@pytest.mark.parametrize("pos", [20, 37, 47])
def test_old_keys_loaded_early_give_the_same_bits(small_splits, pos):
    """decode_attention(early=True): the first tile of each split loads its keys from before the
    round (positions < pos) early and the round's own rows after the wait (on the CPU
    there is no wait: this checks the merge). A round of 3 rows whose tiles straddle pos:
    the same bits as loading them all in the loop."""
    g = torch.Generator().manual_seed(pos)
    W, H, n_kv, hd = 3, 4, 2, 32
    q = torch.randn(W, H, hd, generator=g).to(DEV)
    kc = torch.randn(n_kv, pos + W + 5, hd, generator=g).half().to(DEV)
    vc = torch.randn(n_kv, pos + W + 5, hd, generator=g).half().to(DEV)
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    outs = []
    for early in (False, True):
        outs.append(decode_attention(q, kc, vc, p, kc.shape[1], early=early, tiles=small_splits))
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1].cpu(), decode_attention_ref(q.half().float().cpu(), kc.cpu(), vc.cpu(), pos),
                               atol=2e-3, rtol=2e-3)


def combine_q8_sm90() -> tuple[list[str], dict]:
    """(types, constexprs) of the combine with its q8 output (one Q4_K lane order) at the
    Qwen3-8B shape, bf16 out, for sm90.compile_sm90: what the q8 and PDL tests compile."""
    return (["*fp32", "*fp32", "*fp32", "*bf16", "*i32"] + ["i32"] * 4 + ["*i8", "*i32"],
            dict(N_HEADS=32, HD=128, BLOCK_N=A.BLOCK_N, MAX_SPLITS=A.MAX_SPLITS, NQ=1, SLOT1=32, V1=4, BITS1=4))


def compile_all() -> None:
    """Both kernels for sm_90 at the decode shapes (fp32 queries, bf16 or fp32 output)."""
    from tests.kernels.sm90 import compile_sm90

    def build(kernel, types, const):
        # as the JIT specializes them at these shapes: 16-byte aligned pointers, strides multiples of 16
        # (without them it compiles 2-byte K/V loads: not the kernel the GPU runs); launched without
        # enable_fp_fusion=False (no q8 output), so compiled with fusion on
        compile_sm90(kernel, types, const, num_warps=A.NUM_WARPS, fp_fusion=True, divisible_ints=True)
    blocks = dict(BLOCK_N=A.BLOCK_N, MAX_SPLITS=A.MAX_SPLITS)
    for H, n_kv, hd, out in ((32, 8, 128, "*bf16"), (32, 4, 128, "*fp32")):   # Qwen3-8B, Qwen3-30B-A3B
        group = H // n_kv
        ptrs = ["*fp32", "*fp16", "*fp16", "*fp32", "*fp32", "*fp32", "*i32"]     # Q K V O M L pos
        build(A._attn_split_kernel, [*ptrs, "fp32"] + ["i32"] * 9,
              dict(N_HEADS=H, GROUP=group, G_PAD=max(16, group), HD=hd, PDL=False, **blocks))
        # early with PDL: the old keys' loads come before the wait
        ptx = compile_sm90(A._attn_split_kernel, [*ptrs, "fp32"] + ["i32"] * 9,
                           dict(N_HEADS=H, GROUP=group, G_PAD=max(16, group), HD=hd, PDL=True, EARLY=True, **blocks),
                           num_warps=A.NUM_WARPS, fp_fusion=True, divisible_ints=True).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        assert body[:body.index("griddepcontrol.wait")].count("ld.global") >= 3     # pos, then K and V
        build(A._attn_combine_kernel, ["*fp32", "*fp32", "*fp32", out, "*i32"] + ["i32"] * 4,
              dict(N_HEADS=H, HD=hd, XP1=None, XS1=None, NQ=0, SLOT1=32, V1=4, BITS1=4, PDL=False, **blocks))   # no q8 output


def test_kernels_compile_for_sm90():
    run_in_child("test_attention_split", "compile_all", timeout=600)   # this session's kernels are interpreted
