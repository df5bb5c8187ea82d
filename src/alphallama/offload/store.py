"""The expert store: every routed expert in host RAM (or the mapped file), the hottest also
in one VRAM bank.

    host tier   per class, planes [layers * E, N, per_row] in pinned (page-locked, device-
                mapped) RAM: every expert of the layers that fit the host budget, always
                (weights are read-only, so evicting from the bank is just retargeting the table)
    mapped      the layers past the host budget (`host_bytes`): their experts stay in the
                GGUF file's mapping, computed by the CPU workers from the file's blocks
                (offload/mapped.py), read ahead between rounds
    bank        per class, planes [S, N, per_row] in VRAM: S slots shared by the class's layers
    table       int32 [L, E] on the device: slot of (layer, expert) in its class's bank, or
                HOST (-1, pinned RAM) / MAPPED (-2, the file)

A class is the layers whose experts have the same formats and shapes (a Q4_K_M file
has Q6_K ffn_down in some layers and Q4_K in the others: two classes); its slots are a
share of the bank proportional to its layers. The round's MoE kernels (kernels/moe/moe_f32.py)
read the table on the device and take each expert from its slot, or from the host tier
in place over PCIe where it has none, with the same arithmetic either way: where an
expert lives never changes the bits, and the table is a graph input, so residency
changes never rebuild graphs.

Between rounds (`before_round` / `after_launch`, called by GPUModel.forward and, for a
pass of several streams' rows, GPUModel.round):
- the round's routing (written by the route kernels into `routes`, its rows in the pass's
  order, whatever stream) goes to the host behind the round and feeds the usage policy
  (policy.py) at the next round, and the footprint (footprint.py: the distinct experts w
  rows touch, what the gate prices) after the next round's launch, while the device runs it;
- admissions (admission.py): the victim's table entry is cleared on the round's stream,
  then the new expert's planes are copied into the slot in chunks on a side stream, at
  most `admit_bytes_per_round` queued per stream of the round and only after the round was
  launched, so a copy never delays a round's own inputs; once the copy's event has
  completed, a later round's table gets the slot.
Without CUDA (tests) the same bookkeeping runs with synchronous copies: the "bank" is
then ordinary memory, which is how the tiers are simulated on CPU.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..config import DEFAULTS
from ..gguf.reader import TensorInfo
from ..kernels.formats.qweight import QuantWeight
from .admission import Admission, queue_copies, round_budget
from .estimate import uniform_hit_rate
from .footprint import Footprint
from .mapped import HOST, MAPPED, MappedExperts, ReadAhead, map_past_budget
from .numa import gpu_placement
from .planes import bank_like, host_like, sub_experts, pack_experts, pin

__all__ = ["ExpertStore", "ExpertClass", "LayerView", "Tiers", "pack_experts", "pin"]
from .policy import UsagePolicy


@dataclass
class ExpertClass:
    layers: list[int]                    # model layer ids, in order
    template: tuple[QuantWeight, QuantWeight] | None = None   # one expert's (gate_up, down) planes [1, ...]
    host_gate_up: QuantWeight | None = None  # [host layers * E, 2F, K]; None: every layer mapped
    host_down: QuantWeight | None = None     # [host layers * E, D, F]
    bank_gate_up: QuantWeight | None = None  # [S, 2F, K]
    bank_down: QuantWeight | None = None     # [S, D, F]
    owners: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [S] flat id, -1 free, -2 filling

    @property
    def slot_bytes(self) -> int:
        return self.template[0].nbytes + self.template[1].nbytes


@dataclass(frozen=True)
class LayerView:
    """What one MoE layer's kernels take. A mapped layer has no host planes: host_* are
    then the bank's (the kernels' format and shapes; never read: every pair of a mapped
    expert without a slot is the CPU workers')."""
    host_gate_up: QuantWeight   # [E, 2F, K]
    host_down: QuantWeight      # [E, D, F]
    bank_gate_up: QuantWeight
    bank_down: QuantWeight
    table: torch.Tensor         # [E] int32, a row of the store's table
    mapped: MappedExperts | None = None


