"""The Q4_K decode GEMV with its integer sums on the tensor cores (kernels/qgemv_mma.qgemv_mma_k:
inline PTX mma.sync m16n8k32 on q8_K activations, fragments loaded in fragment order) and its
dp4a partner (kernels/qgemv_q8k: the same bits) against qgemv_i8 (dp4a) at W = 1, 2, 4, 8, 16:
can one float order serve every W, W = 8 at about W = 1's cost (issue 7's W8/W1 <= 1.3),
without losing W = 1? The Q4_K matrices of the 8B and 30B-A3B shapes (a Q6_K shape given in
--shapes: dp4a alone); PDL launches in CUDA graphs, weight copies (and their fragment planes)
cycled to defeat L2; the activations prepared outside the timing (a producer would emit
them). Checks: relative error against qgemv_i8 (another float order), every row of a 16-row
call equal to the row alone, qgemv_q8k equal to qgemv_mma_k. Writes $OUT/gpu_qgemv_mma-*.json.
Removed arms (slower, gpu_qgemv_mma-20261201-213840.json): the Q6_K tensor-core GEMV and its
dp4a partner, qgemv_q8k's one-row-a-thread tile; the per-32 form earlier (-182647.json).

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

from alphallama.kernels.gemv.qgemv_i8 import gemv_tile, qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qgemv_mma import mma_planes, prepare_q8k, qgemv_mma_k  # noqa: E402
from alphallama.kernels.gemv.qgemv_q8k import qgemv_q8k  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402

# "k": qgemv_mma_k, activations with one scale a super-block (another quantization than the
# engine's: its error against dp4a is that, not a bug), with runs (warps a row group, K cut
# over them); "q": qgemv_q8k on the same activations (rows a program: its default, or 8)
# "g2": two 16-row groups a warp sharing each activation fetch (session 25, untimed; the same
# bits as the same tile at one group: checked here against mma-k where the tile is the default's)
ARMS = {"dp4a": None, "mma-k": {"kind": "k", "groups": 1}, "mma-k w4 r1": {"kind": "k", "warps": 4, "runs": 1},
        "mma-k g2": {"kind": "k", "groups": 2}, "mma-k w4 g2": {"kind": "k", "warps": 4, "groups": 2},
        "q8k slots": {"kind": "q"}, "q8k slots 8": {"kind": "q", "rows": 8}}


def _call(x, w, planes, cfg, **kw):
    cfg = dict(cfg)
    if cfg.pop("kind") == "k":
        return qgemv_mma_k(x, w, planes=planes, **cfg, **kw)
    return qgemv_q8k(x, w, **cfg, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["gate_up", "qkv", "o", "down_q4", "qkv_30b", "o_30b"])
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        qt, N, K = DECODE_SHAPES[name]
        w, ws, _ = decode_weight(name, g)
        q4 = qt.name == "Q4_K"
        arms = ARMS if q4 else {"dp4a": None}
        planes = [mma_planes(w_) if q4 else None for w_ in ws]
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
                        kw = {"prepared": prepare_q8k(x, w.n_slots)}
                        fns = [lambda w_=w_, p_=p_, kw=kw, cfg=cfg: _call(x, w_, p_, cfg, out=out, pdl=True, **kw)
                               for w_, p_ in zip(ws, planes)]
                    row["us"][f"{W}:{arm}"] = time_graph(fns) * 1e6
                if cfg is not None:
                    y = _call(x16, w, planes[0], cfg)
                    row["rel_err_vs_dp4a"][arm] = float(((y - ref).abs().max() / ref.abs().max()).item())
                    alone = torch.cat([_call(x16[m:m + 1], w, planes[0], cfg) for m in range(16)])
                    row["rows_equal_alone"][arm] = bool(torch.equal(y, alone))
                    if cfg["kind"] == "q" or (set(cfg) == {"kind", "groups"} and cfg["groups"] != 1):   # = mma-k's bits
                        mma_k = _call(x16, w, planes[0], {"kind": "k", "groups": 1})
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
