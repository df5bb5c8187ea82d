"""The C expert workers (offload/native) against the expert contract's plain-torch
reference (kernels/moe/expert_q8.py), bit for bit: the kernels one call at a time, the
expert FFN, and the thread pool driven through a Mailbox filled the way the GPU would."""
from __future__ import annotations

import platform
import time

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels import QuantWeight
from alphallama.kernels.moe import expert_q8 as ref
from alphallama.offload.mailbox import DONE, LAYER, REQ, ROWS, STOP, Mailbox
from alphallama.offload.native import build, kernels as nk
from alphallama.offload.native.probe import probe, usable_cpus
from alphallama.offload.native.workers import CpuExperts
from tests.kernels.test_qmatmul import random_raw

QTYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_1, T.Q5_1]
IDS = [t.name for t in QTYPES]
KQUANT = {T.Q4_K, T.Q5_K, T.Q6_K}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def activations(R: int, K: int, seed: int) -> torch.Tensor:
    """Rows spanning magnitudes 1e-6 .. 1e4, with all-zero blocks and a lone nonzero value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g) * torch.logspace(-6, 4, K)[torch.randperm(K, generator=g)]
    x[0, :32] = 0                      # an all-zero activation block
    if K >= 64:
        x[-1, 32:64] = 0
        x[-1, 40] = -3.5               # a block with one value: it quantizes to -127
    return x


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_matvec_bit_exact(qtype):
    sizes = [(7, 256), (40, 768), (3, 1024)] if qtype in KQUANT else [(5, 32), (40, 96), (9, 512)]
    for n, k in sizes:
        w = QuantWeight.from_raw(random_raw(qtype, n, k, seed=n + k), qtype, (n, k))
        x = activations(3, k, seed=k)
        xq, dx, xs = ref.quantize_q8(x)
        for m in range(3):
            want = ref.matvec_q8(xq[m], dx[m], xs[m], w)
            assert torch.equal(bits(nk.matvec_q8(xq[m], dx[m], xs[m], w)), bits(want)), (qtype.name, n, k, m)
            r0, r1 = n // 3, n - 1                                       # a row range, as a thread takes
            assert torch.equal(bits(nk.matvec_q8(xq[m], dx[m], xs[m], w, (r0, r1))), bits(want[r0:r1]))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the generic build is an x86-64 one")
def test_generic_build_bit_exact():
    """Built for plain x86-64 (no AVX2: the scalar slot loops), the same bits."""
    so = build.lib("x86-64")
    for qtype in QTYPES:
        k = 512
        w = QuantWeight.from_raw(random_raw(qtype, 9, k, seed=2), qtype, (9, k))
        xq, dx, xs = ref.quantize_q8(activations(1, k, seed=3))
        got = nk.matvec_q8(xq[0], dx[0], xs[0], w, so=so)
        assert torch.equal(bits(got), bits(ref.matvec_q8(xq[0], dx[0], xs[0], w))), qtype.name


def test_quantize_exp_silu_bit_exact():
    x = activations(4, 1024, seed=1)
    for m in range(4):
        got, want = nk.quantize_q8(x[m]), ref.quantize_q8(x[m:m + 1])
        assert all(torch.equal(a, b[0]) for a, b in zip(got, want))
    v = torch.cat([torch.linspace(-100, 100, 20001), torch.randn(5000) * 1e-3,
                   torch.tensor([0.0, -0.0, 87, -87, 1e30])])
    assert torch.equal(bits(nk.exp_c(v)), bits(ref.exp_c(v)))
    g, u = torch.randn(4096) * 12, torch.randn(4096) * 3
    assert torch.equal(bits(nk.silu_mul_c(g, u)), bits(ref.silu_mul_c(g, u)))


def expert_pair(gq: T, dq: T, D: int, F: int, E: int, seed: int) -> tuple[QuantWeight, QuantWeight]:
    gu = QuantWeight.from_raw(random_raw(gq, E * 2 * F, D, seed), gq, (E, 2 * F, D))
    dn = QuantWeight.from_raw(random_raw(dq, E * D, F, seed + 1), dq, (E, D, F))
    return gu, dn


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_expert_ffn_bit_exact(qtype):
    down_q = {T.Q4_K: T.Q6_K, T.Q5_K: T.Q8_0, T.Q6_K: T.Q4_K}.get(qtype, T.Q5_K if qtype == T.Q8_0 else qtype)
    D, F, E = 256, 256, 3
    gu, dn = expert_pair(qtype, down_q, D, F, E, seed=11)
    x = activations(2, D, seed=12)
    xq, dx, xs = ref.quantize_q8(x)
    ce = CpuExperts({0: (gu, dn)}, Mailbox.new(2, D, 2), n_layers=1, threads=1)
    for m in range(2):
        for e in range(E):
            want = ref.expert_ffn(x[m], gu.expert(e), dn.expert(e))
            assert torch.equal(bits(ce.ffn(xq[m], dx[m], xs[m], 0, e)), bits(want))


def post(mb: Mailbox, req: int, layer: int, x: torch.Tensor, ids: torch.Tensor, task: torch.Tensor) -> None:
    """What the GPU does at a MoE layer: activations, ranks, then REQ last."""
    W = x.shape[0]
    xq, dx, xs = ref.quantize_q8(x)
    mb.xq[:W], mb.dx[:W], mb.xs[:W] = xq, dx, xs
    mb.ids[:W], mb.task[:W] = ids, task
    mb.ctl[LAYER], mb.ctl[ROWS] = layer, W
    mb.ctl[REQ] = req


def wait_done(mb: Mailbox, req: int, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while int(mb.ctl[DONE]) != req:
        assert time.monotonic() - t0 < timeout, f"DONE stayed {int(mb.ctl[DONE])} for REQ {req}"
        time.sleep(1e-4)


def test_pool_through_mailbox():
    D, F, E, k = 256, 256, 5, 3
    layers = {1: expert_pair(T.Q4_K, T.Q6_K, D, F, E, seed=21), 3: expert_pair(T.Q8_0, T.Q5_0, D, F, E, seed=23)}
    mb = Mailbox.new(4, D, k)
    g = torch.Generator().manual_seed(5)
    cpus = usable_cpus()
    ce = CpuExperts(layers, mb, n_layers=4, threads=min(2, len(cpus)))
    assert ce.threads >= 1
    req = 0
    for round_ in range(2):                # start, several posts, stop; then the same again
        ce.start()
        assert ce.running
        for W, layer in [(1, 1), (4, 3), (3, 1), (4, 1), (2, 3)]:
            req += 1
            x = activations(W, D, seed=req) * 0.01
            ids = torch.randint(0, E, (W, k), generator=g, dtype=torch.int32)
            task = torch.randint(0, 2, (W, k), generator=g, dtype=torch.int32)
            task[0, 0] = 1                                               # at least one task
            mb.y.fill_(float("nan"))
            post(mb, req, layer, x, ids, task)
            wait_done(mb, req)
            gu, dn = layers[layer]
            for m in range(W):
                for r in range(k):
                    if task[m, r]:
                        want = ref.expert_ffn(x[m], gu.expert(int(ids[m, r])), dn.expert(int(ids[m, r])))
                        assert torch.equal(bits(mb.y[m, r]), bits(want)), (round_, req, m, r)
                    else:                                                # not a CPU rank: untouched
                        assert mb.y[m, r].isnan().all()
        req += 1                                                         # a layer without experts: just DONE
        post(mb, req, 2, torch.randn(1, D), torch.zeros(1, k, dtype=torch.int32), torch.ones(1, k, dtype=torch.int32))
        wait_done(mb, req)
        req += 1                                                         # an expert id out of range: skipped
        mb.y.fill_(float("nan"))
        bad = torch.full((1, k), E, dtype=torch.int32)
        post(mb, req, 1, torch.randn(1, D), bad, torch.ones(1, k, dtype=torch.int32))
        wait_done(mb, req)
        assert mb.y.isnan().all()
        ce.stop()
        assert not ce.running and int(mb.ctl[STOP]) == 0
    ce.stop()                                                            # twice is harmless


def test_pool_clock_counts_its_posts():
    """The clock's posts, pairs and groups are the posts' own; busy time is counted, and a
    gap only between a DONE and a REQ less than 2 ms apart."""
    D, F, E, k = 256, 256, 6, 2
    mb = Mailbox.new(4, D, k)
    ce = CpuExperts({0: expert_pair(T.Q8_0, T.Q8_0, D, F, E, seed=3)}, mb, n_layers=1, threads=1)
    assert ce.clock() == dict.fromkeys(("posts", "busy_ns", "gap_ns", "gaps", "pairs", "groups"), 0)
    g = torch.Generator().manual_seed(9)
    pairs = groups = 0
    with ce:
        for req in range(1, 7):
            W = 1 + req % 4
            ids = torch.randint(0, E, (W, k), generator=g, dtype=torch.int32)
            task = torch.randint(0, 2, (W, k), generator=g, dtype=torch.int32)
            task[0, 0] = 1
            pairs += int(task.sum())
            groups += len(set(ids[task.bool()].tolist()))
            post(mb, req, 0, activations(W, D, seed=req) * 0.01, ids, task)
            wait_done(mb, req)
        c = ce.clock()
    assert (c["posts"], c["pairs"], c["groups"]) == (6, pairs, groups)
    assert c["busy_ns"] > 0 and 0 <= c["gaps"] <= 5 and 0 <= c["gap_ns"] <= c["gaps"] * 2_000_000


def test_probe_thread_count():
    r = probe(nbytes=16 << 20, cache=False)
    n = len(usable_cpus())
    assert 1 <= r["threads"] <= n
    assert all(bw > 0 for bw in r["curve"].values()) and str(r["threads"]) in r["curve"]


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(build.sysconfig, "get_config_var", lambda name: None)
    with pytest.raises(build.NativeBuildError, match="C compiler"):
        build.find_compiler()


def test_bad_input_errors():
    w = QuantWeight.from_raw(random_raw(T.F16, 4, 64, 0), T.F16, (4, 64))
    with pytest.raises(ValueError, match="F16"):
        nk.qmat(w)
    D = 256
    mb = Mailbox.new(1, D, 2)
    with pytest.raises(ValueError, match="d_model"):
        CpuExperts({0: expert_pair(T.Q8_0, T.Q8_0, 128, 64, 2, seed=1)}, mb, n_layers=1, threads=1)
