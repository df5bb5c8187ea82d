"""The decode GEMV's per-slot integer sums on the tensor cores through inline PTX
(kernels/qgemv_mma, a spike: mma.sync m16n8k32, operands built in the threads that own
them) against qgemv_i8 (dp4a) at W = 1, 2, 4, 8, for the Q4_K matrices of the 8B and
30B-A3B shapes. PDL launches in CUDA graphs, weight copies cycled to defeat L2. Checks:
the mma result against qgemv_i8's (relative: another float order) and every row of an
8-row call equal to the row alone. Writes $OUT/gpu_qgemv_mma-*.json.

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_qgemv_mma.py
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

from alphallama.kernels.qgemv_i8 import qgemv_i8  # noqa: E402
from alphallama.kernels.qgemv_mma import qgemv_mma  # noqa: E402
from alphallama.kernels.qmatvec_i8 import prepare_i8  # noqa: E402

ARMS = [("dp4a", None), ("mma w4 s1", (4, 1)), ("mma w4 s2", (4, 2)), ("mma w8 s2", (8, 2)), ("mma w8 s1", (8, 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["gate_up", "qkv", "o", "down_q4", "qkv_30b", "o_30b"])
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 2, 4, 8])
    args = ap.parse_args()
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        qt, N, K = DECODE_SHAPES[name]
        w, ws, x8 = decode_weight(name, g)
        row = {"shape": name, "qtype": qt.name, "N": N, "K": K, "MB": w.nbytes / 1e6, "us": {},
               "rel_err_vs_dp4a": {}, "rows_equal_alone": {}}
        ref = qgemv_i8(x8, w)                                                             # [8, N]
        for k, cfg in ARMS:
            try:
                for W in args.widths:
                    x = x8[:W].contiguous()
                    prep = prepare_i8(x, w)
                    if cfg is None:
                        fns = [lambda w_=w_: qgemv_i8(x, w_, prepared=prep, pdl=True) for w_ in ws]
                    else:
                        fns = [lambda w_=w_: qgemv_mma(x, w_, warps=cfg[0], S=cfg[1], prepared=prep, pdl=True)
                               for w_ in ws]
                    row["us"][f"{W}:{k}"] = time_graph(fns) * 1e6
                if cfg is not None:
                    y = qgemv_mma(x8, w, warps=cfg[0], S=cfg[1])
                    row["rel_err_vs_dp4a"][k] = float(((y - ref).abs().max() / ref.abs().max()).item())
                    alone = torch.cat([qgemv_mma(x8[m:m + 1], w, warps=cfg[0], S=cfg[1]) for m in range(8)])
                    row["rows_equal_alone"][k] = bool(torch.equal(y, alone))
            except Exception as e:                          # recorded, not fatal
                row["us"][f"error:{k}"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.synchronize()
        res["rows"].append(row)
        print(f"{name} {qt.name} {N}x{K} {row['MB']:.1f} MB:", flush=True)
        for k, cfg in ARMS:
            us = {W: row["us"].get(f"{W}:{k}") for W in args.widths}
            if None in us.values():
                print(f"   {k:12s} {row['us'].get(f'error:{k}', 'failed')[:150]}", flush=True)
                continue
            print(f"   {k:12s} " + "  ".join(f"W{W} {v:6.1f}" for W, v in us.items())
                  + f"  | W1 {row['MB'] / us[args.widths[0]]:.2f} TB/s  W8/W1 {us.get(8, 0) / us[args.widths[0]]:.2f}"
                  + (f"  err {row['rel_err_vs_dp4a'][k]:.1e} equal {row['rows_equal_alone'][k]}" if cfg else ""),
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / f"gpu_qgemv_mma-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
