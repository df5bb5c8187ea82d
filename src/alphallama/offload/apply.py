"""Applying the plan: `run` and `serve` fill every setting the user left unset from it.

Explicit flags win (-c, --device); `--gpu-mem BYTES` caps the device budget (to emulate
a smaller card), `--host-mem BYTES` the host tier's pinned RAM (to emulate a smaller host:
the experts past it are read from the mapped file); ALPHA_AUTO=0 turns planning off
(everything resident, as before).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from ..config import DEFAULTS
from .plan import Plan, make_plan, priced

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'24000000000', '24G', '512M', '1.5GiB' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 24000000000, 24G, 512M)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a memory budget must be positive, got {text!r}")
    return n


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """--gpu-mem and --host-mem: the plan's budgets."""
    p.add_argument("--gpu-mem", type=parse_bytes, default=None, metavar="BYTES",
                   help="device memory the plan may use (default: all that is free; suffixes K, M, G)")
    p.add_argument("--host-mem", type=parse_bytes, default=DEFAULTS.offload.host_mem, metavar="BYTES",
                   help="pinned RAM an offloaded model's experts may hold (default: the available RAM less "
                        "a headroom); the experts past it are read from the model file (memory-mapped)")


def auto_enabled() -> bool:
    return os.environ.get(DEFAULTS.offload.auto_env, "1").strip() != "0"


def plan_from_args(args, path: str) -> Plan | None:
    """The plan for a run/serve invocation, or None with ALPHA_AUTO=0. PlanError when
    nothing fits (the caller prints it)."""
    if not auto_enabled():
        return None
    import torch
    # without a GPU the model runs on the CPU whatever the budget (`plan` still shows a GPU layout);
    # with one, "auto" lets the plan fall back to the CPU for a file the GPU runtime would refuse
    device = "cpu" if args.device == "cpu" or not torch.cuda.is_available() else args.device
    plan = make_plan(path, ctx=args.ctx_size, gpu_mem=getattr(args, "gpu_mem", None), device=device,
                     host_mem=getattr(args, "host_mem", None))
    if plan.layout != "cpu":   # the host's bandwidths (a short probe, cached per host) price the round
        from .host_probe import measure
        plan = priced(plan, measure(path))
    print(f"alphallama: plan: {summary(plan)}", file=sys.stderr, flush=True)
    return plan


def summary(plan: Plan | None) -> str:
    if plan is None:
        return f"automatic plan off ({DEFAULTS.offload.auto_env}=0)"
    if plan.layout == "offload":
        rest = (f"the rest computed by {plan.cpu_threads} CPU workers and read over PCIe"
                if plan.cpu_threads else "the rest read from host RAM over PCIe")
        h = plan.host
        mapped = (f"; {h.mapped_experts} experts ({len(h.mapped_layers)} layers) mapped from the file"
                  if h is not None and h.mapped_layers else "")
        return (f"offload: {plan.slots}/{plan.sizes.n_experts} expert slots in VRAM "
                f"({100 * plan.resident_fraction:.0f}%), {rest}{mapped}{_expected(plan)}")
    return plan.layout + _expected(plan)


def _expected(plan: Plan) -> str:
    e = plan.estimate
    return "" if e is None else f"; expected {e.tok_s:.0f} tok/s ({e.ms_round:.2f} ms a round)"


def engine_kwargs(args, plan: Plan | None) -> dict:
    """Engine.load's settings from the plan, where the user gave none (explicit flags win)."""
    kw = {"ctx_size": args.ctx_size, "device": args.device}
    fast = bool(getattr(args, "fast", False))
    if plan is None:
        return {**kw, "fast": fast}
    # fast mode's tensor-core copy only where it fits beside a resident model (else plain fast mode)
    kw["fast"] = fast and plan.layout == "resident" and plan.sizes.fits_fast(plan.budget)
    if args.ctx_size is None:
        kw["ctx_size"] = plan.ctx
    if plan.gpu_refused:   # only planned so under --device auto (cuda raises PlanError)
        kw["device"] = "cpu"
    if plan.layout == "offload":
        kw["expert_slots"] = plan.slots
        kw["cpu_threads"] = plan.cpu_threads or None
        kw["host_bytes"] = plan.host_bytes
        kw["miss_rates"] = plan.estimate.miss if plan.estimate is not None else None   # the gate's miss prices
    return kw
