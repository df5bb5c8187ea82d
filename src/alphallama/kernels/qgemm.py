"""qgemm: x [T, K] @ w[N, K]^T -> [T, N] float32 for prefill chunks, on the tensor cores.

Decode streams each weight once per token and is bandwidth bound (qmatmul.py). A
prefill chunk of T = 512 rows does T times the arithmetic per weight byte, so there
the CUDA-core GEMV is compute bound at a small fraction of the chip. Here each weight
is instead dequantized by a Triton kernel into a reused scratch buffer (bf16 on the
GPU, in row blocks of at most `scratch` elements) and multiplied by cuBLAS: an 8B
model's layers, 4.25 GB as stored, become 13.9 GB of bf16 writes per chunk, against
7.1 TFLOP of tensor work at T = 512. Measured on the H200 (bench/results/
gpu_engine-qwen3-8b-20261130-002535.json): the GEMMs alone 10.5 ms (677 TFLOP/s), the
dequantize pass alone 15 ms (~0.9 TB/s written, whatever the tile), and the eager
chunk host-bound at ~57 ms (runtime/gpu_prefill.ChunkGraphs is the answer to that).

The dequantize kernel reuses each format's `triton_load`/`triton_field` (formats.py):
the same block decoders as the GEMV, so the values are the GEMV's fp32 values (bit
for bit the gguf package's), rounded once to the scratch dtype.

Not row-invariant: cuBLAS picks its kernel (and split of K) by shape, so a row's bits
depend on T. Only prefill uses this path (gpu_model.py says what that means for exact
mode and for re-used KV rows).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import DEFAULTS
from .qmatmul import _use_triton
from .qweight import QuantWeight

# The dequantize kernel's tile: (weight rows, slots, warps) per program, whether a slot
# is stored whole (_dequant_kernel's WHOLE), whether bf16 is rounded by the GPU's own
# convert (HW). Every value is computed on its own and rounded to nearest even either
# way, so no choice changes a bit; bench/gpu_engine.py times them. H200, 8B shape
# (bench/results/gpu_engine-qwen3-8b-20261130-002535.json, before WHOLE and HW existed):
# (2, 128, 4) the best of 7 tiles, 15.05 ms for all layer weights against 15.88 for
# (4, 64, 4); all 7 within 15-16.3 ms (~0.9 TB/s written): the tile is not the limit.
DEQ_TILE = (1, 128, 4, True, True)   # H200 at 010209d: 4.73 ms for the 8B shape, 2.94 TB/s written (the old
                                     # (2, 128, 4, False, False): 14.8 ms); bench/results/gpu_engine-qwen3-8b-20261130-005214.json
DEQ_ROWS_CPU = 64    # under the interpreter: fewer, larger programs


@triton.jit
def _cast(w, dtype: tl.constexpr, HW: tl.constexpr):
    """fp32 -> the scratch dtype. bf16 by explicit round-to-nearest-even on the bits (the
    interpreter's own cast truncates), or with HW by the GPU's convert (also to nearest
    even: the same bits for every finite value, in fewer instructions)."""
    if dtype == tl.bfloat16 and not HW:
        b = w.to(tl.int32, bitcast=True)
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return w.to(dtype)


@triton.jit
def _pair(words, h, s1, s2, FIELD: tl.constexpr, m: tl.constexpr, one):
    """Fields 2m, 2m+1 of the V words: the 2V consecutive values 2mV.. of each slot
    (interleaved, formats.slot_positions): [NT, BN, 2V]."""
    w_a = FIELD(words, h, s1, s2, 2 * m, one)  # [NT, BN, V]
    w_b = FIELD(words, h, s1, s2, 2 * m + 1, one)
    return tl.reshape(tl.join(w_a, w_b), (w_a.shape[0], w_a.shape[1], 2 * w_a.shape[2]))  # a0 b0 a1 b1 ..


@triton.jit
def slot_values(words, h, s1, s2, FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, one):
    """The values of NT slots of BN rows in k order: [NT, BN, SLOT] float32 (P in 1, 4, 8).
    Pairs m = j2 * 2 + j1 (P = 8) are joined as [.., 2V, j1, j2], then put in (m, 2V) order."""
    if P == 1:
        w = FIELD(words, h, s1, s2, 0, one)  # [NT, BN, V]: word v is value v of the slot
    elif P == 8:
        t = tl.join(tl.join(_pair(words, h, s1, s2, FIELD, 0, one), _pair(words, h, s1, s2, FIELD, 1, one)),
                    tl.join(_pair(words, h, s1, s2, FIELD, 2, one), _pair(words, h, s1, s2, FIELD, 3, one)))
        w = tl.reshape(tl.permute(t, (0, 1, 4, 3, 2)), (t.shape[0], t.shape[1], V * P))
    else:
        tl.static_assert(P == 4, "slot_values takes P in 1, 4, 8")
        t = tl.join(_pair(words, h, s1, s2, FIELD, 0, one), _pair(words, h, s1, s2, FIELD, 1, one))
        w = tl.reshape(tl.permute(t, (0, 1, 3, 2)), (t.shape[0], t.shape[1], V * P))
    return w


@triton.jit(do_not_specialize=["one"])
def _dequant_kernel(out, qs, qh, sc, sd, N, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
                    FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, SLOT: tl.constexpr,
                    BN: tl.constexpr, NT: tl.constexpr, WHOLE: tl.constexpr, HW: tl.constexpr,
                    IDX=None, GATHER: tl.constexpr = False, NROWS=1):
    """Rows pid(0)*BN.. and slots pid(1)*NT.. of the weight -> out [N, n_slots * SLOT].
    GATHER: out row n is weight row IDX[n] (N = rows of out: an embedding lookup), an id
    outside the NROWS weight rows read as the nearest row, never past the planes (the
    server rejects such ids before they get here).
    WHOLE: a slot's values are put in k order in registers and stored at once (the
    compiler may then spread a slot's run over several threads: whole sectors per warp
    store); else each field pair is stored as it comes (one 16-byte run per thread)."""
    K: tl.constexpr = n_slots * SLOT
    n = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    dst = tl.minimum(n, N - 1).to(tl.int64)[None, :]  # [1, BN]; past N: reload N-1, not stored
    if GATHER:
        row = tl.minimum(tl.maximum(tl.load(IDX + dst).to(tl.int64), 0), NROWS - 1)  # [1, BN]
    else:
        row = dst
    s0 = tl.program_id(1) * NT
    words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)
    u = (s0 + tl.arange(0, NT))[:, None, None]  # [NT, 1, 1]
    mask = (u < n_slots) & (n < N)[None, :, None]  # [NT, BN, 1]
    base = out + dst[:, :, None] * K + u * SLOT  # [NT, BN, 1]: the slot's first value
    dt: tl.constexpr = out.dtype.element_ty
    if P == 1 or WHOLE:
        w = slot_values(words, h, s1, s2, FIELD, V, P, one)  # [NT, BN, SLOT] in k order
        tl.store(base + tl.arange(0, SLOT)[None, None, :], _cast(w, dt, HW), mask=mask)
    else:
        k2 = tl.arange(0, 2 * V)[None, None, :]  # [1, 1, 2V]
        for m in tl.static_range(0, P // 2):
            w = _pair(words, h, s1, s2, FIELD, m, one)  # [NT, BN, 2V]
            tl.store(base + m * (2 * V) + k2, _cast(w, dt, HW), mask=mask)


def _launch(w: QuantWeight, planes: tuple, out: torch.Tensor, tile: tuple,
            idx: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize the rows whose plane slices are `planes` (or, with idx, rows idx of
    them) into out [n, K] (contiguous)."""
    fmt, n = w.fmt, out.shape[0]
    rows, slots, warps, whole, hw = tile
    if not out.is_cuda:
        rows, hw = DEQ_ROWS_CPU, False     # the interpreter's own cast truncates
    NT = min(slots, triton.next_power_of_2(w.n_slots))
    grid = (triton.cdiv(n, rows), triton.cdiv(w.n_slots, NT))
    _dequant_kernel[grid](out, *planes, n, 1, n_slots=w.n_slots, LOAD=fmt.triton_load, FIELD=fmt.triton_field,
                          V=fmt.V, P=fmt.P, SLOT=fmt.slot, BN=rows, NT=NT, WHOLE=whole, HW=hw, num_warps=warps,
                          enable_fp_fusion=False, IDX=idx, GATHER=idx is not None, NROWS=w.N)
    return out


