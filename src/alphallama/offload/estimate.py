"""Where a plan's experts live (VRAM / RAM / mapped file) and what a decode round should cost.

The host side of the layout (`HostLayout`): the pinned RAM the host tier may hold
(`--host-mem`, else the available RAM less a headroom), and the MoE layers past it, whose
experts stay in the mapped GGUF file (mapped.map_past_budget: the store decides the same).

The cost model (`estimate`), plain decode at W = 1, per round:

    dense bytes / GPU bandwidth + n_layers x layer_fixed_s                    (the resident round)
    + with a store: n_moe x store_layer_extra_s                               (its contract kernels)
    + R h B / GPU                         bank hits
    + R (1 - h) f_ram B / (CPU | PCIe)    host-tier misses: the CPU takes a share of them at
                                          ram x worker_efficiency, PCIe the rest, both at once; the
                                          share where both finish together, CPU / (CPU + PCIe)
    + R (1 - h) f_map B / mapped rate     mapped misses: the CPU workers at min(their rate, the
                                          page cache's) when the mapped bytes fit the RAM left, else
                                          the disk's

R = n_moe x top_k experts a token, B one expert's bytes, h = slots / experts (uniform routing:
a floor; a skewed router hits more, 0.62 measured at 50% on the synthetic 30B-A3B), f_ram /
f_map the host / mapped layers' shares. The constants come from measured rounds (config.py).
The per-byte rates of the two miss lines (`MissRates`) also price the misses of a verify
round's extra columns for the speculation gate (spec/offload_costs.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import DEFAULTS
from .host_probe import Bandwidths
from .mapped import map_past_budget


def human(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def host_budget(host_mem: int | None, available: int | None) -> tuple[int | None, str]:
    """(pinned RAM the host tier may hold, where that figure comes from); None: unknown, no cap."""
    usable = None if available is None else int(available * (1 - DEFAULTS.offload.host_headroom))
    keep = f"{100 * DEFAULTS.offload.host_headroom:.0f}%"
    if host_mem is not None:
        if usable is not None and usable < host_mem:
            return usable, f"available RAM less {keep} (below --host-mem)"
        return host_mem, "--host-mem"
    if usable is None:
        return None, "unknown available RAM: every expert in RAM"
    return usable, f"available RAM less {keep}"


@dataclass(frozen=True)
class HostLayout:
    budget: int | None                 # pinned RAM the host tier may hold
    source: str
    experts_per_layer: int
    ram_bytes: int                     # the host tier (planes)
    mapped_layers: tuple[int, ...]
    mapped_bytes: int                  # the mapped layers' experts (planes; the file's are a little fewer)
    moe_layers: int
    page_room: int | None              # RAM left for the page cache (None: unknown)

    @classmethod
    def of(cls, layer_bytes: dict[int, int], experts_per_layer: int, host_mem: int | None,
           available: int | None) -> "HostLayout":
        budget, source = host_budget(host_mem, available)
        total = sum(layer_bytes.values())
        mapped = tuple(map_past_budget(layer_bytes, budget)) if budget is not None and total > budget else ()
        mb = sum(layer_bytes[i] for i in mapped)
        room = None if available is None else max(available - (total - mb), 0)
        return cls(budget, source, experts_per_layer, total - mb, mapped, mb, len(layer_bytes), room)

    @property
    def ram_experts(self) -> int:
        return (self.moe_layers - len(self.mapped_layers)) * self.experts_per_layer

    @property
    def mapped_experts(self) -> int:
        return len(self.mapped_layers) * self.experts_per_layer

    def to_dict(self) -> dict:
        return {**asdict(self), "ram_experts": self.ram_experts, "mapped_experts": self.mapped_experts}


@dataclass(frozen=True)
class Estimate:
    tok_s: float
    ms_round: float
    hit_rate: float                    # the bank's, under uniform routing
    parts_ms: dict[str, float]         # dense+fixed, store, bank, ram, mapped
    assumed: tuple[str, ...]           # rates not measured here (priced from config.py)
    miss: "MissRates | None" = None    # the seconds a missed expert byte costs (offload; the gate's prices start here)

    def to_dict(self) -> dict:
        return {**asdict(self), "miss": self.miss.to_dict() if self.miss is not None else None}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in self.parts_ms.items() if v > 0)
        note = f"; assumed {', '.join(self.assumed)}" if self.assumed else ""
        return (f"{self.tok_s:.0f} tok/s, {self.ms_round:.2f} ms a round (ms: {parts}; bank hit rate "
                f"{self.hit_rate:.2f} under uniform routing, a floor{note})")


def uniform_hit_rate(slots: int, n_experts: int) -> float:
    """The bank's hit rate when routing is uniform: slots / experts (a floor for a skewed router)."""
    return min(slots / n_experts, 1.0) if n_experts else 1.0


