"""The dense decode GEMVs as a registry, and the plan that picks one per weight and width.

As llama.cpp's mul_mat chooser and vLLM's list of possible kernels: every kernel is one
entry that says which weights it takes (`supports(w) -> reason | None`), the activations
it reads (`layout`: "f32" rows, "i8" int8 rows in a lane order, "q8k" q8_K rows), the
widths it serves and its bits family (kernels of one family give a row the same bits, so
a weight may change kernel with W inside a family and keep exact mode). The plan of a
weight set (one Linear) is made once, at load, for every W = 1..max_w: which kernel runs
each weight, the layouts its producer should emit, whether the GEMV can add into the
residual (its epilogue) and in how many runs its partial sums come. The round only reads it.

Exact mode: every width of a weight must be one bits family (`LinearPlan.check_exact`);
fast mode's hybrid (MmaChoice partner "dp4a") is the one plan that may mix families.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from gguf.constants import GGMLQuantizationType as QT

from ..formats.qweight import QuantWeight
from .qgemv_i8 import MAX_BW as I8_BW
from .qgemv_i8 import SPLIT_MAX_N, SPLIT_MIN_K, gemv_tile, qgemv_i8, split_nt, split_runs
from .qgemv_i8_table import has_dense_i8_form
from .q8k_act import Q8K, prepare_q8k
from .qgemv_mma import COLS, mma_groups, mma_planes, mma_tile, qgemv_mma_k, supports_mma
from .qgemv_q8k import q8k_tile, qgemv_q8k
from .qmatmul import MAX_BW as QM_BW
from .qmatmul import qmatmul
from .qmatmul import tile as qmatmul_tile
from .qmatvec_i8 import lane_order, prepare_i8

# weight rows per qmatmul thread: 4, faster than 2 at W = 1 and W = 8
# (docs/decisions/int8-decode-gemv.md); part of a weight's summation order, so one model
# always uses one value
ROWS_PER_THREAD = 4


class PlanError(ValueError):
    """A plan that breaks a bit contract (exact mode: one bits family a weight)."""


@dataclass(frozen=True)
class GemvKernel:
    """One decode GEMV. run(x, w, out, prepared, planes, pdl) writes x @ w^T into out [W, N];
    key(w) names the activations it reads (prepared by `prepare` unless the producer
    emitted them); tile(w, W, runs, adds) is its launch of record (what decides its float
    order and its programs at width W)."""
    name: str
    family: str
    layout: str                                            # "f32" | "i8" | "q8k"
    widths: range
    supports: Callable[[QuantWeight], str | None]
    run: Callable
    key: Callable[[QuantWeight], tuple | None]
    prepare: Callable | None                               # (x, w, pdl) -> the activations
    tile: Callable[[QuantWeight, int, int, bool], dict]


def _any_format(w: QuantWeight) -> str | None:
    return None


def _i8_support(w: QuantWeight) -> str | None:
    return None if has_dense_i8_form(w.qtype) else \
        f"{w.qtype.name} has no int8 form (expert_q8.SLOT_TERMS, qgemv_i8_table.TABLE_CODES)"


def _mma_support(w: QuantWeight) -> str | None:
    if w.qtype != QT.Q4_K:
        return f"qgemv_mma_k runs Q4_K only, not {w.qtype.name}"
    return None if supports_mma(w) else f"[{w.N}, {w.K}] is not a whole number of mma row groups and steps"


def _run_qmatmul(x, w, out, prepared, planes, pdl):
    out.copy_(qmatmul(x, w, rows_per_thread=ROWS_PER_THREAD))


def _run_i8(x, w, out, prepared, planes, pdl):
    qgemv_i8(x, w, out=out, prepared=prepared, pdl=pdl)


def _run_q8k(x, w, out, prepared, planes, pdl):
    qgemv_q8k(x, w, out=out, prepared=prepared, pdl=pdl)


def _run_mma(x, w, out, prepared, planes, pdl):
    qgemv_mma_k(x, w, planes=planes, out=out, prepared=prepared, pdl=pdl)


def _bw(W: int, most: int) -> int:
    return min(most, 1 << (W - 1).bit_length())


def _tile_qmatmul(w, W, runs, adds):
    BN, NT, warps = qmatmul_tile(w, ROWS_PER_THREAD)
    return {"kernel": "qmatmul", "BN": BN, "NT": NT, "num_warps": warps,
            "BW": min(QM_BW, 16 // ROWS_PER_THREAD, 1 << (W - 1).bit_length())}


def _tile_i8(w, W, runs, adds):
    t = gemv_tile(w)
    nt = min(t.NT, split_nt(w, runs)) if runs > 1 else t.NT
    return {"kernel": "qgemv_i8", "BN": t.BN, "NT": nt, "num_warps": t.num_warps, "prefetch": t.prefetch,
            "split": runs, "BW": _bw(W, I8_BW), "lane_order": lane_order(w), "add_into": adds}


def _tile_q8k(w, W, runs, adds):
    rows, rwarps = q8k_tile(w, W)
    return {"kernel": "qgemv_q8k", "BN": rows, "R": mma_tile(w)[1], "BW": 1 if W == 1 else 2 if W == 2 else 4,
            "num_warps": rwarps}


def _tile_mma(w, W, runs, adds):
    warps, kw = mma_tile(w)
    return {"kernel": "qgemv_mma_k", "WARPS": warps, "KW": kw, "GR": mma_groups(w, W), "COLS": COLS}


ALL_W = range(1, 65)
QMATMUL = GemvKernel("qmatmul", "f32", "f32", ALL_W, _any_format, _run_qmatmul, lambda w: None, None, _tile_qmatmul)
QGEMV_I8 = GemvKernel("qgemv_i8", "i8", "i8", ALL_W, _i8_support, _run_i8, lane_order,
                      lambda x, w, pdl: prepare_i8(x, w, pdl), _tile_i8)
# qgemv_q8k: dp4a on qgemv_mma_k's q8_K activations, the mma's bits (one family)
QGEMV_Q8K = GemvKernel("qgemv_q8k", "q8k", "q8k", ALL_W, _mma_support, _run_q8k, lambda w: Q8K,
                       lambda x, w, pdl: prepare_q8k(x, w.n_slots, pdl), _tile_q8k)
QGEMV_MMA_K = GemvKernel("qgemv_mma_k", "q8k", "q8k", ALL_W, _mma_support, _run_mma, lambda w: Q8K,
                         lambda x, w, pdl: prepare_q8k(x, w.n_slots, pdl), _tile_mma)


@dataclass(frozen=True)
class Kernels:
    """The entries a plan picks from (bench/ passes variants: e.g. qgemv_mma_k's row groups)."""
    f32: GemvKernel = QMATMUL
    i8: GemvKernel = QGEMV_I8
    q8k: GemvKernel = QGEMV_Q8K
    mma: GemvKernel = QGEMV_MMA_K

    def with_mma_groups(self, groups: int) -> "Kernels":
        def run(x, w, out, prepared, planes, pdl):
            qgemv_mma_k(x, w, planes=planes, out=out, prepared=prepared, pdl=pdl, groups=groups)
        return replace(self, mma=replace(self.mma, run=run))


DEFAULT_KERNELS = Kernels()


@dataclass(frozen=True)
class MmaChoice:
    """Where the tensor cores run: widths up to `narrow` take a dp4a kernel, wider ones the
    mma. partner "q8k": engine.gemv_mma, the format's dp4a partner on the same q8_K
    activations (the mma's bits at every width: exact). "dp4a": fast mode's hybrid
    (engine.fast_mma_narrow), narrow rounds exactly as without the mma (qgemv_i8 on its lane
    orders, split runs, the o GEMV's residual add), so plain decode keeps the default's bits
    and speed while wider verify rounds take the mma's (not the same bits: fast mode only)."""
    narrow: int = 4
    partner: str = "q8k"

    def __post_init__(self):
        if self.partner not in ("q8k", "dp4a"):
            raise ValueError(f"MmaChoice partner is 'q8k' or 'dp4a', got {self.partner!r}")


@dataclass(frozen=True)
class Step:
    """A Linear at one width: each weight's kernel, the layouts its producer emits, whether
    it adds into the residual in its epilogue (one dp4a weight) and its partial-sum runs."""
    kernels: tuple[GemvKernel, ...]
    orders: tuple
    adds: bool
    runs: int

    def family(self, j: int) -> str:
        k = self.kernels[j]
        return k.family if self.runs == 1 or k is not self.kernels[0] else f"{k.family}/runs={self.runs}"


@dataclass(frozen=True)
class LinearPlan:
    steps: tuple[Step, ...]          # steps[W - 1]
    i8: tuple[bool, ...]             # weights with an int8 path (the others: qmatmul)
    mma: tuple[bool, ...]            # weights on the tensor cores at some width
    hybrid: bool                     # fast mode's hybrid: narrow and wide rounds differ in bits

    def at(self, W: int) -> Step:
        return self.steps[W - 1]

    def families(self, j: int) -> set[str]:
        return {s.family(j) for s in self.steps}

    def check_exact(self) -> None:
        """Every width of each weight one bits family (exact mode's promise), else PlanError."""
        for j in range(len(self.i8)):
            fams = self.families(j)
            if len(fams) > 1:
                raise PlanError(f"weight {j}: bits families {sorted(fams)} across widths in an exact plan")


def plan_linear(weights: list[QuantWeight], gemv: str = "f32", split: bool = False, mma: MmaChoice | None = None,
                max_w: int = 64, exact: bool | None = None, kernels: Kernels = DEFAULT_KERNELS,
                split_limits: tuple[int, int] = (SPLIT_MIN_K, SPLIT_MAX_N)) -> LinearPlan:
    """The plan of weights applied to one input (a Linear): gemv "i8" runs each weight with
    an int8 form on int8 activations (else qmatmul); split: one dp4a weight gives its sums
    in split_runs parts (split_limits: its (min K, max N)); mma: the Q4_K weights the tensor cores take. exact (default: any
    plan but fast mode's hybrid) asserts one bits family per weight across every width."""
    if gemv not in ("i8", "f32"):
        raise ValueError(f"gemv is 'i8' or 'f32', got {gemv!r}")
    i8 = tuple(gemv == "i8" and kernels.i8.supports(w) is None for w in weights)
    on_mma = tuple(mma is not None and ok and kernels.mma.supports(w) is None for w, ok in zip(weights, i8))
    hybrid = mma is not None and mma.partner == "dp4a" and any(on_mma)
    dp4a_one = len(weights) == 1 and i8[0]
    split_n = split_runs(weights[0], *split_limits) if split and dp4a_one else 1
    steps = []
    for W in range(1, max_w + 1):
        dp4a = not any(on_mma) or (hybrid and W <= mma.narrow)
        ks = tuple(kernels.f32 if not ok else kernels.i8 if dp4a or not m else
                   kernels.q8k if W <= mma.narrow else kernels.mma for ok, m in zip(i8, on_mma))
        orders = tuple(dict.fromkeys(k.key(w) for k, w in zip(ks, weights) if k.layout != "f32"))
        adds = dp4a_one and dp4a
        steps.append(Step(ks, orders, adds, split_n if adds else 1))
    plan = LinearPlan(tuple(steps), i8, on_mma, hybrid)
    if exact if exact is not None else not hybrid:
        plan.check_exact()
    return plan


def mma_planes_of(weights: list[QuantWeight], plan: LinearPlan) -> list[torch.Tensor | None]:
    """The code planes again in the mma's fragment order, for the weights that use it."""
    return [mma_planes(w) if m else None for w, m in zip(weights, plan.mma)]
