"""The Q4_K decode GEMV with its integer sums on the tensor cores (kernels/qgemv_mma: inline
PTX mma.sync m16n8k32, fragments loaded in fragment order, one fma chain a (row, column))
against qgemv_i8 (dp4a) at W = 1, 2, 4, 8, 16: can one kernel serve every W, W = 8 at about
W = 1's cost (issue 7's W8/W1 <= 1.3), without losing W = 1? The Q4_K matrices of the 8B and
30B-A3B shapes; PDL launches in CUDA graphs, weight copies (and their fragment planes)
cycled to defeat L2; the activations' fragment order made outside the timing (a producer
would emit it). Checks: relative error against qgemv_i8 (another float order), every row
of a 16-row call equal to the row alone. Writes $OUT/gpu_qgemv_mma-*.json.

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
from alphallama.kernels.qgemv_mma import mma_planes, mma_x, prepare_q8k, qgemv_mma, qgemv_mma_k  # noqa: E402
from alphallama.kernels.qgemv_mma6 import mma6_planes, prepare_q8k6, qgemv_mma6  # noqa: E402
from alphallama.kernels.qgemv_q8k import qgemv_q8k  # noqa: E402
from alphallama.kernels.qgemv_q8k6 import qgemv_q8k6  # noqa: E402
from alphallama.kernels.qmatvec_i8 import prepare_i8  # noqa: E402

# (warps, steps ahead) for qgemv_mma (per-32 activations, measured 20261201: 2-10x dp4a at W = 1,
# off the default arms); "k": qgemv_mma_k, activations with one scale a super-block (another
# quantization than the engine's: its error against dp4a is that, not a bug), with runs (warps
# a row group, K cut over them) and whether the activations are loaded a super-block ahead
ARMS = {"dp4a": None, "mma-k": {"kind": "k"}, "mma-k w4 r1": {"kind": "k", "warps": 4, "runs": 1},
        "q8k rows": {"kind": "q", "tile": "rows"}, "q8k slots": {"kind": "q", "tile": "slots"},
        "q8k slots 8": {"kind": "q", "tile": "slots", "rows": 8}}
ARMS_Q6 = {"dp4a": None, "mma6": {"kind": "6"}, "q8k6": {"kind": "q6"}}
OLD_ARMS = {"mma w4 u2": {"kind": "u", "warps": 4, "steps": 2}}     # --old
Q8K = ("k", "q")                 # kinds on prepare_q8k's activations: bit for bit the same (checked; Q6_K: 6, q6)


def _call(x, w, planes, cfg, **kw):
    cfg = dict(cfg)
    kind = cfg.pop("kind")
    if kind == "6":
        return qgemv_mma6(x, w, planes=planes, **cfg, **kw)
    if kind == "k":
        return qgemv_mma_k(x, w, planes=planes, **cfg, **kw)
    if kind == "q":
        return qgemv_q8k(x, w, **cfg, **kw)
    if kind == "q6":
        return qgemv_q8k6(x, w, **cfg, **kw)
    return qgemv_mma(x, w, planes=planes, **cfg, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*",
                    default=["gate_up", "qkv", "o", "down_q4", "qkv_30b", "o_30b", "down_q6", "head"])
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--old", action="store_true", help="also qgemv_mma (per-32 activations)")
    args = ap.parse_args()
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        qt, N, K = DECODE_SHAPES[name]
        w, ws, _ = decode_weight(name, g)
        q6 = qt.name == "Q6_K"
        arms = ARMS_Q6 if q6 else {**ARMS, **(OLD_ARMS if args.old else {})}
        planes = [(mma6_planes if q6 else mma_planes)(w_) for w_ in ws]
        x16 = torch.randn(16, K, device="cuda", generator=g).to(torch.bfloat16)           # [16, K]
        row = {"shape": name, "qtype": qt.name, "N": N, "K": K, "MB": w.nbytes / 1e6, "dp4a_tile": str(gemv_tile(w)),
               "us": {}, "rel_err_vs_dp4a": {}, "rows_equal_alone": {}}
        ref = qgemv_i8(x16, w)
        for arm, cfg in arms.items():
            try:
                for W in args.widths:
                    x = x16[:W].contiguous()
                    prep = prepare_i8(x, w)
                    out = torch.empty(W, N, device="cuda")
                    if cfg is None:
                        fns = [lambda w_=w_: qgemv_i8(x, w_, out=out, prepared=prep, pdl=True) for w_ in ws]
                    else:
                        kind = cfg["kind"]
                        kw = ({"prepared": prepare_q8k6(x, w.n_slots)} if kind in ("6", "q6")
                              else {"prepared": prepare_q8k(x, w.n_slots)} if kind in Q8K
                              else {"prepared": prep, "xf": mma_x(prep[0], w.n_slots)})
                        fns = [lambda w_=w_, p_=p_, kw=kw, cfg=cfg: _call(x, w_, p_, cfg, out=out, pdl=True, **kw)
                               for w_, p_ in zip(ws, planes)]
                    row["us"][f"{W}:{arm}"] = time_graph(fns) * 1e6
                if cfg is not None:
                    y = _call(x16, w, planes[0], cfg)
                    row["rel_err_vs_dp4a"][arm] = float(((y - ref).abs().max() / ref.abs().max()).item())
                    alone = torch.cat([_call(x16[m:m + 1], w, planes[0], cfg) for m in range(16)])
                    row["rows_equal_alone"][arm] = bool(torch.equal(y, alone))
                    if cfg["kind"] in ("q", "q6"):       # the narrow-W partner gives the tensor-core kernel's bits
                        mma_k = _call(x16, w, planes[0], {"kind": "k" if cfg["kind"] == "q" else "6"})
                        row.setdefault("equal_mma_k", {})[arm] = bool(torch.equal(y, mma_k))
            except Exception as e:                          # recorded, not fatal
                row["us"][f"error:{arm}"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.synchronize()
        res["rows"].append(row)
        print(f"{name} {qt.name} {N}x{K} {row['MB']:.1f} MB:", flush=True)
        for arm, cfg in arms.items():
            us = {W: row["us"].get(f"{W}:{arm}") for W in args.widths}
            if None in us.values():
                print(f"   {arm:13s} {row['us'].get(f'error:{arm}', 'failed')[:150]}", flush=True)
                continue
            print(f"   {arm:13s} " + "  ".join(f"W{W} {v:6.1f}" for W, v in us.items())
                  + f"  | W1 {row['MB'] / us[args.widths[0]]:.2f} TB/s  W8/W1 {us.get(8, 0) / us[args.widths[0]]:.2f}"
                  + (f"  err {row['rel_err_vs_dp4a'][arm]:.1e} equal {row['rows_equal_alone'][arm]}" if cfg else "")
                  + (f" = mma-k {row['equal_mma_k'][arm]}" if arm in row.get("equal_mma_k", {}) else ""),
                  flush=True)
        del ws, planes
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / f"gpu_qgemv_mma-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
