"""The prefill GEMMs' scratch: reused buffers for dequantized weight row blocks, and the
order of their use (kernels/prefill/qgemm.py's units)."""
from __future__ import annotations

from collections import deque

import torch

from ..kernels.formats.dequant import DEQ_TILE
from ..kernels.formats.qweight import QuantWeight
from ..kernels.prefill.qgemm import Unit, units_of
from .overrides import PRODUCT, Overrides


def activation_dtype(device: torch.device) -> torch.dtype:
    """Activations into the quantized GEMVs: bf16 on the GPU (half the bytes a weight tile
    re-reads; 2.4x faster at W = 1 than fp32, docs/decisions/gemv-history.md), the residual
    stream staying fp32; fp32 on the CPU interpreter (tests)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def prefill_scratch(o: Overrides, dtype: torch.dtype, device: torch.device, graphs: bool) -> Scratch:
    """A model's dequantized-weight buffers for the prefill GEMMs (allocated on first use):
    o.prefill_scratch_mib of `dtype` values."""
    elements = (o.prefill_scratch_mib << 20) // torch.empty(0, dtype=dtype).element_size()
    return Scratch(elements, dtype, device, overlap=o.prefill_overlap, graphs=graphs)


class Scratch:
    """The reused dequantization buffers (`elements` values of `dtype` in all) and the
    order of their use. The model owns one; every weight of a prefill chunk passes
    through a buffer in turn.

    overlap (CUDA): two buffers; while cuBLAS multiplies by one, the next weight is
    dequantized into the other on a side stream (the GEMMs are compute bound, the
    dequantize memory bound, so they share the chip). Events order the reuse: a buffer
    is rewritten only after the GEMM that read it, and read only after its dequantize.
    `plan` names the chunk's GEMMs in order (the caller knows them ahead); a GEMM not
    in the plan (MoE experts before `expect`) is dequantized when asked for. Without
    overlap, one buffer and one stream: dequantize, multiply, in turn."""

    def __init__(self, elements: int, dtype: torch.dtype, device: torch.device, overlap: bool = PRODUCT.prefill_overlap,
                 tile: tuple = DEQ_TILE, graphs: bool = PRODUCT.prefill_graphs):
        self.elements, self.dtype, self.device = elements, dtype, torch.device(device)
        self.overlap = overlap
        # prefill chunks replayed as CUDA graphs (runtime/gpu_prefill.ChunkGraphs), the one
        # captured last kept here: the buffers its GEMMs read are these
        self.graphs = graphs
        self.captured: dict = {}
        self.tile = tile
        self._out_fp32: dict = {}                # op -> does op(out_dtype=float32) work here? (probed once)
        self._bufs: list[torch.Tensor] = []
        self._cache: dict[tuple[int, int], tuple[list, list[Unit]]] = {}
        self._queue: deque[Unit] = deque()      # planned units not yet dequantized
        self._held: deque[tuple[Unit, int]] = deque()   # dequantized ahead: (unit, buffer)
        self._free: list[int] = []
        self._side = None                       # the dequantize stream (CUDA, overlap)
        self._ready: list = []                  # per buffer: its last dequantize done
        self._read: list = []                   # per buffer: its last GEMM done (None: never read)

    @property
    def n_buffers(self) -> int:
        return 2 if self.overlap else 1

    @property
    def buffer_elements(self) -> int:
        return self.elements // self.n_buffers

    def _setup(self) -> None:
        """Allocate the buffers (again if `overlap` changed since)."""
        if len(self._bufs) == self.n_buffers:
            return
        cuda = self.device.type == "cuda"
        if cuda and self._bufs:
            torch.cuda.synchronize(self.device)  # old buffers may still be in use
        self.captured.clear()                    # graphs read the old buffers
        self._bufs = [torch.empty(self.buffer_elements, dtype=self.dtype, device=self.device)
                      for _ in range(self.n_buffers)]
        self._cache.clear()
        self._queue.clear()
        self._held.clear()
        self._free = list(range(self.n_buffers))
        self._side = torch.cuda.Stream(self.device) if cuda and self.overlap else None
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))   # the fresh memory's past users
            self._ready = [torch.cuda.Event() for _ in self._bufs]
            self._read = [None] * self.n_buffers

    def units(self, weights: list[QuantWeight], cache: bool = True) -> list[Unit]:
        """The units of a list of weights (a model's Linear: cached by the list's identity;
        cache=False for throw-away lists, e.g. one expert's views)."""
        self._setup()
        if not cache:
            return units_of(weights, self.buffer_elements // weights[0].K)
        key = (id(weights), self.buffer_elements)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = (weights, units_of(weights, self.buffer_elements // weights[0].K))
        return hit[1]   # the list itself is kept in the entry: its id is not reused

    def plan(self, units: list[Unit]) -> None:
        """The GEMMs to come, in order: the first is dequantized now, each next one while
        the previous GEMM runs. Replaces any earlier plan. The side stream first waits
        for all work issued so far (whatever read the buffers: GEMMs, a graph replay),
        so no earlier event is waited on: inside a CUDA graph capture this is the fork
        that brings the side stream into the capture (`join` ends it)."""
        self._setup()
        self._free.extend(b for _, b in self._held)   # dequantized but never used: free again
        self._held.clear()
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            self._read = [None] * self.n_buffers
        self._queue = deque(units)
        self._prefetch()

    def join(self) -> None:
        """End of a captured stretch: the current stream waits for the side stream (so the
        capture takes all its work in) and nothing stays dequantized ahead."""
        self._free.extend(b for _, b in self._held)
        self._held.clear()
        self._queue.clear()
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def expect(self, units: list[Unit]) -> None:
        """Units to come before the rest of the plan (known late: MoE experts)."""
        self._setup()
        self._queue.extendleft(reversed(units))
        self._prefetch()

    def _dequantize(self, u: Unit) -> int:
        b = self._free.pop(0)
        if self._side is None:
            u.dequantize(self._bufs[b], self.tile)
            return b
        if self._read[b] is not None:
            self._side.wait_event(self._read[b])       # the last GEMM on this buffer is done
        with torch.cuda.stream(self._side):
            u.dequantize(self._bufs[b], self.tile)
        self._ready[b].record(self._side)
        return b

    def _prefetch(self) -> None:
        # at most n_buffers - 1 held ahead: a GEMM outside the plan always finds a buffer
        while self._queue and len(self._held) < self.n_buffers - 1:
            u = self._queue.popleft()
            self._held.append((u, self._dequantize(u)))

    def gemm(self, x: torch.Tensor, units: list[Unit]) -> torch.Tensor:
        """x [T, K] @ (the units' rows)^T -> [T, sum n] float32."""
        if x.dim() != 2 or x.shape[1] != units[0].K:
            raise ValueError(f"x {tuple(x.shape)} does not match weights of K = {units[0].K}")
        x = x.to(self.dtype).contiguous()
        outs = []
        for u in units:
            if self._held and self._held[0][0] is u:
                b = self._held.popleft()[1]
            else:
                if self._queue and self._queue[0] is u:   # planned but not yet ahead (one buffer)
                    self._queue.popleft()
                b = self._dequantize(u)
            if self._side is not None:
                main = torch.cuda.current_stream(self.device)
                main.wait_event(self._ready[b])
                outs.append(self.mm(x, self._bufs[b][:u.n * u.K].view(u.n, u.K)))
                self._read[b] = main.record_event()
            else:
                outs.append(self.mm(x, self._bufs[b][:u.n * u.K].view(u.n, u.K)))
            self._free.append(b)
            self._prefetch()
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def mm(self, x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        """x [T, K] @ wt [n, K]^T -> [T, n] float32; bf16 inputs accumulate in fp32 and,
        where torch supports it, are written as fp32 (no bf16 rounding of the output)."""
        return self._fp32_product(torch.mm, x, wt.T)

    @property
    def mm_out_dtype(self) -> bool | None:
        """Whether torch.mm(out_dtype=float32) works here (None: not yet tried)."""
        return self._out_fp32.get(torch.mm)

    def _fp32_product(self, op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """op(a, b) as float32: written as fp32 by op itself where torch supports it
        (probed once per op), else rounded to a's dtype and widened."""
        if a.dtype == torch.float32:
            return op(a, b)
        if self._out_fp32.get(op) is not False:
            try:
                y = op(a, b, out_dtype=torch.float32)
                self._out_fp32[op] = True
                return y
            except (TypeError, RuntimeError, NotImplementedError):
                self._out_fp32[op] = False
        return op(a, b).float()
