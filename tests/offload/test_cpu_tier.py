"""The mailbox protocol between the MoE kernels and CPU workers, with a Python stand-in
worker that computes its pairs by the plain-torch contract (the native workers have
their own tests against the same reference). A layer's output must be the reference's
bits whichever pairs the CPU took (its share), on CPU (interpreter) and on a GPU, where the
combine spins on the mailbox inside a captured CUDA graph."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.moe.expert_q8 import expert_ffn_q8, moe_q8 as moe_q8_ref  # noqa: E402
from alphallama.kernels.moe.moe_q8 import moe_q8, tiers_torch  # noqa: E402
from alphallama.offload.cpu_tier import CpuLink  # noqa: E402
from alphallama.offload.mailbox import DONE, LAYER, REQ, ROWS, Mailbox  # noqa: E402
from tests.kernels.test_moe_q8 import _bank, _layer  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("one_thread")


class PyWorker(threading.Thread):
    """Answers posts like the native pool: the tasks' experts from the host tier."""

    def __init__(self, mb: Mailbox, layers: dict):
        super().__init__(daemon=True)
        self.mb, self.layers, self.stop, self.answered, self.layers_seen = mb, layers, False, 0, []

    def run(self):
        mb, last = self.mb, 0
        while not self.stop:
            req = int(mb.ctl[REQ])
            if req == last:
                time.sleep(1e-4)
                continue
            layer, W = int(mb.ctl[LAYER]), int(mb.ctl[ROWS])
            gu, dn = self.layers[layer]
            for m in range(W):
                for r in range(mb.top_k):
                    if mb.task[m, r]:
                        e = int(mb.ids[m, r])
                        mb.y[m, r] = expert_ffn_q8(mb.xq[m], mb.dx[m], mb.xs[m], gu.expert(e), dn.expert(e))
            self.layers_seen.append(layer)
            self.answered += 1
            last = req
            mb.ctl[DONE] = req


def _setup(E=4, D=256, F=256, k=2, max_w=4):
    gu, dn = _layer(T.Q4_K, T.Q6_K, E, D, F, seed=21)
    host = (_cpu_copy(gu), _cpu_copy(dn))
    mb = Mailbox.new(max_w, D, k)
    link = CpuLink(mb, DEV)
    w = PyWorker(mb, {5: host})
    w.start()
    table = torch.tensor([0, -1, -1, -1], dtype=torch.int32, device=DEV)        # expert 0 in the bank
    return gu, dn, _bank(gu, [0]), _bank(dn, [0]), table, link, w


def _cpu_copy(w):
    from alphallama.kernels import QuantWeight
    return QuantWeight(w.qtype, w.shape, {n: p.cpu() for n, p in w.planes.items()})


@pytest.mark.parametrize("share", [1.0, 0.5, 0.0])
def test_cpu_pairs_give_the_reference_bits(share):
    gu, dn, bgu, bdn, table, link, worker = _setup()
    try:
        link.set_share(share)
        g = torch.Generator().manual_seed(22)
        h = torch.randn(3, 256, generator=g).to(DEV)
        experts = torch.tensor([[1, 0], [3, 2], [2, 1]], dtype=torch.int32, device=DEV)
        weights = torch.rand(3, 2, generator=g).to(DEV)
        tiers = tiers_torch(experts.cpu(), table.cpu(), int(link.share.item()))
        out = moe_q8(h, weights, experts, gu, dn, bgu, bdn, table, layer=5, link=link)
        ref = moe_q8_ref(h, gu, dn, experts, weights)
        assert torch.equal(out.cpu(), ref)
        n_cpu = int((tiers == 2).sum())
        assert n_cpu == {1.0: 5, 0.5: 3, 0.0: 0}[share]            # 5 host pairs: (5 * 128 + 128) >> 8 = 3
        assert worker.answered == (1 if n_cpu else 0) and all(x == 5 for x in worker.layers_seen)
    finally:
        worker.stop = True


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU (the CPU case above runs the same protocol)")
def test_cpu_pairs_inside_a_cuda_graph():
    gu, dn, bgu, bdn, table, link, worker = _setup()
    try:
        h = torch.zeros(2, 256, device=DEV)
        experts = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
        weights = torch.zeros(2, 2, device=DEV)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe_q8(h, weights, experts, gu, dn, bgu, bdn, table, layer=5, link=link)   # compile
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_q8(h, weights, experts, gu, dn, bgu, bdn, table, layer=5, link=link)
        g = torch.Generator().manual_seed(23)
        for step in range(3):
            h.copy_(torch.randn(2, 256, generator=g))
            experts.copy_(torch.randint(0, 4, (2, 2), generator=g, dtype=torch.int32))
            weights.copy_(torch.rand(2, 2, generator=g))
            before = worker.answered
            graph.replay()
            torch.cuda.synchronize()
            link.check()
            assert torch.equal(out.cpu(), moe_q8_ref(h, gu, dn, experts, weights))
            busy = bool((tiers_torch(experts.cpu(), table.cpu(), 256) == 2).any())
            assert worker.answered == before + int(busy)
    finally:
        worker.stop = True
