"""Does an inline-PTX mma.sync in Triton see the fragments we think (the qgemv_mma spike's
third form gave wrong sums)? One m16n8k32 s8 product of known A [16, 32], B [32, 8]:
(1) fragments loaded as a [128, 4] tensor with contiguous offsets (Triton: one row a thread,
4 elements in a thread in order); (2) the same registers as [128, 8] (two products) loaded
with non-contiguous offsets (one element a thread, repeated along dim 1, as in the spike).
Prints whether each equals A @ B."""
import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _mma(a, b):
    return tl.inline_asm_elementwise(
        "{ mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$12, $13, $14, $15}; }",
        "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [a, b, tl.zeros_like(a)], dtype=tl.int32, is_pure=True, pack=4)


@triton.jit
def contiguous(A, B, C):
    i = tl.arange(0, 128)[:, None]
    r = tl.arange(0, 4)[None, :]
    tl.store(C + i * 4 + r, _mma(tl.load(A + i * 4 + r), tl.load(B + i * 4 + r)))


@triton.jit
def strided(A, B, C):
    # element (i, c) of [128, 8] = register c % 4 of product c // 4, stored in memory as
    # [product][thread][register]: offsets not contiguous along c
    i = tl.arange(0, 128)[:, None]
    c = tl.arange(0, 8)[None, :]
    off = (c // 4) * 512 + i * 4 + c % 4
    tl.store(C + off, _mma(tl.load(A + off), tl.load(B + off)))


def fragments(A, B):
    """PTX ISA fragment layout of m16n8k32 (.s8): per lane a0..a3, b0, b1 as int32; c's (row, col)."""
    a = np.zeros((32, 4), np.int32)
    b = np.zeros((32, 4), np.int32)
    rc = np.zeros((32, 4, 2), np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, k0) in enumerate([(g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t), (g + 8, 16 + 4 * t)]):
            a[lane, r] = A[row, k0:k0 + 4].astype(np.int8).view(np.int32)[0]
        for r, k0 in enumerate([4 * t, 16 + 4 * t]):
            b[lane, r] = np.ascontiguousarray(B[k0:k0 + 4, g]).astype(np.int8).view(np.int32)[0]
        for r, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            rc[lane, r] = (row, col)
    return a, b, rc


def main():
    rng = np.random.default_rng(0)
    ok = {}
    for name in ("contiguous", "strided"):
        prods = 1 if name == "contiguous" else 2
        As = [rng.integers(-8, 16, (16, 32)) for _ in range(prods)]
        Bs = [rng.integers(-128, 128, (32, 8)) for _ in range(prods)]
        a = np.zeros((prods, 128, 4), np.int32)
        b = np.zeros((prods, 128, 4), np.int32)
        want = np.zeros((prods, 128, 4), np.int64)
        for p in range(prods):
            fa, fb, rc = fragments(As[p], Bs[p])
            ref = As[p] @ Bs[p]
            for w in range(4):
                a[p, 32 * w:32 * w + 32] = fa
                b[p, 32 * w:32 * w + 32] = fb
                want[p, 32 * w:32 * w + 32] = ref[rc[..., 0], rc[..., 1]]
        ta, tb = torch.tensor(a, device="cuda"), torch.tensor(b, device="cuda")
        tc = torch.zeros_like(ta)
        (contiguous if name == "contiguous" else strided)[(1,)](ta, tb, tc, num_warps=4)
        got = tc.cpu().numpy()
        ok[name] = bool((got == want).all())
        print(name, "equal A @ B:", ok[name], "| first lane got", got[0, 0], "want", want[0, 0], flush=True)
    return ok


if __name__ == "__main__":
    main()
