"""The round cost table under an expert store: what a verify column's extra experts cost.

With an expert store (offload/store.py) a round of W rows reads, per MoE layer, the
distinct experts its W x k picks name, and each one without a bank slot is a miss that
its tier pays for (the CPU workers and PCIe for the host tier, the workers from the
page cache or the disk for the mapped one). So under offload a column costs its rows'
kernels and the misses of the experts it adds:

    c_off(W) = c_res(W) + sum over MoE layers l of missed_l(W) x ms_l

- missed_l(W): the expected distinct experts of layer l without a bank slot among W
  consecutive rows' picks: the store's `Footprint` (offload/footprint.py), learned from
  every round's routing (decayed per row), starting from the plan's model (uniform
  routing, hit rate slots / experts);
- ms_l: what one such expert adds to a round: its bytes x its tier's seconds per byte
  (offload/estimate.py's `MissRates`, from the plan's measured bandwidths: the rates the
  plan's expected tok/s uses; `MissRates.assumed` without a plan);
- c_res(W): the cost table's round without its own misses. The table is timed at load as
  ever (gate.load_or_measure, inside KVCache.trial), with the store frozen (no admission,
  nothing learned) and the timed rounds' misses kept with it (`CostTable.missed`: bytes
  by tier of the distinct experts the timed round of W rows missed, counted exactly from
  its routing); priced at the same rates, they come off: c_res(W) = c(W) - timed(W),
  continued past the timed widths as the table is, never under RESIDENT_FLOOR x c(W)
  (the rates are a model, not a measurement of this round) and never falling with W.

Every pricer of rounds (Gate.width, allot.best_prefix, the policy's MTP switch and its
drafter rates) reads the same `OffloadCosts` through the table's interface (`cost`,
`columns_free`), built per request from the cost table kept in SpecMemory and the live
footprint: one source. With every expert in the bank nothing is missed, timed or
expected, so c_off(W) == c(W) exactly and every decision is the table's.

A caveat for the device run: today's tier kernels stream an expert once per (row, rank)
pair (the C workers' tasks, the PCIe kernels' programs), so a round's miss bytes lie
between its distinct missed experts (priced here) and its missed pairs, depending on
what the CPU's L3 and the GPU's L2 keep between pairs of one expert.
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np

from ..offload.estimate import MissRates
from ..offload.footprint import missed_by_width
from .gate import CostTable, RoundCosts, extend_line

RESIDENT_FLOOR = 0.1     # c_res(W) >= this x c(W): the timed misses' price is a model


def _layer_bytes(store) -> tuple[np.ndarray, np.ndarray]:
    """([L'] bytes of one expert, [L'] mapped?) per MoE layer, in the store's order."""
    layers = store.moe_layers.tolist()
    return (np.array([store.layer_bytes(i) / store.E for i in layers], dtype=np.float64),
            np.array([i in store.mapped for i in layers], dtype=bool))


class StoreTiming:
    """What timing the cost table needs from a model with an expert store (gate.load_or_measure)."""

    def __init__(self, model):
        self.store = model.store
        self.key = "store, CPU workers" if model.cpu_tier is not None else "store"   # its kernels

    def frozen(self):
        return self.store.frozen()

    def missed(self, W: int) -> list[list[float]]:
        """After the timing's last round (W rows, the widest; the narrower ones ran its
        leading rows from the same state, and every row's routing is its own): [W] ->
        [host-tier, mapped] bytes of the distinct experts without a slot in rows 0..w-1."""
        s = self.store
        ids = s.routes[s.moe_layers, :W].cpu().numpy()                       # [L', W, k]
        counts = missed_by_width(ids, s.resident[s.moe_layers]).astype(np.float64)   # [L', W]
        nbytes, mapped = _layer_bytes(s)
        host = (counts * (nbytes * ~mapped)[:, None]).sum(axis=0)             # [W]
        mapd = (counts * (nbytes * mapped)[:, None]).sum(axis=0)
        return [[float(h), float(m)] for h, m in zip(host, mapd)]


def store_timing(model) -> StoreTiming | None:
    return StoreTiming(model) if getattr(model, "store", None) is not None else None


class OffloadCosts:
    """The cost table with an expert store's misses priced (the module docstring)."""

    def __init__(self, base: CostTable, store, rates: MissRates, cpu_workers: bool):
        self.base, self.store, self.rates = base, store, rates
        nbytes, mapped = _layer_bytes(store)
        host = rates.host if cpu_workers else rates.pcie
        self.expert_ms = 1e3 * nbytes * np.where(mapped, rates.mapped, host)              # [L'] ms a missed expert
        timed = [1e3 * (h * host + m * rates.mapped) for h, m in base.missed[:base.measured]]
        timed = extend_line(timed, len(base.ms)) if timed else [0.0] * len(base.ms)      # [MAX_WIDTH]
        self.resident = list(accumulate((max(c - t, RESIDENT_FLOOR * c) for c, t in zip(base.ms, timed)), max))
        self._seen: tuple[object, int] | None = None                                     # (footprint, version)
        self._miss_ms = np.zeros(0)

    def miss_ms(self) -> np.ndarray:
        """[cap]: the expected ms of the misses of a round of w = 1..cap rows, as the store's
        footprint stands now (recomputed once per round it learned)."""
        fp = self.store.footprint
        if self._seen != (fp, fp.version):
            self._miss_ms = self.expert_ms @ fp.missed()                                 # [L'] @ [L', cap]
            self._seen = (fp, fp.version)
        return self._miss_ms

    def cost(self, width: int) -> float:
        m = self.miss_ms()
        return self.resident[min(width, len(self.resident)) - 1] + float(m[min(width, len(m)) - 1])

    def columns_free(self, max_width: int, tol: float) -> bool:
        return self.cost(max_width) <= (1 + tol) * self.cost(1)

    def to_dict(self) -> dict:
        widths = [w for w in (1, 2, 4, 8, 16) if w <= len(self.resident)]
        return {"resident_ms": {w: self.resident[w - 1] for w in widths},
                "miss_ms": {w: float(self.miss_ms()[w - 1]) for w in widths},
                "rates": self.rates.to_dict(), "footprint": self.store.footprint.to_dict()}


def priced(table: CostTable, model) -> RoundCosts:
    """The prices a request's rounds get: the table itself for resident experts, else the
    table with the store's misses."""
    store = getattr(model, "store", None)
    if store is None:
        return table
    return OffloadCosts(table, store, model.miss_rates, model.cpu_tier is not None)
