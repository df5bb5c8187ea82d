"""Fused decode attention (kernels/attention.py, `counters`): one launch in which the last
program of each (row, kv head) to arrive does the combine. Bit for bit the two-launch
path's output (and q8 activations) at one and many live splits, rows of one round at
different lengths and GQA groups; the counters are zero after each call and serve the
next; the atomic count, not grid order, decides who combines. The sm_90 compile
(offline): the acq_rel gpu-scope atomic after a CTA barrier, the partials read past L1,
and the same float instructions as the split and combine kernels."""
from __future__ import annotations

import re

import pytest
import torch

from alphallama.kernels import attention as A
from alphallama.kernels.attention import decode_attention, decode_attention_q8, decode_attention_ref
from tests.kernels.sm90 import run_in_child

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ORDERS = ((32, 4, 4), (16, 2, 4), (16, 4, 8))    # lane orders (slot, V, bits) of Q4_K, Q6_K, Q8_0


@pytest.fixture
def small_splits(monkeypatch):
    """Small constants (read by the launcher at each call): the split size changes every
    64 keys, so cheap interpreter runs reach one live split, all of them, and a change."""
    monkeypatch.setattr(A, "BLOCK_N", 16)
    monkeypatch.setattr(A, "MAX_SPLITS", 4)


def _inputs(W, H, n_kv, hd, pos, seed):
    g = torch.Generator().manual_seed(seed)
    cap = pos + W + 7
    k = torch.randn(n_kv, cap, hd, generator=g).half()                 # [n_kv, cap, hd]
    v = torch.randn(n_kv, cap, hd, generator=g).half()
    q = torch.randn(W, H, hd, generator=g)                               # [W, H, hd]
    return q.to(DEV), k.to(DEV), v.to(DEV), torch.tensor([pos], dtype=torch.int32, device=DEV)


def _run(q, k, v, pos, out_dtype, order, counters=None) -> list[torch.Tensor]:
    """[out] or [out, xp, xsd]."""
    if order is None:
        return [decode_attention(q, k, v, pos, k.shape[1], out_dtype, counters=counters)]
    out, q8 = decode_attention_q8(q, k, v, pos, out_dtype, (order,), counters=counters)
    return [out, *q8[order]]


def _fused_equals_two_launch(W, H, n_kv, hd, pos, out_dtype, order, tol=2e-3):
    q, k, v, pos_t = _inputs(W, H, n_kv, hd, pos, seed=pos * 31 + W * 7 + H)
    want = _run(q, k, v, pos_t, out_dtype, order)
    ref = decode_attention_ref(q.cpu().half().float(), k.cpu(), v.cpu(), pos)
    torch.testing.assert_close(want[0].float().cpu(), ref, atol=tol, rtol=tol)
    counters = torch.zeros(W * n_kv + 5, dtype=torch.int32, device=DEV)   # a spare tail: never touched
    for call in range(2):                                                  # the second reuses the counters
        got = _run(q, k, v, pos_t, out_dtype, order, counters)
        for a, b, name in zip(got, want, ("out", "xp", "xsd")):
            assert torch.equal(a, b), f"call {call}: {name} differs in {int((a != b).sum())} of {a.numel()}"
        assert not counters.any(), f"call {call}: counters left {counters.tolist()}"


# (W, pos): lengths pos+1 .. pos+W. With BLOCK_N=16, MAX_SPLITS=4: L=1 one live split (the
# last to arrive is a dead one); L=15..17 one then two; L=63..66 four live splits, then the
# split size's change to 32 (three); L=201, 202 all four live, 64 keys each.
ROUNDS = ((1, 0), (3, 14), (4, 62), (2, 200))


@pytest.mark.parametrize("H,n_kv", [(4, 2), (6, 2), (8, 1)])      # GQA groups of 2, 3 (padded), 8
def test_fused_equals_two_launch(small_splits, H, n_kv):
    for W, pos in ROUNDS:
        _fused_equals_two_launch(W, H, n_kv, 32, pos, torch.float32, None)


@pytest.mark.parametrize("order", ORDERS)
def test_fused_q8_equals_two_launch(small_splits, order):
    for W, pos in ROUNDS:
        _fused_equals_two_launch(W, 8, 2, 32, pos, torch.float32, order)


def test_fused_at_the_real_constants():
    """BLOCK_N=32, MAX_SPLITS=64: rows of 2048 keys (64 live splits) and 2049 (33), 8 query
    heads per kv head (the 30B-A3B ratio), bf16 output, with and without q8."""
    step = A.BLOCK_N * A.MAX_SPLITS
    for order in (None, ORDERS[0]):
        _fused_equals_two_launch(2, 8, 1, 32, step - 1, torch.bfloat16, order, tol=1e-2)


def test_the_count_decides_who_combines(small_splits):
    """A counter that starts at 1 makes its (row, kv head) combine one arrival early and end
    at 1; every other (row, kv head) still gives the two-launch bits and ends at 0. (The
    interpreter runs the splits in grid order, so without this an unconditional combine
    in the last split program would pass the tests above.) On a GPU the early combiner's
    reset and the last arrival race, so that counter ends at 0 or 1 there."""
    W, H, n_kv, hd, pos = 2, 4, 2, 32, 100
    q, k, v, pos_t = _inputs(W, H, n_kv, hd, pos, seed=5)
    want = decode_attention(q, k, v, pos_t, k.shape[1])
    counters = torch.zeros(W * n_kv, dtype=torch.int32, device=DEV)
    counters[1 * n_kv + 0] = 1                                             # row 1, kv head 0
    got = decode_attention(q, k, v, pos_t, k.shape[1], counters=counters)
    ends = counters.tolist()
    assert ends[:2] + ends[3:] == [0, 0, 0] and ends[2] in ((1,) if DEV == "cpu" else (0, 1))
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1, H // n_kv * hd:], want[1, H // n_kv * hd:])   # row 1, kv head 1's query heads


