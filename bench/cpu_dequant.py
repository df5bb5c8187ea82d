"""CPU dequantization speed: alphallama.gguf.quants (torch) against gguf.quants (numpy)
for one 4096 x 4096 tensor of every type, both checked bit-equal first.

    PYTHONPATH=src python bench/cpu_dequant.py [--rows 4096 --cols 4096 --reps 3] [--out bench/results]

Writes cpu_dequant-<date>.json: per type the best of --reps wall times of gguf (numpy,
one thread), of ours at one torch thread (the like-for-like figure) and at torch's
default thread count, and which is faster. Timings on a shared machine are noisy: each
repetition runs the arms in turn, so drift hits them alike.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import numpy as np
import torch
from gguf import quants as ggq

from alphallama.gguf.quants import QUANTS, dequantize, random_blocks


def best_of(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    shape = (args.rows, args.cols)
    results = {}
    threads = torch.get_num_threads()
    for qtype, q in QUANTS.items():
        n_blocks = args.rows * args.cols // q.block_size
        raw = random_blocks(qtype, n_blocks, torch.Generator().manual_seed(0)).numpy().reshape(args.rows, -1)
        ours = dequantize(raw, qtype, shape)
        ref = torch.from_numpy(np.ascontiguousarray(ggq.dequantize(raw, qtype)))
        exact = bool(torch.equal(ours.view(torch.int32), ref.view(torch.int32)))
        best = {"gguf_s": 1e9, "torch_1t_s": 1e9, "torch_s": 1e9}
        for _ in range(args.reps):
            best["gguf_s"] = min(best["gguf_s"], best_of(lambda raw=raw, qtype=qtype: ggq.dequantize(raw, qtype), 1))
            torch.set_num_threads(1)
            best["torch_1t_s"] = min(best["torch_1t_s"], best_of(lambda raw=raw, qtype=qtype: dequantize(raw, qtype, shape), 1))
            torch.set_num_threads(threads)
            best["torch_s"] = min(best["torch_s"], best_of(lambda raw=raw, qtype=qtype: dequantize(raw, qtype, shape), 1))
        r = {k: round(v, 4) for k, v in best.items()}
        results[qtype.name] = {"exact": exact, **r,
                               "gguf_over_torch_1t": round(best["gguf_s"] / best["torch_1t_s"], 2),
                               "faster_1t": "torch" if best["torch_1t_s"] <= best["gguf_s"] else "gguf"}
        print(qtype.name, results[qtype.name], flush=True)
    out = {"shape": list(shape), "reps": args.reps, "torch": torch.__version__, "numpy": np.__version__,
           "torch_threads": threads,
           "note": "F32: gguf returns a view of the bytes (no copy); ours copies (never aliases)",
           "loadavg": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
           "nproc": os.cpu_count(), "date": datetime.date.today().isoformat(), "results": results}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"cpu_dequant-{datetime.date.today():%Y%m%d}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(path)


if __name__ == "__main__":
    main()
