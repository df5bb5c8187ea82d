"""qgemv_mma (int8 tensor-core GEMV) against qgemv_i8 (dp4a) on the 8B shape's matrices,
same session: us per call at W = 1, 2, 4, 8, 16 (activations prepared once, as the engine
does), mma tiles, the float64 error, and at full size every row of a W=16 call bit-equal
to that row alone. Writes $OUT/gpu_qgemv_mma-*.json.

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_qgemv_mma.py
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
from alphallama.kernels.expert_q8 import quantize_q8  # noqa: E402
from alphallama.kernels.qgemv_i8 import qgemv_i8  # noqa: E402
from alphallama.kernels.qgemv_mma import MmaTile, mma_tile, qgemv_mma  # noqa: E402
from alphallama.kernels.qmatvec_i8 import prepare_i8  # noqa: E402

SHAPES = [("gate_up", T.Q4_K, 24576, 4096), ("down_q6", T.Q6_K, 4096, 12288), ("down_q4", T.Q4_K, 4096, 12288),
          ("qkv", T.Q4_K, 6144, 4096), ("o", T.Q4_K, 4096, 4096), ("head", T.Q6_K, 151936, 4096),
          ("coder_mlp", T.Q8_0, 9728, 896)]
WIDTHS = (1, 2, 4, 8, 16)


def tiles(w: QuantWeight) -> list[MmaTile]:
    d = mma_tile(w)
    nt2 = d.NT * 2
    return [d, MmaTile(16, d.NT), MmaTile(64, d.NT), MmaTile(32, nt2), MmaTile(64, d.NT, 8), MmaTile(32, d.NT, 2),
            MmaTile(32, d.NT, 4, False)]


def rel_err(out, x, w) -> float:
    xq, dx, _ = quantize_q8(x.float())
    xd = (xq.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape)
    wd = w.dequantize().double()
    ref, scale = xd @ wd.T, xd.abs() @ wd.abs().T
    return ((out.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    res = {**run_header(props), "command": " ".join(sys.argv), "rows": [], "bit_equal": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    t_end = time.time() + float(os.environ.get("BUDGET_S", "300"))
    summary = []
    for name, qt, N, K in SHAPES:
        w = QuantWeight.from_raw(random_raw(qt, N, K, g), qt, (N, K), "cuda")
        ws = copies_for(w)
        x16 = torch.randn(16, K, device="cuda", generator=g).to(torch.bfloat16)
        alone = torch.cat([qgemv_mma(x16[m:m + 1], w) for m in range(16)])
        perm = torch.randperm(16, device="cuda", generator=g)
        res["bit_equal"][name] = bool(torch.equal(qgemv_mma(x16[perm], w), alone[perm]))
        err = None if name == "head" else rel_err(qgemv_mma(x16[:2], w), x16[:2], w)
        row = {"shape": name, "qtype": qt.name, "N": N, "K": K, "MB": w.nbytes / 1e6, "rel_err": err, "us": {}}
        for W in WIDTHS:
            x = x16[:W].contiguous()
            prep = prepare_i8(x, w)
            r = {"i8": time_graph([lambda w_=w_: qgemv_i8(x, w_, prepared=prep) for w_ in ws]) * 1e6}
            for t in tiles(w):
                if time.time() > t_end and t != mma_tile(w):
                    continue
                key = f"mma{(t.BN, t.NT, t.num_warps, t.prefetch)}"
                try:
                    r[key] = time_graph([lambda w_=w_: qgemv_mma(x, w_, tile=t, prepared=prep) for w_ in ws]) * 1e6
                except Exception as e:  # noqa: BLE001
                    r[key] = repr(e)[:200]
            row["us"][W] = r
            best = min((v, k) for k, v in r.items() if k != "i8" and isinstance(v, float))
            print(f"{name:9s} W={W:2d} i8 {r['i8']:7.1f} us | mma default {r[next(iter(k for k in r if k != 'i8'))]:7.1f}"
                  f" | best {best[1]} {best[0]:7.1f} us ({w.nbytes / best[0] / 1e6:4.2f} TB/s)", flush=True)
        res["rows"].append(row)
        summary.append((name, res["bit_equal"][name], err))
        del ws
        torch.cuda.empty_cache()
    print("bit-equal W=16 vs alone, rel err:", summary)
    out = Path(os.environ.get("OUT", ".")) / f"gpu_qgemv_mma-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
