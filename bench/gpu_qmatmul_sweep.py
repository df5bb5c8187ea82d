"""qmatmul tile and register-cap sweep on the 8B shape's matrices (and the dp4a kernel's
grid), one device call. Writes $OUT/gpu_qmatmul_sweep-*.json and prints a table.

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_qmatmul_sweep.py

Why: Nsight Compute on Q4_K 4096x12288 at W=1 (this session) read 80 registers per
thread -> 37.5% theoretical occupancy (29.5% achieved), 1.29 waves, issue slots 53%
busy and DRAM 35%: latency and occupancy, then instruction issue. A register cap
(maxnreg) raises occupancy without touching the arithmetic; rows per thread and slots
per step change the tile (and so a weight's bits): both are timed here, and each
config's rows are checked against the float64 reference.
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
from gpu_kernels import copies_for, random_raw, rel_err, run_header, time_graph  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import qmatvec_i8  # noqa: E402

SHAPES = [("gate_up", T.Q4_K, 24576, 4096), ("down_q6", T.Q6_K, 4096, 12288), ("down_q4", T.Q4_K, 4096, 12288),
          ("o", T.Q4_K, 4096, 4096), ("head", T.Q6_K, 151936, 4096)]
# (rows_per_thread, slots_per_step, num_warps, maxnreg)
CONFIGS = [(4, 128, 4, None), (4, 128, 4, 64), (4, 128, 4, 48), (2, 128, 4, None), (2, 128, 4, 48),
           (4, 64, 2, None), (4, 64, 2, 48), (2, 32, 1, None), (4, 32, 1, None), (4, 32, 1, 48),
           (1, 128, 4, 40), (4, 128, 8, None)]
I8_BN = [16, 8, 4, 2]   # qmatvec_i8's weight rows a program (its lanes are the contract's)


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
            base = None
            for rpt, nt, nw, mr in CONFIGS:
                if time.time() > t_end:
                    break
                kw = dict(rows_per_thread=rpt, slots_per_step=nt, num_warps=nw, maxnreg=mr)
                try:
                    err = rel_err(qmatmul(x, w, **kw), x, w) if name != "head" else None
                    us = time_graph([lambda w_=w_: qmatmul(x, w_, **kw) for w_ in ws]) * 1e6
                except Exception as e:  # noqa: BLE001
                    res["rows"].append({"shape": name, "W": W, "cfg": [rpt, nt, nw, mr], "error": repr(e)[:300]})
                    continue
                base = base or us
                row = {"shape": name, "qtype": qt.name, "N": N, "K": K, "W": W, "kernel": "qmatmul",
                       "cfg": [rpt, nt, nw, mr], "us": us, "TBps": w.nbytes / us / 1e6, "vs_first": us / base,
                       "rel_err": err}
                res["rows"].append(row)
                print(f"{name:8s} W={W} qmatmul {str((rpt, nt, nw, mr)):22s} {us:8.1f} us {row['TBps']:5.2f} TB/s",
                      flush=True)
            if name == "head":
                continue
            for bn in I8_BN:
                t = f"BN={bn}"
                if time.time() > t_end:
                    continue
                try:
                    us = time_graph([lambda w_=w_: qmatvec_i8(x, w_, BN=bn) for w_ in ws]) * 1e6
                except Exception as e:  # noqa: BLE001
                    res["rows"].append({"shape": name, "W": W, "tile": t, "error": repr(e)[:300]})
                    continue
                res["rows"].append({"shape": name, "qtype": qt.name, "N": N, "K": K, "W": W, "kernel": "qmatvec_i8",
                                    "tile": t, "us": us, "TBps": w.nbytes / us / 1e6})
                print(f"{name:8s} W={W} i8 {t:60s} {us:8.1f} us {w.nbytes / us / 1e6:5.2f} TB/s", flush=True)
        del ws
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / f"gpu_qmatmul_sweep-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
