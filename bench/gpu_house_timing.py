"""Round time at W = 1 and 8 of one synthetic GGUF through whichever alphallama is on
PYTHONPATH (issue 30's before / after: the same file, the same process layout), using only
GPUModel's public surface and its graphs, so that an older tree runs it unchanged.

    PYTHONPATH=/tmp/site:.before/src python bench/gpu_house_timing.py --gguf F --label before --out J
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from alphallama.bench.engine_bench import time_cuda
from alphallama.gguf.reader import GGUFFile
from alphallama.runtime.gpu_model import GPUModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    t0 = time.perf_counter()
    m = GPUModel(GGUFFile(a.gguf), 4096, "cuda")
    cache = m.new_cache()
    g = torch.Generator().manual_seed(1)
    m.forward(torch.randint(m.cfg.vocab_size, (a.depth,), generator=g), 0, cache)
    ms = {}
    for W in (1, 8):
        graph = m.graphs[W][0]

        def replay():
            m._pos.fill_(a.depth)
            graph.replay()
        ms[W] = time_cuda(replay, a.reps)
    rec = {"label": a.label, "gguf": a.gguf, "depth": a.depth, "reps": a.reps, "ms_per_round": ms,
           "load_s": time.perf_counter() - t0, "module": GPUModel.__module__,
           "file": __import__("alphallama").__file__}
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{a.label:7s} W1 {ms[1]:.3f} W8 {ms[8]:.3f} ms  ({a.gguf})", flush=True)


if __name__ == "__main__":
    main()
