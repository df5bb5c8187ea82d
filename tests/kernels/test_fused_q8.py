"""The producers that emit int8 activations in the same launch (add_rmsnorm_q8,
silu_mul_q8, decode_attention_q8) give bit for bit what the separate prepare launch (prepare_i8) makes of
their output, for every lane order, with and without row padding (D not a power of 2,
F not a multiple of the SiLU block); and their float outputs match the references."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.attention.decode import decode_attention_q8, decode_attention_ref  # noqa: E402
from alphallama.kernels.norm.rmsnorm import add_rmsnorm_q8, add_rmsnorm_ref  # noqa: E402
from alphallama.kernels.activations.silu import silu_mul_q8, silu_mul_ref  # noqa: E402
from alphallama.kernels.gemv.q8k_act import Q8K, prepare_q8k  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import lane_order, prepare_i8  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_qmatvec_i8 import _weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEV == "cuda" else torch.float32


def _order_weights(K):
    """A weight of each lane order at width K (Q4_K's order is also Q5_K's, Q4_0's, Q5_0's)."""
    return {lane_order(w): w for w in (_weight(q, 8, K, seed=1)[1] for q in (T.Q4_K, T.Q6_K, T.Q8_0))}


def _same(a: tuple, b: tuple, what: str) -> None:
    for x, y, name in zip(a, b, ("xp", "xsd")):
        assert torch.equal(x, y), f"{what}: {name} differs in {int((x != y).sum())} of {x.numel()}"


@pytest.mark.parametrize("D", [768, 256 * 3 + 32 * 4])      # 768 = 3 x 256; 896: Qwen2.5-0.5B's width
def test_add_rmsnorm_q8_equals_prepare(D):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(3, D, generator=g).to(DEV)
    y = torch.randn(3, D, generator=g).to(DEV)
    w = (torch.rand(D, generator=g) + 0.5).to(DEV)
    ws = _order_weights(D) if D % 256 == 0 else {lane_order(_weight(T.Q8_0, 8, D, seed=1)[1]):
                                                 _weight(T.Q8_0, 8, D, seed=1)[1]}
    orders = list(ws)
    for pair in (orders[:2], orders[-1:]):
        x1 = x.clone()
        h, q8 = add_rmsnorm_q8(x1, y, w, 1e-6, ACT, tuple(pair))
        xr, hr = add_rmsnorm_ref(x, y, w, 1e-6)
        torch.testing.assert_close(x1, xr)                                 # the residual, in place
        torch.testing.assert_close(h.float(), hr, atol=1e-2, rtol=1e-2)
        for o in pair:
            _same(q8[o], prepare_i8(h, ws[o]), f"D={D} order {o}")


@pytest.mark.parametrize("q8", [False, True], ids=["plain", "q8"])
def test_norm_sums_the_moe_ranks_as_the_combine_does(q8):
    """add_rmsnorm(x, (part, weights)): the ranks summed by moe's combine code in the norm's
    launch give the bits of the combine kernel's sum added as y (the residual, h and the
    int8 activations), with D past a power of two (masked lanes)."""
    from alphallama.kernels.norm.rmsnorm import add_rmsnorm
    from alphallama.kernels.moe.moe_f32 import BD_COMBINE, down_combine_kernel
    W, k, D = 3, 4, 896
    g = torch.Generator().manual_seed(9)
    x = torch.randn(W, D, generator=g).to(DEV)
    part = torch.randn(W, k, D, generator=g).to(DEV)
    weights = torch.rand(W, k, generator=g).to(DEV)
    w = (torch.rand(D, generator=g) + 0.5).to(DEV)
    y = torch.empty(W, D, device=DEV)
    down_combine_kernel[(W * -(-D // BD_COMBINE),)](part, weights, y, D, TOP_K=k, BD=BD_COMBINE, num_warps=2,
                                                      enable_fp_fusion=False)
    x_two, x_one = x.clone(), x.clone()
    if q8:
        order = lane_order(_weight(T.Q8_0, 8, D, seed=1)[1])
        h_two, q_two = add_rmsnorm_q8(x_two, y, w, 1e-6, ACT, (order,))
        h_one, q_one = add_rmsnorm_q8(x_one, (part, weights), w, 1e-6, ACT, (order,))
        _same(q_one[order], q_two[order], "int8 activations")
    else:
        h_two = add_rmsnorm(x_two, y, w, 1e-6, ACT)
        h_one = add_rmsnorm(x_one, (part, weights), w, 1e-6, ACT)
    assert torch.equal(x_one, x_two) and torch.equal(h_one, h_two)
    with pytest.raises(ValueError, match="MoE parts"):
        add_rmsnorm(x.clone(), (part[:, :, :8], weights), w, 1e-6, ACT)


@pytest.mark.parametrize("F", [1024, 1024 + 256 + 32 * 3])     # one whole block; a ragged last block
def test_silu_mul_q8_equals_prepare(F):
    g = torch.Generator().manual_seed(F)
    gu = (torch.randn(2, 2 * F, generator=g) * 3).to(DEV)
    w = _weight(T.Q6_K if F % 256 == 0 else T.Q8_0, 8, F, seed=2)[1]
    o = lane_order(w)
    a, q8 = silu_mul_q8(gu, ACT, (o,))
    torch.testing.assert_close(a.float(), silu_mul_ref(gu), atol=2e-2, rtol=1e-2)
    _same(q8[o], prepare_i8(a, w), f"F={F}")


def _same_q8k(got: tuple, want: tuple, W: int, what: str) -> None:
    """prepare_q8k's four tensors; the fragment words of the padding columns (past W in the
    last 8-column block) are written by neither, so not compared."""
    K = want[3].shape[1] * 4
    fg, fw = (t.reshape(-1, K // 64, 8, 4, 2, 2) for t in (got[0], want[0]))   # [cb, step, g, t, j, e]
    for cb in range(fg.shape[0]):
        n = min(8, W - 8 * cb)
        assert torch.equal(fg[cb, :, :n], fw[cb, :, :n]), f"{what}: fragment words of columns {8 * cb}.."
    for x, y, name in zip(got[1:], want[1:], ("xsum", "dx", "row words")):
        assert torch.equal(x, y), f"{what}: {name} differs in {int((x != y).sum())} of {x.numel()}"


@pytest.mark.parametrize("D", [768, 1024 + 256])                # D not a power of 2: the norm's padded row
def test_add_rmsnorm_emits_prepare_q8k(D):
    """Q8K among the orders: the norm's fused q8_K activations are prepare_q8k's of h, bit for
    bit, beside a lane order in the same launch."""
    g = torch.Generator().manual_seed(D + 1)
    x = torch.randn(10, D, generator=g).to(DEV)
    w = (torch.rand(D, generator=g) + 0.5).to(DEV)
    wq = _weight(T.Q6_K, 8, D, seed=1)[1]
    h, q8 = add_rmsnorm_q8(x.clone(), None, w, 1e-6, ACT, (lane_order(wq), Q8K))
    _same_q8k(q8[Q8K], prepare_q8k(h, D // 32), 10, f"D={D}")
    _same(q8[lane_order(wq)], prepare_i8(h, wq), f"D={D} beside q8_K")


@pytest.mark.parametrize("F", [1024, 1024 + 256])              # one whole SiLU block; a ragged last block
def test_silu_mul_emits_prepare_q8k(F):
    """The SiLU's fused q8_K activations: prepare_q8k's, bit for bit."""
    g = torch.Generator().manual_seed(F + 2)
    gu = (torch.randn(3, 2 * F, generator=g) * 3).to(DEV)
    a, q8 = silu_mul_q8(gu, ACT, (Q8K,))
    _same_q8k(q8[Q8K], prepare_q8k(a, F // 32), 3, f"F={F}")


def _attention_inputs(seed: int, hd: int, n_heads: int = 4, n_kv: int = 2, W: int = 3, pos: int = 37):
    """q [W, n_heads, hd], a 128-row fp16 KV cache of n_kv heads, and the round's position pos."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_kv, 128, hd, generator=g).half().to(DEV)
    v = torch.randn(n_kv, 128, hd, generator=g).half().to(DEV)
    q = torch.randn(W, n_heads, hd, generator=g).to(DEV)
    return q, k, v, torch.tensor([pos], dtype=torch.int32, device=DEV)


