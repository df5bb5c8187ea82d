"""qmatmul on the GPU: correctness at real sizes, exact-mode rotation, and speed.

    PYTHONUNBUFFERED=1 python bench/gpu_kernels.py [--quick]

1. Correctness: every type at [N, K] = 4096x4096, 4096x12288, 12288x4096 (and the
   151936x4096 output head for Q6_K/Q8_0/Q4_K), W in (1, 8, 17), against a float64
   matmul of the plain-torch dequantization (itself checked bit for bit against gguf's
   numpy dequantizer on the first rows).
2. Exact mode: at 4096x4096 every row of every width 1..64, at three rotations, equals
   bit for bit that row computed alone.
3. Speed: qmatmul per type and W, timed as CUDA-graph replays over enough weight copies
   to defeat the 60 MB L2, as GB/s of weight bytes against the measured device-to-device
   copy bandwidth (bytes read + written). Tile variants (rows per thread) for W=1 and 8.

Writes $OUT/gpu_kernels.json (or bench/results/ when OUT is unset) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gguf import quants as gguf_quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from alphallama.bench.hostinfo import host_state  # noqa: E402
from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qmatmul import tile  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul  # noqa: E402

QTYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q4_0]
SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096)]
HEAD = (151936, 4096)
ROTATION = ((4096, 4096), 64)   # shape, widths 1..64
SPEED = (4096, 12288)
DEV = "cuda"
L2_BYTES = 60 << 20
F16_FIELDS = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_raw(qtype: T, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random GGUF bytes on the GPU: random bits, fp16 scales small and finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = n * k // block
    if qtype in (T.F16, T.BF16, T.F32):
        dt = {T.F16: torch.float16, T.BF16: torch.bfloat16, T.F32: torch.float32}[qtype]
        return (torch.randn(nb, generator=g, device=DEV) * 0.05).to(dt).view(torch.uint8).reshape(n, -1)
    blocks = torch.randint(0, 256, (nb, size), dtype=torch.uint8, generator=g, device=DEV)  # [nb, size]
    for off in F16_FIELDS[qtype]:
        scale = (torch.rand(nb, generator=g, device=DEV) * 2 - 1) * 2e-3
        blocks[:, off:off + 2] = scale.to(torch.float16).reshape(nb, 1).view(torch.uint8)
    return blocks.reshape(n, -1)


def rel_err(out: torch.Tensor, x: torch.Tensor, w: QuantWeight) -> float:
    """max over elements of |out - ref| / (|x| @ |w|^T), float64 reference."""
    wd = w.dequantize().double()  # [N, K]
    ref = x.double() @ wd.T
    scale = x.double().abs() @ wd.abs().T
    return ((out.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()


def check_against_gguf(raw: torch.Tensor, w: QuantWeight, rows: int = 64) -> bool:
    ref = gguf_quants.dequantize(raw[:rows].cpu().numpy(), w.qtype)
    ours = w.dequantize()[:rows].cpu().numpy()
    return bool(np.array_equal(ref.view(np.uint32), ours.view(np.uint32)))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    a.random_()
    times = []
    for _ in range(23):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * (1 << 30) / float(np.median(times[3:]))


def time_graph(fn_list, reps: int = 20) -> float:
    """Seconds per call: a CUDA graph replays the calls (one per weight copy, cycled
    to defeat L2) `reps` times; median replay time over the call count."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fn_list:  # warm-up: compile and allocate outside the capture
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_list:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return float(np.median(times)) / len(fn_list)


# the decode round's matrices (type, N, K): the 8B shape's, and the 30B-A3B's attention
DECODE_SHAPES = {"gate_up": (T.Q4_K, 24576, 4096), "down_q6": (T.Q6_K, 4096, 12288), "down_q4": (T.Q4_K, 4096, 12288),
                 "qkv": (T.Q4_K, 6144, 4096), "o": (T.Q4_K, 4096, 4096), "head": (T.Q6_K, 151936, 4096),
                 "qkv_30b": (T.Q4_K, 5120, 2048), "o_30b": (T.Q4_K, 2048, 4096)}


def decode_weight(name: str, g: torch.Generator, copies: bool = True
                  ) -> tuple[QuantWeight, list[QuantWeight], torch.Tensor]:
    """One of DECODE_SHAPES with random GGUF bytes on DEV: (weight, the copies that defeat
    L2 for timing, or [weight], 8 bf16 activation rows [8, K])."""
    qt, n, k = DECODE_SHAPES[name]
    w = QuantWeight.from_raw(random_raw(qt, n, k, g), qt, (n, k), DEV)
    x8 = torch.randn(8, k, device=DEV, generator=g).to(torch.bfloat16)                 # [8, K]
    return w, copies_for(w) if copies else [w], x8


