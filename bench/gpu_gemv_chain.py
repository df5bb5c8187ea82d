"""qgemv_i8 tiles timed where the round runs them: behind a latency-bound kernel, in a PDL
chain.

The tile sweeps so far (gpu_qgemv_tiles.py) timed each GEMV alone, where a tile whose
programs load their whole rows before the PDL wait has nothing to overlap. In the round
every GEMV follows a small kernel (a norm, the attention combine, the SiLU) that holds a
few SMs for ~2 us; a GEMV launched early by PDL can have its weights in flight meanwhile.
The megakernel probe's synthetic chain (bench/gpu_megakernel_probe.py) streams an 8B layer's
GEMV bytes at ~94% of the copy rate with such whole-row programs. Here the real kernel:
tiles of NT = all of a row's slots (one step: everything loaded before the wait) against
today's, each as (A, GEMV) pairs in a graph over weight copies cycled past L2; A = 16
programs spinning SPIN ns. Figures: the pair less A alone (what the GEMV adds to the
chain), and the GEMV alone. W = 1 and 8 (one tile serves both: it is part of the float
order). Rows of a W = 8 call equal the rows alone for every tile (checked).
$OUT/gpu_gemv_chain-*.json.
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
from gpu_kernels import decode_weight, run_header, time_graph  # noqa: E402
from gpu_pdl_overlap import _spin_kernel  # noqa: E402

from alphallama.kernels.gemv.qgemv_i8 import GemvTile, gemv_tile, qgemv_i8, split_runs  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402

# (BN, NT, warps, prefetch) beside each weight's default (with its split runs, as the engine runs it)
TILES = {"qkv": [(8, 128, 4, 1), (16, 128, 8, 1), (16, 128, 4, 1), (32, 128, 8, 1)],
         "o": [(4, 128, 4, 1), (8, 128, 4, 1), (8, 128, 8, 1), (16, 128, 8, 1)],
         "gate_up": [(8, 128, 4, 1), (16, 128, 8, 1), (32, 128, 8, 1)],
         "down_q4": [(4, 128, 4, 2), (8, 128, 8, 2), (16, 128, 8, 2)],
         "down_q6": [(4, 128, 4, 2), (8, 128, 8, 2), (16, 128, 8, 2)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=list(TILES))
    ap.add_argument("--spin", type=int, default=2000)
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 8])
    args = ap.parse_args()
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv),
           "spin_ns": args.spin, "rows": []}
    path = Path(os.environ.get("OUT", ".")) / f"gpu_gemv_chain-{time.strftime('%Y%m%d-%H%M%S')}.json"
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = torch.zeros(3, 16, dtype=torch.int64, device="cuda")

    def A():
        _spin_kernel[(16,)](ts, SPIN=args.spin, PDL=True, launch_pdl=True)
    a_us = time_graph([A] * 16) * 1e6
    res["A_us"] = a_us
    print(f"A alone {a_us:.2f} us", flush=True)
    for name in args.shapes:
        w, ws, x8 = decode_weight(name, g)
        d = gemv_tile(w)
        runs = split_runs(w)
        tiles = {"default" + (f" split{runs}" if runs > 1 else ""): (d, runs)}
        for bn, nt, nw, pf in TILES[name]:
            tiles[f"{bn},{nt},{nw},p{pf}"] = (GemvTile(BN=bn, NT=nt, num_warps=nw, prefetch=pf), 1)
        row = {"shape": name, "N": w.N, "K": w.K, "MB": w.nbytes / 1e6, "default": str(d), "us": {}, "equal": {}}
        for W in args.widths:
            x = x8[:W].contiguous()
            prep = prepare_i8(x, w)
            for key, (t, split) in tiles.items():
                def gemv(w_, t=t, split=split):
                    qgemv_i8(x, w_, tile=t, prepared=prep, pdl=True, split=split)
                alone = time_graph([lambda w_=w_: gemv(w_) for w_ in ws]) * 1e6
                pair = time_graph([lambda w_=w_: (A(), gemv(w_)) for w_ in ws]) * 1e6
                row["us"][f"W{W} {key}"] = {"alone": alone, "after_A": pair - a_us}
                print(f"  {name:8s} W{W} {key:16s} alone {alone:6.2f}  after A {pair - a_us:6.2f} us", flush=True)
        for key, (t, split) in tiles.items():
            both = qgemv_i8(x8, w, tile=t, split=split)
            alone = torch.cat([qgemv_i8(x8[m:m + 1], w, tile=t, split=split) for m in range(8)])
            row["equal"][key] = bool(torch.equal(both, alone))
        res["rows"].append(row)
        path.write_text(json.dumps(res, indent=1, default=str))
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
