"""qgemv_i8 tiles on the 8B shape's matrices (and the 30B-A3B's attention) at W = 1 and 8
(and 2, 4 for the 8-warp tiles and the default), at the current qgemv_i8.MAX_BW: the tile is part of a weight's float order, so it must be one per weight
whatever W; this finds the one that balances plain decode (W=1) against verify rounds.
Activations prepared once, as in the engine. Writes $OUT/gpu_qgemv_tiles-*.json.

    python bench/gpu_qgemv_tiles.py --warm-only --shapes gate_up   # compile only (run several at once)
    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_qgemv_tiles.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import DECODE_SHAPES as SHAPES, decode_weight, run_header, time_graph  # noqa: E402

from alphallama.kernels.gemv.qgemv_i8 import GemvTile, gemv_tile, qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402

TILES = [(8, 32, 4), (16, 32, 4), (16, 32, 8), (32, 32, 8), (32, 32, 4), (64, 32, 8), (32, 64, 8), (16, 64, 4),
         (4, 64, 4), (4, 32, 4), (16, 64, 8), (8, 32, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--warm-only", action="store_true")
    args = ap.parse_args()
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        qt, N, K = SHAPES[name]
        w, ws, x8 = decode_weight(name, g, copies=not args.warm_only)
        ts = [GemvTile(*t) for t in TILES] + [gemv_tile(w)]
        row = {"shape": name, "qtype": qt.name, "N": N, "K": K, "MB": w.nbytes / 1e6, "default": str(gemv_tile(w)),
               "us": {}}
        for W in (1, 2, 4, 8):
            x = x8[:W].contiguous()
            prep = prepare_i8(x, w)
            for t in ts:
                if W in (2, 4) and t != ts[-1] and t.num_warps != 8:
                    continue
                key = f"{W}:{t.BN},{t.NT},{t.num_warps}"
                if args.warm_only:
                    qgemv_i8(x, w, tile=t, prepared=prep)
                    continue
                row["us"][key] = time_graph([lambda w_=w_: qgemv_i8(x, w_, tile=t, prepared=prep) for w_ in ws]) * 1e6
        torch.cuda.synchronize()
        if args.warm_only:
            continue
        # exactness: a W=8 call's rows against each row alone, same tile
        row["rows_equal_alone"] = {f"{t.BN},{t.NT},{t.num_warps}": bool(torch.equal(
            qgemv_i8(x8, w, tile=t), torch.cat([qgemv_i8(x8[m:m + 1], w, tile=t) for m in range(8)]))) for t in ts}
        res["rows"].append(row)
        print(f"{name} (default {row['default']}):", flush=True)
        for t in ts:
            k = f"{t.BN},{t.NT},{t.num_warps}"
            print(f"   {k:10s} " + "  ".join(f"W{W} {row['us'][f'{W}:{k}']:7.1f}" for W in (1, 2, 4, 8)
                                           if f"{W}:{k}" in row["us"]) + f"  equal {row['rows_equal_alone'][k]}",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    if not args.warm_only:
        out = Path(os.environ.get("OUT", ".")) / f"gpu_qgemv_tiles-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
