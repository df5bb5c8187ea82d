"""Expert planes for the store: a layer's experts packed as the GPU formats lay them out,
page-locked host planes (the host tier), and the bank's slots shaped like them."""
from __future__ import annotations

import weakref

import torch

from ..gguf.reader import TensorInfo
from ..kernels.formats.qweight import QuantWeight
from .numa import on_cpus, touch_pages


def _expert_rows(p: TensorInfo) -> torch.Tensor:
    """An [E, N, K] tensor's bytes as uint8 [E, N, row_bytes]."""
    E, N, _ = p.shape
    return torch.from_numpy(p.data.reshape(E, N, -1).view("uint8").copy())


def pack_experts(gate: TensorInfo, up: TensorInfo, down: TensorInfo, device) -> tuple[QuantWeight, QuantWeight]:
    """One layer's experts as (gate|up fused along N [E, 2F, D], down [E, D, F])."""
    if gate.qtype != up.qtype:
        raise NotImplementedError(f"experts' gate and up of different types ({gate.qtype.name}, "
                                  f"{up.qtype.name}) are not supported on the GPU")
    E, F, D = gate.shape
    raw = torch.cat([_expert_rows(gate), _expert_rows(up)], dim=1)           # [E, 2F, row_bytes]
    gate_up = QuantWeight.from_raw(raw, gate.qtype, (E, 2 * F, D), device)
    return gate_up, QuantWeight.from_raw(down.data, down.qtype, tuple(down.shape), device)


def pin(t: torch.Tensor) -> torch.Tensor:
    """Page-lock and map `t` (cudaHostRegister) so kernels read it in place and copies
    from it are asynchronous DMA; unregistered when `t` is freed. A no-op without CUDA."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return t
    cudart = torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    rc = cudart.cudaHostRegister(ptr, size, 3)   # cudaHostRegisterPortable | cudaHostRegisterMapped
    if int(rc) != 0:
        return t.pin_memory()   # the allocator's pinned memory (rounded up to a power of two)
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


def host_like(w: QuantWeight, rows: int, cpus: tuple[int, ...] | None = None) -> QuantWeight:
    """Empty pinned host planes for `rows` experts shaped like w's. cpus: a memory node's
    (numa.Placement): the planes are allocated, first touched and pinned by this thread
    moved onto them, so their pages lie on that node; None: wherever the kernel puts them."""
    def plane(p: torch.Tensor) -> torch.Tensor:
        t = torch.empty((rows, *p.shape[1:]), dtype=p.dtype)
        return pin(touch_pages(t) if cpus else t)
    with on_cpus(cpus):
        planes = {n: plane(p) for n, p in w.planes.items()}
    return QuantWeight(w.qtype, (rows, *w.shape[1:]), planes, w.table)   # a codebook stays where the kernels read


def bank_like(w: QuantWeight, slots: int, device) -> QuantWeight:
    planes = {n: torch.zeros((slots, *p.shape[1:]), dtype=p.dtype, device=device) for n, p in w.planes.items()}
    return QuantWeight(w.qtype, (slots, *w.shape[1:]), planes, w.table)


def sub_experts(w: QuantWeight, start: int, stop: int) -> QuantWeight:
    return QuantWeight(w.qtype, (stop - start, *w.shape[1:]), {n: p[start:stop] for n, p in w.planes.items()},
                       w.table)
