"""`alphallama plan -m MODEL`: the layout `serve` and `run` would choose, without loading
any tensor (offload/plan.py)."""
from __future__ import annotations

import argparse
import json
import sys

from .config import DEFAULTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .offload.apply import add_memory_arguments
    p.add_argument("-m", "--model", help="GGUF model file (default: the embedded model)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length in tokens")
    p.add_argument("--device", default=DEFAULTS.engine.device, choices=["auto", "cpu", "cuda"])
    add_memory_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--no-probe", action="store_true",
                   help="skip measuring the host's bandwidths (no expected tok/s)")


def run(args) -> int:
    from .cli_run import resolve_model
    from .offload.plan import PlanError, make_plan, priced
    if args.ctx_size is not None and args.ctx_size <= 0:
        print(f"alphallama plan: error: -c/--ctx-size must be positive, got {args.ctx_size}", file=sys.stderr)
        return 2
    try:
        path = resolve_model(args.model)
        plan = make_plan(path, ctx=args.ctx_size, gpu_mem=args.gpu_mem, device=args.device, host_mem=args.host_mem)
        if not args.no_probe and plan.layout != "cpu":
            from .offload.host_probe import measure
            plan = priced(plan, measure(path))
    except PlanError as e:
        print(f"alphallama plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict()) if args.json else plan.describe())
    return 0
