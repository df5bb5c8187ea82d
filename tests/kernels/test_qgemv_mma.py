"""qgemv_mma_k (the Q4_K decode GEMV with its integer sums on the tensor cores, on q8_K
activations) against a float64 product of the same quantized activations with gguf's
dequantized weights; rows bit-identical whatever W and their column; the fragment-order
planes and activations against their index formula; and, compiled for sm_90, the layout
the inline PTX relies on (every operand of the mma one row a thread). CPU: the interpreter
with the mma emulated over the same fragments; on a GPU the same tests run the PTX."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.gemv.q8k_act import prepare_q8k  # noqa: E402
from alphallama.kernels.gemv.qgemv_mma import COLS, mma_planes, qgemv_mma_k, supports_mma  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_qmatmul import gguf_dequant  # noqa: E402
from tests.kernels.test_qmatvec_i8 import _weight, _x  # noqa: E402


def q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [W, K] int32, dx [W, K/256]) with expert_q8's rounding rule, one scale a super-block."""
    from alphallama.kernels.moe.expert_q8 import rne
    W, K = x.shape
    xb = x.cpu().float().reshape(W, K // 256, 256)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)), 0.0)
    return rne(xb * inv[..., None]).to(torch.int32).reshape(W, K), amax / torch.tensor(127.0)


def q8k_reference64(x: torch.Tensor, raw, qtype, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [W, N] of q8k(x) @ w^T, the bound scale |q8k(x)| @ |w|^T)."""
    q, dx = q8k(x)
    xd = (q.double().reshape(x.shape[0], -1, 256) * dx.double()[..., None]).reshape(x.shape[0], k)
    wd = gguf_dequant(raw, qtype).double().reshape(n, k)
    return xd @ wd.T, xd.abs() @ wd.abs().T


def _rel_err(out, ref, scale) -> float:
    return ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()


def mma_x(xp: torch.Tensor, n_slots: int) -> torch.Tensor:
    """prepare_i8's words [W, n_slots * 8] -> fragment order [W/8, n_slots/2, 32 lanes, 2 slots,
    2 (lo, hi)]: lane 4g + t holds column g's lo and hi word t (columns past W: zero). The
    reference for emit_q8k's order of words."""
    W = xp.shape[0]
    n_cb = -(-W // COLS)
    x = torch.zeros((n_cb * COLS, n_slots * 8), dtype=torch.int32, device=xp.device)
    x[:W] = xp
    x = x.reshape(n_cb, 8, n_slots // 2, 2, 2, 4)                      # [cb, g, step, j, e, t]
    return x.permute(0, 2, 1, 5, 3, 4).contiguous()                    # [cb, step, g, t, j, e]


def test_fragment_planes_follow_the_mma_layout():
    """Lane 4g + t of group G, step s holds qs word t of rows 16G + g and 16G + g + 8 of
    slots 2s and 2s + 1; x: column g's lo and hi words t (columns past W zero)."""
    _, w = _weight(T.Q4_K, 32, 512, seed=7)
    qs = w.planes["qs"].reshape(32, w.n_slots, 4)                      # [N, slot, word]
    qf = mma_planes(w).reshape(2, w.n_slots // 2, 32, 2, 2)            # [G, step, lane, j, h]
    for G, s, lane, j, h in [(0, 0, 0, 0, 0), (1, 3, 29, 1, 1), (0, 7, 6, 1, 0), (1, 0, 31, 0, 1)]:
        g, t = divmod(lane, 4)
        assert qf[G, s, lane, j, h] == qs[16 * G + g + 8 * h, 2 * s + j, t]
    x = _x(3, 512, seed=8)
    xp, _ = prepare_i8(x, w)
    xw = xp.reshape(3, w.n_slots, 8)                                   # [W, slot, word e*4 + t]
    xf = mma_x(xp, w.n_slots).reshape(1, w.n_slots // 2, 32, 2, 2)    # [cb, step, lane, j, e]
    for s, lane, j, e in [(0, 0, 0, 0), (5, 9, 1, 1), (2, 11, 0, 1)]:
        g, t = divmod(lane, 4)
        assert xf[0, s, lane, j, e] == xw[g, 2 * s + j, 4 * e + t]
    assert not xf[0, :, 12:].any()                                     # columns 3..7: padding


@pytest.mark.parametrize("warps,runs,ahead", [(2, 1, True), (2, 2, True), (4, 4, False), (4, 2, True)])
def test_q8k_variant_matches_float64_and_keeps_rows_apart(warps, runs, ahead):
    """qgemv_mma_k: activations with one scale a 256-value super-block (the slots folded in
    integers, the float work once a super-block) against float64 of those activations; K cut
    in runs over a row group's warps (48 rows at 4 warps in 2 runs: 1.5 programs)."""
    n, k, W = 48, 1024, 10
    raw, w = _weight(T.Q4_K, n, k, seed=3)
    x = _x(W, k, seed=4)
    out = qgemv_mma_k(x, w, warps=warps, runs=runs, ahead=ahead)
    assert _rel_err(out, *q8k_reference64(x, raw, T.Q4_K, n, k)) < 2e-6
    alone = torch.cat([qgemv_mma_k(x[m:m + 1], w, warps=warps, runs=runs, ahead=ahead) for m in range(W)])
    assert torch.equal(out, alone)
    rolled = qgemv_mma_k(torch.roll(x, 3, dims=0), w, warps=warps, runs=runs, ahead=ahead)
    assert torch.equal(torch.roll(out, 3, dims=0), rolled)
    _, xs, dx, _ = prepare_q8k(x, w.n_slots)
    assert xs.shape == (W, w.n_slots) and dx.shape == (W, k // 256)


@pytest.mark.parametrize("warps,runs,ahead", [(2, 1, True), (4, 2, False)])
def test_two_row_groups_a_warp_give_the_same_bits(warps, runs, ahead):
    """groups=2: a warp's two 16-row groups share each activation fetch; every row's
    operations are groups=1's, so its bits are too (80 rows: 5 groups, so a program's second
    group falls past N and is not stored), at W = 10 (two column blocks) and W = 1."""
    n, k = 80, 1024
    raw, w = _weight(T.Q4_K, n, k, seed=5)
    for W in (10, 1):
        x = _x(W, k, seed=6 + W)
        two = qgemv_mma_k(x, w, warps=warps, runs=runs, ahead=ahead, groups=2)
        assert torch.equal(two, qgemv_mma_k(x, w, warps=warps, runs=runs, ahead=ahead, groups=1))
        assert _rel_err(two, *q8k_reference64(x, raw, T.Q4_K, n, k)) < 2e-6
    with pytest.raises(ValueError, match="groups"):
        qgemv_mma_k(x, w, groups=3)
    # the rule the engine takes (groups=None): two from W = 5 on matrices of <= 8192 rows
    from alphallama.kernels.gemv.qgemv_mma import mma_groups
    assert [mma_groups(w, W) for W in (1, 4, 5, 8, 16)] == [1, 1, 2, 2, 2]
    _, wide = _weight(T.Q4_K, 8192 + 16, 256, seed=7)
    assert mma_groups(wide, 8) == 1


def test_prepare_q8k_bytes_land_in_fragment_order():
    """The one-launch q8_K prepare against plain torch: expert_q8's rounding rule with one
    scale a 256-value super-block, prepare_i8's lane order inside each slot, mma_x's order of
    words (the padding columns of the last 8-column block are not written: not compared), and
    the row-order copy for qgemv_q8k: prepare_i8's words exactly."""
    from alphallama.kernels.gemv.qmatvec_i8 import lane_perm
    W, K = 11, 512
    n_slots = K // 32
    x = _x(W, K, seed=9)
    xf, xs, dx, xl = prepare_q8k(x, n_slots)
    q, dxr = q8k(x)
    q = q.reshape(W, n_slots, 32)
    assert torch.equal(dx.cpu(), dxr)
    assert torch.equal(xs.cpu(), q.sum(-1, dtype=torch.int32))
    words = q[:, :, lane_perm(32, 4, 4)].to(torch.int8).reshape(W, K).contiguous().view(torch.int32)
    ref = mma_x(words, n_slots).reshape(2, n_slots // 2, 8, 4, 2, 2)    # [cb, step, g, t, j, e]
    got = xf.cpu().reshape(2, n_slots // 2, 8, 4, 2, 2)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1, :, :W - 8], ref[1, :, :W - 8])
    assert torch.equal(xl.cpu(), words)


def test_refuses_what_it_does_not_cover():
    _, w6 = _weight(T.Q6_K, 32, 256, seed=1)
    _, w_odd = _weight(T.Q4_K, 24, 256, seed=1)
    assert not supports_mma(w6) and not supports_mma(w_odd)
    with pytest.raises(ValueError, match="Q4_K"):
        mma_planes(w6)


def compile_sm90() -> None:
    """The kernel for sm_90 (child process): every inline-asm operand and result lies one row
    a thread (threadsPerWarp [32, 1], the row's 4 elements in the thread: the mma's
    fragments), and nothing goes through shared memory."""
    import re

    from alphallama.kernels.gemv.q8k_act import _prepare_q8k_kernel
    from alphallama.kernels.gemv.qgemv_mma import _qgemv_mma_k_kernel
    from tests.kernels.sm90 import compile_sm90 as build

    build(_prepare_q8k_kernel, ["*bf16", "*i8", "*i32", "*fp32", "*i8", "i32"], dict(n_slots=128, PDL=True))

    i32, i16, f16, f32 = "*i32", "*i16", "*fp16", "*fp32"
    for warps, runs in ((4, 1), (8, 1), (4, 4), (8, 4)):   # 4 steps a super-block, 2 mma each
        k = build(_qgemv_mma_k_kernel, [i32, i32, f32, f32, i32, i16, f16, "i32", "i32", "i32"],
                  dict(n_slots=128, WARPS=warps, EMULATE=False, KW=runs), num_warps=warps)
        ttgir = k.asm["ttgir"]
        layouts = dict(re.findall(r"^(#blocked\d*) = (.*)$", ttgir, re.M))
        asm = [ln for ln in ttgir.splitlines() if "elementwise_inline_asm" in ln]
        assert asm, "no inline asm in the kernel"
        for name in set(re.findall(r"#blocked\d*", " ".join(asm))):
            lay = layouts[name]
            assert "sizePerThread = [1, 4]" in lay and "threadsPerWarp = [32, 1]" in lay \
                and f"warpsPerCTA = [{warps}, 1]" in lay and "order = [1, 0]" in lay, lay
        assert (k.metadata.shared == 0) == (runs == 1)      # only the runs' sum goes through shared memory
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32", k.asm["ptx"])) == 8
    # two row groups a warp (groups=2): twice the mma, the same one-row-a-thread fragments
    k = build(_qgemv_mma_k_kernel, [i32, i32, f32, f32, i32, i16, f16, "i32", "i32", "i32"],
              dict(n_slots=128, WARPS=8, EMULATE=False, KW=4, GR=2), num_warps=8)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32", k.asm["ptx"])) == 16


def test_compiles_for_sm90_with_fragments_one_row_a_thread():
    run_in_child("test_qgemv_mma")