def gather_rows(w: QuantWeight, idx: torch.Tensor, out: torch.Tensor | None = None,
                tile: tuple = DEQ_TILE) -> torch.Tensor:
    """Rows idx [T] (integer, on w's device) of a 2-D weight, dequantized: [T, K] float32
    (or out's dtype), bit for bit the gguf dequantizers' values. An embedding lookup in
    one launch, so that a captured round holds one node for it, not the ~25 of a
    plain-torch dequantize."""
    if len(w.shape) != 2 or idx.dim() != 1 or idx.device != w.device:
        raise ValueError(f"gather_rows takes a 2-D weight and 1-D indices on its device, got {w.shape} on "
                         f"{w.device}, {tuple(idx.shape)} on {idx.device}")
    out = torch.empty((idx.shape[0], w.K), dtype=torch.float32, device=w.device) if out is None else out
    if out.shape != (idx.shape[0], w.K) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{idx.shape[0]}, {w.K}], got {tuple(out.shape)}")
    if idx.shape[0] == 0:
        return out
    if not _use_triton(out):
        rows = idx.clamp(0, w.N - 1)
        return out.copy_(w.fmt.dequantize({n: p[rows] for n, p in w.planes.items()}, w.K))
    return _launch(w, w.plane_args(), out, tile, idx)


