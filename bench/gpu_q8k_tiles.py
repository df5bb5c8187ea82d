"""qgemv_q8k's program tile at narrow widths: rows a program x warps, on the 8B qkv / o /
gate_up (Q4_K). Neither is in the float order (the runs are: mma_tile), so any tile keeps
the mma's bits (checked here against qgemv_mma_k). The question: is qgemv_q8k's W = 1 gap
to dp4a (qkv 7.2 against 5.2 us, o 4.9 against 4.2, gate_up 18.2 against 16.3;
gpu_qgemv_mma-20261201-213840.json) its tile, so that exact mode could pair it with the
mma at no W = 1 cost? PDL launches in CUDA graphs, weight copies cycled to defeat L2, dp4a
(qgemv_i8) timed in the same run. Prints as it goes; $OUT/gpu_q8k_tiles-*.json after each shape.

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_q8k_tiles.py [--shapes qkv o] [--widths 1 4]
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
from gpu_kernels import DECODE_SHAPES, decode_weight, run_header, time_graph  # noqa: E402

from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qgemv_mma import mma_planes, prepare_q8k, qgemv_mma_k  # noqa: E402
from alphallama.kernels.gemv.qgemv_q8k import q8k_tile, qgemv_q8k  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402

TILES = [(rows, warps) for rows in (8, 16, 32) for warps in (1, 2, 4, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qkv", "o", "gate_up"])
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 4])
    args = ap.parse_args()
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv), "rows": []}
    path = Path(os.environ.get("OUT", ".")) / f"gpu_q8k_tiles-{time.strftime('%Y%m%d-%H%M%S')}.json"
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        qt, N, K = DECODE_SHAPES[name]
        w, ws, _ = decode_weight(name, g)
        x16 = torch.randn(16, K, device="cuda", generator=g).to(torch.bfloat16)
        mma_bits = qgemv_mma_k(x16[:4], w, planes=mma_planes(w))
        row = {"shape": name, "N": N, "K": K, "MB": w.nbytes / 1e6, "us": {}, "equal_mma_k": {}}
        for W in args.widths:
            x = x16[:W].contiguous()
            prep, prep8k = prepare_i8(x, w), prepare_q8k(x, w.n_slots)
            out = torch.empty(W, N, device="cuda")
            row["us"][f"{W}:dp4a"] = time_graph([lambda w_=w_: qgemv_i8(x, w_, out=out, prepared=prep, pdl=True)
                                                 for w_ in ws]) * 1e6
            line = f"{name} W{W} dp4a {row['us'][f'{W}:dp4a']:5.1f} |"
            rule = q8k_tile(w, W)                        # the default tile, timed first
            row["us"][f"{W}:rule"] = time_graph([lambda w_=w_: qgemv_q8k(x, w_, out=out, prepared=prep8k, pdl=True)
                                                 for w_ in ws]) * 1e6
            line += f" rule r{rule[0]}w{rule[1]} {row['us'][f'{W}:rule']:5.1f} |"
            for rows, warps in TILES:
                key = f"{W}:r{rows}w{warps}"
                try:
                    row["us"][key] = time_graph([lambda w_=w_: qgemv_q8k(x, w_, out=out, prepared=prep8k, rows=rows,
                                                                         warps=warps, pdl=True) for w_ in ws]) * 1e6
                    if W == 1:
                        y = qgemv_q8k(x16[:4], w, rows=rows, warps=warps)
                        row["equal_mma_k"][key] = bool(torch.equal(y, mma_bits))
                    line += f" r{rows}w{warps} {row['us'][key]:5.1f}"
                except Exception as e:                   # recorded, not fatal
                    row["us"][key] = f"{type(e).__name__}: {str(e)[:200]}"
                    torch.cuda.synchronize()
                    line += f" r{rows}w{warps} err"
            print(line, flush=True)
        print(f"   equal to mma-k: {all(row['equal_mma_k'].values())}", flush=True)
        res["rows"].append(row)
        path.write_text(json.dumps(res, indent=1, default=str))
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
