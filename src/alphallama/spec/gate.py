"""Confidence-gated verify width: a draft is verified only if it is worth its column.

A round of W rows costs c(W) ms (the cost table, timed once per model file, device and
engine version, and cached on disk). If S_k is the chance that drafts 1..k are all
accepted (the cumulative confidence), verifying drafts 1..n commits on average
E_n = 1 + S_1 + ... + S_n tokens, at E_n / c(n + 1) tokens per ms. The gate verifies
the n leading drafts that maximize that rate. Adding draft n raises it exactly when

    S_n > (c(n + 1) - c(n)) / (c(n) / E_{n-1})   # column cost / time per token = tau_n

which is DESIGN §5's rule; taking the best prefix instead of stopping at the first
column that does not pay lets drafts past a dearer width (a new bucket) pay for it.
A drafter that spent `overhead` ms on this round's drafts (the MTP head's chain; the
policy measures it) makes every width cost that much more: the rate is
E_n / (c(n + 1) + overhead), which the round pays whatever it verifies. Whether the
drafter should run at all is the policy's question (spec/policy.py, `MTPSwitch`).

The gate is off (every draft is verified) where columns are nearly free: when the
widest round the drafters may ask for costs at most `gate_free` more than W = 1.
`--spec-p-min P` replaces the pricing by a fixed floor (verify while S_k >= P);
`--no-gate` verifies every draft.

MTP drafts carry their probabilities (S_k = their running product); the copy drafter
has none, so `CopyConfidence` learns its per-depth acceptance per match length online.

With an expert store (offload) the table is priced further: a wider round touches more
experts, and those without a bank slot are misses its tiers pay for; the gate, the
streams' allotment and the MTP switch then read `OffloadCosts` (spec/offload_costs.py),
which has the table's interface (`RoundCosts`) and adds the learned miss cost.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from .. import __version__
from .stats import DepthCounts, match_bucket

COST_VERSION = 2        # bump when what a round does changes enough to invalidate cached tables
                        # (2: PDL, int8 experts and the GEMV tiles of 20261130: a W=8 round ~0.6x its old cost)
MAX_WIDTH = 64


class RoundCosts(Protocol):
    """What prices a round: the cost table, or the table with an expert store's misses."""

    def cost(self, width: int) -> float: ...

    def columns_free(self, max_width: int, tol: float) -> bool: ...


@dataclass
class CostTable:
    ms: list[float]                 # [W - 1]: ms per verify round of W rows, W = 1..len(ms)
    measured: int = 0               # widths 1..measured were timed; wider ones extrapolated linearly
    measure_s: float = 0.0          # what timing it cost (at load, once per model and device)
    key: dict = field(default_factory=dict)
    from_cache: bool = False
    # with an expert store: [W - 1] -> [CPU, PCIe, mapped] bytes of the distinct experts without
    # a bank slot that the timed round of W rows read, W = 1..measured ([]: none): the host
    # tier's by its share, as the kernels split it (offload_costs.StoreTiming.missed)
    missed: list[list[float]] = field(default_factory=list)
    # with an expert store: [W - 1] ms per round timed again with every missed expert read from a
    # bank slot (store.bank_only): the rounds' own cost, misses apart ([]: not timed)
    bank: list[float] = field(default_factory=list)

    def cost(self, width: int) -> float:
        return self.ms[min(width, len(self.ms)) - 1]

    def columns_free(self, max_width: int, tol: float) -> bool:
        return self.cost(max_width) <= (1 + tol) * self.cost(1)


def expected_tokens(conf: list[float]) -> list[float]:
    """E_n for n = 0..len(conf): 1 (the bonus) + the cumulative confidences of n drafts."""
    out = [1.0]
    for s in conf:
        out.append(out[-1] + s)
    return out


@dataclass
class Gate:
    """How many leading drafts to verify. table None and p_min None: all of them."""
    table: RoundCosts | None = None
    p_min: float | None = None

    @property
    def on(self) -> bool:
        return self.table is not None or self.p_min is not None

    def width(self, conf: list[float], overhead: float = 0.0) -> int:
        """conf[k-1] = S_k, non-increasing -> the number of drafts to verify. overhead:
        ms the round costs on top of the table's verify (spent drafting)."""
        if self.p_min is not None:
            return next((k for k, s in enumerate(conf) if s < self.p_min), len(conf))
        if self.table is None:
            return len(conf)
        e = expected_tokens(conf)
        rates = [e[n] / (self.table.cost(n + 1) + overhead) for n in range(len(e))]
        return max(range(len(rates)), key=lambda n: (rates[n], -n))     # ties: the narrower round

    def to_dict(self) -> dict:
        mode = "p_min" if self.p_min is not None else "priced" if self.table is not None else "off"
        return {"mode": mode, "p_min": self.p_min}


def cumulative(probs) -> list[float]:
    out, s = [], 1.0
    for p in probs:
        s *= p
        out.append(s)
    return out


class CopyConfidence:
    """The copy drafter's per-depth conditional acceptance per match length, learned from
    its drafts scored against the committed output (every draft it proposed, verified or
    not, so a gate that cut deep drafts still learns about them). Laplace prior (1/2)."""

    def __init__(self):
        self.counts: dict[str, DepthCounts] = {}

    def record(self, match_len: int, proposed: int, accepted: int) -> None:
        self.counts.setdefault(match_bucket(match_len), DepthCounts()).record(proposed, accepted)

    def conf(self, match_len: int, n: int) -> list[float]:
        dc = self.counts.get(match_bucket(match_len), DepthCounts())
        out, s = [], 1.0
        for k in range(n):
            r = dc.reached[k] if k < len(dc.reached) else 0
            h = dc.hits[k] if k < len(dc.hits) else 0
            s *= (h + 1) / (r + 2)
            out.append(s)
        return out


