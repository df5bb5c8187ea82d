"""The decode GEMV (qgemv_i8) on the 8B shape's matrices, for Nsight Compute to read (no
timing of its own): why a GEMV runs at ~3 TB/s where a copy runs at 4.2.

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:qgemv_i8 \
        python bench/ncu_qgemv_i8.py [--w 1 4]

Each matrix (random GGUF bytes, its default tile: qgemv_i8.gemv_tile) at each W, launched
twice (the first compiles), on activations prepared once (as the norms emit them).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402

SHAPES = {"gate_up": (T.Q4_K, 24576, 4096), "down_q6k": (T.Q6_K, 4096, 12288), "down_q4k": (T.Q4_K, 4096, 12288),
          "qkv": (T.Q4_K, 6144, 4096), "o": (T.Q4_K, 4096, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--w", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    dev = gpu_kernels.DEV = args.device          # (random_raw makes its bytes on gpu_kernels.DEV)
    g = torch.Generator(device=dev).manual_seed(0)
    for name in args.shapes:
        qt, n, k = SHAPES[name]
        w = QuantWeight.from_raw(gpu_kernels.random_raw(qt, n, k, g), qt, (n, k), dev)
        for W in args.w:
            x = torch.randn(W, k, device=dev, generator=g).to(torch.bfloat16)
            prepared = prepare_i8(x, w)
            for _ in range(2):
                qgemv_i8(x, w, prepared=prepared)
        if dev == "cuda":
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
