"""Where a decode round's time goes, with PDL on (a profile cannot say: with PDL a kernel's
profiled time includes its wait on the one before). The round at the defaults against
graphs of parts of it, one process, same file, same depth:

  round        the captured round (the control)
  gemv         only the dense GEMVs (qkv, o, gate_up, down, head), in the round's order,
               on the inputs the round gave them: what the weights cost through our GEMVs
  gemv+moe     the dense GEMVs and the routed experts' launches (router, route, gate_up, down)
  no-gemv      the round with every dense GEMV replaced by its recorded output (no launch):
               what norms, attention, RoPE, SiLU, embedding cost
  no-gemv-moe  and the experts' launches gone too

The values of the partial graphs are garbage (stale inputs); only their time means
anything. Each part's share tells which work can reach the targets: if `gemv` alone is
over a target's ms, no fusion of the small kernels reaches it.

    GIT_COMMIT=... python bench/gpu_decode_ablate.py --preset qwen3-8b [--widths 1 8]
    TRITON_INTERPRET=1 python bench/gpu_decode_ablate.py --preset tiny-qwen3moe --device cpu   # smoke

Writes $OUT/gpu_decode_ablate-<preset>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from alphallama.bench.engine_bench import copy_bandwidth, kv_bytes_per_token, time_cuda
from alphallama.bench.hostinfo import host_state
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.runtime.capture import collector_paused
from alphallama.runtime.gpu_model import MoE, GPUModel, Linear

# the methods whose launches the partial graphs keep or drop: (class, name)
DENSE = ((Linear, "__call__"), (Linear, "parts"), (Linear, "add_into"))
EXPERTS = ((MoE, "__call__"),)


@contextmanager
def patched(methods, wrap):
    """Each (cls, name) replaced by wrap(original) for the block."""
    saved = [(cls, name, cls.__dict__[name]) for cls, name in methods]
    try:
        for cls, name, orig in saved:
            setattr(cls, name, wrap(orig))
        yield
    finally:
        for cls, name, orig in saved:
            setattr(cls, name, orig)


def record(model: GPUModel, W: int, methods) -> list:
    """One eager round; every call of `methods` as (original, self, args, kwargs, output), in
    order (the tensors they saw stay alive in the record)."""
    calls = []

    def wrap(orig):
        def f(self, *a, **k):
            out = orig(self, *a, **k)
            calls.append((orig, self, a, k, out))
            return out
        return f
    with patched(methods, wrap):
        model._rows(model._tokens[:W], model._pos, model.cache)
    return calls


def replay_calls(calls) -> None:
    for orig, self, a, k, _ in calls:
        orig(self, *a, **k)


def without(model: GPUModel, W: int, calls, methods):
    """A round in which `methods` return what they returned in `calls` (no launch)."""
    outs = defaultdict(list)

    def wrap(orig):
        def f(self, *a, **k):
            q = outs[(id(self), orig.__name__)]
            return q.pop(0) if q else None
        return f

    def run():
        outs.clear()                              # one round's outputs a run, in call order
        for orig, self, a, k, out in calls:
            outs[(id(self), orig.__name__)].append(out)
        with patched(methods, wrap):
            model._rows(model._tokens[:W], model._pos, model.cache)
    return run


def timed(fn, reps: int, cuda: bool) -> float:
    """ms of fn as a captured graph (CUDA) or eagerly (the CPU smoke)."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                      # every kernel compiled before the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(g):
        fn()
    ms = time_cuda(g.replay, reps)
    del g
    return ms


@torch.inference_mode()
def ablate(model: GPUModel, W: int, depth: int, reps: int, cuda: bool) -> dict:
    model._tokens[:W].copy_(torch.arange(W, device=model._tokens.device) + 1)
    model._pos.fill_(depth)
    moe = any(L.moe is not None for L in model.layers)
    dense = record(model, W, DENSE)
    both = record(model, W, DENSE + EXPERTS)
    out = {"launches_recorded": {"dense": len(dense), "dense+moe": len(both)}}
    if cuda:
        graph = model.graphs[W][0]
        out["round"] = time_cuda(graph.replay, reps)
    else:
        out["round"] = timed(lambda: model._rows(model._tokens[:W], model._pos, model.cache), reps, cuda)
    out["gemv"] = timed(lambda: replay_calls(dense), reps, cuda)
    out["no-gemv"] = timed(without(model, W, dense, DENSE), reps, cuda)
    if moe:
        out["gemv+moe"] = timed(lambda: replay_calls(both), reps, cuda)
        out["no-gemv-moe"] = timed(without(model, W, both, DENSE + EXPERTS), reps, cuda)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--device", default="cuda", help="cpu: an eager smoke run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    path = f"/tmp/ablate-{args.preset}.gguf"
    write_synthetic(PRESETS[args.preset](**({"n_layers": args.layers} if args.layers else {})), path)
    f = GGUFFile(path)
    model = GPUModel(f, 4096 if cuda else 256, args.device)
    cache = model.new_cache()                     # (and the round's graphs: model.graphs)
    g = torch.Generator().manual_seed(1)
    model.forward(torch.randint(model.cfg.vocab_size, (args.depth,), generator=g), 0, cache)
    bw = copy_bandwidth() if cuda else 1e9
    floor_ms = (model.weight_bytes + kv_bytes_per_token(model.cfg, args.depth)) / bw * 1000
    res = {"host": host_state(sys.argv), "commit": os.environ.get("GIT_COMMIT"), "preset": args.preset,
           "layers": args.layers, "depth": args.depth, "copy_bandwidth_GBps": bw / 1e9, "floor_ms": floor_ms,
           "capture_s": model.capture_s, "ms": {}}
    for W in args.widths:
        r = ablate(model, W, args.depth, args.reps, cuda)
        res["ms"][W] = r
        parts = "  ".join(f"{k} {v:7.3f}" for k, v in r.items() if k != "launches_recorded")
        print(f"{args.preset} W{W}: {parts} ms | floor {floor_ms:.3f}", flush=True)
    if cuda:
        out = Path(os.environ.get("OUT", ".")) / f"gpu_decode_ablate-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
