"""The CPU workers' misses grouped by expert (offload/native/group.c, post.c): each weight
row read and decoded once for every pair of the round that uses its expert. A pair's bits
must be the per-pair path's (aq_matvec, ffn: held to the plain-torch contract by
test_native*.py), whatever its group, its thread and the rest of the round: the grouped
kernel against one matvec per activation for every format (whole chunks and tails, row
ranges, biases, the mapped rows, the build without AVX2), and the pool through the mailbox
on rounds whose rows share experts, all, some or none, at 1 and 3 threads."""
from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels import QuantWeight
from alphallama.kernels.moe import expert_q8 as ref
from alphallama.offload.mailbox import Mailbox
from alphallama.offload.mapped import MappedExperts
from alphallama.offload.native import build
from alphallama.offload.native import kernels as nk
from alphallama.offload.native.probe import allowed_cpus
from alphallama.offload.native.workers import CpuExperts
from tests.kernels.test_qmatmul import random_raw
from tests.offload.test_mapped_native import _info
from tests.offload.test_native import (
    KQUANT,
    QTYPES,
    activations,
    bits,
    expert_pair,
    post,
    wait_done,
)
from tests.offload.test_native_mx import _mx, _ops

FORMATS = [*QTYPES, T.MXFP4]
IDS = [t.name for t in FORMATS]
DOWN = {T.Q4_K: T.Q6_K, T.Q5_K: T.Q8_0, T.Q6_K: T.Q4_K, T.Q8_0: T.Q5_K, T.Q4_0: T.Q5_1, T.Q5_0: T.Q4_1,
        T.Q4_1: T.Q5_0, T.Q5_1: T.Q4_0, T.MXFP4: T.MXFP4}


def _weight(qtype, n: int, k: int, seed: int, E: int = 1) -> QuantWeight:
    if qtype == T.MXFP4:
        return _mx(n, k, seed, E)
    return QuantWeight.from_raw(random_raw(qtype, E * n, k, seed), qtype, (E, n, k) if E > 1 else (n, k))


def _sizes(qtype) -> list[int]:
    """K with whole chunks of 8 slots only, and with a tail (the scalar slots after them)."""
    return [256, 768, 1280] if qtype in KQUANT else [96, 256, 288, 2880]


def _acts(G: int, K: int, seed: int) -> list[tuple]:
    xq, dx, xs = ref.quantize_q8(activations(G, K, seed))
    return [(xq[g], dx[g], xs[g]) for g in range(G)]


@pytest.mark.parametrize("qtype", FORMATS, ids=IDS)
def test_group_equals_matvec_per_activation(qtype):
    for K in _sizes(qtype):
        w = _weight(qtype, 9, K, seed=K, E=2)
        bias = torch.randn(2, 9, generator=torch.Generator().manual_seed(K)) * 3
        for G in (1, 2, 5):
            acts = _acts(G, K, seed=G + K)
            for e, rows, b in ((0, None, None), (1, (2, 7), None), (1, None, bias)):
                got = nk.matvec_group_q8(acts, w, rows, expert=e, bias=b)
                for g, a in enumerate(acts):
                    want = nk.matvec_q8(*a, w, rows, expert=e, bias=b)
                    assert torch.equal(bits(got[g]), bits(want)), (qtype.name, K, G, e, rows, g)
    w2 = _weight(qtype, 5, _sizes(qtype)[0], seed=3)                       # and the contract itself
    acts = _acts(3, w2.K, seed=4)
    got = nk.matvec_group_q8(acts, w2)
    for g, a in enumerate(acts):
        assert torch.equal(bits(got[g]), bits(ref.matvec_q8(*a, w2)))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="these builds are x86-64 ones")
