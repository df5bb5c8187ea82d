"""The decode GEMV's per-slot integer sums on the tensor cores (kernels/qgemv_mma, a spike)
against qgemv_i8 (dp4a) at W = 1, 2, 4, 8, 16: does a verify round's GEMV then cost what a
W = 1 round's does (issue 7's W8/W1 <= 1.3)? For each Q4_K matrix of the 8B and 30B-A3B
shapes, several mma tiles (rows, slots a step, warps), PDL launches in CUDA graphs, weight
copies cycled to defeat L2. Checks beside the times: the mma result against qgemv_i8's
(relative; a different float order) and every row of a 16-row call equal to it alone.
Writes $OUT/gpu_qgemv_mma-*.json.

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

from alphallama.kernels.qgemv_i8 import gemv_tile, qgemv_i8  # noqa: E402
from alphallama.kernels.qgemv_mma import MmaTile, qgemv_mma, qgemv_mma2  # noqa: E402
from alphallama.kernels.qmatvec_i8 import prepare_i8  # noqa: E402

# (BN, NT, warps): ptxas sm_90a registers at BW 8 (Q4_K K=4096): 80, 80, 106, 127, 80;
# NT 16 with BN 32 holds ~254 (the unpacked int8 operand a thread holds before the mma)
# second form (int8 vector loads of weight and x bytes), (BN, NT, warps): ptxas sm_90a registers
# at BW 8 (Q4_K K=4096): 64, 120, 128, 126; at BW 16: 162 (32,16,8)
TILES = [MmaTile(32, 4, 4), MmaTile(32, 8, 4), MmaTile(64, 8, 8), MmaTile(32, 16, 8), MmaTile(32, 16, 8, max_bw=8)]
FIRST = MmaTile(32, 4, 4)       # the first form's best at W 8 (gpu_qgemv_mma-20261201-155410.json)


def key(t: MmaTile) -> str:
    return f"mma {t.BN},{t.NT},{t.num_warps},bw{t.max_bw}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["gate_up", "qkv", "o_30b"])
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        qt, N, K = DECODE_SHAPES[name]
        w, ws, _ = decode_weight(name, g)
        x16 = torch.randn(16, K, device="cuda", generator=g).to(torch.bfloat16)          # [16, K]
        row = {"shape": name, "qtype": qt.name, "N": N, "K": K, "MB": w.nbytes / 1e6, "dp4a_tile": str(gemv_tile(w)),
               "us": {}, "rel_err_vs_dp4a": {}, "rows_equal_alone": {}}
        ref = qgemv_i8(x16, w)                                                            # [16, N]
        arms = [("dp4a", None), ("first " + key(FIRST), FIRST)] + [(key(t), t) for t in TILES]
        for k, t in arms:
            try:
                for W in args.widths:
                    x = x16[:W].contiguous()
                    prep = prepare_i8(x, w)
                    if t is None:
                        fns = [lambda w_=w_: qgemv_i8(x, w_, prepared=prep, pdl=True) for w_ in ws]
                    else:
                        f = qgemv_mma if k.startswith("first") else qgemv_mma2
                        fns = [lambda w_=w_, f=f: f(x, w_, tile=t, prepared=prep, pdl=True) for w_ in ws]
                    row["us"][f"{W}:{k}"] = time_graph(fns) * 1e6
                if t is not None:
                    f = qgemv_mma if k.startswith("first") else qgemv_mma2
                    y = f(x16, w, tile=t)
                    row["rel_err_vs_dp4a"][k] = float(((y - ref).abs().max() / ref.abs().max()).item())
                    alone = torch.cat([f(x16[m:m + 1], w, tile=t) for m in range(16)])
                    row["rows_equal_alone"][k] = bool(torch.equal(y, alone))
            except Exception as e:                          # a tile the compiler rejects: recorded, not fatal
                row["us"][f"error:{k}"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.synchronize()
        res["rows"].append(row)
        print(f"{name} {qt.name} {N}x{K} {row['MB']:.1f} MB:", flush=True)
        for k, _ in arms:
            us = {W: row["us"].get(f"{W}:{k}") for W in args.widths}
            if None in us.values():
                print(f"   {k:22s} {row['us'].get(f'error:{k}', 'failed')[:100]}", flush=True)
                continue
            print(f"   {k:22s} " + "  ".join(f"W{W} {v:6.1f}" for W, v in us.items())
                  + f"  | W1 {row['MB'] / us[args.widths[0]]:.2f} TB/s  W8/W1 {us.get(8, 0) / us[args.widths[0]]:.2f}"
                  + (f"  err {row['rel_err_vs_dp4a'][k]:.1e} equal {row['rows_equal_alone'][k]}" if k != "dp4a" else ""),
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / f"gpu_qgemv_mma-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
