"""The mapped tier's cost per expert on the CPU: one Qwen3-30B-A3B expert (gate|up Q4_K
[1536, 2048], down Q6_K [2048, 768]) through the C workers' matvec from planes (the host
tier) and from the GGUF file's blocks (the mapped tier: each row re-laid into planes, then
the same slot code), one thread, the same bits (checked). The gap is what a mapped miss
pays over a pinned one before any page-cache or disk read.

With --baseline REF (a git ref, or a folder of .c files), the mapped arm also runs on the
native library as it was there, built with today's flags, in the same process: before and
after in one run, the arms alternating rep by rep.

    PYTHONPATH=src:. python bench/cpu_mapped_relay.py [--reps 20] [--baseline REF] [--out bench/results]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.bench.hostinfo import host_state
from alphallama.kernels.formats.qweight import QuantWeight
from alphallama.kernels.moe import expert_q8 as ref
import ctypes

from alphallama.offload.native import build
from alphallama.offload.native import kernels as nk
from alphallama.offload.native.bench import build_at
from tests.kernels.test_qmatmul import random_raw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--baseline", default=None, help="a git ref (or folder of .c files): its mapped arm too")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    torch.set_num_threads(1)
    so = {"tree": build.lib()}
    if a.baseline:
        tmp = tempfile.mkdtemp()
        so["baseline"] = build.declare(ctypes.CDLL(str(build_at(a.baseline, Path(tmp)))))
    rows = []
    for what, qtype, N, K in (("gate|up", T.Q4_K, 768, 2048), ("down", T.Q6_K, 1024, 768)):
        E = 2                                                            # two file tensors (gate, up) of N rows
        raw = [random_raw(qtype, E * N, K, seed=7 + i).reshape(E, N, -1) for i in range(2)]
        planes = QuantWeight.from_raw(np.concatenate(raw, axis=1), qtype, (E, 2 * N, K))
        mapped = nk.qmat_mapped(raw, int(qtype), K)
        xq, dx, xs = ref.quantize_q8(torch.randn(1, K, generator=torch.Generator().manual_seed(1)))
        arms = [("planes", planes, so["tree"]), ("mapped", mapped, so["tree"])]
        arms += [("mapped_baseline", mapped, so["baseline"])] if a.baseline else []
        out = {name: nk.matvec_q8(xq[0], dx[0], xs[0], w, expert=1, so=lib) for name, w, lib in arms}
        times = {name: [] for name, _, _ in arms}
        for rep in range(a.reps):                                        # alternate: drift hits every arm alike
            for name, w, lib in (arms if rep % 2 == 0 else arms[::-1]):
                t = time.perf_counter()
                nk.matvec_q8(xq[0], dx[0], xs[0], w, expert=1, so=lib)
                times[name].append(time.perf_counter() - t)
        ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
        same = all(torch.equal(out["planes"].view(torch.int32), o.view(torch.int32)) for o in out.values())
        row = {"matrix": what, "qtype": qtype.name, "rows": 2 * N, "K": K, "ms_planes": ms["planes"],
               "ms_mapped": ms["mapped"], "mapped_over_planes": ms["mapped"] / ms["planes"], "same_bits": same}
        if a.baseline:
            row |= {"ms_mapped_baseline": ms["mapped_baseline"], "baseline_over_tree": ms["mapped_baseline"] / ms["mapped"]}
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    host = host_state(sys.argv)
    res = {**host, "commit": os.environ.get("GIT_COMMIT") or host["git"]["commit"], "threads": 1,
           "baseline": a.baseline, "reps": a.reps, "rows": rows}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path(a.out) / f"cpu_mapped_relay-{stamp}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
