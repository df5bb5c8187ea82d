"""The expert contract's plain-torch reference (kernels/moe/expert_q8.py) against float64:
its quantization, its exp, and its products within float32 rounding of the exact
math on the quantized activations. (The Triton kernels and the CPU workers are then
held to this reference bit for bit, in their own tests.)"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels import QuantWeight
from alphallama.kernels.moe.expert_q8 import QBLOCK, combine, exp_c, expert_ffn, matvec_q8, quantize_q8, silu_mul_c
from tests.kernels.test_qmatmul import gguf_dequant, random_raw

QTYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q4_0]


def test_quantize_q8_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g) * torch.logspace(-3, 2, 256)
    x[1, :32] = 0                                                  # an all-zero block
    xq, dx, xs = quantize_q8(x)
    assert xq.dtype == torch.int8 and dx.shape == (3, 8) and xs.shape == (3, 16)
    back = xq.double().reshape(3, 8, 32) * dx.double()[..., None]
    err = (back.reshape(3, 256) - x.double()).abs().reshape(3, 8, 32)
    assert (err <= dx.double()[..., None] * 0.5001).all()
    amax = x.abs().reshape(3, 8, 32).amax(-1)
    assert (xq.reshape(3, 8, 32).abs().amax(-1)[amax > 0] == 127).all()
    assert (xq[1, :32] == 0).all() and dx[1, 0] == 0
    assert torch.equal(xs, xq.to(torch.int32).reshape(3, 16, 16).sum(-1))


def test_exp_c_accuracy():
    v = torch.linspace(-87, 87, 200001, dtype=torch.float32)
    ref = torch.exp(v.double())
    rel = ((exp_c(v).double() - ref) / ref).abs()
    assert rel.max() < 4e-7
    assert exp_c(torch.tensor([1000.0, -1000.0])).isfinite().all()


def test_silu_mul_c():
    g = torch.linspace(-30, 30, 1001)
    u = torch.linspace(2, -2, 1001)
    ref = torch.nn.functional.silu(g.double()) * u.double()
    assert ((silu_mul_c(g, u).double() - ref).abs() <= 1e-6 * (g.double().abs() * u.double().abs() + 1e-6)).all()


@pytest.mark.parametrize("qtype", QTYPES, ids=[t.name for t in QTYPES])
def test_matvec_q8_vs_float64(qtype):
    n, k = 24, 512
    raw = random_raw(qtype, n, k, seed=3)
    w = QuantWeight.from_raw(raw, qtype, (n, k))
    w64 = gguf_dequant(raw, qtype).double().reshape(n, k)            # gguf's own dequantizer
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4))
    xq, dx, xs = quantize_q8(x)
    y = matvec_q8(xq[0], dx[0], xs[0], w)
    xd = (xq.double().reshape(-1, QBLOCK) * dx.double().reshape(-1, 1)).reshape(k)
    ref = w64 @ xd
    scale = w64.abs() @ xd.abs()
    assert y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= 2e-6 * scale + 1e-30).all()
    # and against the unquantized activations: the int8 rounding's own error
    bound = w64.abs() @ (dx.double().repeat_interleave(QBLOCK, 1)[0] * 0.5) + 2e-6 * scale
    assert ((y.double() - w64 @ x[0].double()).abs() <= bound + 1e-12).all()


def test_expert_and_combine_vs_float64():
    D, F, E = 64, 96, 3
    gu_raw = random_raw(T.Q8_0, E * 2 * F, D, seed=5)
    dn_raw = random_raw(T.Q8_0, E * D, F, seed=6)
    gate_up = QuantWeight.from_raw(gu_raw, T.Q8_0, (E, 2 * F, D))
    down = QuantWeight.from_raw(dn_raw, T.Q8_0, (E, D, F))
    x = torch.randn(D, generator=torch.Generator().manual_seed(7))
    y = expert_ffn(x, gate_up.expert(1), down.expert(1))
    gu64 = gguf_dequant(gu_raw, T.Q8_0).double().reshape(E, 2 * F, D)[1]
    dn64 = gguf_dequant(dn_raw, T.Q8_0).double().reshape(E, D, F)[1]
    h = gu64 @ x.double()
    a = torch.nn.functional.silu(h[:F]) * h[F:]
    ref = dn64 @ a
    # two int8 quantizations: about 1% of the scale
    assert ((y.double() - ref).abs() <= 0.02 * (dn64.abs() @ a.abs()) + 1e-9).all()
    ys = torch.randn(2, 3, 5)
    wts = torch.rand(2, 3)
    got = combine(ys, wts)
    expect = ((wts[:, 0:1] * ys[:, 0]) + (wts[:, 1:2] * ys[:, 1])) + (wts[:, 2:3] * ys[:, 2])
    assert torch.equal(got, expect)
    assert not math.isnan(float(got.sum())) and np.isfinite(got.numpy()).all()
