"""The FFN norm that also computes the MoE router's logits (norm/rmsnorm.rmsnorm_router_q8), and
the GEMV that adds into the residual (qgemv_i8(accumulate=True)): together they stand in
for the o GEMV, add_rmsnorm_q8 and the router GEMV (engine.norm_router).

- h and its int8 activations: add_rmsnorm_q8's (bit for bit under the interpreter, whose
  reductions do not depend on the layout; to an ulp on a GPU, where the two kernels may
  lay the row's sum of squares out differently), and bit for bit what prepare_i8 makes of h;
- logits: h @ router^T in float64 to 1e-5, the same bits for a row alone or in a round;
- the accumulating GEMV: bit for bit out + the plain GEMV's result."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.norm.rmsnorm import add_rmsnorm_q8, rmsnorm_router_q8  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import lane_order, prepare_i8  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_qmatvec_i8 import _weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEV == "cuda" else torch.float32


@pytest.mark.parametrize("D,E", [(512, 12), (256 * 3 + 32 * 4, 8)])   # E past a block of 8; D past a power of 2
@pytest.mark.parametrize("rdtype", [torch.float32, torch.bfloat16])
def test_norm_router_gives_the_norm_and_the_logits(D, E, rdtype):
    g = torch.Generator().manual_seed(D + E)
    x = torch.randn(3, D, generator=g).to(DEV)
    w = (torch.rand(D, generator=g) + 0.5).to(DEV)
    router = (torch.randn(E, D, generator=g) / D ** 0.5).to(rdtype).to(DEV)
    ws = [_weight(q, 8, D, seed=1)[1] for q in ((T.Q4_K, T.Q8_0) if D % 256 == 0 else (T.Q8_0,))]
    orders = tuple(dict.fromkeys(lane_order(v) for v in ws))
    x0 = x.clone()
    h, q8, logits = rmsnorm_router_q8(x, w, router, 1e-6, ACT, orders)
    assert torch.equal(x, x0)                                               # the residual is only read
    h2, q82 = add_rmsnorm_q8(x.clone(), None, w, 1e-6, ACT, orders)
    if DEV == "cpu":
        assert torch.equal(h, h2)
        for o in orders:
            assert all(torch.equal(a, b) for a, b in zip(q8[o], q82[o]))
    else:
        torch.testing.assert_close(h.float(), h2.float(), atol=0, rtol=2 ** -7)
    for v in ws:
        o = lane_order(v)
        assert all(torch.equal(a, b) for a, b in zip(q8[o], prepare_i8(h, v)))
    ref = h.double() @ router.double().T                                    # [W, E]
    torch.testing.assert_close(logits.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    for i in range(3):                                                      # a row alone: the same bits
        hi, _, li = rmsnorm_router_q8(x[i:i + 1].clone(), w, router, 1e-6, ACT, orders)
        assert torch.equal(hi, h[i:i + 1]) and torch.equal(li, logits[i:i + 1])


def test_norm_router_adds_the_o_runs():
    """parts (the o GEMV's runs, engine.gemv_split): the norm's residual is x + (p0 + p1),
    written to x_out with x untouched, and h, its int8 activations and the logits are
    the bits of the plain call on that residual (computed here in the combine's order)."""
    D, E, S = 512, 12, 2
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, D, generator=g).to(DEV)
    part = torch.randn(3, S, D, generator=g).to(DEV)
    ones = torch.ones(3, S, device=DEV)
    w = (torch.rand(D, generator=g) + 0.5).to(DEV)
    router = (torch.randn(E, D, generator=g) / D ** 0.5).to(DEV)
    orders = (lane_order(_weight(T.Q4_K, 8, D, seed=1)[1]),)
    x0, x_out = x.clone(), torch.full_like(x, float("nan"))
    h, q8, logits = rmsnorm_router_q8(x, w, router, 1e-6, ACT, orders, parts=(part, ones), x_out=x_out)
    want = x0 + (part[:, 0] + part[:, 1])
    assert torch.equal(x, x0) and torch.equal(x_out, want)
    h2, q82, l2 = rmsnorm_router_q8(want, w, router, 1e-6, ACT, orders)
    assert torch.equal(h, h2) and torch.equal(logits, l2)
    assert all(torch.equal(a, b) for a, b in zip(q8[orders[0]], q82[orders[0]]))
    with pytest.raises(ValueError, match="together"):
        rmsnorm_router_q8(x, w, router, 1e-6, ACT, orders, parts=(part, ones))


def test_gemv_adds_into_its_output():
    _, wq = _weight(T.Q4_K, 48, 512, seed=4)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4)).to(DEV)
    base = torch.randn(3, 48, generator=torch.Generator().manual_seed(5)).to(DEV)
    y = qgemv_i8(x, wq)
    out = base.clone()
    assert qgemv_i8(x, wq, out=out, accumulate=True) is out
    assert torch.equal(out, base + y)
    with pytest.raises(ValueError, match="accumulate"):
        qgemv_i8(x, wq, accumulate=True)


def compile_sm90() -> None:
    from alphallama.kernels.norm import rmsnorm
    from tests.kernels.sm90 import compile_sm90 as compile_kernel

    ptx = compile_kernel(rmsnorm._norm_router_kernel, ["*fp32", "*fp32", "*bf16", "*fp32", "*fp32", "i32", "fp32",
                                                     "*i8", "*i32"],
                         dict(D=2048, BLOCK=2048, RB=rmsnorm.ROUTER_ROWS, XP2=None, XS2=None, NQ=1, SLOT1=32, V1=4,
                              BITS1=4, SLOT2=32, V2=4, BITS2=4, PDL=True), num_warps=16).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    # the router rows are asked for before the wait
    assert body.index("ld.global") < body.index("griddepcontrol.wait") < body.index("st.global")


def test_compiles_for_sm90():
    run_in_child("test_norm_router")
