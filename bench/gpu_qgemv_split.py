"""qgemv_i8 with the slots cut into runs (GemvTile.split): more programs for the matrices
whose rows alone leave the H200's SMs short of bytes in flight (Nsight Compute, 20261201:
the 8B down Q6_K at 128 programs reads 2.5 TB/s at 12.8% occupancy, the Q4_K down at
256 programs 1.9 TB/s), without the many-row tiles' loss at W=8 (a run re-reads no more
x than the whole row does). The partials [W, split, N] are what the consumer (the next
norm, qkv_rope, the SiLU) would add; that add is not timed here.

Each matrix of the 8B and 30B-A3B shapes at its default tile (qgemv_i8.gemv_tile) and at
split 2, 4 (and more where the steps allow), W = 1, 4, 8, launched with PDL as in the
decode graphs, weight copies cycled to defeat L2. Writes $OUT/gpu_qgemv_split-*.json.

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_qgemv_split.py
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import DECODE_SHAPES, decode_weight, run_header, time_graph  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8 import GemvTile, gemv_tile, qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402

SPLITS = (1, 2, 3, 4, 6, 8)


def variants(w: QuantWeight) -> list[GemvTile]:
    """The default tile at every split whose runs are whole steps, and the same with half
    the rows a program (twice the programs again)."""
    t0 = gemv_tile(w)
    steps = w.n_slots // t0.NT
    out = []
    for BN in (t0.BN, t0.BN // 2):
        for s in SPLITS:
            if BN >= 4 and w.n_slots % t0.NT == 0 and steps % s == 0 and (BN == t0.BN or s > 1):
                out.append(dataclasses.replace(t0, BN=BN, split=s))
    return out


def key(t: GemvTile) -> str:
    return f"{t.BN},{t.NT},{t.num_warps},s{t.split}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[n for n in DECODE_SHAPES if n != "head"])
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 4, 8])
    args = ap.parse_args()
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        qt, N, K = DECODE_SHAPES[name]
        w, ws, x8 = decode_weight(name, g)
        ts = variants(w)
        row = {"shape": name, "qtype": qt.name, "N": N, "K": K, "MB": w.nbytes / 1e6, "default": str(gemv_tile(w)),
               "us": {}, "rel_err_vs_split1": {}, "rows_equal_alone": {}}
        full = qgemv_i8(x8, w, tile=ts[0])                                             # [8, N]
        for t in ts:
            for W in args.widths:
                x = x8[:W].contiguous()
                prep = prepare_i8(x, w)
                row["us"][f"{W}:{key(t)}"] = time_graph(
                    [lambda w_=w_: qgemv_i8(x, w_, tile=t, prepared=prep, pdl=True) for w_ in ws]) * 1e6
            y = qgemv_i8(x8, w, tile=t)
            y = y.sum(1) if t.split > 1 else y                      # (torch's order: a check, not the bits)
            row["rel_err_vs_split1"][key(t)] = float(((y - full).abs().max() / full.abs().max()).item())
            alone = torch.cat([qgemv_i8(x8[m:m + 1], w, tile=t) for m in range(8)])
            row["rows_equal_alone"][key(t)] = bool(torch.equal(qgemv_i8(x8, w, tile=t), alone))
        torch.cuda.synchronize()
        res["rows"].append(row)
        print(f"{name} {qt.name} {N}x{K} {row['MB']:.1f} MB:", flush=True)
        for t in ts:
            k = key(t)
            us = {W: row["us"][f"{W}:{k}"] for W in args.widths}
            print(f"   {k:14s} " + "  ".join(f"W{W} {v:6.1f}" for W, v in us.items())
                  + f"  | {row['MB'] / us[args.widths[0]]:.2f} TB/s  err {row['rel_err_vs_split1'][k]:.1e}"
                  + f"  equal {row['rows_equal_alone'][k]}", flush=True)
        del ws
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / f"gpu_qgemv_split-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
