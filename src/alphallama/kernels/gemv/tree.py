"""One fixed pairwise tree for the sums whose order is part of a bit contract: adjacent pairs
first, ((y0 + y1) + (y2 + y3)) + ..., written out, where tl.sum's tree would follow each
kernel's layout (and the interpreter's np.sum its own). Used by the q8_K kernels' runs
(qgemv_mma, qgemv_q8k) and the expert contract's lanes (qmatvec_i8.lane_tree, moe_i8)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pairs(y):
    """[A, B, K] -> [A, B, K / 2]: adjacent pairs added (y[2i] + y[2i + 1])."""
    a, b = tl.split(tl.reshape(y, (y.shape[0], y.shape[1], y.shape[2] // 2, 2)))
    return a + b


@triton.jit
def tree_sum(y, K: tl.constexpr):
    """y [A, B, K] (K a power of two, at most 64) -> [A, B]: ((y0 + y1) + (y2 + y3)) + ..."""
    tl.static_assert(K > 0 and K <= 64 and (K & (K - 1)) == 0, "K: a power of two, at most 64")
    for i in tl.static_range(6):
        if K > (1 << i):
            y = _pairs(y)
    return tl.reshape(y, (y.shape[0], y.shape[1]))
