"""qgemv_mma6 (Q6_K, m16n8k16 through inline PTX, activations scaled a super-block) against
float64 of those activations with gguf's dequantized weights; rows bit-identical whatever W;
the re-laid planes decode back to the codes; the prepare against plain torch; and, for
sm_90, every operand of the mma one row a thread. CPU: the mma emulated over the same
fragments (and the asm's bit spreading written as tensor ops); on a GPU the PTX."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.formats import torch_fields, torch_high  # noqa: E402
from alphallama.kernels.qgemv_mma6 import mma6_planes, prepare_q8k6, qgemv_mma6, supports_mma6  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_qgemv_mma import q8k, q8k_reference64  # noqa: E402
from tests.kernels.test_qmatvec_i8 import _weight, _x  # noqa: E402


@pytest.mark.parametrize("n,k,W,warps,runs", [(48, 512, 10, 2, 1), (32, 768, 1, 1, 1), (64, 256, 3, 4, 1),
                                              (48, 1024, 10, 4, 4), (32, 512, 3, 4, 2)])
def test_matches_float64_of_the_q8k_activations(n, k, W, warps, runs):
    """runs > 1: K cut over a row group's warps, their sums added at the end."""
    raw, w = _weight(T.Q6_K, n, k, seed=3)
    x = _x(W, k, seed=4)
    out = qgemv_mma6(x, w, warps=warps, runs=runs)
    ref, scale = q8k_reference64(x, raw, T.Q6_K, n, k)
    err = ((out.cpu().double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert torch.isfinite(out).all() and err < 2e-6


@pytest.mark.parametrize("warps,runs", [(2, 1), (2, 2)])
def test_rows_do_not_depend_on_width_or_column(warps, runs):
    _, w = _weight(T.Q6_K, 32, 512, seed=5)
    x = _x(10, 512, seed=6)
    planes = mma6_planes(w)
    kw = dict(planes=planes, warps=warps, runs=runs)
    full = qgemv_mma6(x, w, **kw)
    alone = torch.cat([qgemv_mma6(x[m:m + 1], w, **kw) for m in range(10)])
    assert torch.equal(full, alone)
    assert torch.equal(torch.roll(full, 3, dims=0), qgemv_mma6(torch.roll(x, 3, dims=0), w, **kw))


def test_planes_decode_back_to_the_codes():
    """Lane 4g + t's LO_g word i holds the low nibbles of codes k = 4t .. 4t + 3 of slots
    2i (bits 0-15) and 2i + 1 (16-31) of row g; HI the 2-bit highs of (g, 2i), (g + 8, 2i),
    (g, 2i + 1), (g + 8, 2i + 1); the same bytes as qs + qh."""
    _, w = _weight(T.Q6_K, 32, 512, seed=7)
    codes = (torch_fields(w.planes["qs"], 4, 2) | (torch_high(w.planes["qh"], 2, 2, 8) << 4)).cpu()  # [N, ns, 16]
    pl = mma6_planes(w).cpu().reshape(2, w.n_slots // 8, 32, 3, 4)    # [G, chunk, lane, (LO_g, LO_g8, HI), i]
    assert pl.numel() * 4 == w.planes["qs"].numel() * 4 + w.planes["qh"].numel() * 4
    for G, ch, lane, i, par, h in [(0, 0, 0, 0, 0, 0), (1, 3, 29, 3, 1, 1), (0, 2, 6, 1, 1, 0), (1, 1, 31, 2, 0, 1)]:
        g, t = divmod(lane, 4)
        c = codes[16 * G + 8 * h + g, ch * 8 + 2 * i + par, 4 * t: 4 * t + 4]
        lo = (int(pl[G, ch, lane, h, i]) >> (16 * par)) & 0xFFFF
        hi = (int(pl[G, ch, lane, 2, i]) >> (16 * par + 8 * h)) & 0xFF
        assert [(lo >> (4 * j)) & 15 | ((hi >> (2 * j)) & 3) << 4 for j in range(4)] == c.tolist()


def test_prepare_q8k6_against_plain_torch():
    W, K = 11, 512
    n_slots = K // 16
    x = _x(W, K, seed=9)
    xf, xs, dx, xl = prepare_q8k6(x, n_slots)
    q, dxr = q8k(x)
    from alphallama.kernels.qmatvec_i8 import lane_perm                 # the row copy: prepare_i8's Q6_K words
    assert torch.equal(xl.cpu(), q.reshape(W, n_slots, 16)[:, :, lane_perm(16, 2, 4)].to(torch.int8)
                       .reshape(W, K).contiguous().view(torch.int32))
    assert torch.equal(dx.cpu(), dxr)
    assert torch.equal(xs.cpu(), q.reshape(W, n_slots, 16).sum(-1, dtype=torch.int32))
    b = xf.cpu().view(torch.int8).reshape(2, n_slots // 8, 8, 4, 2, 4, 4)   # [cb, chunk, g, t, parity, i, byte]
    for m, s, t in [(0, 0, 0), (10, 31, 3), (5, 17, 2), (8, 8, 1)]:
        cb, g = divmod(m, 8)
        ch, r = divmod(s, 8)
        assert b[cb, ch, g, t, r % 2, r // 2].tolist() == q[m, 16 * s + 4 * t: 16 * s + 4 * t + 4].tolist()


def test_refuses_what_it_does_not_cover():
    _, w4 = _weight(T.Q4_K, 32, 256, seed=1)
    assert not supports_mma6(w4)
    with pytest.raises(ValueError, match="Q6_K"):
        mma6_planes(w4)


def compile_sm90() -> None:
    """For sm_90 (child process): the asm's operands and results one row a thread, no shared
    memory, 16 k16 mma a super-block."""
    import re

    from alphallama.kernels.qgemv_mma6 import _prepare_q8k6_kernel, _q6_kernel
    from tests.kernels.sm90 import compile_sm90 as build

    build(_prepare_q8k6_kernel, ["*bf16", "*i8", "*i32", "*fp32", "*i8", "i32"], dict(n_slots=768, PDL=True))
    for warps, runs in ((4, 1), (8, 1), (4, 4), (8, 8)):
        k = build(_q6_kernel, ["*i32", "*i32", "*fp32", "*fp32", "*i32", "*i8", "*fp16", "i32", "i32", "i32"],
                  dict(n_slots=768, WARPS=warps, EMULATE=False, KW=runs), num_warps=warps)
        ttgir = k.asm["ttgir"]
        layouts = dict(re.findall(r"^(#blocked\d*) = (.*)$", ttgir, re.M))
        asm = [ln for ln in ttgir.splitlines() if "elementwise_inline_asm" in ln]
        assert asm
        for name in set(re.findall(r"#blocked\d*", " ".join(asm))):
            lay = layouts[name]
            assert "sizePerThread = [1, 4]" in lay and "threadsPerWarp = [32, 1]" in lay and "order = [1, 0]" in lay, lay
        assert (k.metadata.shared == 0) == (runs == 1)      # only the runs' sum goes through shared memory
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", k.asm["ptx"])) == 16


def test_compiles_for_sm90_with_fragments_one_row_a_thread():
    run_in_child("test_qgemv_mma6")