# -- measuring the table -------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{platform.processor() or 'unknown'}-{torch.get_num_threads()}threads"


def table_key(model_path: str, device: torch.device, exact: bool, hybrid: bool = False,
              experts: str | None = None) -> dict:
    """hybrid: the model verifies wide rounds on the tensor cores in fast mode (GPUModel.hybrid;
    only where its second weight copy fits), which prices widths differently. experts: the
    kernels an expert store runs (offload_costs.StoreTiming.key; None: experts resident)."""
    st = os.stat(model_path)
    key = {"model": os.path.realpath(model_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
           "device": device_name(device), "engine": f"{__version__}/{COST_VERSION}",
           "verify": "exact" if exact else ("fast+mma" if hybrid else "fast")}
    if experts is not None:
        key["experts"] = experts
    return key


def cache_file(cache_dir: str, key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "round-costs" / f"{digest}.json"


def measure(model, cache, vocab: int, exact: bool, budget_s: float,
            max_width: int = MAX_WIDTH, min_width: int = 4, reps: int = 5) -> tuple[list[float], int]:
    """ms per verify round for W = 1..max_width, rows placed just past the cache's
    committed rows (written, then dropped again: the cache keeps what it held).

    Widths are timed in order, `reps` times each (median, after a first call: a graph's
    first replay) until budget_s is spent, then once each until twice the budget; a slow
    model (the CPU reference at real size) stops there, after at least 1..min_width, and
    the rest continue the line through the widths measured. The table is made
    non-decreasing (a wider round never costs less; timing noise could say so)."""
    if cache.length + max_width > cache.max_len:
        raise ValueError(f"no room to time rounds: {cache.length} + {max_width} > {cache.max_len}")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (max_width,), generator=g)
    ms: list[float] = []
    with cache.trial() as pos:                  # every round from the same state, all dropped after
        probe, _ = model.verify(tokens[:1], pos, cache, exact=exact)      # warm-up
        sync = torch.cuda.synchronize if probe.device.type == "cuda" else (lambda: None)
        t_start = time.perf_counter()
        for w in range(1, max_width + 1):
            within = time.perf_counter() - t_start < budget_s
            times: list[float] = []
            for r in range(reps + 1 if within else 1):
                cache.truncate(pos)
                sync()
                t0 = time.perf_counter()
                model.verify(tokens[:w], pos, cache, exact=exact)
                sync()
                if r or not within:
                    times.append(1000 * (time.perf_counter() - t0))
            times.sort()
            ms.append(times[len(times) // 2])
            if w >= min_width and time.perf_counter() - t_start > 2 * budget_s:
                break
    measured = len(ms)
    ms = extend_line(ms, max_width)
    for i in range(1, len(ms)):
        ms[i] = max(ms[i], ms[i - 1])
    return ms, measured


def extend_line(values: list[float], max_width: int) -> list[float]:
    """values at widths 1..n, continued to max_width along the line through their second
    half (never falling)."""
    n = len(values)
    if n >= max_width:
        return list(values)
    lo = n // 2
    slope = max(0.0, (values[-1] - values[lo - 1]) / (n - lo))
    return list(values) + [values[-1] + slope * (w - n) for w in range(n + 1, max_width + 1)]


def load_or_measure(model, cache, model_path: str, vocab: int, exact: bool, cache_dir: str,
                    budget_s: float, experts=None, room: Callable[[], object] | None = None) -> CostTable:
    """The cached table for this model, device and engine version, or a freshly timed one
    (then written to the cache). experts: an expert store's timing (offload_costs.StoreTiming;
    None: experts resident): its kernels key the table, its bank stays as it is while the
    rounds are timed, and the timed rounds' misses are kept with the table, beside the same
    rounds timed again with every expert read from the bank (`CostTable.bank`). cache: the
    device's (it keys the table) and, unless `room` is given, the one timed on; room: gives
    the cache to time on, asked only when the table is timed (engine_slots.timing_slot)."""
    key = table_key(model_path, cache.k.device, exact, getattr(model, "hybrid", False),
                    experts.key if experts is not None else None)
    path = cache_file(cache_dir, key)
    if path.exists():
        try:
            d = json.loads(path.read_text())
            if d.get("key") == key and len(d.get("ms", [])) == MAX_WIDTH:
                return CostTable(d["ms"], d["measured"], d["measure_s"], key, from_cache=True,
                                 missed=d.get("missed", []), bank=d.get("bank", []))
        except (OSError, ValueError, KeyError):
            pass                                    # unreadable: time it again and overwrite
    t0 = time.perf_counter()
    bank: list[float] = []
    with experts.frozen() if experts is not None else nullcontext():
        on = room() if room is not None else cache
        ms, measured = measure(model, on, vocab, exact, budget_s)
        missed = experts.missed(measured) if experts is not None else []
        if experts is not None:             # the same rounds with no misses: what the misses cost is the difference
            with experts.bank_only():
                bank, _ = measure(model, on, vocab, exact, budget_s)
    table = CostTable(ms, measured, time.perf_counter() - t0, key, missed=missed, bank=bank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        d = asdict(table)
        d.pop("from_cache")
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(path)
    except OSError:
        pass                                        # a read-only home: use it, time it again next time
    return table
