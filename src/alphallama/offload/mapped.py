"""The tier below RAM: a MoE layer's experts read where they sit in the GGUF file.

When the RAM a host allows the store's host tier (`--host-mem`, the plan's host budget)
cannot hold every expert, the layers past the budget keep no copy at all: their experts
stay in the file's memory mapping (gguf/reader.py: read-only np.memmap views), in the
kernel's page cache when it has room, on the disk otherwise. Nothing of them is pinned.

    the CPU workers   compute such an expert from the mapped bytes: each row's GGUF blocks
                      are re-laid as planes in a per-thread scratch and run through the same
                      slot code as a host-tier row (native/gguf_rows.c), so the bits are the
                      contract's whichever tier served the expert;
    the bank          admits such an expert from planes packed from the file (the same
                      fmt.pack as the host tier's), so a slot holds the same bytes;
    prefill           dequantizes it from planes packed from the file, on the device;
    the GPU           never reads the mapping (it is not page-locked): the post kernel
                      gives every pair of a mapped expert without a slot to the CPU
                      (table entry MAPPED, kernels/moe/expert_q8_gpu.q8_post_kernel).

Read-ahead (`ReadAhead`): between rounds, the mapped layers' likeliest experts that have
no slot (the admission policy's decayed scores, which follow the context) are handed to
the kernel with madvise(MADV_WILLNEED), so a page-cache miss is read before a round needs
it; each expert is asked for once until it drops out of the likely set.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..gguf.reader import TensorInfo
from ..kernels.formats.qweight import QuantWeight

HOST, MAPPED = -1, -2   # table entries of an expert without a slot: in pinned RAM, or in the mapped file


def _rows(t: TensorInfo) -> np.ndarray:
    """An [E, N, K] tensor's file bytes as uint8 [E, N, row_bytes] (a view of the mapping)."""
    E, N, _ = t.shape
    return t.data.reshape(E, N, -1).view(np.uint8)


def map_past_budget(layer_bytes: dict[int, int], budget: int | None) -> list[int]:
    """The MoE layers whose experts stay in the mapped file: with `budget` bytes of pinned
    RAM, the layers (id -> bytes of all its experts) are taken in order while they fit;
    the rest are mapped. None: no budget, nothing mapped. The store and the plan both
    decide with this."""
    if budget is None:
        return []
    if budget < 0:
        raise ValueError(f"the host tier's budget must be >= 0 bytes, got {budget}")
    mapped, used = [], 0
    for i in sorted(layer_bytes):
        if used + layer_bytes[i] <= budget:
            used += layer_bytes[i]
        else:
            mapped.append(i)
    return mapped


@dataclass(frozen=True)
class MappedExperts:
    """One MoE layer's routed experts (gate, up, down [E, N, K]) in the mapped file."""
    gate: TensorInfo
    up: TensorInfo
    down: TensorInfo

    @property
    def n_experts(self) -> int:
        return int(self.gate.shape[0])

    @property
    def file_bytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def desc(self):
        """The CPU workers' descriptor (native/kernels.LayerDesc), rows read from the mapping."""
        from .native.kernels import LayerDesc, qmat_mapped
        if self.gate.qtype != self.up.qtype:
            raise ValueError(f"{self.gate.name}: gate and up of different types cannot be fused")
        gu = qmat_mapped([_rows(self.gate), _rows(self.up)], int(self.gate.qtype), int(self.gate.shape[2]))
        dn = qmat_mapped([_rows(self.down)], int(self.down.qtype), int(self.down.shape[2]))
        return LayerDesc(gu, dn)

    def views(self, e: int) -> list[np.ndarray]:
        """Expert e's bytes in the mapping: its gate, up and down rows."""
        return [_rows(t)[e] for t in (self.gate, self.up, self.down)]

    def expert(self, e: int, device) -> tuple[QuantWeight, QuantWeight]:
        """Expert e packed from the file, as the host tier holds it: (gate_up [1, 2F, D], down [1, D, F])."""
        from .planes import pack_experts
        one = [replace(t, shape=(1, *t.shape[1:]), data=_rows(t)[e:e + 1], offset=t.offset + e * _rows(t).strides[0])
               for t in (self.gate, self.up, self.down)]
        return pack_experts(*one, device)


class ReadAhead:
    """Between rounds: ask the kernel to read the likely experts of the mapped layers.

    advise(view) -> bool: the hint for one mapped byte range (default: madvise WILLNEED
    through the native library). per_layer: the likely experts kept per mapped layer."""

    def __init__(self, layers: dict[int, MappedExperts], per_layer: int,
                 advise: Callable[[np.ndarray], bool] | None = None):
        if per_layer < 0:
            raise ValueError(f"read-ahead experts per layer must be >= 0, got {per_layer}")
        if advise is None:
            from .native.kernels import willneed as advise
        self.layers, self.per_layer, self.advise = layers, per_layer, advise
        self.asked: set[tuple[int, int]] = set()   # (layer, expert) hinted and still likely
        self.hints = 0                             # experts hinted so far

    def step(self, score: np.ndarray, resident: np.ndarray) -> None:
        """score / resident [L, E]: the policy's scores and which experts have a slot."""
        if self.per_layer == 0:
            return
        likely = set()
        for i, m in self.layers.items():
            s = np.where(resident[i], -np.inf, score[i])                       # [E]
            top = np.argsort(-s, kind="stable")[:self.per_layer]
            likely.update((i, int(e)) for e in top if s[e] > 0)
        for i, e in sorted(likely - self.asked):
            for v in self.layers[i].views(e):
                self.advise(v)
            self.hints += 1
        self.asked = likely