def dequantize_into(w: QuantWeight, out: torch.Tensor, r0: int = 0, r1: int | None = None,
                    tile: tuple = DEQ_TILE) -> torch.Tensor:
    """Rows r0..r1 of a 2-D weight, dequantized into out [r1 - r0, K] (contiguous; any
    float dtype: the fp32 values are rounded once to it)."""
    r1 = w.N if r1 is None else r1
    if len(w.shape) != 2:
        raise ValueError(f"dequantize_into takes a 2-D weight; use w.expert(e) for {w.shape}")
    if out.shape != (r1 - r0, w.K) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{r1 - r0}, {w.K}], got {tuple(out.shape)}")
    if not _use_triton(out):
        return out.copy_(w.fmt.dequantize({n: p[r0:r1] for n, p in w.planes.items()}, w.K))
    return _launch(w, tuple(p[r0:r1] for p in w.plane_args()), out, tile)  # row slices: still contiguous


@dataclass(frozen=True, eq=False)
class Unit:
    """What one scratch buffer holds for one GEMM: row blocks (w, r0, r1) of one or more
    weights of the same K, stacked in order, with their plane slices cut once."""
    pieces: tuple[tuple[QuantWeight, int, int, tuple], ...]
    K: int

    @property
    def n(self) -> int:
        return sum(r1 - r0 for _, r0, r1, _ in self.pieces)

    def dequantize(self, buf: torch.Tensor, tile: tuple) -> torch.Tensor:
        """-> the unit's values [n, K], a view of the front of buf."""
        out = buf[:self.n * self.K].view(self.n, self.K)  # [n, K]
        o = 0
        for w, r0, r1, planes in self.pieces:
            part = out[o:o + r1 - r0]  # [r1 - r0, K]: contiguous rows
            if _use_triton(part):
                _launch(w, planes, part, tile)
            else:
                part.copy_(w.fmt.dequantize({k: p[r0:r1] for k, p in w.planes.items()}, w.K))
            o += r1 - r0
        return out


def units_of(weights: list[QuantWeight], max_rows: int) -> list[Unit]:
    """2-D weights of one K applied to the same input (outputs concatenated) -> units of
    at most max_rows rows: small weights share a unit (one GEMM), large ones are split."""
    K = weights[0].K
    if any(len(w.shape) != 2 or w.K != K for w in weights):
        raise ValueError(f"units_of takes 2-D weights of one K, got {[w.shape for w in weights]}")
    if max_rows < 1:
        raise ValueError(f"a scratch buffer must hold at least one row of K = {K}")
    units, cur, room = [], [], max_rows
    for w in weights:
        planes = w.plane_args()
        r0 = 0
        while r0 < w.N:
            r1 = min(w.N, r0 + room)
            cur.append((w, r0, r1, tuple(p[r0:r1] for p in planes)))
            room -= r1 - r0
            r0 = r1
            if room == 0:
                units.append(Unit(tuple(cur), K))
                cur, room = [], max_rows
    if cur:
        units.append(Unit(tuple(cur), K))
    return units


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

    def __init__(self, elements: int, dtype: torch.dtype, device: torch.device, overlap: bool | None = None,
                 tile: tuple = DEQ_TILE, graphs: bool | None = None):
        self.elements, self.dtype, self.device = elements, dtype, torch.device(device)
        self.overlap = DEFAULTS.engine.prefill_overlap if overlap is None else overlap
        # prefill chunks replayed as CUDA graphs (runtime/gpu_prefill.ChunkGraphs), the one
        # captured last kept here: the buffers its GEMMs read are these
        self.graphs = DEFAULTS.engine.prefill_graphs if graphs is None else graphs
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


def qgemm(x: torch.Tensor, w: QuantWeight, scratch: Scratch) -> torch.Tensor:
    """x [T, K] @ w^T -> [T, N] float32 through dequantized row blocks of w."""
    if len(w.shape) != 2:
        raise ValueError(f"qgemm takes a 2-D weight; use w.expert(e) for {w.shape}")
    if x.dim() != 2 or x.shape[1] != w.K:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {w.shape}")
    return scratch.gemm(x, scratch.units([w], cache=False))


def qgemm_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """float64 reference: [T, N]."""
    return x.double() @ w.dequantize().double().T  # [T, N]
