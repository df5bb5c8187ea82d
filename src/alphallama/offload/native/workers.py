"""CpuExperts: the pool of C worker threads that computes routed experts where their
weights sit (the store's host tier, read in place), driven through the mailbox.

    experts = CpuExperts.from_store(store, mailbox)   # or CpuExperts(layers, mailbox, n_layers)
    experts.start()           # threads pinned away from the calling (launch) thread
    ...                       # the GPU posts; the workers write y and DONE
    experts.stop()            # also at garbage collection and interpreter exit

Thread 0 polls the mailbox's REQ; on a change it reads LAYER, ROWS and the ranks with
task == 1 (the pairs), grouped by expert, and all threads split the gate|up rows of every
group (+ the experts' biases), each weight row read once for all the group's pairs (a
round's rows that share an expert stream it from RAM once: native/post.c), then the
layer's activation (SiLU, or gpt-oss's swiglu_oai: ExpertOps) and quantization per pair,
then the down rows (+ biases) into y[m, r, :]; thread 0 then stores DONE = REQ. Idle threads spin ~2 ms, then sleep ~30 us between polls, and 0.5 ms
after 100 ms without a post (an idle pool of 2 threads used ~7% of one core here).
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from ...kernels.formats.qweight import QuantWeight
from ...kernels.moe.expert_q8 import ExpertOps, supports_act
from ..mailbox import Mailbox
from .build import lib
from .kernels import LayerDesc, bias_plane, qmat
from .probe import worker_cpus


CLOCK = ("posts", "busy_ns", "gap_ns", "gaps", "pairs", "groups")   # pool.c's ST_* order


def _stop(handle: list) -> None:
    """Stop the pool behind handle[0] (finalizer: must not reference the CpuExperts)."""
    if handle and handle[0]:
        lib().aq_pool_stop(handle[0])
        handle[0] = None


class CpuExperts:
    def __init__(self, layers: dict[int, "tuple[QuantWeight, QuantWeight] | MappedExperts"], mailbox: Mailbox,
                 n_layers: int, threads: int | None = None, cpus: list[int] | None = None,
                 ops: dict[int, ExpertOps] | None = None):
        """layers: model layer id -> (gate_up [E, 2F, D], down [E, D, F]) host planes, or
        the layer's experts in the mapped file (offload/mapped.py: rows read from the GGUF
        blocks). threads/cpus: worker count and the cpus to pin them to (default: the
        probe's count, on cpus other than the calling thread's). ops: a layer's activation
        and biases where they are not SiLU and none (gpt-oss's; copied to host memory)."""
        from ..mapped import MappedExperts
        if mailbox.xq.device.type != "cpu":
            raise ValueError("the mailbox must live in host memory")
        D = mailbox.d_model
        self._descs = (LayerDesc * max(n_layers, 1))()
        self._keep: list[torch.Tensor] = []        # the biases' host copies the C side reads
        for i, src in layers.items():
            if not 0 <= i < n_layers:
                raise ValueError(f"layer {i} outside 0..{n_layers - 1}")
            d = src.desc() if isinstance(src, MappedExperts) else LayerDesc(qmat(src[0]), qmat(src[1]))
            gu, dn = d.gate_up, d.down
            if gu.K != D or dn.N != D or dn.K * 2 != gu.N or gu.E != dn.E:
                raise ValueError(f"layer {i}: gate_up [{gu.E}, {gu.N}, {gu.K}] / down [{dn.E}, {dn.N}, {dn.K}] "
                                 f"do not match d_model {D}")
            if dn.K % 32:
                raise ValueError(f"layer {i}: the expert contract needs F % 32 == 0, got F={dn.K}")
            self._keep += self._set_ops(i, d, (ops or {}).get(i, ExpertOps()))
            self._descs[i] = d
        self.layers, self.mailbox, self.n_layers = layers, mailbox, n_layers   # layers: kept alive for the C side
        self.cpus = list(cpus) if cpus is not None else worker_cpus(threads)
        if threads is not None and cpus is not None and len(self.cpus) != threads:
            raise ValueError(f"{threads} threads but {len(self.cpus)} cpus given")
        self.threads = len(self.cpus)
        self._handle: list = [None]
        self._finalizer = weakref.finalize(self, _stop, self._handle)   # also runs at interpreter exit

    @staticmethod
    def _set_ops(i: int, d: LayerDesc, ops: ExpertOps) -> list[torch.Tensor]:
        """Layer i's activation and biases into its descriptor: the bias planes it points at."""
        if not supports_act(ops.act):
            raise ValueError(f"layer {i}: the expert contract has no activation {ops.act}")
        d.act = ops.act
        if ops.biases is None:
            return []
        planes = [bias_plane(b, q.E, q.N) for b, q in zip(ops.biases, (d.gate_up, d.down))]
        d.gate_up.bias, d.down.bias = (p.data_ptr() for p in planes)
        return planes

    @classmethod
    def from_store(cls, store, mailbox: Mailbox, threads: int | None = None,
                   cpus: list[int] | None = None, ops: dict[int, ExpertOps] | None = None) -> "CpuExperts":
        """Every MoE layer of an ExpertStore: its host tier read in place, or its mapped
        file's blocks (the store's mapped layers); ops as the constructor's. Default cpus:
        on a host of several memory nodes, the store's GPU's node's (probe.worker_cpus)."""
        if cpus is None:
            cpus, threads = worker_cpus(threads, store.device), None
        return cls(store.cpu_sources(), mailbox, store.table.shape[0], threads, cpus, ops)

    @property
    def running(self) -> bool:
        return bool(self._handle[0])

    def start(self) -> "CpuExperts":
        if self.running:
            return self
        mb = self.mailbox
        cpu_arr = (ctypes.c_int * self.threads)(*self.cpus)
        h = lib().aq_pool_start(self.threads, cpu_arr, mb.ctl.data_ptr(), mb.xq.data_ptr(), mb.dx.data_ptr(),
                                mb.xs.data_ptr(), mb.ids.data_ptr(), mb.task.data_ptr(), mb.y.data_ptr(),
                                mb.max_w, mb.top_k, mb.d_model, ctypes.byref(self._descs), self.n_layers)
        if not h:
            raise RuntimeError(f"could not start {self.threads} CPU expert threads "
                               f"(max_w * top_k must be <= 4096: {mb.max_w} * {mb.top_k})")
        self._handle[0] = h
        return self

    def stop(self) -> None:
        _stop(self._handle)

    def clock(self) -> dict[str, int]:
        """The pool's sums since it started (pool.c's clock): posts served, busy_ns (thread 0
        seeing REQ to DONE: the CPU's part of a post), gap_ns over gaps (a DONE to the next
        REQ within 2 ms: the GPU's part between two posts of a round), pairs and groups
        (distinct experts, each streamed from RAM once a post). Zeros when not running."""
        out = (ctypes.c_long * len(CLOCK))()
        lib().aq_pool_stats(self._handle[0], out)
        return dict(zip(CLOCK, out))

    def __enter__(self) -> "CpuExperts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def ffn(self, xq: torch.Tensor, dx: torch.Tensor, xs: torch.Tensor, layer: int, expert: int) -> torch.Tensor:
        """One quantized row (xq int8 [D], dx [D/32], xs int32 [D/16]) through one expert, on
        the calling thread: y float32 [D]."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} has no experts here (layers: {sorted(self.layers)})")
        E = self._descs[layer].gate_up.E
        if not 0 <= expert < E:
            raise ValueError(f"expert {expert} outside 0..{E - 1}")
        D = self.mailbox.d_model
        xq, dx, xs = xq.to(torch.int8).contiguous(), dx.float().contiguous(), xs.to(torch.int32).contiguous()
        if xq.numel() != D or dx.numel() != D // 32 or xs.numel() != D // 16:
            raise ValueError(f"a quantized row of d_model {D} is xq [{D}], dx [{D // 32}], xs [{D // 16}]")
        y = torch.empty(D)
        rc = lib().aq_expert_ffn(ctypes.byref(self._descs[layer]), expert, xq.data_ptr(), dx.data_ptr(),
                                 xs.data_ptr(), y.data_ptr())
        if rc != 0:
            raise RuntimeError(f"expert_ffn failed (rc {rc})")
        return y

