"""Gated DeltaNet kernels on the GPU (kernels/deltanet), at the 35B-A3B-like recurrent shape
(16 key heads, 32 value heads of 128, d_conv 4, 30 recurrent layers), beside
flash-linear-attention's where it is installed (fla-core; docs/decisions/deltanet-kernels.md).

- decode / verify: one layer's step at W = 1, 4, 16, 64 (graph over 30 layer copies: the
  states, 2 MiB a layer, do not stay in L2), verify (no state write) at W = 16;
- commit: every layer in one launch, n = 1, 4, 16 accepted rows;
- prefill: our conv + chunk kernels at T = 512 and 4096 against fla's chunk_gated_delta_rule
  (the delta rule only: q, k, v, g, beta prepared) and its error against a float64 recurrence
  at T = 512; fla's fused_recurrent at W = 1 beside our step.
$OUT/gpu_deltanet-*.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import run_header, time_graph  # noqa: E402

from alphallama.kernels.deltanet.common import RING_ROWS, DeltaNetShape  # noqa: E402
from alphallama.kernels.deltanet.prefill import chunk_delta_rule, deltanet_prefill  # noqa: E402
from alphallama.kernels.deltanet.reference import layer_ref  # noqa: E402
from alphallama.kernels.deltanet.step import DeltaNetWeights, deltanet_commit, deltanet_step  # noqa: E402

SHAPE = DeltaNetShape(hk=16, hv=32, dk=128, dv=128, d_conv=4, tiled=False)
LAYERS = 30
DEV = "cuda"


def _inputs(T: int, L: int, g: torch.Generator):
    C, hv = SHAPE.channels, SHAPE.hv
    mix = torch.randn(L, T, C, device=DEV, generator=g)
    ab = torch.randn(L, T, 2 * hv, device=DEV, generator=g)
    w = DeltaNetWeights(0.5 * torch.randn(L, C, SHAPE.d_conv, device=DEV, generator=g),
                        torch.randn(L, hv, device=DEV, generator=g),
                        -0.1 - 2 * torch.rand(L, hv, device=DEV, generator=g))
    ring = torch.randn(L, RING_ROWS, C, device=DEV, generator=g)
    state = 0.3 * torch.randn(L, hv, SHAPE.dk, SHAPE.dv, device=DEV, generator=g)
    return mix, ab, w, ring, state


def _layer(w: DeltaNetWeights, i: int) -> DeltaNetWeights:
    return DeltaNetWeights(*(t[i] for t in w))


def time_events(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def decode_rows(res: dict, g: torch.Generator) -> None:
    pos = torch.tensor([100], dtype=torch.int32, device=DEV)
    for W in (1, 4, 16, 64):
        mix, ab, w, ring, state = _inputs(W, LAYERS, g)
        for verify in ((False, True) if W == 16 else (False,)):
            fns = [lambda i=i: deltanet_step(mix[i], ab[i, :, SHAPE.hv:], ab[i, :, :SHAPE.hv], _layer(w, i), ring[i],
                                             state[i], pos, SHAPE, write_state=not verify) for i in range(LAYERS)]
            us = time_graph(fns) * 1e6
            res["step"].append({"W": W, "verify": verify, "us_per_layer": us})
            print(f"step W={W:2d}{' verify' if verify else ''}: {us:.2f} us a layer", flush=True)
    mix, ab, w, ring, state = _inputs(16, LAYERS, g)
    for n in (1, 4, 16):
        nt = torch.tensor([n], dtype=torch.int32, device=DEV)
        us = time_graph([lambda: deltanet_commit(ab[..., SHAPE.hv:], ab[..., :SHAPE.hv], w, ring, state, pos, nt,
                                                 SHAPE)]) * 1e6
        res["commit"].append({"n": n, "layers": LAYERS, "us": us})
        print(f"commit n={n:2d}, {LAYERS} layers: {us:.2f} us", flush=True)


def prefill(res: dict, g: torch.Generator, fla) -> None:
    pos = 0
    for T in (512, 4096):
        mix, ab, w, ring, state = _inputs(T, 1, g)
        w0, alpha, beta = _layer(w, 0), ab[0, :, SHAPE.hv:], ab[0, :, :SHAPE.hv]
        whole = time_events(lambda: deltanet_prefill(mix[0], alpha, beta, w0, ring[0], state[0].clone(), pos, SHAPE))
        xc = torch.randn(T, SHAPE.channels, device=DEV, generator=g)                # [T, C] conv outputs
        qk = xc[:, :2 * SHAPE.hk * SHAPE.dk].view(T, 2 * SHAPE.hk, SHAPE.dk)
        qk.copy_(torch.nn.functional.normalize(qk, dim=-1))
        st = state[0].clone()
        row = {"T": T, "ours_ms": whole * 1e3,
               "ours_delta_rule_ms": time_events(lambda: chunk_delta_rule(xc, alpha, beta, w0, st, SHAPE)) * 1e3}
        if T == 512:
            o_ref, _, S_ref, _ = layer_ref(mix[0], alpha, beta, w0, torch.zeros(3, SHAPE.channels, device=DEV),
                                           state[0], SHAPE)
            st0 = state[0].clone()
            o = deltanet_prefill(mix[0], alpha, beta, w0, torch.zeros_like(ring[0]), st0, pos, SHAPE)
            row["ours_rel_err"] = ((o.double() - o_ref).abs().max() / o_ref.abs().max()).item()
            row["ours_state_rel_err"] = ((st0.double() - S_ref).abs().max() / S_ref.abs().max()).item()
        if fla is not None:
            kh = SHAPE.key_head()
            q = torch.nn.functional.normalize(torch.randn(1, T, SHAPE.hk, SHAPE.dk, device=DEV, generator=g), dim=-1)
            k = torch.nn.functional.normalize(torch.randn(1, T, SHAPE.hk, SHAPE.dk, device=DEV, generator=g), dim=-1)
            v = torch.randn(1, T, SHAPE.hv, SHAPE.dv, device=DEV, generator=g)
            gg = -torch.rand(1, T, SHAPE.hv, device=DEV, generator=g)
            bb = torch.rand(1, T, SHAPE.hv, device=DEV, generator=g)
            h0 = state[0][None].clone()

            def run():
                return fla.chunk_gated_delta_rule(q, k, v, gg, bb, initial_state=h0, output_final_state=True)
            row["fla_chunk_ms"] = time_events(run) * 1e3
            if T == 512:
                from alphallama.model.deltanet import delta_rule
                o_ref, S_ref = delta_rule(q[0][:, kh].double(), k[0][:, kh].double(), v[0].double(), gg[0].double(),
                                          bb[0].double(), h0[0].double())
                o, S = run()
                row["fla_rel_err"] = ((o[0].double() - o_ref).abs().max() / o_ref.abs().max()).item()
                row["fla_state_rel_err"] = ((S[0].double() - S_ref).abs().max() / S_ref.abs().max()).item()
            if T == 512:
                q1, k1, v1, g1, b1 = (t[:, :1].contiguous() for t in (q, k, v, gg, bb))

                def step1():
                    return fla.fused_recurrent_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=h0,
                                                                output_final_state=True)
                try:                                   # in a graph, as our step is timed
                    row["fla_fused_recurrent_W1_us_graph"] = time_graph([step1]) * 1e6
                except Exception as e:                 # not capturable: eager, launch overhead included
                    row["fla_fused_recurrent_W1_us_eager"] = time_events(step1, reps=100) * 1e6
                    row["fla_graph_error"] = repr(e)[:300]
        res["prefill"].append(row)
        print(row, flush=True)


def main() -> None:
    try:
        import fla.ops.gated_delta_rule as fla
    except ImportError as e:
        print(f"fla not installed ({e}): ours only", flush=True)
        fla = None
    res = {**run_header(torch.cuda.get_device_properties(0)), "command": " ".join(sys.argv),
           "shape": SHAPE.__dict__, "fla": getattr(sys.modules.get("fla"), "__version__", None),
           "step": [], "commit": [], "prefill": []}
    g = torch.Generator(device=DEV).manual_seed(0)
    decode_rows(res, g)
    prefill(res, g, fla)
    path = Path(os.environ.get("OUT", ".")) / f"gpu_deltanet-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
