"""The decode round's small kernels, one at a time, as a graph sees them (one device call).

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_small_kernels.py

Each case is REPS launches captured back to back in one CUDA graph (each launch reads
what the previous one wrote, as in a round), replayed; us per launch = the replay's
time / REPS, with and without PDL. Cases: an empty kernel (the floor of a graph node),
add+RMSNorm at the 8B and 30B-A3B widths with 0, 1 and 2 int8 lane orders emitted, at
several warp counts (norm.NORM_WARPS); the embedding lookup as one kernel
(formats/dequant.gather_rows) against the plain-torch dequantize it replaced. Also checks that
every warp count gives the same h to within rounding (the bits may differ: the sum of
squares' layout follows the warps). Writes $OUT/gpu_small_kernels-*.json; table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from alphallama.bench.hostinfo import host_state
from alphallama.gguf.quants import dequantize, random_blocks
from alphallama.kernels.norm import rmsnorm as norm
from alphallama.kernels.pdl import pdl_kwargs, pdl_start
from alphallama.kernels.formats.dequant import gather_rows
from alphallama.kernels.gemv.qmatvec_i8 import lane_order
from alphallama.kernels.formats.qweight import QuantWeight

REPS = 64


@triton.jit
def _empty_kernel(X, PDL: tl.constexpr = False):
    pdl_start(PDL)
    tl.store(X + tl.program_id(0), tl.load(X + tl.program_id(0)) + 1.0)


def per_launch_us(fn, reps: int = REPS) -> float:
    """us per launch of fn(), REPS launches captured in one graph, replayed."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / (10 * reps))
    return best


def random_weight(qtype: T, n: int, k: int, dev) -> tuple[QuantWeight, torch.Tensor]:
    """Valid random GGUF rows: (their planes, the raw rows [n, row_bytes] on dev)."""
    g = torch.Generator().manual_seed(0)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, n * k // block, g).reshape(n, k // block * size)   # [n, row_bytes]
    return QuantWeight.from_raw(raw, qtype, (n, k), dev), raw.to(dev)


def norm_cases(dev, pdl: bool) -> list[dict]:
    rows = []
    q4 = lane_order(random_weight(T.Q4_K, 16, 4096, dev)[0])
    q6 = lane_order(random_weight(T.Q6_K, 16, 4096, dev)[0])
    for D in (4096, 2048):
        x = torch.randn(1, D, device=dev)
        y = torch.randn(1, D, device=dev) * 1e-3
        w = torch.rand(D, device=dev) + 0.5
        xfix = x.clone()                 # the timed launches add y into x: check on a fixed row
        ref = None
        for warps in (1, 2, 4, 8, 16):
            norm.NORM_WARPS = warps
            for orders in ((), (q4,), (q4, q6)):
                if orders:
                    fn = lambda: norm.add_rmsnorm_q8(x, y, w, 1e-6, torch.bfloat16, orders, pdl)   # noqa: E731
                else:
                    fn = lambda: norm.add_rmsnorm(x, y, w, 1e-6, torch.bfloat16, pdl)               # noqa: E731
                us = per_launch_us(fn)
                h = norm.add_rmsnorm(xfix.clone(), None, w, 1e-6, torch.float32)
                ref = h if ref is None or ref.shape != h.shape else ref
                rows.append({"case": f"norm D={D} orders={len(orders)} warps={warps}", "pdl": pdl, "us": us,
                             "max_rel_vs_first": float(((h - ref).abs().max() / ref.abs().max()).item())})
    norm.NORM_WARPS = 4
    return rows


def embed_cases(dev, pdl: bool) -> list[dict]:
    rows = []
    for qtype, V, D in ((T.Q4_K, 4096, 4096), (T.Q6_K, 4096, 4096), (T.Q8_0, 4096, 896)):
        w, rawrows = random_weight(qtype, V, D, dev)
        for W in (1, 8):
            tok = torch.randint(0, V, (W,), device=dev)
            assert torch.equal(gather_rows(w, tok), dequantize(rawrows[tok], qtype, (W, D)))
            ours = per_launch_us(lambda: gather_rows(w, tok))
            old = per_launch_us(lambda: dequantize(rawrows[tok], qtype, (W, D)))
            rows.append({"case": f"embed {qtype.name} D={D} W={W} gather_rows", "pdl": pdl, "us": ours})
            rows.append({"case": f"embed {qtype.name} D={D} W={W} torch dequantize", "pdl": pdl, "us": old})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"host": host_state(sys.argv), "commit": args.commit, "reps_per_graph": REPS, "rows": []}
    x = torch.zeros(1, device=dev)
    for pdl in (False, True):
        res["rows"].append({"case": "empty kernel", "pdl": pdl,
                            "us": per_launch_us(lambda: _empty_kernel[(1,)](x, **pdl_kwargs(pdl, dev)))})
        res["rows"] += norm_cases(dev, pdl)
    res["rows"] += embed_cases(dev, False)
    out = Path(os.environ.get("OUT", ".")) / f"gpu_small_kernels-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))
    for r in res["rows"]:
        extra = f"  (h vs 1 warp: {r['max_rel_vs_first']:.1e})" if "max_rel_vs_first" in r else ""
        print(f"{r['us']:7.2f} us  pdl={int(r['pdl'])}  {r['case']}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
