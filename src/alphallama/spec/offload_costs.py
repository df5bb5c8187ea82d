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
  its routing), then timed again with every missed expert pointed at a bank slot
  (`CostTable.bank`, store.bank_only): that is c_res(W), measured. The difference c(W) -
  c_res(W) is what the timed misses cost on this host; the rates' price of the same bytes
  is scaled to it (one factor, least squares over the timed widths: `rates_scale`), so
  the misses are priced at what they cost here, not at the probe's streaming rates
  (session 49: the timing's random rows miss most of a 25% bank and cost about twice
  their price there; offload-v2.md). A table without `bank` (timed before it existed)
  keeps the older rule: c_res(W) = c(W) - timed(W) at the plan's rates, never under
  RESIDENT_FLOOR x c(W), never falling with W.

The tiers, explicitly (`round_ms`, one function for the expected and the timed misses):
a mapped layer's misses are the CPU workers', who read a missed expert once a round for
all its pairs (offload/native/post.c): its distinct experts are what it costs. A host
layer's pairs are split as the post kernel splits them, the CPU workers the first `share`
of them in (row, rank) order, PCIe the rest, both at once: the CPU's cost is the distinct
experts of its pairs (the rows of its share: the footprint's window of share x w rows),
PCIe's is priced the same way, distinct experts of its rows, though its kernels read an
expert once per pair: that price is a floor, exact where the GPU's L2 keeps an expert
between its pairs (to be measured on the device: `to_dict` gives the per-pair price
beside it). The two are summed over layers before the max (the layers are alike; the
truth, a max per layer, is a little higher where they are not). At W = 1 every miss is
its own expert, and the price is the plan's: k (1 - h) x max(share / CPU, (1 - share) / PCIe).

Every pricer of rounds (Gate.width, allot.best_prefix, the policy's MTP switch and its
drafter rates) reads the same `OffloadCosts` through the table's interface (`cost`,
`columns_free`), built per request from the cost table kept in SpecMemory and the live
footprint: one source. With every expert in the bank nothing is missed, timed or
expected, so c_off(W) == c(W) exactly and every decision is the table's.
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np

from ..offload.estimate import MissRates
from ..offload.footprint import at_widths, missed_by_width, missed_split
from .gate import CostTable, RoundCosts, extend_line

RESIDENT_FLOOR = 0.1     # c_res(W) >= this x c(W): the timed misses' price is a model
SCALE_BOUNDS = (0.25, 8.0)   # the fitted rates_scale is kept within these (a timing's noise)


def _layer_bytes(store) -> tuple[np.ndarray, np.ndarray]:
    """([L'] bytes of one expert, [L'] mapped?) per MoE layer, in the store's order."""
    layers = store.moe_layers.tolist()
    return (np.array([store.layer_bytes(i) / store.E for i in layers], dtype=np.float64),
            np.array([i in store.mapped for i in layers], dtype=bool))


def round_ms(cpu_b, pcie_b, mapped_b, rates: MissRates):
    """ms the misses of a round add, from their bytes by tier (floats or arrays by width): the
    host tier's CPU and PCIe shares at once, then the mapped layers (CPU workers)."""
    return 1e3 * (np.maximum(cpu_b * rates.cpu, pcie_b * rates.pcie) + mapped_b * rates.mapped)


class StoreTiming:
    """What timing the cost table needs from a model with an expert store (gate.load_or_measure)."""

    def __init__(self, model):
        self.store = model.store
        link = model.cpu_tier.link if model.cpu_tier is not None else None
        self.share = int(link.share.item()) if link is not None else 0                   # 0..256, as the kernels split
        # its kernels (and what `missed` holds: bytes by tier, the CPU workers reading an expert once a round)
        self.key = ("store, CPU workers by expert" if link is not None else "store, PCIe") + "; bank timed"

    def bank_only(self):
        return self.store.bank_only()

    def frozen(self):
        return self.store.frozen()

    def missed(self, W: int) -> list[list[float]]:
        """After the timing's last round (W rows, the widest; the narrower ones ran its
        leading rows from the same state, and every row's routing is its own): [W] ->
        [CPU, PCIe, mapped] bytes of the distinct experts without a slot in rows 0..w-1,
        the host layers' split as the post kernel splits a round of w rows."""
        s = self.store
        ids, resident = s.routes[s.moe_layers, :W].cpu().numpy(), s.resident[s.moe_layers]   # [L', W, k]
        nbytes, mapped = _layer_bytes(s)
        cpu, pcie = (c.astype(np.float64) for c in missed_split(ids, resident, self.share))   # [L', W]
        whole = missed_by_width(ids, resident).astype(np.float64)
        host_b, map_b = (nbytes * ~mapped)[:, None], (nbytes * mapped)[:, None]
        by_tier = ((cpu * host_b).sum(axis=0), (pcie * host_b).sum(axis=0), (whole * map_b).sum(axis=0))
        return [[float(c), float(p), float(m)] for c, p, m in zip(*by_tier)]


