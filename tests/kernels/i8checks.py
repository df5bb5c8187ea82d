"""The checks every int8 form of qgemv_i8 passes, whatever its lanes (the table, grid and
crumb types: test_qgemv_i8_table.py, _grid.py, _more.py): a row's bits at any width and
column, the epilogues, the plan. Each test file makes its weights (raw bytes, QuantWeight)
its own way and hands them in."""
from __future__ import annotations

import torch

from alphallama.kernels.gemv.qgemv_i8 import GemvTile, gemv_tile, qgemv_i8
from alphallama.kernels.gemv.qgemv_i8_table import has_dense_i8_form, i8_codes
from alphallama.kernels.gemv.qmatvec_i8 import lane_order
from alphallama.kernels.gemv.registry import QGEMV_I8, QMATMUL, plan_linear
from tests.kernels.test_qgemv_i8 import reference64
from tests.kernels.test_qmatvec_i8 import DEV, _x, assert_same_bits

ROWS_NK = (20, 512)          # 20: a masked weight-row tile
EPILOGUE_NK = (24, 1024)


def rows_keep_their_bits(qtype, raw, w) -> None:
    """Each row of W = 1 / 3 / 8 has the bits of that row alone, at another column too
    (rotated rows), with the interpreter's tile and with the GPU's; w is [20, 512]."""
    n, k = ROWS_NK
    x = _x(8, k, seed=6)
    alone = torch.stack([qgemv_i8(x[m:m + 1], w)[0] for m in range(8)])
    for W in (1, 3, 8):
        for shift in (0, 5):
            rows = torch.roll(torch.arange(8), shift)[:W]
            assert_same_bits(qgemv_i8(x[rows], w), alone[rows], f"{qtype.name} W={W} shift={shift}")
    ref, scale = reference64(x, raw, qtype, n, k)
    assert ((alone.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item() < 2e-6
    t = gemv_tile(w)
    one = torch.stack([qgemv_i8(x[m:m + 1], w, tile=t)[0] for m in range(8)])
    for W in (3, 8):
        rows = torch.roll(torch.arange(8), 2)[:W]
        assert_same_bits(qgemv_i8(x[rows], w, tile=t), one[rows], f"{qtype.name} W={W} {t}")


def epilogues_add_up(qtype, raw, w) -> None:
    """out += x @ w^T is the fp32 add of the plain product (bit for bit), and split runs'
    partials add up to the float64 product, each row's the same as that row alone; w is [24, 1024]."""
    n, k = EPILOGUE_NK
    x = _x(3, k, seed=8)
    base = torch.randn(3, n, generator=torch.Generator().manual_seed(9)).to(DEV)
    plain = qgemv_i8(x, w)
    out = base.clone()
    qgemv_i8(x, w, out=out, accumulate=True)
    assert_same_bits(out, base + plain, "accumulate")
    t = GemvTile(8, 8, 4, split=2)
    part = qgemv_i8(x, w, tile=t)                                        # [W, 2, N]
    ref, scale = reference64(x, raw, qtype, n, k)
    assert (((part[:, 0] + part[:, 1]).cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item() < 2e-6
    assert_same_bits(qgemv_i8(x[2:3], w, tile=t)[0], part[2], "split row 2 alone")


def plan_shares_the_order(qtype, w, other) -> None:
    """An "i8" plan runs w on qgemv_i8 at W = 1..16 (one bits family: exact), reading the lane
    order of `other`'s format, so a Linear with both quantizes once; "f32" keeps qmatmul."""
    assert has_dense_i8_form(qtype) and i8_codes(qtype)[4] > 0
    assert QGEMV_I8.supports(w) is None and lane_order(w) == lane_order(other)
    plan = plan_linear([w], "i8", max_w=16)
    assert plan.i8 == (True,)
    for W in range(1, 17):
        assert plan.at(W).kernels == (QGEMV_I8,) and plan.at(W).orders == (lane_order(other),)
    plan.check_exact()
    assert plan.families(0) == {"i8"}
    mixed = plan_linear([other, w], "i8", max_w=16)
    assert all(s.orders == (lane_order(other),) for s in mixed.steps)
    mixed.check_exact()
    assert plan_linear([w], "f32", max_w=16).at(1).kernels == (QMATMUL,)
