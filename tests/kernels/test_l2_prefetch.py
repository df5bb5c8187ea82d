"""L2 prefetch plans (kernels/l2.py): the chunks cover exactly the asked prefixes, the
kernels that take a plan compile for sm_90 with the bulk prefetch ahead of their PDL
wait, and on a GPU a kernel's output is bit for bit the same with a plan or without."""
from __future__ import annotations

import pytest
import torch

from alphallama.kernels import fused
from alphallama.kernels.l2 import ALIGN, CHUNK, PAD, L2Prefetch
from tests.kernels.sm90 import run_in_child


def _covered(chunks):
    """Merge (address, size) chunks into maximal [start, end) runs."""
    runs = []
    for a, s in sorted(chunks):
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], a + s)
        else:
            runs.append([a, a + s])
    return [tuple(r) for r in runs]


def test_plan_covers_each_planes_prefix():
    a = torch.zeros(300_000, dtype=torch.uint8)           # 4.6 chunks
    b = torch.zeros(1000, dtype=torch.int32)              # 4000 bytes
    c = torch.zeros(10, dtype=torch.int16)                # 20 bytes: its half rounds down to 0
    plan = L2Prefetch([([a, b], 0.0, 0.5), ([c], 0.0, 0.5), ([b], 0.5, 1.0), ([a], 0.75, 0.8)])
    want_a = 150_000 // ALIGN * ALIGN
    lo_a, hi_a = 225_000 // ALIGN * ALIGN, 240_000 // ALIGN * ALIGN
    runs = _covered(plan.chunks)
    assert (a.data_ptr(), a.data_ptr() + want_a) in runs
    assert (a.data_ptr() + lo_a, a.data_ptr() + hi_a) in runs
    assert (b.data_ptr(), b.data_ptr() + 4000) in runs          # its two halves meet
    assert not any(s <= c.data_ptr() < e for s, e in runs)
    assert all(s % ALIGN == 0 and 0 < s <= CHUNK for _, s in plan.chunks)
    assert all(addr % ALIGN == 0 for addr, _ in plan.chunks)
    assert plan.nbytes == want_a + (hi_a - lo_a) + 4000
    t = plan.table
    assert t.dtype == torch.int64 and t.shape[0] == 2 and t.shape[1] % PAD == 0
    n = len(plan.chunks)
    assert [tuple(r) for r in t[:, :n].T.tolist()] == plan.chunks
    assert (t[0, n:] == plan.chunks[0][0]).all() and (t[1, n:] == ALIGN).all()
    assert plan.kwargs(4, torch.device("cpu")) == {}          # the interpreter and the CPU never prefetch
    assert L2Prefetch([([c], 0.0, 0.1)]).table is None


def compile_sm90() -> None:
    from alphallama.kernels import attention, moe
    from tests.kernels.sm90 import compile_sm90 as compile_kernel

    def build(kern, types, const, num_warps=4) -> None:
        block = 32 * num_warps
        ptx = compile_kernel(kern, types + ["*i64"], {**const, "PDL": True, "PF_N": 512, "PF_BLOCK": block},
                             num_warps=num_warps).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        assert "cp.async.bulk.prefetch.L2.global" in body, kern.fn.__name__
        assert body.index("cp.async.bulk.prefetch.L2.global") < body.index("griddepcontrol.wait"), kern.fn.__name__

    build(fused._add_rmsnorm_kernel, ["*fp32", "*fp32", "*fp32", "*bf16", "fp32", "*i8", "*i32"],
          dict(D=4096, BLOCK=4096, HAS_Y=True, XP2=None, XS2=None, NQ=1, SLOT1=32, V1=4, BITS1=4, SLOT2=32, V2=4,
               BITS2=4, PART=None, PW=None, TOP_K=0), num_warps=16)
    build(fused._silu_mul_kernel, ["*fp32", "*bf16", "*i8", "*i32"], dict(F=12288, BLOCK=1024, NQ=1, SLOT1=16, V1=2,
                                                                        BITS1=4))
    build(fused._qkv_rope_kernel, ["*fp32"] * 7 + ["*fp16", "*fp16", "*i32", "fp32"] + ["i32"] * 4,
          dict(N_HEADS=32, N_KV=8, HD=128, HAS_BIAS=False, QK_NORM=True, NEOX=True))
    build(attention._attn_split_kernel, ["*fp32", "*fp16", "*fp16", "*fp32", "*fp32", "*fp32", "*i32", "fp32"]
          + ["i32"] * 9, dict(N_HEADS=32, GROUP=4, G_PAD=16, HD=128, BLOCK_N=attention.BLOCK_N,
                              MAX_SPLITS=attention.MAX_SPLITS))
    build(moe._route_kernel, ["*fp32", "*fp32", "*i32", "i32"], dict(TOP_K=8, BLOCK_E=128, BLOCK_K=8, NORM=True))
    # the routed experts' slices, asked for once chosen (after the wait: they are the router's output)
    ptx = compile_kernel(moe._route_kernel, ["*fp32", "*fp32", "*i32", "i32", "*i64"],
                         dict(TOP_K=8, BLOCK_E=128, BLOCK_K=8, NORM=True, PDL=True, PF=None, PF_N=0, PF_BLOCK=128, EPF_N=6, EPF_CH=32,
                              CH=65536)).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    assert body.index("griddepcontrol.wait") < body.index("cp.async.bulk.prefetch.L2.global")


def test_prefetch_compiles_for_sm90_before_the_wait():
    run_in_child("test_l2_prefetch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bulk prefetch runs on a GPU only")
def test_prefetch_leaves_the_bits_alone():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4096, generator=g).cuda()
    y = torch.randn(8, 4096, generator=g).cuda()
    w = torch.randn(4096, generator=g).cuda()
    weights = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")
    plan = L2Prefetch([([weights], 0.0, 0.5)])
    orders = ((32, 4, 4),)
    outs = []
    for p in (None, plan):
        xx = x.clone()
        h, q8 = fused.add_rmsnorm_q8(xx, y, w, 1e-6, torch.bfloat16, orders, pdl=True, prefetch=p)
        torch.cuda.synchronize()
        outs.append((xx, h, *q8[orders[0]]))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
