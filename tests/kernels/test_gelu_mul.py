"""GELU(gate) * up (GeGLU, gemma3's dense FFN): the SiLU kernel's GELU constexpr
(kernels/activations/silu.py) against the reference's tanh-form GELU, its int8-emitting
launch the same bits, and its sm_90 compile with the down's int8 activations."""
from __future__ import annotations

import pytest
import torch

from alphallama.kernels.activations.silu import (
    gelu_mul,
    gelu_mul_q8,
    gelu_mul_ref,
    silu_mul_ref,
)
from tests.kernels.sm90 import run_in_child

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # the interpreter's exp(+big)
def test_gelu_mul_against_the_reference():
    """At large |gate| too (exp overflows to inf: the value is 0 or x, not NaN); the launch
    that emits the down GEMV's int8 activations gives the same values."""
    gu = torch.randn(3, 2 * 96, generator=torch.Generator().manual_seed(0)) * 4
    gu[0, :5] = torch.tensor([-30.0, -12.0, 0.0, 12.0, 30.0])
    out = gelu_mul(gu.to(DEV)).cpu()
    torch.testing.assert_close(out, gelu_mul_ref(gu), atol=1e-5, rtol=1e-5)
    assert (out - silu_mul_ref(gu)).abs().max() > 0.1                       # not the SiLU
    q8_out, q8 = gelu_mul_q8(gu.to(DEV), torch.float32, ((32, 4, 4),))
    assert torch.equal(q8_out.cpu(), out) and (32, 4, 4) in q8


def compile_gelu() -> None:
    """The GELU launch with one lane order (gemma3 27B's d_ff 21504), for sm_90."""
    from alphallama.kernels.activations import silu
    from tests.kernels.sm90 import compile_sm90
    compile_sm90(silu._silu_mul_kernel, ["*fp32", "*bf16", "*i8", "*i32"],
                 {"F": 21504, "BLOCK": 1024, "NQ": 1, "SLOT1": 32, "V1": 4, "BITS1": 4, "ACT": silu.ACT_IDS["gelu"]})


def test_gelu_compiles_for_sm90():
    run_in_child("test_gelu_mul", "compile_gelu", timeout=600)