class Tiers(NamedTuple):
    """Where one MoE layer's experts are read in a round: the host planes (all experts,
    resident or not), the bank and the slot table (None: every expert resident), and the
    round's route record (the store's admission policy reads it; None: not kept)."""
    gate_up: QuantWeight        # [E, 2F, K]
    down: QuantWeight           # [E, D, F]
    table: torch.Tensor | None
    bank_gate_up: QuantWeight | None
    bank_down: QuantWeight | None
    routes: torch.Tensor | None

    @classmethod
    def resident(cls, gate_up: QuantWeight, down: QuantWeight) -> "Tiers":
        return cls(gate_up, down, None, None, None, None)


class ExpertStore:
    def __init__(self, layers: dict[int, tuple[TensorInfo, TensorInfo, TensorInfo]], n_layers: int,
                 n_experts: int, top_k: int, slots: int, device, max_w: int, progress=None,
                 admit_bytes_per_round: int = DEFAULTS.offload.admit_bytes_per_round,
                 chunk_bytes: int = DEFAULTS.offload.admit_chunk_bytes,
                 half_life: float = DEFAULTS.offload.score_half_life, margin: float = DEFAULTS.offload.admit_margin,
                 host_bytes: int | None = None, readahead: int = DEFAULTS.offload.readahead_experts):
        """layers: MoE layer id -> (gate, up, down) tensor infos; slots: bank slots in all.
        host_bytes: pinned RAM the host tier may hold (None: every expert); the layers past
        it (in layer order, each whole) stay in the mapped file. readahead: the likely
        experts per mapped layer read ahead between rounds."""
        self.device = torch.device(device)
        self.E, self.top_k = n_experts, top_k
        self.admit_bytes_per_round, self.chunk_bytes = admit_bytes_per_round, chunk_bytes
        self.classes: list[ExpertClass] = []
        self._class_of: dict[int, tuple[ExpertClass, int]] = {}   # layer -> (class, index in class)
        keys: dict[tuple, ExpertClass] = {}
        for i, (g, u, d) in sorted(layers.items()):
            key = (g.qtype, u.qtype, tuple(g.shape), d.qtype, tuple(d.shape))
            keys.setdefault(key, ExpertClass([])).layers.append(i)
        self.classes = list(keys.values())
        for c in self.classes:
            c.template = MappedExperts(*layers[c.layers[0]]).expert(0, "cpu")
        self.mapped = self._map_past_budget(layers, host_bytes)
        self.placement = gpu_placement(self.device)   # the GPU's memory node (None: one node, or no GPU)
        node_cpus = self.placement.cpus if self.placement is not None else None
        if node_cpus is not None and progress is not None:
            progress(self.placement.describe(), 0)
        for c in self.classes:
            host_layers = [i for i in c.layers if i not in self.mapped]
            for i in c.layers:
                if i in self.mapped:
                    self._class_of[i] = (c, -1)
            for j, i in enumerate(host_layers):
                gu, dn = pack_experts(*layers[i], self.device)
                if c.host_gate_up is None:
                    rows = len(host_layers) * self.E
                    c.host_gate_up, c.host_down = host_like(gu, rows, node_cpus), host_like(dn, rows, node_cpus)
                for host, w in ((c.host_gate_up, gu), (c.host_down, dn)):
                    for n, p in w.planes.items():
                        host.planes[n][j * self.E:(j + 1) * self.E].copy_(p)
                self._class_of[i] = (c, j)
                del gu, dn
                if progress is not None:
                    progress(f"experts of layer {i}", 0)
        self.moe_layers = np.array(sorted(layers), dtype=np.int64)
        self._home = torch.full((n_layers, self.E), HOST, dtype=torch.int32, device=self.device)  # [L, E] no slot
        self._home[sorted(self.mapped)] = MAPPED
        self.table = self._home.clone()                                                         # [L, E]
        self.readahead = ReadAhead(self.mapped, readahead) if self.mapped else None
        self.resident = np.zeros((n_layers, self.E), dtype=bool)                                  # host mirror
        self.routes = torch.zeros((n_layers, max_w, top_k), dtype=torch.int32, device=self.device)  # [L, W, k]
        cuda = self.device.type == "cuda"
        self._routes_host = torch.zeros(self.routes.shape, dtype=torch.int32, pin_memory=cuda)
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._pending_routes: tuple[int, np.ndarray, object] | None = None   # (W, resident snapshot, event)
        self._admissions: list[Admission] = []
        self._half_life = half_life
        self.policy = UsagePolicy(n_layers, self.E, half_life, margin)
        self._split_and_fill(slots)
        self.footprint = self._new_footprint()
        self._unseen: tuple[np.ndarray, np.ndarray] | None = None   # (ids, resident) the footprint has not seen
        self._frozen = False

    def _new_footprint(self) -> Footprint:
        o = DEFAULTS.offload
        return Footprint(len(self.moe_layers), self.E, self.top_k,
                         uniform_hit_rate(self.slots, len(self.moe_layers) * self.E), o.footprint_half_life,
                         o.footprint_prior_rows)

    # -- layout --------------------------------------------------------------------
    def _map_past_budget(self, layers: dict, host_bytes: int | None) -> dict[int, MappedExperts]:
        """The layers whose experts stay in the mapped file (mapped.map_past_budget)."""
        size = {i: c.slot_bytes * self.E for c in self.classes for i in c.layers}
        return {i: MappedExperts(*layers[i]) for i in map_past_budget(size, host_bytes)}

    def _split_and_fill(self, slots: int) -> None:
        """Share the slots among the classes by layer count, and fill each bank with a
        layer-balanced start (expert 0 of every layer, then expert 1, ...)."""
        total_layers = sum(len(c.layers) for c in self.classes)
        shares = [min(slots * len(c.layers) // total_layers, len(c.layers) * self.E) for c in self.classes]
        for i in np.argsort([-len(c.layers) for c in self.classes]):   # leftovers to the largest classes
            extra = min(slots - sum(shares), len(self.classes[i].layers) * self.E - shares[i])
            shares[i] += max(extra, 0)
        for c, s in zip(self.classes, shares):
            c.bank_gate_up = bank_like(c.template[0], s, self.device)
            c.bank_down = bank_like(c.template[1], s, self.device)
        self.slots = sum(shares)
        self._fill_start()

    def _fill_start(self) -> None:
        for c in self.classes:
            c.owners = np.full(c.bank_gate_up.shape[0], -1, dtype=np.int64)
            for slot in range(c.owners.size):
                layer, e = c.layers[slot % len(c.layers)], slot // len(c.layers)
                self._copy_now(c, slot, layer * self.E + e)

    def reset(self) -> None:
        """Back to the start layout with a fresh policy (benchmarks: every arm from the
        same state). Waits for queued admissions."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
            torch.cuda.synchronize(self.device)
        self._admissions.clear()
        self._pending_routes = None
        self.table.copy_(self._home)
        self.resident[:] = False
        if self.readahead is not None:
            self.readahead.asked.clear()
        self.policy = UsagePolicy(self.table.shape[0], self.E, self._half_life, self.policy.margin)
        self._fill_start()
        self.footprint, self._unseen = self._new_footprint(), None

    def _sources(self, c: ExpertClass, slot: int, flat: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(bank slot plane, source plane) pairs of one expert: its host-tier rows, or
        planes packed from the mapped file (page-locked on CUDA: the copy is asynchronous)."""
        layer, e = divmod(flat, self.E)
        j = self._class_of[layer][1]
        if j < 0:
            gu, dn = self.mapped[layer].expert(e, "cpu")
            cuda = self.device.type == "cuda"
            return [(bank.planes[n][slot], p.planes[n][0].pin_memory() if cuda else p.planes[n][0])
                    for bank, p in ((c.bank_gate_up, gu), (c.bank_down, dn)) for n in p.planes]
        h = j * self.E + e
        return [(bank.planes[n][slot], host.planes[n][h])
                for bank, host in ((c.bank_gate_up, c.host_gate_up), (c.bank_down, c.host_down))
                for n in host.planes]

    def _copy_now(self, c: ExpertClass, slot: int, flat: int) -> None:
        for dst, src in self._sources(c, slot, flat):
            dst.copy_(src)
        self._assign(c, slot, flat)

    def _assign(self, c: ExpertClass, slot: int, flat: int) -> None:
        layer, e = divmod(flat, self.E)
        c.owners[slot] = flat
        self.table[layer, e] = slot
        self.resident[layer, e] = True

    def layer(self, i: int) -> LayerView:
        c, j = self._class_of[i]
        if j < 0:
            return LayerView(c.bank_gate_up, c.bank_down, c.bank_gate_up, c.bank_down, self.table[i], self.mapped[i])
        a, b = j * self.E, (j + 1) * self.E
        return LayerView(sub_experts(c.host_gate_up, a, b), sub_experts(c.host_down, a, b), c.bank_gate_up, c.bank_down,
                         self.table[i])

    def host_expert(self, i: int, e: int) -> tuple[QuantWeight, QuantWeight]:
        """Expert e of layer i without its slot, where the device can read it: (gate_up
        [2F, D], down [D, F]) from the host tier in place, or packed from the mapped file
        onto the device (prefill)."""
        v = self.layer(i)
        if v.mapped is None:
            return v.host_gate_up.expert(e), v.host_down.expert(e)
        gu, dn = v.mapped.expert(e, self.device)
        return gu.expert(0), dn.expert(0)

    def layer_bytes(self, i: int) -> int:
        """All of layer i's experts, as planes."""
        return self._class_of[i][0].slot_bytes * self.E

    def cpu_sources(self) -> dict:
        """Per MoE layer, what the CPU workers read: (gate_up, down) host planes, or the
        layer's MappedExperts."""
        return {i: self.mapped[i] if i in self.mapped else (self.layer(i).host_gate_up, self.layer(i).host_down)
                for i in self.moe_layers.tolist()}

    def tiers(self, i: int, rows: int) -> Tiers:
        """Layer i's experts as a round of `rows` rows reads them (the kernels' table dispatch)."""
        v = self.layer(i)
        return Tiers(v.host_gate_up, v.host_down, v.table, v.bank_gate_up, v.bank_down, self.routes[i, :rows])

    @property
    def bank_bytes(self) -> int:
        return sum(c.bank_gate_up.nbytes + c.bank_down.nbytes for c in self.classes)

    @property
    def host_bytes(self) -> int:
        """Pinned RAM of the host tier."""
        return sum(c.host_gate_up.nbytes + c.host_down.nbytes for c in self.classes if c.host_gate_up is not None)

    @property
    def mapped_bytes(self) -> int:
        """The mapped layers' experts, as the file holds them."""
        return sum(m.file_bytes for m in self.mapped.values())

    # -- between rounds --------------------------------------------------------------
    @property
    def is_frozen(self) -> bool:
        return self._frozen

    @contextmanager
    def frozen(self):
        """Rounds inside (the gate's cost table being timed, spec/gate.py) leave the bank, the
        admission policy, the footprint and the hit counts as they were: no admissions, no
        routing learned, nothing read ahead; `routes` still holds the last round's picks."""
        self.before_round()                    # the last real round's routing first
        self._frozen = True
        try:
            yield self
        finally:
            self._frozen = False

    @contextmanager
    def bank_only(self):
        """Rounds inside read every expert from a bank slot: one without a slot points at a
        slot of its layer's class (another expert's weights: for timing the bank's own cost,
        values discarded, spec/gate.py), so no pair goes to PCIe or the CPU workers. The table
        and `routes` (the picks of the last round before) are back as they were after, also on
        an error; a class without slots keeps its misses."""
        saved, routes = self.table.clone(), self.routes.clone()
        e = torch.arange(self.E, device=self.table.device, dtype=self.table.dtype)       # [E]
        for c in self.classes:
            if c.owners.size:
                rows = torch.tensor(c.layers, device=self.table.device)
                t = self.table[rows]                                                       # [L_c, E]
                self.table[rows] = torch.where(t < 0, e % c.owners.size, t)
        try:
            yield self
        finally:
            self.table.copy_(saved)
            self.routes.copy_(routes)

    def before_round(self) -> None:
        """Learn from the last round's routing; hand finished admissions their slots."""
        if self._frozen:
            return
        if self._pending_routes is not None:
            W, resident, ev = self._pending_routes
            if ev is not None:
                ev.synchronize()
            ids = self._routes_host[self.moe_layers, :W].numpy()             # [L', W, k]
            self.policy.observe(ids, self.moe_layers, resident)
            self._unseen = (ids.copy(), resident[self.moe_layers])
            self._pending_routes = None
            if self.readahead is not None:
                self.readahead.step(self.policy.score, self.resident)
        done = [a for a in self._admissions if not a.chunks and (a.ready is None or a.ready.query())]
        for a in done:
            if a.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(a.ready)
            c, _ = self._class_of[a.flat // self.E]
            self._assign(c, a.slot, a.flat)
            self._admissions.remove(a)
            self.policy.stats.admissions += 1

    def learn_prompt(self, layer: int, weighted, rows: int) -> None:
        """A prefill chunk's routing of MoE layer `layer` (policy.learn_prompt); nothing while
        frozen. Admissions follow at the next decode round's after_launch."""
        if not self._frozen:
            self.policy.learn_prompt(layer, np.asarray(weighted, dtype=np.float64), rows)

    def after_launch(self, W: int, streams: int = 1) -> None:
        """After a round of W rows (of `streams` parallel streams) was launched: its routing
        goes to the host behind it, new admissions are chosen, and copies are queued up to
        the round's budget (admission.round_budget: each stream's); the footprint learns the
        previous round's routing (off the round's path)."""
        if self._frozen:
            return
        cuda = self.device.type == "cuda"
        ev = None
        if cuda:
            self._routes_host.copy_(self.routes, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        else:
            self._routes_host.copy_(self.routes)
        self._pending_routes = (W, self.resident.copy(), ev)
        budget = round_budget(self.admit_bytes_per_round, streams)
        evicted = not self._admissions and self._choose(budget)
        if evicted and cuda:
            # the evicted slots' last readers (rounds launched before the table was
            # cleared) finish before their slots are overwritten
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        queue_copies(self._admissions, budget, self._copy_stream, self.policy.stats)
        if self._unseen is not None:
            self.footprint.observe(*self._unseen)
            self._unseen = None

    def _choose(self, budget: int) -> bool:
        """Start admissions (up to `budget` bytes' worth a class); True if any resident was
        evicted for them."""
        busy = {a.flat for a in self._admissions}
        evicted = False
        for c in self.classes:
            if c.owners.size == 0:
                continue
            limit = max(1, budget // max(c.slot_bytes, 1))
            flats = (np.array(c.layers, dtype=np.int64)[:, None] * self.E + np.arange(self.E)).ravel()
            cands = flats[~self.resident.ravel()[flats]]
            for slot, flat in self.policy.choose(c.owners, cands, busy, limit):
                old = int(c.owners[slot])
                if old >= 0:   # evict: later rounds read it from the host tier (or the mapped file)
                    self.table[old // self.E, old % self.E] = self._home[old // self.E, old % self.E]
                    self.resident[old // self.E, old % self.E] = False
                    evicted = True
                c.owners[slot] = -2
                chunks = []
                for dst, src in self._sources(c, slot, flat):
                    rows = max(1, self.chunk_bytes // max(dst[0].numel() * dst.element_size(), 1))
                    chunks += [(dst[r:r + rows], src[r:r + rows]) for r in range(0, dst.shape[0], rows)]
                self._admissions.append(Admission(slot, flat, chunks))
                busy.add(flat)
        return evicted

    @property
    def stats(self):
        return self.policy.stats
