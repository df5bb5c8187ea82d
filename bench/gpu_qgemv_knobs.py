"""Which of qgemv_i8's launch knobs change a row's bits on the GPU (a diagnostic: the
interpreter cannot tell, its reductions do not depend on layouts). For each format and
each knob set (BN, warps, prefetch) and width, every row is compared bitwise with the
same row computed alone with the default tile. Writes $OUT/gpu_qgemv_knobs-*.json.

    PYTHONUNBUFFERED=1 python bench/gpu_qgemv_knobs.py
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
from gpu_kernels import random_raw, run_header  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8 import GemvTile, gemv_tile, qgemv_i8  # noqa: E402

KNOBS = [(4, 4, True), (16, 4, True), (8, 4, True), (4, 2, True), (16, 8, True), (4, 4, False), (16, 16, True)]


def main() -> None:
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for qt, N, K in ((T.Q4_K, 512, 4096), (T.Q6_K, 512, 4096), (T.Q8_0, 512, 4096), (T.Q4_K, 40, 512)):
        w = QuantWeight.from_raw(random_raw(qt, N, K, g), qt, (N, K), "cuda")
        x = torch.randn(11, K, device="cuda", generator=g).to(torch.bfloat16)
        base = gemv_tile(w)
        alone = torch.stack([qgemv_i8(x[m:m + 1], w, tile=base)[0] for m in range(11)])
        for bn, nw, pf in KNOBS:
            t = GemvTile(BN=bn, NT=base.NT, num_warps=nw, prefetch=pf)
            for W in (1, 2, 8, 11):
                out = qgemv_i8(x[:W], w, tile=t)
                diff = int((out.view(torch.int32) != alone[:W].view(torch.int32)).sum())
                res["rows"].append({"qtype": qt.name, "N": N, "K": K, "BN": bn, "warps": nw, "prefetch": pf, "W": W,
                                    "elements_differing": diff})
                print(f"{qt.name} {N}x{K} BN {bn:2d} warps {nw:2d} prefetch {pf!s:5s} W {W:2d}: "
                      f"{diff} elements differ", flush=True)
    out = Path(os.environ.get("OUT", ".")) / f"gpu_qgemv_knobs-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
