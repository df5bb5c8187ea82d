"""The CPU tier: what a round's MoE layers need to hand (row, rank) pairs to the CPU
workers, and the host-side half of the mailbox protocol (offload/mailbox.py).

On the GPU the post, the sequence number and the wait all happen inside the round's
graph (kernels/moe/expert_q8_gpu.py); `seq` and `share` are device tensors (graph inputs).
Under the Triton interpreter the kernels post, and the host waits (`wait_host`): an
interpreted kernel cannot spin on memory another thread writes.
"""
from __future__ import annotations

import os
import threading
import time
import weakref

import torch

from .mailbox import DONE, ERR, Mailbox

WAIT_TIMEOUT_S = 30.0


class CpuWorkersError(RuntimeError):
    pass


class CpuLink:
    def __init__(self, mailbox: Mailbox, device, share: float = 1.0):
        """share: the fraction of a layer's host pairs the CPU computes (the first, in row,
        rank order); the GPU reads the others in place over PCIe, at the same time."""
        self.mailbox = mailbox
        self.device = torch.device(device)
        self.seq = torch.zeros(1, dtype=torch.int32, device=self.device)          # last REQ posted
        self.share = torch.zeros(1, dtype=torch.int32, device=self.device)        # 0..256
        self.set_share(share)

    def set_share(self, share: float) -> None:
        """Between rounds (a graph input: no recapture)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the CPU share of host experts is a fraction in [0, 1], got {share}")
        self.share.fill_(round(share * 256))
        self.share_now = round(share * 256) / 256      # the same, readable from any thread without the device

    def wait_host(self, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Until the workers answered the last post (DONE == seq)."""
        s = int(self.seq.item())
        ctl = self.mailbox.ctl
        t0 = time.monotonic()
        while int(ctl[DONE]) != s:
            if time.monotonic() - t0 > timeout_s:
                raise CpuWorkersError(f"the CPU expert workers did not answer post {s} in {timeout_s:.0f} s")
            time.sleep(0)

    def check(self) -> None:
        """After a round: did the GPU give up waiting for the workers?"""
        if int(self.mailbox.ctl[ERR]) != 0:
            raise CpuWorkersError("the GPU gave up waiting for the CPU expert workers (are they running?)")


class CpuTier:
    """The CPU workers serving a store's host tier, their link, and the cpus they leave
    to the thread that launches rounds (kept apart: never a core shared with a worker).

    A thread pinned apart gets its own affinity back when the tier goes (garbage
    collection or interpreter exit): a thread inherits its creator's affinity and the next
    tier's workers are chosen from the calling thread's, so a second store in the process
    (a reload, a benchmark's next arm) would otherwise find one cpu for all its workers
    (measured: 10x slower rounds on the arms after a bench's first, 2026-12-06)."""

    def __init__(self, link: CpuLink, experts, launch_cpus: set[int]):
        self.link, self.experts, self.launch_cpus = link, experts, launch_cpus
        self._pinned: dict[int, set[int]] = {}         # native thread id -> its affinity before
        self._restore = weakref.finalize(self, _give_back_affinity, self._pinned)

    def keep_launch_thread_apart(self) -> None:
        """Pin the calling (round-launching) thread, once, to the cpus the workers do not
        use (Linux; elsewhere a no-op)."""
        tid = threading.get_native_id()
        if tid in self._pinned or not self.launch_cpus or not hasattr(os, "sched_setaffinity"):
            return
        self._pinned[tid] = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.launch_cpus)    # 0: this thread

    def release_launch_threads(self) -> None:
        """Give every thread pinned apart its affinity back (also done when the tier goes)."""
        _give_back_affinity(self._pinned)


def _give_back_affinity(pinned: dict[int, set[int]]) -> None:
    """Finalizer: must not reference the CpuTier. A thread that has exited is skipped."""
    for tid, cpus in list(pinned.items()):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:              # ESRCH: the thread is gone
            pass
        pinned.pop(tid, None)


def start_cpu_tier(store, d_model: int, top_k: int, max_w: int, device, threads: int | None, share: float,
                   progress=None, ops: dict | None = None) -> CpuTier | None:
    """CPU workers for the store's host tier, if every MoE layer fits the expert contract
    (its formats, shapes and activation; ops: layer -> expert_q8.ExpertOps, its activation
    and biases, where not SiLU and none); else (or without a C compiler) None: the host
    tier stays read in place over PCIe."""
    from ..kernels.moe.expert_q8 import ExpertOps
    from ..kernels.moe.moe_q8 import contract_ok
    from .native.build import NativeBuildError
    from .native.probe import allowed_cpus, placement
    from .native.workers import CpuExperts
    from .numa import on_cpus
    ops = ops or {}
    layers = store.moe_layers.tolist()
    if not all(contract_ok(store.layer(i).host_gate_up, store.layer(i).host_down, ops.get(i, ExpertOps()).act)
               for i in layers):
        if progress is not None:
            progress("CPU expert workers off: an expert format or activation outside the contract "
                     "(host tier over PCIe)", 0)
        return None
    placed = placement(store.device)          # None on a host of one memory node
    with on_cpus(placed.cpus if placed is not None else None):
        mailbox = Mailbox.new(max_w, d_model, top_k)   # polled by the workers: on their node
    try:
        experts = CpuExperts.from_store(store, mailbox, threads, ops=ops).start()
    except (NativeBuildError, OSError) as e:
        if progress is not None:
            progress(f"CPU expert workers off ({e}); host tier over PCIe", 0)
        return None
    if placed is not None and progress is not None:
        progress(placed.describe(experts.cpus), 0)
    return CpuTier(CpuLink(mailbox, device, share), experts, set(allowed_cpus()) - set(experts.cpus))
