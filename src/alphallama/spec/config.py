"""Speculation settings, the spec-type registry, and building a request's drafter.

Spec types: `none`, `ngram` (the copy drafter), `mtp` (the model's MTP head),
`mtp,ngram` (both, under the policy of spec/policy.py). Drafts of every type pass the
confidence gate (spec/gate.py) unless it is off; MTP drafts only while its measured
tokens pay for its measured cost (the policy's switch) unless `--spec-mtp-always`.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..config import DEFAULTS
from ..engine_slots import timing_slot
from .drafter import Drafter
from .gate import MAX_WIDTH, CostTable, Gate, RoundCosts, load_or_measure, table_key
from .ngram import NgramDrafter
from .offload_costs import priced, store_timing
from .policy import PolicyDrafter, PolicyMemory, PolicyRules

D = DEFAULTS.spec


@dataclass
class ModelMemory:
    """One model's: its round costs, and what the policy learned from each slot's streams
    (`policy`: slot 0's, the one stream's at -np 1; the others' in `slots`, made on first use
    and sharing slot 0's measured chain ms: a cost of the model, not of a text)."""
    table: CostTable | None = None
    policy: PolicyMemory = field(default_factory=PolicyMemory)
    slots: dict[int, PolicyMemory] = field(default_factory=dict)

    def policy_for(self, slot: int) -> PolicyMemory:
        if slot == 0:
            return self.policy
        return self.slots.setdefault(slot, PolicyMemory(mtp_cost=self.policy.mtp_cost))


@dataclass
class SpecMemory:
    """What speculation measures and learns, per model file, device and verify mode; it
    outlives requests (a server keeps one SpecConfig, so one memory, for all of them)."""
    models: dict[str, ModelMemory] = field(default_factory=dict)

    def for_engine(self, engine, exact: bool) -> tuple[str, ModelMemory]:
        key = json.dumps(table_key(engine.gguf.path, engine.cache.k.device, exact), sort_keys=True)
        return key, self.models.setdefault(key, ModelMemory())


@dataclass(frozen=True)
class SpecConfig:
    spec_type: str = D.spec_type               # a key of SPEC_TYPES
    draft_max: int = D.draft_max
    ngram_min: int = D.ngram_min
    fast: bool = D.fast                        # verify rows batched: may differ from plain decoding in near-ties
    mtp_depth: int = D.mtp_depth
    mtp_min_p: float = D.mtp_min_p
    mtp_switch: bool = D.mtp_switch            # MTP drafts only while it pays for its own cost (spec/policy.py)
    p_min: float | None = D.p_min              # fixed gate floor instead of pricing
    gate: bool = D.gate
    cost_cache_dir: str = D.cost_cache_dir
    cost_budget_s: float = D.cost_budget_s
    memory: SpecMemory = field(default_factory=SpecMemory, compare=False, repr=False)
    # what the policy times the MTP head's proposals by (their ms price its drafts): a test's
    # deterministic clock makes two engines' decisions comparable
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False, repr=False)

    def validate(self) -> None:
        if self.spec_type != AUTO and self.spec_type not in SPEC_TYPES:
            raise ValueError(f"unknown --spec-type {self.spec_type!r} (choose from {', '.join([AUTO, *SPEC_TYPES])})")
        if not 1 <= self.draft_max <= MAX_WIDTH:
            raise ValueError(f"--spec-draft-max must be in 1..{MAX_WIDTH}, got {self.draft_max}")
        if self.ngram_min < 1:
            raise ValueError(f"--spec-ngram-min must be >= 1, got {self.ngram_min}")
        if not 1 <= self.mtp_depth <= 5:
            raise ValueError(f"--spec-mtp-depth must be in 1..5, got {self.mtp_depth}")
        if not 0.0 <= self.mtp_min_p <= 1.0:
            raise ValueError(f"--spec-mtp-min-p must be in 0..1, got {self.mtp_min_p}")
        if self.p_min is not None and not 0.0 < self.p_min <= 1.0:
            raise ValueError(f"--spec-p-min must be in (0, 1], got {self.p_min}")

    def on_device(self, device_type: str) -> "SpecConfig":
        """The config with "auto" resolved for a device: D.auto_cuda on a GPU, none on the
        CPU (its exact verify runs a draft's rows one by one: drafts save it nothing).
        The memory stays shared."""
        if self.spec_type != AUTO:
            return self
        return replace(self, spec_type=D.auto_cuda if device_type == "cuda" else "none")

    @property
    def mode(self) -> str:
        return "fast (not token-identical)" if self.fast else "exact"

    @property
    def max_drafts(self) -> int:
        kinds = SPEC_TYPES[self.spec_type]
        return max([self.draft_max] * ("ngram" in kinds) + [self.mtp_depth] * ("mtp" in kinds) + [0])

    def rules(self) -> PolicyRules:
        return PolicyRules(D.long_match, D.copy_margin, D.policy_min_obs)

    def switched(self) -> bool:
        """Does this config's MTP drafter run under the switch (so a PolicyDrafter and the cost table)?"""
        return self.mtp_switch and "mtp" in SPEC_TYPES[self.spec_type]

    def cost_table(self, engine, slot=None) -> RoundCosts:
        """The round prices for this engine's model and device: the cost table from memory,
        else from the disk cache, else timed now (once; reported on stderr); with an expert
        store, priced with its misses (spec/offload_costs.py). slot: the one the asking
        request holds (engine_slots.Slot; None: none). Timing runs on it or on a free slot,
        never on another stream's (engine_slots.timing_slot)."""
        _, mem = self.memory.for_engine(engine, not self.fast)
        if mem.table is None:
            def room():             # called only if the table must be timed
                return timing_slot(engine.slots, slot, MAX_WIDTH, engine.reset_slot).cache
            mem.table = load_or_measure(engine.model, engine.cache, engine.gguf.path, engine.cfg.vocab_size,
                                        not self.fast, self.cost_cache_dir, self.cost_budget_s,
                                        store_timing(engine.model), room=room)
            if not mem.table.from_cache:
                print(f"alphallama: timed verify rounds of 1..{mem.table.measured} rows for this model and "
                      f"device in {mem.table.measure_s:.1f} s (kept in {self.cost_cache_dir})", file=sys.stderr)
        return priced(mem.table, engine.model)

    def make_gate(self, table: RoundCosts | None) -> Gate:
        if not self.gate:
            return Gate()
        if self.p_min is not None:
            return Gate(p_min=self.p_min)
        if table is None or table.columns_free(1 + self.max_drafts, D.gate_free):
            return Gate()
        return Gate(table)

    def make_drafter(self, engine=None, mtp=None, slot=None) -> Drafter | None:
        """A drafter for one request. `engine` gives drafters that need the model (MTP)
        its head, and the gate its round costs; without it (replay) the copy drafter runs
        alone and ungated. mtp: the request's slot's MTP state (spec/mtp.py; None: the
        engine's first slot's). slot: the request's slot (engine_slots.Slot; None: the
        first): its policy memory, and where the cost table may be timed. "auto" is
        resolved for the engine's device (without an engine: none)."""
        self.validate()
        if self.spec_type == AUTO:
            device = engine.cache.k.device.type if engine is not None else "cpu"
            return self.on_device(device).make_drafter(engine, mtp, slot)
        kinds = SPEC_TYPES[self.spec_type]
        if not kinds:
            return None
        if engine is None and "mtp" in kinds:
            raise ValueError(f"--spec-type {self.spec_type} needs the model (its MTP head)")
        made = {k: DRAFTERS[k](self, engine, mtp) for k in kinds}
        mtp, copy = made.get("mtp"), made.get("ngram")
        policy = mtp is not None and copy is not None
        switched = self.switched()
        if engine is None or not (policy or switched or self.gate):
            return mtp or copy
        table = self.cost_table(engine, slot) if policy or switched or self.p_min is None else None
        gate = self.make_gate(table)
        if not (policy or switched or gate.on):
            return mtp or copy
        _, mem = self.memory.for_engine(engine, not self.fast)
        memory = mem.policy_for(slot.id if slot is not None else 0)
        return PolicyDrafter(mtp, copy, gate, memory, table, self.rules(), switch=self.mtp_switch, clock=self.clock)


