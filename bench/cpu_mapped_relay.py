"""The mapped tier's cost per expert on the CPU: one Qwen3-30B-A3B expert (gate|up Q4_K
[1536, 2048], down Q6_K [2048, 768]) through the C workers' matvec from planes (the host
tier) and from the GGUF file's blocks (the mapped tier: each row re-laid into planes, then
the same slot code), one thread, the same bits (checked). The gap is what a mapped miss
pays over a pinned one before any page-cache or disk read.

    PYTHONPATH=src:. python bench/cpu_mapped_relay.py [--reps 20] [--out bench/results]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.bench.hostinfo import host_state
from alphallama.kernels.formats.qweight import QuantWeight
from alphallama.kernels.moe import expert_q8 as ref
from alphallama.offload.native import kernels as nk
from tests.kernels.test_qmatmul import random_raw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for what, qtype, N, K in (("gate|up", T.Q4_K, 768, 2048), ("down", T.Q6_K, 1024, 768)):
        E = 2                                                            # two file tensors (gate, up) of N rows
        raw = [random_raw(qtype, E * N, K, seed=7 + i).reshape(E, N, -1) for i in range(2)]
        planes = QuantWeight.from_raw(np.concatenate(raw, axis=1), qtype, (E, 2 * N, K))
        mapped = nk.qmat_mapped(raw, int(qtype), K)
        xq, dx, xs = ref.quantize_q8(torch.randn(1, K, generator=torch.Generator().manual_seed(1)))
        ms, out = {}, {}
        for name, w in (("planes", planes), ("mapped", mapped)):
            out[name] = nk.matvec_q8(xq[0], dx[0], xs[0], w, expert=1)
            times = []
            for _ in range(a.reps):
                t = time.perf_counter()
                nk.matvec_q8(xq[0], dx[0], xs[0], w, expert=1)
                times.append(time.perf_counter() - t)
            ms[name] = 1e3 * float(np.median(times))
        same = bool(torch.equal(out["planes"].view(torch.int32), out["mapped"].view(torch.int32)))
        rows.append({"matrix": what, "qtype": qtype.name, "rows": 2 * N, "K": K, "ms_planes": ms["planes"],
                     "ms_mapped": ms["mapped"], "mapped_over_planes": ms["mapped"] / ms["planes"], "same_bits": same})
        print(json.dumps(rows[-1]), flush=True)
    host = host_state(sys.argv)
    res = {**host, "commit": os.environ.get("GIT_COMMIT") or host["git"]["commit"], "threads": 1, "rows": rows}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path(a.out) / f"cpu_mapped_relay-{stamp}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
