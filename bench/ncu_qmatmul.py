"""A few qmatmul launches for Nsight Compute to read (no timing of its own).

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        -k regex:qmatmul python bench/ncu_qmatmul.py [--w 1 8] [--qtype Q4_K]

One weight [N, K] (random GGUF bytes) and W rows of bf16 x, each W launched twice
(the first compiles). ncu reports per launch what bounds the kernel: DRAM throughput,
issue-slot use, warp stall reasons.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import random_raw  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=12288)
    ap.add_argument("--w", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--rows-per-thread", type=int, default=4)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    qt = T[args.qtype]
    w = QuantWeight.from_raw(random_raw(qt, args.n, args.k, g), qt, (args.n, args.k), "cuda")
    for W in args.w:
        x = torch.randn(W, args.k, device="cuda", generator=g).to(torch.bfloat16)
        for _ in range(2):
            qmatmul(x, w, rows_per_thread=args.rows_per_thread)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