def store_timing(model) -> StoreTiming | None:
    return StoreTiming(model) if getattr(model, "store", None) is not None else None


class OffloadCosts:
    """The cost table with an expert store's misses priced (the module docstring)."""

    def __init__(self, base: CostTable, store, rates: MissRates, cpu_workers: bool, tuner=None):
        """tuner: the CPU share's tuner (offload/share_tuner.py), whose share the prices follow."""
        self.base, self.store, self.rates = base, store, rates
        self._share = rates.share if cpu_workers else 0.0                                # of the host pairs, the CPU's
        self._tuner = tuner if cpu_workers else None
        nbytes, mapped = _layer_bytes(store)
        self.host_b, self.mapped_b = nbytes * ~mapped, nbytes * mapped                   # [L'] bytes of a missed expert
        timed = [float(round_ms(c, p, m, rates)) for c, p, m in base.missed[:base.measured]]
        self.rates_scale = 1.0                                                          # what a priced ms costs here
        if base.bank:
            self.resident = list(accumulate(base.bank, max))
            self.rates_scale = fit_scale(base.ms[:len(timed)], base.bank[:len(timed)], timed)
        else:
            timed = extend_line(timed, len(base.ms)) if timed else [0.0] * len(base.ms)  # [MAX_WIDTH]
            self.resident = list(accumulate((max(c - t, RESIDENT_FLOOR * c) for c, t in zip(base.ms, timed)), max))
        self._seen: tuple[object, int, float] | None = None                              # (footprint, version, share)
        self._miss_ms = np.zeros(0)

    @property
    def share(self) -> float:
        """The CPU workers' share of the host pairs as the rounds run now (the tuner's, or the plan's)."""
        return self._tuner.share if self._tuner is not None else self._share

    def _by_tier(self, pcie_pairs: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[cap] bytes a round of w = 1..cap rows is expected to miss, by tier (CPU, PCIe,
        mapped), as the footprint stands; pcie_pairs: PCIe's at one read per pair (its kernels')."""
        missed = self.store.footprint.missed()                                          # [L', cap]
        w = np.arange(1, missed.shape[1] + 1, dtype=np.float64)
        cpu = self.host_b @ at_widths(missed, self.share * w)
        pcie = (1 - self.share) * w * (self.host_b @ missed[:, 0]) if pcie_pairs else \
            self.host_b @ at_widths(missed, (1 - self.share) * w)
        return cpu, pcie, self.mapped_b @ missed

    def miss_ms(self) -> np.ndarray:
        """[cap]: the expected ms of the misses of a round of w = 1..cap rows, as the store's
        footprint stands now (recomputed once per round it learned)."""
        fp = self.store.footprint
        if self._seen != (fp, fp.version, self.share):
            self._miss_ms = self.rates_scale * round_ms(*self._by_tier(), self.rates)
            self._seen = (fp, fp.version, self.share)
        return self._miss_ms

    def cost(self, width: int) -> float:
        m = self.miss_ms()
        return self.resident[min(width, len(self.resident)) - 1] + float(m[min(width, len(m)) - 1])

    def columns_free(self, max_width: int, tol: float) -> bool:
        return self.cost(max_width) <= (1 + tol) * self.cost(1)

    def to_dict(self) -> dict:
        """The prices by width, and (for the device run) the misses' had PCIe's been priced per pair."""
        widths = [w for w in (1, 2, 4, 8, 16) if w <= len(self.resident)]
        pairs = self.rates_scale * round_ms(*self._by_tier(pcie_pairs=True), self.rates)
        return {"resident_ms": {w: self.resident[w - 1] for w in widths}, "rates_scale": self.rates_scale,
                "bank_timed": bool(self.base.bank),
                "miss_ms": {w: float(self.miss_ms()[w - 1]) for w in widths},
                "miss_ms_pcie_per_pair": {w: float(pairs[w - 1]) for w in widths}, "cpu_share": self.share,
                "rates": self.rates.to_dict(), "footprint": self.store.footprint.to_dict()}


def fit_scale(ms, bank, priced_ms) -> float:
    """The factor that makes the rates' price of the timed misses what they cost: the least
    squares k of (ms - bank) ~ k x priced over the widths where something was missed, within
    SCALE_BOUNDS; 1 where nothing was (lists by width, ms)."""
    cost = np.maximum(np.asarray(ms, dtype=np.float64) - np.asarray(bank, dtype=np.float64), 0.0)
    p = np.asarray(priced_ms, dtype=np.float64)
    if not (p > 0).any():
        return 1.0
    return float(np.clip((cost * p).sum() / (p * p).sum(), *SCALE_BOUNDS))


def priced(table: CostTable, model) -> RoundCosts:
    """The prices a request's rounds get: the table itself for resident experts, else the
    table with the store's misses."""
    store = getattr(model, "store", None)
    if store is None:
        return table
    return OffloadCosts(table, store, model.miss_rates, model.cpu_tier is not None, getattr(model, "share_tuner", None))
