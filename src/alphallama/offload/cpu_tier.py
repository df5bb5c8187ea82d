"""The CPU tier: what a round's MoE layers need to hand (row, rank) pairs to the CPU
workers, and the host-side half of the mailbox protocol (offload/mailbox.py).

On the GPU the post, the sequence number and the wait all happen inside the round's
graph (kernels/moe/expert_q8_gpu.py); `seq` and `share` are device tensors (graph inputs).
Under the Triton interpreter the kernels post, and the host waits (`wait_host`): an
interpreted kernel cannot spin on memory another thread writes.
"""
from __future__ import annotations

import time

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
