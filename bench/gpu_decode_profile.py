"""Where a decode round's time goes: device time per kernel inside the captured graphs.

    PYTHONUNBUFFERED=1 python bench/gpu_decode_profile.py [--layers 6] [--preset qwen3-8b ...]

For each preset: a synthetic model of --layers layers (head and embeddings full size),
graphs captured, a 512-token prefill, then torch.profiler over `--reps` replays of the
W=1 and W=8 graphs (CUPTI records the kernels a graph launches). Per kernel name:
count per round and microseconds per round; the round's wall time beside it (CUDA
events, no profiler), so that the gap between the two is the graph's launch overhead
and idle time. Writes $OUT/gpu_decode_profile-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from alphallama.bench.engine_bench import time_cuda
from alphallama.bench.hostinfo import host_state
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides


def kernel_table(replay, reps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" or getattr(e, "device_time", 0) > 0:
            k = e.name[:90]
            per[k][0] += 1
            per[k][1] += e.device_time
    rows = sorted(((k, c / reps, us / reps) for k, (c, us) in per.items()), key=lambda r: -r[2])
    return {"kernels": [{"name": k, "per_round": c, "us_per_round": us} for k, c, us in rows],
            "device_us_per_round": sum(r[2] for r in rows), "launches_per_round": sum(r[1] for r in rows)}


def profile_preset(preset: str, layers: int, reps: int, depth: int, fuse_q8: bool = True, pdl: bool = True,
                   mma: bool = False) -> dict:
    path = f"/tmp/prof-{preset}.gguf"
    if not os.path.exists(path):
        write_synthetic(PRESETS[preset](n_layers=layers), path)
    # fuse off: a prepare launch per GEMV input; mma: engine.gemv_mma (qgemv_q8k up to gemv_mma_narrow rows)
    model = GPUModel(GGUFFile(path), 4096, "cuda", overrides=Overrides(fuse_q8=fuse_q8, pdl=pdl, gemv_mma=mma))
    cache = model.new_cache(4096)
    g = torch.Generator().manual_seed(1)
    model.forward(torch.randint(model.cfg.vocab_size, (depth,), generator=g), 0, cache)
    out = {"layers": layers, "weight_bytes": model.weight_bytes, "capture_s": model.capture_s,
           "fuse_q8": model._fuse_q8, "pdl": model.pdl, "gemv_mma": mma}
    for W in (1, 8):
        graph = model.graphs[W][0]

        def replay():
            model._pos.fill_(depth)
            graph.replay()
        ms = time_cuda(replay, 50)
        t = kernel_table(replay, reps)
        t["wall_us_per_round"] = ms * 1000
        out[f"W{W}"] = t
        print(f"\n{preset} ({layers} layers, fused q8 {model._fuse_q8}, mma {mma}) W={W}: {ms * 1000:.0f} us/round wall, "
              f"{t['device_us_per_round']:.0f} us in kernels, {t['launches_per_round']:.0f} launches", flush=True)
        for k in t["kernels"][:18]:
            print(f"  {k['us_per_round']:8.1f} us  x{k['per_round']:5.1f}  {k['name']}", flush=True)
    return out                       # the model is freed with this frame


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", nargs="*", default=["qwen3-8b", "qwen3-30b-a3b"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--fuse-control", action="store_true", help="also each preset with a prepare launch per GEMV")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without PDL: a kernel's profiled time then excludes its wait on the previous one")
    ap.add_argument("--mma-control", action="store_true", help="also each preset with engine.gemv_mma on")
    args = ap.parse_args()
    res = {"host": host_state(sys.argv), "commit": args.commit}
    for p in args.preset:
        res[p] = profile_preset(p, args.layers, args.reps, args.depth, pdl=not args.no_pdl)
        if args.fuse_control:
            res[p + "-unfused"] = profile_preset(p, args.layers, args.reps, args.depth, fuse_q8=False)
        if args.mma_control:
            res[p + "-mma"] = profile_preset(p, args.layers, args.reps, args.depth, pdl=not args.no_pdl, mma=True)
    out = Path(os.environ.get("OUT", ".")) / f"gpu_decode_profile-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
