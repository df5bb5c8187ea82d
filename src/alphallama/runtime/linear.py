"""Linear: one or more GGUF matrices applied to one input, each on the GEMV its plan (made
at load: kernels/gemv/registry.py) names for the round's width."""
from __future__ import annotations

import torch

from ..gguf.reader import TensorInfo
from ..kernels.formats.qweight import QuantWeight
from ..kernels.gemv.qgemv_i8 import qgemv_i8
from ..kernels.gemv.qmatmul import qmatmul
from ..kernels.gemv.qmatvec_i8 import lane_order
from ..kernels.gemv.registry import DEFAULT_KERNELS, ROWS_PER_THREAD, Kernels, MmaChoice, mma_planes_of, plan_linear
from ..kernels.moe.moe_f32 import MoEParts
from .overrides import PRODUCT
from .widths import MAX_W


def concat_rows(parts: list[TensorInfo]) -> tuple[torch.Tensor, tuple[int, int]]:
    """GGUF rows are independent runs of blocks: stacking the bytes stacks the matrices."""
    raw = torch.cat([torch.from_numpy(p.data.reshape(p.shape[0], -1).view("uint8").copy()) for p in parts])
    return raw, (sum(p.shape[0] for p in parts), parts[0].shape[1])


class Linear:
    """One or more GGUF matrices applied to the same input; outputs concatenated.
    Matrices of the same type are fused into one weight (one launch). Which GEMV runs
    each weight at each width is its plan (kernels/gemv/registry.py), made here once.

    gemv "i8": the input is quantized to int8 once per lane order (kernels/gemv/qmatvec_i8:
    one order per slot shape, shared by e.g. Q4_K and Q5_K) and each weight's dp4a GEMV
    writes its columns of one output buffer (no concatenation); weights without an
    integer form (F16, F32) take qmatmul."""

    def __init__(self, parts: list[TensorInfo], device, gemv: str = "f32", split: bool = False,
                 mma: MmaChoice | None = None, kernels: Kernels = DEFAULT_KERNELS,
                 split_limits: tuple[int, int] = PRODUCT.split_limits):
        """split: parts() may give partial sums (qgemv_i8.split_runs) for a norm to add.
        mma: the weights qgemv_mma_k (Q4_K) covers run there (engine.gemv_mma), on q8_K
        activations (one scale a super-block) that its producer emits (orders:
        q8k_act.Q8K) or this Linear prepares; rounds of up to mma.narrow rows take the
        format's dp4a partner (qgemv_q8k: the same bits)."""
        groups: list[list[TensorInfo]] = []
        for p in parts:
            if groups and groups[-1][0].qtype == p.qtype:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.weights = []
        for g in groups:
            raw, shape = concat_rows(g)
            self.weights.append(QuantWeight.from_raw(raw, g[0].qtype, shape, device))
        self.nbytes = sum(w.nbytes for w in self.weights)
        self.plan = plan_linear(self.weights, gemv, split, mma, MAX_W, kernels=kernels, split_limits=split_limits)
        self.i8, self.mma = list(self.plan.i8), list(self.plan.mma)
        # fast mode's hybrid: rounds of up to mma.narrow rows run as if there were no mma at all
        self.hybrid = self.plan.hybrid
        # the code planes again in the mma's fragment order (the prefill path reads the planes as they
        # are): more memory held, the same bytes read a round (nbytes, the floor's numerator)
        self._planes = mma_planes_of(self.weights, self.plan)
        self.N = sum(w.N for w in self.weights)
        runs = max(s.runs for s in self.plan.steps)
        # the runs' unit weights for the norm's add (norm.add_rmsnorm's MoE-ranks path): [MAX_W, runs]
        self._ones = torch.ones((MAX_W, runs), dtype=torch.float32, device=device) if runs > 1 else None

    def orders(self, W: int) -> tuple:
        """The activation layouts a round of W rows reads (its producer can emit them)."""
        return self.plan.at(W).orders

    def adds(self, W: int) -> bool:
        """Can add_into run at width W: one weight on dp4a (its epilogue adds)."""
        return self.plan.at(W).adds

    def runs(self, W: int) -> int:
        """parts()'s partial sums at width W (1: one [W, N] sum)."""
        return self.plan.at(W).runs

    def add_into(self, x: torch.Tensor, q8: dict | None, out: torch.Tensor, pdl: bool = False) -> None:
        """out += x @ w^T in the GEMV's epilogue (one weight, i8: self.adds): the residual
        stream's add, bit for bit the norm's x + y."""
        w = self.weights[0]
        qgemv_i8(x, w, out=out, prepared=(q8 or {}).get(lane_order(w)), pdl=pdl, accumulate=True)

    def parts(self, x: torch.Tensor, q8: dict | None = None, pdl: bool = False) -> "torch.Tensor | MoEParts":
        """x @ w^T for a norm to add into the residual: [W, N], or with runs (self.runs > 1)
        (the runs' partial sums [W, runs, N], their unit weights [W, runs]), which the norm
        adds in run order as it adds MoE ranks (more programs for a short matrix)."""
        runs = self.runs(x.shape[0])
        if runs == 1:
            return self(x, q8, pdl)
        w = self.weights[0]
        part = qgemv_i8(x, w, prepared=(q8 or {}).get(lane_order(w)), pdl=pdl, split=runs)   # [W, runs, N]
        return part, self._ones[:x.shape[0]]

    def __call__(self, x: torch.Tensor, q8: dict | None = None, pdl: bool = False) -> torch.Tensor:
        """x [W, K] -> [W, N] fp32; q8: x's int8 activations by layout, if its producer
        made them (else they are made here, one prepare launch per layout)."""
        if not any(self.i8):
            outs = [qmatmul(x, w, rows_per_thread=ROWS_PER_THREAD) for w in self.weights]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        out = torch.empty((x.shape[0], self.N), dtype=torch.float32, device=x.device)   # [W, N]
        prepared: dict = dict(q8 or {})
        n0 = 0
        for w, k, planes in zip(self.weights, self.plan.at(x.shape[0]).kernels, self._planes):
            key = k.key(w)
            if key is not None and key not in prepared:
                prepared[key] = k.prepare(x, w, pdl)
            k.run(x, w, out[:, n0:n0 + w.N], prepared.get(key), planes, pdl)
            n0 += w.N
        return out
