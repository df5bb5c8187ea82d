"""The mailbox between a round's MoE layers on the GPU and the CPU expert workers.

One block of pinned, device-mapped host memory per model. Inside the round's graph,
at each MoE layer, the GPU posts the layer's quantized activations (the expert
contract's xq / dx / xs, kernels/moe/expert_q8.py), the ranks' expert ids and which ranks
the CPU computes, then the sequence number `req` last (a system-scope release store).
The workers (offload/native) see `req` change, compute their ranks' experts from the
host tier where the weights sit, write `y`, then `done = req`. The GPU's combine
kernel spins on `done` (a system-scope acquire load) only if the layer gave the CPU
any rank, and adds every rank in order whichever side computed it.

Control words (int32, each on its own 64-byte line):
    REQ   sequence number of the post (> 0, increasing), written last by the GPU
    LAYER model layer of the post
    ROWS  W, rows posted
    DONE  = REQ once the CPU's results are in `y`, written last by the CPU
    STOP  set to 1 by the host to stop the workers
    ERR   set to 1 by the GPU when it gave up waiting for DONE (the host raises)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.moe.mailbox_layout import CTL_WORDS, DONE, ERR, LAYER, REQ, ROWS, STOP
from .numa import touch_pages
from .store import pin

__all__ = ["CTL_WORDS", "DONE", "ERR", "LAYER", "REQ", "ROWS", "STOP", "Mailbox"]   # the words: kernels/moe/mailbox_layout.py


@dataclass
class Mailbox:
    ctl: torch.Tensor    # int32 [CTL_WORDS]
    xq: torch.Tensor     # int8  [max_w, D]
    dx: torch.Tensor     # f32   [max_w, D / 32]
    xs: torch.Tensor     # int32 [max_w, D / 16]
    ids: torch.Tensor    # int32 [max_w, k]   expert id of each rank
    task: torch.Tensor   # int32 [max_w, k]   1: the CPU computes this rank
    y: torch.Tensor      # f32   [max_w, k, D]  the CPU's outputs (its ranks only)

    @classmethod
    def new(cls, max_w: int, d_model: int, top_k: int) -> "Mailbox":
        if d_model % 32:
            raise ValueError(f"the expert contract needs d_model % 32 == 0, got {d_model}")

        def buf(shape, dtype):   # first touched by this thread (numa.py: on its node), then zeroed
            return pin(touch_pages(torch.empty(shape, dtype=dtype)).zero_())
        return cls(buf((CTL_WORDS,), torch.int32), buf((max_w, d_model), torch.int8),
                   buf((max_w, d_model // 32), torch.float32), buf((max_w, d_model // 16), torch.int32),
                   buf((max_w, top_k), torch.int32), buf((max_w, top_k), torch.int32),
                   buf((max_w, top_k, d_model), torch.float32))

    @property
    def max_w(self) -> int:
        return self.xq.shape[0]

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]

    @property
    def d_model(self) -> int:
        return self.xq.shape[1]
