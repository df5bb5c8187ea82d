"""L2 prefetch: a latency-bound kernel asks for the weights a later kernel of the round reads.

Half of a decode round's kernels read almost nothing from HBM: the norms, RoPE, the
attention at short depth, the SiLU, the routing (~15 us a layer on the H200's 8B shape,
H200 profile bench/results/gpu_decode_profile-20261130-103639.json). HBM idles while they run
their chains of dependent steps, and the GEMV after them then starts cold: its first
wave waits a full HBM latency before any weight arrives, and its bytes take their own
time on top. Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2.global [addr], size`,
fire-and-forget, issued by one thread for a whole range) lets those small kernels start
moving the next GEMV's weights into the 50 MB L2 at their very top, before their PDL
wait (weights are no kernel's output). The GEMV then finds the first part of its planes
in L2. Prefetching is a hint: no value read anywhere changes, so every kernel's bits are
the same with it or without it.

A plan (`L2Prefetch`) is a table of (address, bytes) chunks over prefixes of a
weight's planes (each plane cut at the same fraction: a GEMV's first programs read the
first rows of every plane), built once at load. A kernel takes it as (PF, PF_N,
PF_BLOCK): its programs take blocks of PF_BLOCK chunks in turn (one chunk per thread of
the program, PF_BLOCK = 32 * num_warps, so no thread repeats another's), before anything
else. Off under the interpreter and when no plan is given (PF_N = 0 compiles to nothing).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1 << 16          # bytes a prefetch instruction asks for
ALIGN = 16               # the instruction's address and size granule
PAD = 512                # chunks a table is padded to a multiple of (32 lanes x 16 warps at most)


@triton.jit
def _bulk_prefetch(addr, size):
    return tl.inline_asm_elementwise("{\ncp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}",
                                     "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch(PF, PF_N: tl.constexpr, PF_BLOCK: tl.constexpr):
    """Issue this program's share of the plan's PF_N chunks (PF: int64 [2, PF_N], the
    addresses then the sizes): blocks pid, pid + grid, ... of PF_BLOCK chunks. A kernel
    calls it at its top, before its PDL wait."""
    if PF_N > 0:
        pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        for b in range(pid, PF_N // PF_BLOCK, nprog):
            i = b * PF_BLOCK + tl.arange(0, PF_BLOCK)
            _bulk_prefetch(tl.load(PF + i), tl.load(PF + PF_N + i).to(tl.int32))


@triton.jit
def expert_prefetch(EPF, ids, EPF_N: tl.constexpr, EPF_CH: tl.constexpr, CH: tl.constexpr):
    """The routed experts' slices of EPF_N planes (EPF: int64 [2, EPF_N], each plane's base
    address then its bytes per expert), for expert ids [BLOCK_K]: EPF_CH chunks of CH bytes
    per slice (those past a slice's end repeat its last chunk)."""
    c = tl.arange(0, EPF_CH)[None, :]                                  # [1, EPF_CH]
    e = ids.to(tl.int64)[:, None]                                      # [BLOCK_K, 1]
    for j in tl.static_range(EPF_N):
        base = tl.load(EPF + j)
        per = tl.load(EPF + EPF_N + j)
        off = tl.minimum(c * CH, (per - 1) // CH * CH)                 # [1, EPF_CH]
        size = (tl.minimum(per - off, CH) // 16 * 16).to(tl.int32)
        _bulk_prefetch(base + e * per + off, size)


def expert_table(weights: list, device) -> "tuple[torch.Tensor, int] | None":
    """(EPF table int64 [2, n], EPF_CH) for [E, N, K] QuantWeights' planes (each plane's
    base and bytes per expert), or None off CUDA."""
    rows = [(p.data_ptr(), p[0].numel() * p.element_size()) for w in weights for p in w.planes.values()
            if p.numel() and (p[0].numel() * p.element_size()) % ALIGN == 0]
    if not rows or torch.device(device).type != "cuda":
        return None
    ch = triton.next_power_of_2(triton.cdiv(max(b for _, b in rows), CHUNK))
    return torch.tensor(rows, dtype=torch.int64).T.contiguous().to(device), ch


class L2Prefetch:
    """The chunks covering bytes [lo, hi) x size of every plane of some weights (lo, hi:
    fractions; both ends rounded down to ALIGN bytes), padded with repeats of the first
    chunk's first granule to a multiple of PAD. `table` int64 [2, n] on the planes' device."""

    def __init__(self, parts: list[tuple[list[torch.Tensor], float, float]]):
        chunks: list[tuple[int, int]] = []
        device = None
        for planes, lo, hi in parts:
            for p in planes:
                if p is None or p.numel() == 0:
                    continue
                device = p.device
                size = p.numel() * p.element_size()
                a, b = (int(size * min(max(f, 0.0), 1.0)) // ALIGN * ALIGN for f in (lo, hi))
                base = p.data_ptr()
                chunks += [(base + o, min(CHUNK, b - o)) for o in range(a, b, CHUNK)]
        self.chunks = chunks                                     # the real ones, in order
        self.nbytes = sum(s for _, s in chunks)
        if not chunks:
            self.table = None
            return
        pad = -len(chunks) % PAD
        rows = chunks + [(chunks[0][0], ALIGN)] * pad
        self.table = torch.tensor(rows, dtype=torch.int64).T.contiguous().to(device)   # [2, n]

    def kwargs(self, num_warps: int, device: torch.device) -> dict:
        """The kernel arguments (PF, PF_N, PF_BLOCK), or nothing off CUDA / without chunks."""
        if self.table is None or torch.device(device).type != "cuda":
            return {}
        return {"PF": self.table, "PF_N": self.table.shape[1], "PF_BLOCK": 32 * num_warps}


def prefetch_kwargs(plan: "L2Prefetch | None", num_warps: int, device: torch.device) -> dict:
    return {} if plan is None else plan.kwargs(num_warps, device)