def _mtp(cfg: SpecConfig, engine, state) -> Drafter:
    try:
        from .mtp import make_mtp_drafter
    except ImportError as e:
        raise ValueError(f"the MTP drafter is not available in this build ({e})") from None
    return make_mtp_drafter(engine, cfg.mtp_depth, cfg.mtp_min_p, state)


# drafter name -> factory(config, engine, the slot's MTP state)
DRAFTERS: dict[str, Callable[[SpecConfig, object, object], Drafter]] = {
    "ngram": lambda c, engine, state: NgramDrafter(ngram_min=c.ngram_min, draft_max=c.draft_max),
    "mtp": _mtp,
}
# --spec-type -> the drafters it runs (two: the policy chooses per round); AUTO: see SpecConfig.on_device
AUTO = "auto"
SPEC_TYPES: dict[str, tuple[str, ...]] = {"none": (), "ngram": ("ngram",), "mtp": ("mtp",), "mtp,ngram": ("mtp", "ngram")}


def add_spec_arguments(p) -> None:
    """Speculation flags for run and serve."""
    p.add_argument("--spec-type", default=D.cli_spec_type, choices=[AUTO, *SPEC_TYPES],
                   help=f"speculative drafter: the copy (ngram), the MTP head (mtp), or both under the policy; "
                        f"{AUTO} (default): {D.auto_cuda} on a GPU, none on the CPU")
    p.add_argument("--spec-draft-max", type=int, default=D.draft_max, help="most copy drafts per round")
    p.add_argument("--spec-ngram-min", type=int, default=D.ngram_min,
                   help="shortest suffix match the copy drafter acts on")
    p.add_argument("--spec-mtp-depth", type=int, default=D.mtp_depth, help="MTP drafts per round (1..5)")
    p.add_argument("--spec-mtp-min-p", type=float, default=D.mtp_min_p,
                   help="MTP stops before a draft whose probability is under this")
    p.add_argument("--spec-mtp-always", action="store_true",
                   help="MTP drafts every round, even where its measured tokens per round do not pay for the "
                        "head's measured cost (default: the policy switches it off there)")
    p.add_argument("--spec-p-min", type=float, default=D.p_min,
                   help="verify drafts while their cumulative confidence is at least this (instead of pricing columns)")
    p.add_argument("--no-gate", action="store_true", help="verify every draft (no confidence gate)")
    p.add_argument("--fast", action="store_true",
                   help="fast mode: batched verify, may differ from plain greedy in near-ties")


def spec_from_args(args) -> SpecConfig:
    cfg = SpecConfig(spec_type=args.spec_type, draft_max=args.spec_draft_max, ngram_min=args.spec_ngram_min,
                     fast=args.fast, mtp_depth=args.spec_mtp_depth, mtp_min_p=args.spec_mtp_min_p,
                     mtp_switch=not args.spec_mtp_always, p_min=args.spec_p_min, gate=not args.no_gate)
    cfg.validate()
    return cfg
