"""Attention sinks (gpt-oss: one more logit a head, no value, in the softmax's denominator) in
the split-KV decode attention (kernels/attention/decode.py: the combine's term) and in the
prefill's SDPA (runtime/gpu_prefill.prefill_attention: a sink key first), against the
float64 reference, with and without a sliding window; small tiles so a row's keys cross
several splits; a row's bits the same alone and in rounds; the q8 combine and the early
loads the same values / bits."""
from __future__ import annotations


import pytest
import torch


from alphallama.kernels.attention import decode as A  # noqa: E402
from alphallama.kernels.attention.decode import decode_attention, decode_attention_q8, decode_attention_ref  # noqa: E402
from alphallama.model.layers import attention  # noqa: E402
from alphallama.runtime.gpu_prefill import prefill_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TILES = A.Tiles(block_n=16, max_splits=4)     # the split size changes every 64 keys
SCALE = 0.3
H, N_KV, HD = 4, 2, 32


def _case(W: int, cap: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(W, H, HD, generator=g)
    kc = torch.randn(N_KV, cap, HD, generator=g).half()
    vc = torch.randn(N_KV, cap, HD, generator=g).half()
    # sinks around the scores' scale: one far above them (the sink takes most of the weight)
    sinks = torch.tensor([0.5, -1.0, 2.5, 6.0])
    return q, kc, vc, sinks


def _run(q, kc, vc, pos, sinks, window=0, **kw):
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    return decode_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), p, kc.shape[1], tiles=TILES, scale=SCALE,
                            window=window, sinks=sinks.to(DEV), **kw).cpu()


@pytest.mark.parametrize("pos, window", [(0, 0), (70, 0), (70, 40)])
def test_sinks_against_float64(pos, window):
    """A round of 3 rows at pos..pos+2 (one split, several, a window past key 0) within 2e-3;
    the reference without the sinks far away (the control)."""
    q, kc, vc, sinks = _case(3, pos + 5, pos)
    out = _run(q, kc, vc, pos, sinks, window)
    ref = decode_attention_ref(q.half().float(), kc, vc, pos, SCALE, window, sinks)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert (decode_attention_ref(q.half().float(), kc, vc, pos, SCALE, window) - ref).abs().max() > 0.1


def test_sink_row_bits_alone_and_in_rounds():
    """The row at position 90: alone, in a round of 3 at column 2, of 4 at column 0 with spare
    capacity; the same bits (the sink is a constant of its head)."""
    length, g = 91, torch.Generator().manual_seed(5)
    q_row = torch.randn(H, HD, generator=g)
    own = torch.randn(2, N_KV, length, HD, generator=g).half()
    got = []
    for W, col, spare in ((1, 0, 0), (3, 2, 5), (4, 0, 40)):
        pos = length - 1 - col
        q, kc, vc, sinks = _case(W, pos + W + spare, W)
        kc[:, :length], vc[:, :length] = own[0], own[1]
        q[col] = q_row
        got.append(_run(q, kc, vc, pos, sinks)[col])
    assert all(torch.equal(o, got[0]) for o in got[1:])


def test_sinks_early_and_q8_combine():
    """early=True gives the plain launch's bits; the combine that emits the o projection's int8
    activations gives the same values (compiled without fp fusion: equal under the interpreter)."""
    pos = 50
    q, kc, vc, sinks = _case(2, pos + 2, 9)
    plain = _run(q, kc, vc, pos, sinks)
    assert torch.equal(_run(q, kc, vc, pos, sinks, early=True), plain)
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    out, q8 = decode_attention_q8(q.to(DEV), kc.to(DEV), vc.to(DEV), p, torch.float32, ((32, 4, 4),),
                                  tiles=TILES, scale=SCALE, sinks=sinks.to(DEV))
    torch.testing.assert_close(out.cpu(), plain, atol=1e-6, rtol=1e-6)
    assert len(q8) == 1


@pytest.mark.parametrize("pos, T, window", [(0, 20, 0), (30, 5, 0), (0, 20, 8), (30, 5, 8)])
def test_prefill_attention_sinks(pos, T, window):
    """The prefill's SDPA with the sink key against the reference's attention (model/layers.py),
    first chunk and after a prefix, with and without a window; without sinks it differs."""
    g = torch.Generator().manual_seed(pos + T)
    q = torch.randn(T, H, 16, generator=g).half().float()
    k, v = (torch.randn(N_KV, pos + T + 6, 16, generator=g).half() for _ in range(2))   # rows past pos+T: junk
    sinks = torch.tensor([0.5, -1.0, 2.5, 6.0])
    out = prefill_attention(q.to(DEV), k.to(DEV), v.to(DEV), pos, torch.float32, SCALE, window, sinks.to(DEV)).cpu()
    ref = attention(q, k[:, :pos + T].float(), v[:, :pos + T].float(), pos, SCALE, window, sinks)   # [T, H*16]
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert (attention(q, k[:, :pos + T].float(), v[:, :pos + T].float(), pos, SCALE, window) - ref).abs().max() > 0.1


def compile_sinks() -> None:
    """The combine with sinks for sm_90 (gpt-oss-120b: 64 heads of 64), plain and with the o
    projection's int8 activations."""
    from tests.kernels.sm90 import compile_sm90
    blocks = {"BLOCK_N": A.BLOCK_N, "MAX_SPLITS": A.MAX_SPLITS, "WINDOW": 128, "SINKS": True,
              "XF": None, "XK": None, "DXK": None, "XL": None, "Q8K": False, "ROWS": 0}
    compile_sm90(A._attn_combine_kernel, ["*fp32", "*fp32", "*fp32", "*bf16", "*i32"] + ["i32"] * 4 + ["*fp32"],
                 dict(N_HEADS=64, HD=64, XP1=None, XS1=None, NQ=0, SLOT1=32, V1=4, BITS1=4, PDL=False, **blocks),
                 num_warps=A.COMBINE_WARPS, fp_fusion=True, divisible_ints=True)
    compile_sm90(A._attn_combine_kernel, ["*fp32", "*fp32", "*fp32", "*bf16", "*i32"] + ["i32"] * 4
                 + ["*i8", "*i32", "*fp32"],
                 dict(N_HEADS=64, HD=64, NQ=1, SLOT1=32, V1=4, BITS1=4, PDL=True, **blocks),
                 num_warps=A.COMBINE_WARPS, divisible_ints=True)


def test_sink_kernels_compile_for_sm90():
    from tests.kernels.sm90 import run_in_child
    run_in_child("test_attention_sinks", "compile_sinks", timeout=600)