def test_attention_q8_equals_prepare_and_is_row_invariant():
    n_heads, hd, pos, W = 4, 64, 37, 3
    q, k, v, pos_t = _attention_inputs(7, hd, n_heads, W=W, pos=pos)
    w = _weight(T.Q4_K, 8, n_heads * hd, seed=3)[1]
    o = lane_order(w)
    out, q8 = decode_attention_q8(q, k, v, pos_t, ACT, (o,))
    torch.testing.assert_close(out.float().cpu(), decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), pos),
                               atol=2e-2, rtol=2e-2)
    _same(q8[o], prepare_i8(out, w), "attention output")
    for r in range(W):                                  # each row alone (at its own position) gives the same bits
        one, q8_one = decode_attention_q8(q[r:r + 1], k, v, torch.tensor([pos + r], dtype=torch.int32, device=DEV),
                                          ACT, (o,))
        assert torch.equal(one[0], out[r])
        _same(tuple(t[0] for t in q8_one[o]), tuple(t[r] for t in q8[o]), f"row {r}")


def test_attention_emits_prepare_q8k_two_heads_a_program():
    """Q8K: the combine takes the two heads of a 256-value super-block a program; its output
    is the one-head-a-program combine's, bit for bit, and its q8_K activations prepare_q8k's."""
    from alphallama.kernels.attention.decode import decode_attention
    n_heads, hd, W = 4, 128, 3
    q, k, v, pos_t = _attention_inputs(8, hd, n_heads, W=W)
    out, q8 = decode_attention_q8(q, k, v, pos_t, ACT, (Q8K,))
    assert torch.equal(out, decode_attention(q, k, v, pos_t, 128, ACT))
    _same_q8k(q8[Q8K], prepare_q8k(out, n_heads * hd // 32), W, "attention output")
    with pytest.raises(ValueError, match="head_dim 128"):
        decode_attention_q8(q[:, :, :64].contiguous(), k[:, :, :64].contiguous(), v[:, :, :64].contiguous(), pos_t,
                            ACT, (Q8K,))


def compile_sm90() -> None:
    """Both producers and the attention combine with their q8 outputs, for sm_90."""
    import triton

    from alphallama.kernels.attention import decode as attention
    from alphallama.kernels.norm import rmsnorm
    from alphallama.kernels.activations import silu
    from tests.kernels.sm90 import compile_sm90 as build

    for D in (4096, 896):
        build(rmsnorm._add_rmsnorm_kernel, ["*fp32", "*fp32", "*fp32", "*bf16", "fp32", "*i8", "*i32", "*i8", "*i32"],
              dict(D=D, BLOCK=triton.next_power_of_2(D), HAS_Y=True, NQ=2, SLOT1=32, V1=4, BITS1=4,
                   SLOT2=16, V2=2, BITS2=4))
    # the norm summing the MoE ranks (PART, PW after the PDL flag), with its two lane orders
    build(rmsnorm._add_rmsnorm_kernel, ["*fp32", "*fp32", "*fp32", "*bf16", "fp32", "*i8", "*i32", "*i8", "*i32"]
          + ["*fp32", "*fp32"], dict(D=2048, BLOCK=2048, HAS_Y=True, NQ=2, SLOT1=32, V1=4, BITS1=4, SLOT2=16, V2=2,
                                     BITS2=4, PDL=False, TOP_K=8), num_warps=16)
    for F in (12288, 4864):
        build(silu._silu_mul_kernel, ["*fp32", "*bf16", "*i8", "*i32"], dict(F=F, BLOCK=1024, NQ=1, SLOT1=16, V1=2,
                                                                            BITS1=4))
    # with q8_K activations (q8k_act.Q8K) beside a lane order: the 8B shape's norm and SiLU
    q8k = ["*i8", "*i32", "*fp32", "*i8"]
    lanes = dict(SLOT1=16, V1=2, BITS1=4, SLOT2=32, V2=4, BITS2=4)
    build(rmsnorm._add_rmsnorm_kernel, ["*fp32", "*fp32", "*fp32", "*bf16", "fp32", "*i8", "*i32", "*i8", "*i32"]
          + ["*fp32", "*fp32"] + q8k, dict(D=4096, BLOCK=4096, HAS_Y=True, NQ=1, PDL=True, TOP_K=0, Q8K=True, **lanes),
          num_warps=16)
    build(silu._silu_mul_kernel, ["*fp32", "*bf16", "*i8", "*i32"] + q8k,      # the 8B down's input for qgemv_q8k
          dict(F=12288, BLOCK=1024, NQ=0, SLOT1=16, V1=2, BITS1=4, PDL=True, Q8K=True))
    types, const = combine_q8_sm90_q8k()
    build(attention._attn_combine_kernel, types, const)
    from tests.kernels.test_attention_split import combine_q8_sm90
    build(attention._attn_combine_kernel, *combine_q8_sm90())


def combine_q8_sm90_q8k() -> tuple[list[str], dict]:
    """The combine emitting q8_K activations at the Qwen3-8B shape (two heads a program)."""
    from alphallama.kernels.attention import decode as A
    return (["*fp32", "*fp32", "*fp32", "*bf16", "*i32"] + ["i32"] * 4 + ["*i8", "*i32"] + ["*i8", "*i32", "*fp32", "*i8"],
            dict(N_HEADS=32, HD=128, BLOCK_N=A.BLOCK_N, MAX_SPLITS=A.MAX_SPLITS, NQ=0, SLOT1=32, V1=4, BITS1=4,
                 PDL=True, Q8K=True))


def test_compiles_for_sm90():
    run_in_child("test_fused_q8")