@dataclass(frozen=True)
class MissRates:
    """Seconds one byte of a missed expert adds to a round, per tier: the cost model's rates
    (the module docstring), for the estimate here and the gate's round prices
    (spec/offload_costs.py: a missed expert costs its bytes times its tier's rate).

    A host-tier miss is split by (row, rank) pairs: the CPU workers take `share` of a
    layer's host pairs, PCIe the rest, at once. The two tiers read differently: the workers
    read a missed expert once a round for all its pairs (native/post.c), the PCIe kernels
    once per pair (the GPU's L2 may keep it between pairs: not measured yet). One row's
    misses are distinct experts, so at W = 1 a miss costs `host` a byte either way."""
    pcie: float                        # a host-tier miss over PCIe (all of it, without CPU workers)
    mapped: float                      # a mapped miss: the CPU workers at min(their rate, page cache | disk)
    cpu: float = 0.0                   # a host-tier miss all on the CPU workers (0: none)
    share: float = 0.0                 # of a layer's host pairs, the CPU workers' (0 without them)
    source: str = "measured"

    @property
    def host(self) -> float:
        """A host-tier miss of a one-row round: `share` on the workers, the rest over PCIe, at once."""
        return max(self.share * self.cpu, (1 - self.share) * self.pcie)

    @classmethod
    def of(cls, bw: Bandwidths, cpu_threads: int, mapped_fits: bool) -> "MissRates":
        """mapped_fits: the mapped layers' bytes fit the RAM left for the page cache."""
        o = DEFAULTS.offload
        pcie = bw.pcie if bw.pcie is not None else o.assumed_pcie_bw
        cpu = bw.ram * o.worker_efficiency if cpu_threads else 0.0
        # unmeasured page cache: priced as the disk; an unmeasured disk as config's assumed one
        src = (bw.page_cache if mapped_fits else None) or bw.disk or o.assumed_disk_bw
        rate = min(cpu, src)                                            # no workers: no mapped tier (0)
        return cls(pcie=1 / pcie, mapped=1 / max(rate, 1.0), cpu=1 / cpu if cpu else 0.0,
                   share=cpu / (cpu + pcie),        # both pipes finish together (the tuner's start; 0 without workers)
                   source=bw.source if bw.pcie is not None else f"{bw.source}; PCIe assumed")

    @classmethod
    def assumed(cls, cpu_threads: int) -> "MissRates":
        """Without a plan's measured bandwidths (a library caller): config.py's assumed ones."""
        o = DEFAULTS.offload
        return cls.of(Bandwidths(ram=o.assumed_ram_bw, source="assumed"), cpu_threads, False)

    def to_dict(self) -> dict:
        return {**asdict(self), "host": self.host}


def estimate(dense: int, expert_bytes: float, n_layers: int, n_moe: int, top_k: int, slots: int, n_experts: int,
             host: HostLayout | None, bw: Bandwidths, cpu_threads: int) -> Estimate:
    """Plain decode's expected round (see the module's docstring). host None: every expert
    resident (no store); expert_bytes: one expert's (gate + up + down); n_moe: MoE layers."""
    o = DEFAULTS.offload
    gpu = bw.gpu if bw.gpu is not None else o.assumed_gpu_bw
    pcie = bw.pcie if bw.pcie is not None else o.assumed_pcie_bw
    assumed = tuple(f"{name} {v / 1e9:.0f} GB/s" for name, v, got in
                    (("GPU", gpu, bw.gpu), ("PCIe", pcie, bw.pcie)) if got is None)
    R = n_moe * top_k                                                 # experts a token reads
    parts = {"dense+fixed": 1e3 * (dense / gpu + n_layers * o.layer_fixed_s)}
    miss = None
    if host is None:
        parts["experts"] = 1e3 * R * expert_bytes / gpu
        h = 1.0
    else:
        h = uniform_hit_rate(slots, n_experts)
        f_map = len(host.mapped_layers) / max(host.moe_layers, 1)
        fits = host.page_room is not None and host.mapped_bytes <= host.page_room
        miss = MissRates.of(bw, cpu_threads, fits)
        b = R * (1 - h) * expert_bytes
        ram_b, map_b = b * (1 - f_map), b * f_map
        parts["store"] = 1e3 * n_moe * o.store_layer_extra_s
        parts["bank"] = 1e3 * R * h * expert_bytes / gpu
        parts["ram"] = 1e3 * ram_b * miss.host
        if map_b:
            parts["mapped"] = 1e3 * map_b * miss.mapped
            if not (fits and bw.page_cache) and bw.disk is None:
                assumed += (f"disk {o.assumed_disk_bw / 1e9:.1f} GB/s",)
    ms = sum(parts.values())
    return Estimate(1e3 / ms, ms, h, {k: round(v, 4) for k, v in parts.items()}, assumed, miss)
