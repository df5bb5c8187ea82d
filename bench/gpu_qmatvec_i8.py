"""qmatvec_i8 (int8 activations + dp4a, the expert contract) on the GPU beside qmatmul.

    PYTHONUNBUFFERED=1 python bench/gpu_qmatvec_i8.py [--budget S]

1. Bit-exactness on the GPU: for each bench weight, rows of a W=16 call against
   expert_q8.matvec_q8 on the CPU (first 512 output rows), and rotation: every row of
   W = 3, 8, 16 equals that row computed alone (all N rows).
2. Speed: us per call (prepare + GEMV) and TB/s of weight bytes, CUDA-graph replays over
   enough weight copies to defeat the 60 MB L2 (bench/gpu_kernels.py's method), for
   W = 1, 2, 4, 8, 16, beside qmatmul with bf16 x (the control arm, same run). Then a
   few tile variants at W = 1 and 8.

Writes $OUT/gpu_qmatvec_i8.json (or bench/results/ when OUT is unset) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from gpu_kernels import copies_for, copy_bandwidth, random_raw, run_header, time_graph  # noqa: E402
from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul  # noqa: E402
from alphallama.kernels.moe.expert_q8 import matvec_q8, quantize_q8  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import Tile, qmatvec_i8, tile_i8  # noqa: E402

DEV = "cuda"
CASES = [(T.Q4_K, 4096, 12288), (T.Q6_K, 4096, 12288), (T.Q4_K, 4096, 4096)]   # (type, N, K)
WIDTHS = (1, 2, 4, 8, 16)
VARIANTS = [Tile(BN=64, NT=8, BW=1), Tile(BN=16, NT=32, BW=1, prefetch=False)]   # BW is set per W
REF_ROWS = 512


def _cpu_slice(w: QuantWeight, rows: int) -> QuantWeight:
    return QuantWeight(w.qtype, (rows, w.K), {n: p[:rows].cpu() for n, p in w.planes.items()})


def exactness(w: QuantWeight, g: torch.Generator) -> dict:
    x = torch.randn(16, w.K, generator=g, device=DEV).to(torch.bfloat16)
    out = torch.full((16, w.N), float("nan"), device=DEV)
    qmatvec_i8(x, w, out=out)
    wc = _cpu_slice(w, REF_ROWS)
    xq, dx, xs = quantize_q8(x.cpu())
    ref_bad = [m for m in (0, 5, 15)
               if not torch.equal(out[m, :REF_ROWS].cpu().view(torch.int32),
                                  matvec_q8(xq[m], dx[m], xs[m], wc).view(torch.int32))]
    alone = torch.cat([qmatvec_i8(x[i:i + 1], w) for i in range(16)])   # [16, N]
    rot_bad = []
    for W in (3, 8, 16):
        idx = [(W // 2 + 5 + j) % 16 for j in range(W)]
        if not torch.equal(qmatvec_i8(x[idx], w).view(torch.int32), alone[idx].view(torch.int32)):
            rot_bad.append(W)
    return {"qtype": w.qtype.name, "N": w.N, "K": w.K, "all_written": bool(out.isfinite().all()),
            "vs_matvec_q8_rows": [0, 5, 15], "vs_matvec_q8_mismatch_rows": ref_bad,
            "rotation_widths": [3, 8, 16], "rotation_mismatch_widths": rot_bad,
            "ok": not ref_bad and not rot_bad and bool(out.isfinite().all())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; later phases are cut short")
    args = ap.parse_args()
    t0 = time.time()
    g = torch.Generator(device=DEV).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    res: dict = {
        **run_header(props),
        "exact": [], "timing": [],
        "method": "us per call = CUDA-graph replay time / calls, calls cycle over weight copies (> 4x L2); "
                  "qmatvec_i8 includes its prepare kernel; TB/s = planes' bytes / time",
    }
    copy_bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = copy_bw / 1e9
    print(f"{props.name}  copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write)", flush=True)
    weights = {}
    for qt, n, k in CASES:
        w = QuantWeight.from_raw(random_raw(qt, n, k, g), qt, (n, k), DEV)
        weights[(qt, n, k)] = w
        e = exactness(w, g)
        res["exact"].append(e)
        print(f"exact {qt.name} {n}x{k}: {'bit-identical' if e['ok'] else f'MISMATCH {e}'}", flush=True)

    def timed(name, qt, n, k, W, fn_of, copies, tile=None):
        x = torch.randn(W, k, generator=g, device=DEV).to(torch.bfloat16)
        sec = time_graph([lambda wc=wc: fn_of(x, wc) for wc in copies])
        w = copies[0]
        row = {"kernel": name, "qtype": qt.name, "N": n, "K": k, "W": W, "us": sec * 1e6,
               "weight_bytes": w.nbytes, "TBps": w.nbytes / sec / 1e12, "frac_of_copy_bw": w.nbytes / sec / copy_bw,
               "tile": str(tile) if tile else None, "copies": len(copies)}
        res["timing"].append(row)
        return row

    for qt, n, k in CASES:
        if time.time() - t0 > args.budget:
            res["cut_short"] = True
            break
        copies = copies_for(weights[(qt, n, k)])
        for W in WIDTHS:
            ri = timed("qmatvec_i8", qt, n, k, W, lambda x, wc: qmatvec_i8(x, wc), copies,
                       tile_i8(copies[0], W))
            rq = timed("qmatmul", qt, n, k, W, lambda x, wc: qmatmul(x, wc), copies)
            print(f"{qt.name} {n}x{k} W={W:2d}: i8 {ri['us']:7.1f} us {ri['TBps']:.2f} TB/s | "
                  f"qmatmul {rq['us']:7.1f} us {rq['TBps']:.2f} TB/s", flush=True)
        del copies
        torch.cuda.empty_cache()
    qt, n, k = CASES[0]
    copies = copies_for(weights[(qt, n, k)])
    for v in VARIANTS:
        for W in (1, 8):
            if time.time() - t0 > args.budget:
                res["cut_short"] = True
                break
            t = Tile(BN=v.BN, NT=v.NT, BW=W, num_warps=v.num_warps, prefetch=v.prefetch)
            r = timed("qmatvec_i8", qt, n, k, W, lambda x, wc, t=t: qmatvec_i8(x, wc, tile=t), copies, t)
            print(f"variant {t}: W={W} {r['us']:.1f} us {r['TBps']:.2f} TB/s", flush=True)

    # summary: ratios to W=1 per kernel and case
    print("\nkernel      case            " + "  ".join(f"W={W:<2d} us (xW1)" for W in WIDTHS))
    for qt, n, k in CASES:
        for name in ("qmatvec_i8", "qmatmul"):
            rows = {r["W"]: r for r in res["timing"] if r["kernel"] == name and r["tile"] == (
                str(tile_i8(weights[(qt, n, k)], r["W"])) if name == "qmatvec_i8" else None)
                and (r["qtype"], r["N"], r["K"]) == (qt.name, n, k)}
            if 1 not in rows:
                continue
            for r in rows.values():
                r["vs_W1"] = r["us"] / rows[1]["us"]
            cells = "  ".join(f"{rows[W]['us']:6.1f} ({rows[W]['vs_W1']:.2f})" if W in rows else " " * 13
                              for W in WIDTHS)
            print(f"{name:11s} {qt.name} {n}x{k:<6d} {cells}   W=1 {rows[1]['TBps']:.2f} TB/s")
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_qmatvec_i8.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}  ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
