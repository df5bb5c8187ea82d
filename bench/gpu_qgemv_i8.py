"""qgemv_i8 (dp4a decode GEMV) against qmatmul on the 8B shape's matrices, same session:
tiles at W=1 and W=8, kernel alone (activations prepared once) and with the prepare
launch; the float64 check of each shape. Writes $OUT/gpu_qgemv_i8-*.json.

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_qgemv_i8.py
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import copies_for, random_raw, run_header, time_graph  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul  # noqa: E402
from alphallama.kernels.moe.expert_q8 import quantize_q8  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8 import GemvTile, qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402

SHAPES = [("gate_up", T.Q4_K, 24576, 4096), ("down_q6", T.Q6_K, 4096, 12288), ("down_q4", T.Q4_K, 4096, 12288),
          ("o", T.Q4_K, 4096, 4096), ("head", T.Q6_K, 151936, 4096)]
TILES = [GemvTile(8, 32, 4, True), GemvTile(16, 32, 4, True), GemvTile(4, 32, 4, True), GemvTile(8, 32, 2, True),
         GemvTile(4, 32, 2, True), GemvTile(8, 32, 4, False), GemvTile(32, 32, 8, True), GemvTile(8, 64, 4, True),
         GemvTile(16, 64, 4, True), GemvTile(4, 64, 4, True)]


def check(x, w) -> float:
    xq, dx, _ = quantize_q8(x.float())
    xd = (xq.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape)
    wd = w.dequantize().double()
    ref, scale = xd @ wd.T, xd.abs() @ wd.abs().T
    return ((qgemv_i8(x, w).double() - ref).abs() / scale.clamp_min(1e-30)).max().item()


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    res = {**run_header(props), "command": " ".join(sys.argv), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    t_end = time.time() + float(os.environ.get("BUDGET_S", "400"))
    for name, qt, N, K in SHAPES:
        w = QuantWeight.from_raw(random_raw(qt, N, K, g), qt, (N, K), "cuda")
        ws = copies_for(w)
        for W in (1, 8):
            x = torch.randn(W, K, device="cuda", generator=g).to(torch.bfloat16)
            err = check(x, w) if name != "head" else None
            us0 = time_graph([lambda w_=w_: qmatmul(x, w_, rows_per_thread=4) for w_ in ws]) * 1e6
            res["rows"].append({"shape": name, "W": W, "kernel": "qmatmul", "us": us0, "TBps": w.nbytes / us0 / 1e6})
            print(f"{name:8s} W={W} qmatmul (control)                 {us0:8.1f} us {w.nbytes / us0 / 1e6:5.2f} TB/s",
                  flush=True)
            prep = prepare_i8(x, w)
            us_p = time_graph([lambda: prepare_i8(x, w)]) * 1e6
            for t in TILES:
                if time.time() > t_end:
                    break
                try:
                    us = time_graph([lambda w_=w_: qgemv_i8(x, w_, tile=t, prepared=prep) for w_ in ws]) * 1e6
                except Exception as e:  # noqa: BLE001
                    res["rows"].append({"shape": name, "W": W, "tile": str(t), "error": repr(e)[:300]})
                    continue
                res["rows"].append({"shape": name, "qtype": qt.name, "N": N, "K": K, "W": W, "kernel": "qgemv_i8",
                                    "tile": [t.BN, t.NT, t.num_warps, t.prefetch], "us": us, "prepare_us": us_p,
                                    "TBps": w.nbytes / us / 1e6, "vs_qmatmul": us0 / us, "rel_err": err})
                print(f"{name:8s} W={W} i8 {str((t.BN, t.NT, t.num_warps, t.prefetch)):28s} {us:8.1f} us "
                      f"{w.nbytes / us / 1e6:5.2f} TB/s  x{us0 / us:4.2f}  (+prep {us_p:.1f})", flush=True)
        del ws
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / f"gpu_qgemv_i8-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
