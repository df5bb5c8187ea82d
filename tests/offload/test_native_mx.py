"""The C expert workers with gpt-oss's experts, bit for bit against the expert contract's
plain-torch reference (kernels/moe/expert_q8.py): MXFP4 slot dots (the E2M1 level table,
A = 2^(e - 128) with the subnormal scales e = 0, 1), the SIMD chunks and the scalar tail
(K = 2880: 90 slots), the experts' biases, swiglu_oai, and the pool through the mailbox
serving an MXFP4 layer with biases beside a plain SiLU one."""
from __future__ import annotations

import platform

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels import QuantWeight
from alphallama.kernels.activations.act_ids import ACT_IDS
from alphallama.kernels.moe import expert_q8 as ref
from alphallama.offload.mailbox import Mailbox
from alphallama.offload.native import build, kernels as nk
from alphallama.offload.native.probe import usable_cpus
from alphallama.offload.native.workers import CpuExperts
from tests.kernels.test_moe_q8_oai import mx_raw
from tests.offload.test_native import activations, bits, expert_pair, post, wait_done

OAI = ACT_IDS["swiglu_oai"]


def _mx(n: int, k: int, seed: int, E: int = 1) -> QuantWeight:
    """Random MXFP4 [n, k] (E > 1: [E, n, k]), scales e in 100..140 and 0, 1, 2 in row 0."""
    raw = mx_raw(E * n, k, seed, e_range=(100, 140))
    return QuantWeight.from_raw(raw, T.MXFP4, (E, n, k) if E > 1 else (n, k))


def _ops(E: int, F: int, D: int, seed: int) -> ref.ExpertOps:
    g = torch.Generator().manual_seed(seed)
    return ref.ExpertOps(OAI, (torch.randn(E, 2 * F, generator=g) * 6, torch.randn(E, D, generator=g)))


def test_matvec_bit_exact():
    for n, k in [(5, 32), (40, 96), (9, 512), (3, 2880)]:
        w = _mx(n, k, seed=n + k)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(k)) * 4
        xq, dx, xs = ref.quantize_q8(activations(3, k, seed=k))
        for m in range(3):
            want = ref.matvec_q8(xq[m], dx[m], xs[m], w)
            assert torch.equal(bits(nk.matvec_q8(xq[m], dx[m], xs[m], w)), bits(want)), (n, k, m)
            assert torch.equal(bits(nk.matvec_q8(xq[m], dx[m], xs[m], w, (1, n))), bits(want[1:]))
            assert torch.equal(bits(nk.matvec_q8(xq[m], dx[m], xs[m], w, bias=bias)), bits(want + bias))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the generic build is an x86-64 one")
def test_generic_build_bit_exact():
    """Built for plain x86-64 (no AVX2: the scalar table lookups), the same bits."""
    so = build.lib("x86-64")
    w = _mx(9, 512, seed=2)
    xq, dx, xs = ref.quantize_q8(activations(1, 512, seed=3))
    got = nk.matvec_q8(xq[0], dx[0], xs[0], w, so=so)
    assert torch.equal(bits(got), bits(ref.matvec_q8(xq[0], dx[0], xs[0], w)))


def test_activations_bit_exact():
    g = torch.cat([torch.randn(4096) * 12, torch.tensor([7.0, 7.0000005, -7.0, 0.0, -0.0, 100.0, -100.0])])
    u = torch.cat([torch.randn(4096) * 8, torch.tensor([-7.0, 7.0000005, 6.9, -0.0, 0.0, -50.0, 50.0])])
    assert torch.equal(bits(nk.act_c(OAI, g, u)), bits(ref.swiglu_oai_c(g, u)))
    assert torch.equal(bits(nk.act_c(ACT_IDS["silu"], g, u)), bits(ref.silu_mul_c(g, u)))
    with pytest.raises(ValueError, match="no activation"):
        nk.act_c(ACT_IDS["gelu"], g, u)


def test_expert_ffn_with_biases_bit_exact():
    D, F, E = 96, 64, 3
    gu, dn = _mx(2 * F, D, seed=5, E=E), _mx(D, F, seed=6, E=E)
    ops = _ops(E, F, D, seed=7)
    x = activations(2, D, seed=8)
    xq, dx, xs = ref.quantize_q8(x)
    ce = CpuExperts({0: (gu, dn)}, Mailbox.new(2, D, 2), n_layers=1, threads=1, ops={0: ops})
    plain = CpuExperts({0: (gu, dn)}, Mailbox.new(2, D, 2), n_layers=1, threads=1)
    for m in range(2):
        for e in range(E):
            want = ref.expert_ffn(x[m], gu.expert(e), dn.expert(e), OAI, ops.expert(e))
            assert torch.equal(bits(ce.ffn(xq[m], dx[m], xs[m], 0, e)), bits(want)), (m, e)
            assert not torch.equal(bits(plain.ffn(xq[m], dx[m], xs[m], 0, e)), bits(want))
    with pytest.raises(ValueError, match="no activation"):
        CpuExperts({0: (gu, dn)}, Mailbox.new(2, D, 2), n_layers=1, threads=1, ops={0: ref.ExpertOps(1)})
    with pytest.raises(ValueError, match="bias"):
        CpuExperts({0: (gu, dn)}, Mailbox.new(2, D, 2), n_layers=1, threads=1,
                   ops={0: ref.ExpertOps(OAI, (ops.biases[1], ops.biases[0]))})


def test_pool_serves_mxfp4_with_biases_beside_silu():
    D, F, E, k = 96, 64, 4, 2
    mx = (_mx(2 * F, D, seed=11, E=E), _mx(D, F, seed=12, E=E))
    layers = {0: mx, 2: expert_pair(T.Q8_0, T.Q4_0, D, F, E, seed=13)}
    ops = {0: _ops(E, F, D, seed=14)}
    mb = Mailbox.new(3, D, k)
    ce = CpuExperts(layers, mb, n_layers=3, threads=min(2, len(usable_cpus())), ops=ops).start()
    g = torch.Generator().manual_seed(15)
    try:
        for req, (W, layer) in enumerate([(3, 0), (2, 2), (1, 0)], start=1):
            x = activations(W, D, seed=req)
            ids = torch.randint(0, E, (W, k), generator=g, dtype=torch.int32)
            task = torch.ones(W, k, dtype=torch.int32)
            mb.y.fill_(float("nan"))
            post(mb, req, layer, x, ids, task)
            wait_done(mb, req)
            gu, dn = layers[layer]
            o = ops.get(layer, ref.ExpertOps())
            for m in range(W):
                for r in range(k):
                    e = int(ids[m, r])
                    want = ref.expert_ffn(x[m], gu.expert(e), dn.expert(e), o.act, o.expert(e))
                    assert torch.equal(bits(mb.y[m, r]), bits(want)), (req, m, r)
    finally:
        ce.stop()