def test_bad_counters():
    q, k, v, pos_t = _inputs(2, 4, 2, 32, 3, seed=1)
    for bad in (torch.zeros(4, dtype=torch.int64, device=DEV), torch.zeros(3, dtype=torch.int32, device=DEV)):
        with pytest.raises(ValueError, match="counters"):
            decode_attention(q, k, v, pos_t, k.shape[1], counters=bad)


# -- sm_90 (offline, in a child process without the interpreter) -------------------------
def _build(kernel, types, const, fp_fusion, maxnreg=None):
    """compile_sm90 as the JIT specializes these launches (aligned pointers, strides
    multiples of 16); maxnreg, which compile_sm90 does not pass, patched into its options."""
    import triton

    from tests.kernels.sm90 import compile_sm90
    real = triton.compile
    if maxnreg is not None:
        triton.compile = lambda src, target=None, options=None: real(src, target=target,
                                                                     options={**options, "maxnreg": maxnreg})
    try:
        return compile_sm90(kernel, types, const, num_warps=A.NUM_WARPS, fp_fusion=fp_fusion, divisible_ints=True)
    finally:
        triton.compile = real


FLOAT_OPS = ("FFMA", "FADD", "FMUL", "MUFU", "FMNMX", "FSEL", "FSETP")


def _float_ops(sass: str) -> dict:
    """How many of each float opcode ('--:-:0:-:8\t@P0 FFMA.FTZ R1, ...;' lines)."""
    ops = re.findall(r"\t(?:@!?U?P\w+ +)?([A-Z0-9]+)", sass)
    return {name: ops.count(name) for name in FLOAT_OPS}


def compile_fused() -> None:
    blocks = dict(BLOCK_N=A.BLOCK_N, MAX_SPLITS=A.MAX_SPLITS, PDL=False)
    ptrs = ["*fp32", "*fp16", "*fp16", "*fp32", "*fp32", "*fp32"]                  # Q K V O M L
    for H, n_kv, hd, out in ((32, 8, 128, "*bf16"), (32, 4, 128, "*fp32")):        # Qwen3-8B, Qwen3-30B-A3B
        group = H // n_kv
        split_const = dict(N_HEADS=H, GROUP=group, G_PAD=max(16, group), HD=hd, **blocks)
        # the split kernel does the same instructions with fp fusion on and off, so the fused
        # q8 launch (compiled without fusion) computes the split kernel's partials
        split = [_build(A._attn_split_kernel, [*ptrs, "*i32", "fp32"] + ["i32"] * 9, split_const, ff).asm["sass"]
                 for ff in (True, False)]
        assert split[0] == split[1], "the split kernel's code depends on fp fusion"
        for q8 in (False, True):
            qc = dict(NQ=1, SLOT1=32, V1=4, BITS1=4) if q8 else dict(XP1=None, XS1=None, NQ=0)
            qt = ["*i8", "*i32"] if q8 else []
            comb = _build(A._attn_combine_kernel, ["*fp32", "*fp32", "*fp32", out, "*i32"] + ["i32"] * 4 + qt,
                          dict(N_HEADS=H, HD=hd, **blocks, **qc), not q8)
            fused = _build(A._attn_fused_kernel, [*ptrs, out, "*i32", "*i32", "fp32"] + ["i32"] * 10 + qt,
                           {**split_const, **qc}, not q8, A.FUSED_MAXNREG)
            what = f"H={H} n_kv={n_kv} q8={q8}"
            ptx = fused.asm["ptx"]
            atom = "atom.global.gpu.acq_rel.add.u32"
            assert ptx.count(atom) == 1, what
            before, after = ptx.split(atom)
            assert "bar.sync" in before[before.rindex("st.global"):], f"{what}: no CTA barrier before the atomic"
            loads = [ln for ln in after.splitlines() if "ld.global" in ln]
            assert loads and all("ld.global.cg" in ln for ln in loads), f"{what}: a partial read through L1"
            # the same float instructions as the two launches together (the combine's once: a loop over the group)
            want = {k: a + b for (k, a), b in zip(_float_ops(split[0]).items(), _float_ops(comb.asm["sass"]).values())}
            assert _float_ops(fused.asm["sass"]) == want, what
            sass = fused.asm["sass"].splitlines()
            at = next(i for i, ln in enumerate(sass) if "ATOMG" in ln)
            assert not any("STL" in ln for ln in sass[:at]), f"{what}: the split part spills under the cap"
    # PDL as the split kernel has it: dependents released and the previous grid awaited at the
    # top, before the first read (pos) and so before any partial or counter is touched
    ptx = _build(A._attn_fused_kernel, [*ptrs, "*bf16", "*i32", "*i32", "fp32"] + ["i32"] * 10 + ["*i8", "*i32"],
                 dict(N_HEADS=32, GROUP=4, G_PAD=16, HD=128, **{**blocks, "PDL": True}, NQ=1, SLOT1=32, V1=4, BITS1=4),
                 False, A.FUSED_MAXNREG).asm["ptx"]
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


def test_fused_kernel_compiles_for_sm90():
    run_in_child("test_attention_one_launch", "compile_fused", timeout=600)