def copies_for(w: QuantWeight) -> list[QuantWeight]:
    n = max(2, math.ceil(4 * L2_BYTES / w.nbytes))
    return [w] + [QuantWeight(w.qtype, w.shape, {k: p.clone() for k, p in w.planes.items()}) for _ in range(n - 1)]


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError as e:
        return f"({e})"


def run_header(props) -> dict:
    """What a kernel bench's JSON starts with: the project's host_state (date, command,
    git, host, versions, GPU driver/clocks/power), the SM count and the commit measured
    (GIT_COMMIT: the device copy is not a git checkout)."""
    return {**host_state(), "gpu_name": props.name, "sms": props.multi_processor_count,
            "commit": os.environ.get("GIT_COMMIT") or _run(["git", "rev-parse", "HEAD"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer types and widths")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; later phases are cut short")
    args = ap.parse_args()
    t0 = time.time()
    g = torch.Generator(device=DEV).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    res: dict = {
        **run_header(props),
        "correctness": [], "rotation": [], "timing": [],
    }
    copy_bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = copy_bw / 1e9
    print(f"{props.name}  copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write)", flush=True)
    qtypes = QTYPES[:3] if args.quick else QTYPES

    # 1. correctness
    for qt in qtypes:
        shapes = SHAPES + ([HEAD] if qt == T.Q6_K else [])
        for (n, k) in shapes:
            raw = random_raw(qt, n, k, g)
            w = QuantWeight.from_raw(raw, qt, (n, k), DEV)
            entry = {"qtype": qt.name, "N": n, "K": k, "gguf_bit_exact": check_against_gguf(raw, w),
                     "tile": tile(w)}
            for W in (1, 8, 17):
                x = torch.randn(W, k, generator=g, device=DEV).to(torch.bfloat16)
                out = torch.full((W, n), float("nan"), device=DEV)  # poisoned: every element must be written
                qmatmul(x, w, out=out)
                entry[f"W{W}_max_err_over_scale"] = rel_err(out, x, w)
                entry[f"W{W}_all_finite"] = bool(out.isfinite().all())
            entry["ok"] = entry["gguf_bit_exact"] and all(
                entry[f"W{W}_max_err_over_scale"] < 1e-5 and entry[f"W{W}_all_finite"] for W in (1, 8, 17))
            res["correctness"].append(entry)
            print(f"check {qt.name:5s} {n}x{k}: {'ok' if entry['ok'] else 'FAIL'} "
                  f"err/scale W1 {entry['W1_max_err_over_scale']:.1e} W17 {entry['W17_max_err_over_scale']:.1e}",
                  flush=True)
            del w, raw
    torch.cuda.empty_cache()

    # 2. exact mode: rotation at real size
    for qt in qtypes:
        (n, k), pool = ROTATION
        w = QuantWeight.from_raw(random_raw(qt, n, k, g), qt, (n, k), DEV)
        xs = torch.randn(pool, k, generator=g, device=DEV).to(torch.bfloat16)
        alone = torch.cat([qmatmul(xs[i:i + 1], w) for i in range(pool)])  # [pool, N]
        bad = []
        for W in range(1, pool + 1):
            for shift in sorted({0, W // 2, pool - 1}):
                idx = [(shift + j) % pool for j in range(W)]
                out = qmatmul(xs[idx], w)
                if not torch.equal(out.view(torch.int32), alone[idx].view(torch.int32)):
                    bad.append((W, shift))
        xs32 = torch.randn(pool, k, generator=g, device=DEV)  # fp32 activations, a few widths
        alone32 = torch.cat([qmatmul(xs32[i:i + 1], w) for i in range(pool)])
        for W in (2, 3, 8, 17, pool):
            idx = [(pool - 1 + j) % pool for j in range(W)]
            if not torch.equal(qmatmul(xs32[idx], w).view(torch.int32), alone32[idx].view(torch.int32)):
                bad.append((W, "fp32"))
        res["rotation"].append({"qtype": qt.name, "N": n, "K": k, "widths": f"1..{pool}", "rotations": 3,
                                "mismatches": bad, "ok": not bad})
        print(f"rotation {qt.name:5s} {n}x{k} W=1..{pool}: {'bit-identical' if not bad else f'MISMATCH {bad[:5]}'}",
              flush=True)
    torch.cuda.empty_cache()

    # 3. speed
    widths = (1, 2, 4, 8) if args.quick else (1, 2, 4, 8, 16, 32, 64)
    # (type, shape, widths, variants (rows_per_thread, x dtype)), most wanted first:
    # the time budget cuts the tail
    base, more = [(2, torch.bfloat16)], [(4, torch.bfloat16), (2, torch.float32)]
    plan = [(qt, SPEED, (1, 8), base) for qt in qtypes]
    plan += [(T.Q4_K, SPEED, widths, base), (T.Q6_K, HEAD, (1, 8), base)]
    plan += [(qt, SPEED, (1, 8), more) for qt in qtypes]
    plan += [(qt, SPEED, widths, base) for qt in qtypes if qt != T.Q4_K]
    plan += [(T.Q4_K, SPEED[::-1], (1, 8), base + more), (T.Q4_K, SHAPES[0], (1, 8), base + more),
             (T.F16, SHAPES[0], (1, 8), base)]
    for qt, (n, k), ws, vars_ in plan:
        if time.time() - t0 > args.budget:
            print("time budget reached: speed runs cut short", flush=True)
            res["cut_short"] = True
            break
        raw = random_raw(qt, n, k, g)
        w = QuantWeight.from_raw(raw, qt, (n, k), DEV)
        del raw
        ws_copies = copies_for(w)
        for rpt, xdt in vars_:
            t1 = None
            for W in ws:
                x = torch.randn(W, k, generator=g, device=DEV).to(xdt)
                calls = [lambda wc=wc: qmatmul(x, wc, rows_per_thread=rpt) for wc in ws_copies]
                sec = time_graph(calls)
                t1 = sec if W == 1 else t1
                if t1 is None:   # W=1 of this variant ran in an earlier stage
                    t1 = next((r["us"] / 1e6 for r in res["timing"] if r["W"] == 1 and r["qtype"] == qt.name
                               and (r["N"], r["K"], r["rows_per_thread"]) == (n, k, rpt)
                               and r["x_dtype"] == str(xdt).replace("torch.", "")), sec)
                gbps = w.nbytes / sec / 1e9
                row = {"qtype": qt.name, "N": n, "K": k, "W": W, "rows_per_thread": rpt, "tile": tile(w, rpt),
                       "x_dtype": str(xdt).replace("torch.", ""),
                       "us": sec * 1e6, "weight_bytes": w.nbytes, "gguf_bytes": w.gguf_nbytes,
                       "GBps": gbps, "frac_of_copy_bw": gbps * 1e9 / copy_bw,
                       "vs_W1": sec / t1 if t1 else None, "copies": len(ws_copies)}
                res["timing"].append(row)
                print(f"time {qt.name:5s} {n:6d}x{k:<5d} W={W:2d} rpt={rpt} x={row['x_dtype']:8s}: {sec * 1e6:8.1f} us "
                      f"{gbps:7.0f} GB/s ({row['frac_of_copy_bw']:.0%} of copy)  x{sec / t1:.2f} of W=1", flush=True)
        del ws_copies, w
        torch.cuda.empty_cache()

    res["elapsed_s"] = time.time() - t0
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_kernels.json").write_text(json.dumps(res, indent=1))

    print("\nqtype  NxK           rpt x         W=1 us  GB/s   W=8 us  GB/s  W8/W1   (copy bw %.0f GB/s)" % (copy_bw / 1e9))
    key = ("qtype", "N", "K", "rows_per_thread", "x_dtype")
    for r1 in (r for r in res["timing"] if r["W"] == 1):
        r8 = next((r for r in res["timing"] if r["W"] == 8 and all(r[k] == r1[k] for k in key)), None)
        if r8:
            print(f"{r1['qtype']:5s}  {r1['N']:6d}x{r1['K']:<6d} {r1['rows_per_thread']:2d}  {r1['x_dtype']:8s} "
                  f"{r1['us']:7.1f} {r1['GBps']:5.0f}  {r8['us']:7.1f} {r8['GBps']:5.0f}  {r8['us'] / r1['us']:5.2f}")
    ok = all(e["ok"] for e in res["correctness"]) and all(e["ok"] for e in res["rotation"])
    print(f"correctness and rotation: {'all ok' if ok else 'FAILURES'}; {res['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
