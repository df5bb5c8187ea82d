"""What kernel boundaries cost in a decode round, and what programmatic dependent launch
(PDL) gives back: the 8B shape's GEMVs of 8 layers (qkv, o, gate_up, down: distinct
weights, ~860 MB, so nothing stays in L2) replayed as one CUDA graph, PDL off / on /
on with the first weights fetched before the wait; beside it, the sum of each matrix
timed alone. Results must be bitwise equal across the arms.

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_pdl_chain.py
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
from gpu_kernels import random_raw, run_header, time_graph  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.qmatmul import qmatmul  # noqa: E402

LAYER = [("qkv", T.Q4_K, 6144, 4096), ("o", T.Q4_K, 4096, 4096), ("gate_up", T.Q4_K, 24576, 4096),
         ("down", T.Q6_K, 4096, 12288)]
LAYERS = 8


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    res = {**run_header(props), "command": " ".join(sys.argv), "layers": LAYERS, "arms": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [[QuantWeight.from_raw(random_raw(qt, N, K, g), qt, (N, K), "cuda") for _, qt, N, K in LAYER]
          for _ in range(LAYERS)]
    nbytes = sum(w.nbytes for L in ws for w in L)
    res["weight_bytes"] = nbytes
    for W in (1, 8):
        xs = {K: torch.randn(W, K, device="cuda", generator=g).to(torch.bfloat16) for K in (4096, 12288)}
        outs = [[torch.empty(W, w.N, device="cuda") for w in L] for L in ws]
        alone = sum(time_graph([lambda w=w: qmatmul(xs[w.K], w, rows_per_thread=4)]) for w in ws[0]) * 1e6

        def chain(pdl):
            for L, O in zip(ws, outs):
                for w, o in zip(L, O):
                    qmatmul(xs[w.K], w, out=o, rows_per_thread=4, pdl=pdl)
        ref = None
        for pdl in (0, 1, 2):
            us = time_graph([lambda: chain(pdl)], reps=30) * 1e6
            same = None
            got = [o.clone() for O in outs for o in O]
            if ref is None:
                ref = got
            else:
                same = all(torch.equal(a, b) for a, b in zip(ref, got))
            res["arms"][f"W{W}_pdl{pdl}"] = {"us_per_chain": us, "us_per_layer": us / LAYERS,
                                             "TBps": nbytes / us / 1e6, "bitwise_equal_to_pdl0": same}
            print(f"W={W} pdl={pdl}: {us / LAYERS:7.1f} us/layer, {nbytes / us / 1e6:5.2f} TB/s, equal {same}",
                  flush=True)
        res["arms"][f"W{W}_alone_sum_us_per_layer"] = alone
        print(f"W={W} matrices timed alone, summed: {alone:7.1f} us/layer", flush=True)
    out = Path(os.environ.get("OUT", ".")) / f"gpu_pdl_chain-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