@pytest.mark.parametrize("march", ["x86-64", "haswell"])
@pytest.mark.parametrize("qtype", FORMATS, ids=IDS)
def test_group_other_builds(qtype, march):
    """Built for plain x86-64 (no AVX2: storage-order codes, scalar dots) and for AVX2 without
    VNNI (maddubs pairs in int16), the same bits as this host's build's per-row path."""
    so = build.lib(march)
    K = _sizes(qtype)[-1]
    w = _weight(qtype, 7, K, seed=5)
    acts = _acts(3, K, seed=6)
    got = nk.matvec_group_q8(acts, w, so=so)
    for g, a in enumerate(acts):
        assert torch.equal(bits(got[g]), bits(nk.matvec_q8(*a, w))), g


@pytest.mark.parametrize("qtype", FORMATS, ids=IDS)
def test_group_from_mapped_rows(qtype):
    """Rows read from the GGUF blocks (gate|up from two tensors): re-laid once per row for the group."""
    K, N, E = _sizes(qtype)[-1], 6, 3
    raw = [random_raw(qtype, E * N, K, seed=9 + i).reshape(E, N, -1) for i in range(2)]
    fused = QuantWeight.from_raw(np.concatenate(raw, axis=1), qtype, (E, 2 * N, K))
    desc = nk.qmat_mapped(raw, int(qtype), K)
    acts = _acts(4, K, seed=10)
    for e in range(E):
        got = nk.matvec_group_q8(acts, desc, (N - 2, N + 3), expert=e)   # a range across gate and up
        for g, a in enumerate(acts):
            want = nk.matvec_q8(*a, fused, (N - 2, N + 3), expert=e)
            assert torch.equal(bits(got[g]), bits(want)), (qtype.name, e, g)


