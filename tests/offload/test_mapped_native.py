"""The mapped tier's C side: a GGUF row re-laid by the workers (native/gguf_rows.c) is the
planes fmt.pack makes, byte for byte, so a matvec from the file's blocks has the bits of
one from the host tier's planes; and the pool computes a mapped layer's experts as it
computes a host layer's."""
from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from alphallama.gguf.reader import TensorInfo
from alphallama.kernels import QuantWeight
from alphallama.kernels.formats.qweight import format_of
from alphallama.kernels.moe import expert_q8 as ref
from alphallama.offload.mailbox import Mailbox
from alphallama.offload.mapped import MappedExperts
from alphallama.offload.native import build
from alphallama.offload.native import kernels as nk
from alphallama.offload.native.workers import CpuExperts
from tests.kernels.test_qmatmul import random_raw
from tests.offload.test_native import KQUANT, QTYPES, activations, bits


MAPPED = [*QTYPES, T.MXFP4]      # the contract's formats (MXFP4: gpt-oss's experts)
MAPPED_IDS = [t.name for t in MAPPED]


def _k(qtype) -> int:
    return 512 if qtype in KQUANT else 96


BUILDS = ["native"] + (["x86-64", "haswell"] if platform.machine() == "x86_64" else [])


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("qtype", MAPPED, ids=MAPPED_IDS)
def test_repack_row_is_fmt_pack(qtype, march):
    """Every build re-lays a row as fmt.pack lays it: x86-64 by the scalar gather, AVX2
    builds in vectors (each format's blocks, all but a small format's last ones whose
    32-byte window would pass the row's end: those take the scalar gather, so both meet)."""
    so = build.lib(march)
    if march != "x86-64" and platform.machine() == "x86_64" and "avx2" in _cpu_flags():
        assert so.aq_relay_vectorized(int(qtype)) == 1, qtype.name
    if march == "x86-64":
        assert so.aq_relay_vectorized(int(qtype)) == 0
    K = _k(qtype)
    raw = random_raw(qtype, 3, K, seed=K)                                  # [3, row_bytes]
    block, size = GGML_QUANT_SIZES[qtype]
    planes = format_of(qtype).pack(torch.from_numpy(raw.reshape(3, K // block, size).copy()))
    for r in range(3):
        got = nk.repack_row(raw[r], int(qtype), K, so=so)
        for name, p in planes.items():
            want = p[r].contiguous().view(torch.uint8).numpy()
            assert np.array_equal(got[name][:want.size], want), (qtype.name, name, r, march)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))


@pytest.mark.parametrize("qtype", MAPPED, ids=MAPPED_IDS)
def test_matvec_from_mapped_rows_bit_exact(qtype):
    K, N, E = _k(qtype), 8, 3
    raw = [random_raw(qtype, E * N, K, seed=7 + i).reshape(E, N, -1) for i in range(2)]   # two tensors: gate, up
    fused = QuantWeight.from_raw(np.concatenate(raw, axis=1), qtype, (E, 2 * N, K))
    desc = nk.qmat_mapped(raw, int(qtype), K)
    xq, dx, xs = ref.quantize_q8(activations(1, K, seed=3))
    for e in range(E):
        want = nk.matvec_q8(xq[0], dx[0], xs[0], fused, expert=e)
        assert torch.equal(bits(nk.matvec_q8(xq[0], dx[0], xs[0], desc, expert=e)), bits(want)), (qtype.name, e)
        assert torch.equal(bits(nk.matvec_q8(xq[0], dx[0], xs[0], desc, (N - 2, N + 3), expert=e)),
                           bits(want[N - 2:N + 3]))                       # a range across gate and up


def _info(name: str, qtype, shape, data: np.ndarray) -> TensorInfo:
    return TensorInfo(name, qtype, shape, data.reshape(shape[0], -1), 0)


def test_pool_ffn_mapped_equals_host():
    D, F, E = 64, 64, 3
    gate, up = (random_raw(T.Q8_0, E * F, D, seed=s) for s in (1, 2))
    down = random_raw(T.Q4_0, E * D, F, seed=3)
    m = MappedExperts(_info("g", T.Q8_0, (E, F, D), gate), _info("u", T.Q8_0, (E, F, D), up),
                      _info("d", T.Q4_0, (E, D, F), down))
    host = {0: (QuantWeight.from_raw(np.concatenate([gate.reshape(E, F, -1), up.reshape(E, F, -1)], 1), T.Q8_0,
                                     (E, 2 * F, D)), QuantWeight.from_raw(down, T.Q4_0, (E, D, F)))}
    xq, dx, xs = ref.quantize_q8(activations(1, D, seed=5))
    a = CpuExperts(host, Mailbox.new(2, D, 2), n_layers=1, threads=1)
    b = CpuExperts({0: m}, Mailbox.new(2, D, 2), n_layers=1, threads=1)
    for e in range(E):
        assert torch.equal(bits(b.ffn(xq[0], dx[0], xs[0], 0, e)), bits(a.ffn(xq[0], dx[0], xs[0], 0, e)))
        gu, dn = m.expert(e, "cpu")                                        # packed for the bank / prefill
        for w, h in ((gu, host[0][0]), (dn, host[0][1])):
            assert all(torch.equal(w.planes[n][0], h.planes[n][e]) for n in h.planes)