def _routes(kind: str, W: int, k: int, E: int, g: torch.Generator) -> torch.Tensor:
    """[W, k] expert ids: every row the same k ("shared"); a shared core plus each row's own
    ("mixed"); as few repeats as E allows ("distinct"); random, repeats within a row too ("random")."""
    if kind == "shared":
        return torch.randperm(E, generator=g)[:k].to(torch.int32).repeat(W, 1)
    if kind == "distinct":
        return torch.arange(W * k, dtype=torch.int32).reshape(W, k) % E
    if kind == "mixed":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(W)]).to(torch.int32)
        ids[:, : k // 2] = ids[0, : k // 2]
        return ids
    return torch.randint(0, E, (W, k), generator=g, dtype=torch.int32)


def _check_round(ce: CpuExperts, mb: Mailbox, req: int, x: torch.Tensor, ids: torch.Tensor, task: torch.Tensor,
                 layer: int = 0) -> None:
    """Post a round, then hold every CPU pair's output to the per-pair ffn, the others untouched."""
    mb.y.fill_(float("nan"))
    post(mb, req, layer, x, ids, task)
    wait_done(mb, req)
    xq, dx, xs = ref.quantize_q8(x)
    for m in range(x.shape[0]):
        for r in range(ids.shape[1]):
            if task[m, r]:
                want = ce.ffn(xq[m], dx[m], xs[m], layer, int(ids[m, r]))
                assert torch.equal(bits(mb.y[m, r]), bits(want)), (req, m, r)
            else:
                assert mb.y[m, r].isnan().all(), (req, m, r)


def _threads(n: int) -> dict:
    """n workers over the cpus there are (this box may have fewer: they share them)."""
    cpus = allowed_cpus()
    return {"threads": n, "cpus": [cpus[i % len(cpus)] for i in range(n)]}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("qtype", FORMATS, ids=IDS)
def test_pool_rounds_sharing_experts(qtype, threads):
    D, F, E, k, W = (96, 64, 6, 4, 8) if qtype == T.MXFP4 else (256, 256, 6, 4, 8)
    if qtype == T.MXFP4:                                                   # gpt-oss's: biases, swiglu_oai
        layers, ops = {0: (_mx(2 * F, D, seed=1, E=E), _mx(D, F, seed=2, E=E))}, {0: _ops(E, F, D, seed=3)}
    else:
        layers, ops = {0: expert_pair(qtype, DOWN[qtype], D, F, E, seed=4)}, None
    mb = Mailbox.new(W, D, k)
    ce = CpuExperts(layers, mb, n_layers=1, ops=ops, **_threads(threads)).start()
    g = torch.Generator().manual_seed(5)
    try:
        for req, (kind, w, some) in enumerate([("shared", 8, False), ("mixed", 5, False), ("distinct", 3, False),
                                               ("shared", 1, False), ("random", 8, True), ("mixed", 8, True)], 1):
            x = activations(w, D, seed=req) * 0.05
            ids = _routes(kind, w, k, E, g)
            task = torch.randint(0, 2, (w, k), generator=g, dtype=torch.int32) if some else \
                torch.ones(w, k, dtype=torch.int32)
            task[0, 0] = 1
            _check_round(ce, mb, req, x, ids, task)
    finally:
        ce.stop()


def test_pool_mapped_layer_beside_a_host_layer():
    """A mapped layer (rows from the file's blocks) and a host one, rounds sharing experts, 2 threads."""
    D, F, E, k = 64, 64, 4, 2
    gate, up = (random_raw(T.Q8_0, E * F, D, seed=s) for s in (1, 2))
    down = random_raw(T.Q4_0, E * D, F, seed=3)
    mapped = MappedExperts(_info("g", T.Q8_0, (E, F, D), gate), _info("u", T.Q8_0, (E, F, D), up),
                           _info("d", T.Q4_0, (E, D, F), down))
    layers = {0: mapped, 1: expert_pair(T.Q4_0, T.Q8_0, D, F, E, seed=4)}
    mb = Mailbox.new(6, D, k)
    ce = CpuExperts(layers, mb, n_layers=2, **_threads(2)).start()
    g = torch.Generator().manual_seed(6)
    try:
        for req, (kind, layer) in enumerate([("shared", 0), ("mixed", 1), ("shared", 1), ("random", 0)], 1):
            x = activations(6, D, seed=req) * 0.05
            _check_round(ce, mb, req, x, _routes(kind, 6, k, E, g), torch.ones(6, k, dtype=torch.int32), layer)
    finally:
        ce.stop()


def test_pool_a_round_of_many_rows_on_one_expert():
    """Every pair of a 64-row round on one expert (a group of 64, split by rows across threads)."""
    D, F, E, k, W = 128, 128, 3, 1, 64
    layers = {0: expert_pair(T.Q8_0, T.Q4_0, D, F, E, seed=7)}
    mb = Mailbox.new(W, D, k)
    ce = CpuExperts(layers, mb, n_layers=1, **_threads(3)).start()
    try:
        _check_round(ce, mb, 1, activations(W, D, seed=8) * 0.05, torch.full((W, k), 2, dtype=torch.int32),
                     torch.ones(W, k, dtype=torch.int32))
    finally:
        ce.stop()


def test_pool_oversubscribed_many_posts():
    """8 workers on this host's few cpus: the OS deschedules them mid-post all the time. The
    units are claimed one at a time, tagged with their post, and DONE comes from the thread
    that finishes the last one: 300 posts of mixed routing, each bit for bit the per-pair
    ffn, none touched by a thread that woke after its post ended."""
    D, F, E, k, W = 64, 64, 5, 2, 4
    layers = {0: expert_pair(T.Q8_0, T.Q4_0, D, F, E, seed=9)}
    mb = Mailbox.new(W, D, k)
    ce = CpuExperts(layers, mb, n_layers=1, **_threads(8)).start()
    g = torch.Generator().manual_seed(10)
    try:
        for req in range(1, 301):
            w = int(torch.randint(1, W + 1, (1,), generator=g))
            x = activations(w, D, seed=req) * 0.05
            task = torch.randint(0, 2, (w, k), generator=g, dtype=torch.int32)
            task[0, 0] = 1
            _check_round(ce, mb, req, x, _routes(["shared", "distinct", "random"][req % 3], w, k, E, g), task)
    finally:
        ce.stop()
